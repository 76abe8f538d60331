"""What torchmem takes from PyTorch's own allocator settings (PYTORCH_ALLOC_CONF).

People who switch allocators keep their environment. PyTorch's allocator reads
``PYTORCH_ALLOC_CONF`` (or its older name ``PYTORCH_CUDA_ALLOC_CONF``) as
``key:value`` pairs separated by commas. Most keys tune PyTorch's own caching
(block rounding, split limits, expandable segments, garbage-collection
thresholds) and mean nothing to torchmem's pool, which has its own options
(TORCHMEM_CONF, docs/config.md). One key sets a budget, and a budget means the
same thing to any allocator: ``per_process_memory_fraction``, which torchmem
applies to every device's pool as if ``torch.cuda.set_per_process_memory_fraction``
had been called before the first allocation (Note [Memory fraction] in
csrc/shim/budget.h).
"""

import os

ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch reads the first one set
FRACTION_KEY = "per_process_memory_fraction"


def settings_text(environ=None):
    """(variable name, value) of the torch allocator setting in force, or (None, "")."""
    environ = os.environ if environ is None else environ
    for name in ENV_NAMES:
        value = environ.get(name)
        if value:
            return name, value
    return None, ""


def parse_pairs(text):
    """{key: value} of a torch allocator setting string. Commas inside brackets belong to
    the value (``roundup_power2_divisions:[256:1,512:2]``); a key without ':' maps to ''."""
    pairs, depth, start = {}, 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if item:
                key, _, value = item.partition(":")
                pairs[key.strip()] = value.strip()
    return pairs


def memory_fraction(environ=None):
    """The per_process_memory_fraction torch's setting asks for, or None if it names none.
    Raises ValueError, in torch's words, for a value outside [0.0, 1.0]."""
    name, text = settings_text(environ)
    if name is None:
        return None
    raw = parse_pairs(text).get(FRACTION_KEY)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{name}: {FRACTION_KEY} is invalid, set it in [0.0, 1.0] (got {raw!r}); torchmem applies it "
            f"as the budget of every device's pool")
    return value
