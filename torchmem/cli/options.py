"""Options and errors shared by the subcommands, so that one rule holds in all of them.

- TRACE / FILE / IN: a path, or a bundled trace's name (`replay --list`) in every
  subcommand that reads a trace.
- --limit: a bare number up to 1 is a fraction of the device (1 = all of it), a
  bare whole number above 1 is bytes, a size with a unit (20GiB) is bytes, a
  percentage (50%) is a fraction; 0 is refused (leave --limit out for no limit).
- Errors name what the user typed (`--limit`, `--config`, `FILE`), never the
  internal field a value ends up in, and are one line: a CliError (or ValueError,
  FileNotFoundError) becomes "torchmem COMMAND: error: ..." with exit status 2.
"""

import os

from torchmem.analysis import trace as trace_io
from torchmem.runtime.config import ENV_VAR, Config
from torchmem.runtime.config import parse_bytes

GRANULE = 2 << 20
LIMIT_RULE = ("a fraction of the device (a bare number up to 1: 0.5, or 1 for all of it; or 50%), "
              "or bytes (a size such as 20GiB, or a bare whole number above 1)")
LIMIT_HELP = f"memory budget: {LIMIT_RULE}; default: the whole device. 0 is refused: leave --limit out instead"


class CliError(Exception):
    """A problem the user can fix, said in one line."""


def _gib(nbytes):
    return f"{nbytes / (1 << 30):,.2f} GiB"


def parse_limit(text, flag="--limit"):
    """--limit's value under LIMIT_RULE: None (not given), a float fraction in (0, 1] or
    an int of bytes; raises CliError naming `flag`."""
    if text is None:
        return None
    value = str(text).strip()
    try:
        if value.endswith("%"):
            fraction = float(value[:-1]) / 100
        elif value and not value[-1].isalpha():
            number = float(value)
            if number > 1:
                if not number.is_integer():
                    raise CliError(f"{flag} {text}: a bare number above 1 is bytes and must be whole; "
                                   f"give {LIMIT_RULE}")
                return int(number)
            fraction = number
        else:
            return parse_bytes(flag, value) or _refuse_zero(text, flag)
    except ValueError:
        raise CliError(f"{flag} {text!r}: expected {LIMIT_RULE}") from None
    if fraction == 0:
        _refuse_zero(text, flag)
    if not 0 < fraction <= 1:
        raise CliError(f"{flag} {text}: a fraction of the device must be in (0, 1] (0.5, 50%); "
                       f"for bytes give a size such as 20GiB")
    return fraction


def _refuse_zero(text, flag):
    raise CliError(f"{flag} {text}: a budget of 0 leaves no memory; leave {flag} out for no limit "
                   f"(or give 1 for the whole device)")


def limit_bytes(limit, capacity, flag="--limit"):
    """parse_limit's answer in bytes on a device of `capacity` bytes (0 for None), refused
    below one 2 MiB granule or above the device."""
    if limit is None:
        return 0
    nbytes = int(limit * capacity) if isinstance(limit, float) else int(limit)
    if nbytes < GRANULE:
        raise CliError(f"{flag}: {nbytes:,} bytes is below one 2 MiB granule, the smallest budget the pool "
                       f"can hold; give at least 2MiB (or a fraction such as 0.5)")
    if nbytes > capacity:
        raise CliError(f"{flag}: {_gib(nbytes)} is more than the simulated device's {_gib(capacity)} "
                       f"(--capacity); give at most that, or a fraction such as 0.5")
    return nbytes


def parse_size(text, flag):
    """A size in bytes (an int, or 140GiB) for an option such as --capacity; CliError naming `flag`."""
    try:
        return parse_bytes(flag, text)
    except ValueError:
        raise CliError(f"{flag} {text!r}: expected a size such as 140GiB or 1073741824") from None


def parse_config(text, flag="--config"):
    """--config "key=value,..." (the TORCHMEM_CONF syntax) as a torchmem.Config applied over
    TORCHMEM_CONF. Errors name `flag`, unless the environment's value is the one at fault.
    A `limit` given here follows LIMIT_RULE, as --limit does."""

    options = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise CliError(f"{flag}: expected key=value[,key=value...], got {item!r}")
        if key in options:
            raise CliError(f"{flag}: option {key!r} given twice")
        options[key] = parse_limit(value, f"{flag} limit=") if key == "limit" else value
    try:
        return Config(**options)
    except ValueError as exc:
        if str(exc).startswith(ENV_VAR):
            raise
        raise CliError(f"{flag}: {exc}") from None


def bundled_names():
    return [trace_io.bundled_trace_names(path)[0] for path in trace_io.bundled_traces()]


def resolve_trace(name, what="TRACE"):
    """A path for a trace argument: the file if it exists, else the bundled trace of that
    name (`replay --list`); CliError naming `what` when it is neither."""

    if os.path.exists(name):
        return name
    if os.sep in name or "." in os.path.basename(name):
        raise CliError(f"{what} {name}: no such file")
    try:
        return trace_io.bundled_trace(name)
    except ValueError:
        pass
    raise CliError(f"{what} {name!r}: neither a file nor a bundled trace (bundled: {', '.join(bundled_names())}; "
                   f"`python -m torchmem replay --list` shows them)")
