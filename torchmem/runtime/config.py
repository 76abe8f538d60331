"""torchmem's configuration: every option of the pool, its default and its
meaning in one place.

``Config(**options)`` validates eagerly: an unknown key or a bad value raises
``ValueError`` naming the key and what is allowed.

Note [One rule for TORCHMEM_CONF] Every Config is built the same way: the
defaults, then the environment's ``TORCHMEM_CONF="key=value,key=value"``, then
the explicit arguments, which win. So ``Config()``, ``install()``, the replay
API and ``python -m torchmem replay`` all see the same options; a bad value in
the environment raises naming TORCHMEM_CONF. (``replace()`` starts from a
Config's own values, so it does not read the environment again.) ``OPTIONS`` is the single table the docs
(docs/config.md) are generated from and tested against:
``python -m torchmem.runtime.config --markdown > docs/config.md``.
"""

import dataclasses
import os
import re
import sys

ENV_VAR = "TORCHMEM_CONF"

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(key, value):
    """An int of bytes, or a string such as "512MiB", "8 GB", "1.5g" (binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"torchmem config {key!r}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"torchmem config {key!r}: size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ValueError(
        f"torchmem config {key!r}: expected a size such as 1048576, '512MiB' or '8GiB', got {value!r}"
    )


def parse_limit(key, value):
    """None, a fraction of device memory (0 < f <= 1 as a float, or "80%"), or a size."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            if text.endswith("%"):
                value = float(text[:-1]) / 100.0
            elif "." in text and not text[-1].isalpha():
                value = float(text)
        except ValueError:
            raise ValueError(f"torchmem config {key!r}: expected a fraction, '80%' or a size, got {value!r}") from None
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"torchmem config {key!r}: a fraction of device memory must be in (0, 1], got {value}; "
                f"for bytes give an int or a size such as '20GiB'"
            )
        return value
    size = parse_bytes(key, value)
    if size == 0:
        raise ValueError(f"torchmem config {key!r}: a limit of 0 bytes leaves no memory; use None for no limit")
    return size


def parse_bool(key, value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"torchmem config {key!r}: expected true or false, got {value!r}")


def _choice(*allowed):
    def parse(key, value):
        text = str(value).strip().lower()
        if text not in allowed:
            raise ValueError(f"torchmem config {key!r}: expected one of {', '.join(allowed)}, got {value!r}")
        return text
    return parse


def _number(low, high=None, integer=False):
    def parse(key, value):
        try:
            number = int(value) if integer else float(value)
            if integer and isinstance(value, float) and not value.is_integer():
                raise ValueError
        except (TypeError, ValueError):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"torchmem config {key!r}: expected {kind}, got {value!r}") from None
        if isinstance(value, bool) or number < low or (high is not None and number > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"torchmem config {key!r}: must be {bound}, got {value!r}")
        return number
    return parse


def _auto_or(parse):
    """None (or "auto", "none", ""): the option's value follows other options; else `parse`."""
    def parse_or_auto(key, value):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto", "none")):
            return None
        return parse(key, value)
    return parse_or_auto


# run_below_limit's auto value: with `share` the arbiter moves the limit all run long, and every
# move back up is growth again; the share scenario grew with half the handles and a 2% higher
# throughput at 0.5 (BENCHMARKS.md, Sharing and monitoring). Under a fixed limit growth is a one-off warm-up
# and 0 packs tightest (Note [Runs under a limit]).
SHARE_RUN_BELOW_LIMIT = 0.5


# A sharing group's name: it names files beside the records (share/agent.py group_files).
_GROUP_RE = re.compile(r"^[A-Za-z0-9_.-]{1,31}$")


def _share_group(key, value):
    """A sharing group's name, or None (no sharing)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    text = str(value).strip()
    if not _GROUP_RE.match(text):
        raise ValueError(f"torchmem config {key!r}: a group name is 1-31 letters, digits, '_', '.' or '-', got {value!r}")
    return text


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    default: object
    parse: object
    doc: str
    # The core PoolConfig field this option feeds (csrc/core/pool.h,
    # TORCHMEM_POOL_CONFIG), or "" for options of the Python layer and the shim.
    # tests/test_config.py checks these cover every field, so a new pool option
    # is one X-macro line in C++ and one Option here.
    core: str = ""


OPTIONS = (
    Option("backend", "auto", _choice("auto", "vmm", "cuda_malloc"),
           "Where memory comes from. `vmm`: CUDA virtual memory (cuMem*), granules are stitched "
           "to fight fragmentation. `cuda_malloc`: plain cudaMalloc segments, no stitching. "
           "`auto`: vmm where the device supports it."),
    Option("limit", None, parse_limit,
           "Memory budget: bytes ('20GiB'), a fraction of device memory (0.8 or '80%'), or None "
           "for the whole device. `torch.cuda.set_per_process_memory_fraction` changes it later."),
    Option("reserve", 0, parse_bytes,
           "Bytes mapped at install and kept even by empty_cache (pre-reservation).",
           core="reserve_bytes"),
    Option("small_threshold", 1 << 20, parse_bytes,
           "Requests of at most this size go to the small heap (2 MiB pages of their own).",
           core="small_threshold"),
    Option("small_page", 2 << 20, parse_bytes,
           "Page size of the small heap; a multiple of the backend's granule.",
           core="small_page_bytes"),
    Option("reclaim_slack", 0.0, _number(0.0, 10.0),
           "Create new granules instead of stitching cached ones while held < (1 + slack) x in use. "
           "0 stitches whenever a granule is needed and one is reclaimable (least memory); "
           "larger values trade memory for fewer driver calls.",
           core="reclaim_slack"),
    Option("stitch_above", 0.95, _number(0.0, 1.0),
           "With no limit set, the pool stitches granules (moves cached memory where a new block needs "
           "it) only once it holds this fraction of the device; below, it grows like expandable_segments "
           "and a stable workload makes no driver calls. 0 = always stitch (least memory, most driver "
           "calls). Under a limit, stitch_above_limit rules instead.",
           core="stitch_above"),
    Option("stitch_above_limit", 1.0, _number(0.0, 1.0),
           "Under a limit (a memory fraction, a share, the batch controller's ceiling), the pool stitches "
           "only once it holds this fraction of the limit. 1 (the default) grows to the limit before "
           "moving anything; with backed_fit the pool then places requests where cached granules already "
           "back them, so shapes that vary do not move gigabytes of granules whenever a new shape fits none "
           "of the holes (on an H100 at 1.03-1.12x with a new shape every step: 0-3 driver calls after "
           "warm-up, as expandable_segments' 0-6, where 0.95 made 428-3,114; BENCHMARKS.md, Budget "
           "regime). 0 = always stitch.",
           core="stitch_above_limit"),
    Option("run_below", 0.5, _number(0.0, 1.0),
           "With no limit set, while the pool holds less than this fraction of the device it grows "
           "by one driver handle per run of missing granules, up to 256 MiB or a 16th of the hole a "
           "run (one create, map and access for the run: ~0.3 us per 2 MiB at 256 granules against "
           "~30 us with a handle per granule); above, it grows granule by granule so that it can "
           "stitch, except that a request missing 8 GiB or more still takes runs (Note [Huge holes]). "
           "A run's memory goes back only when the whole run is free, so a live block holds at most "
           "its own runs (Note [Run length]). Under a limit (or memory fraction, or share) "
           "run_below_limit rules instead. 0 = a handle per granule always.",
           core="run_below"),
    Option("run_below_limit", None, _auto_or(_number(0.0, 1.0)),
           "Under a limit (a memory fraction, a share, the batch controller's ceiling), while the pool "
           "holds less than this fraction of the limit it grows by one driver handle per run of missing "
           "granules, as run_below does with no limit. 0 keeps a handle per granule under a limit, so "
           "that every cached granule can be moved and the pool packs as tightly as it can; 0.5 trades "
           "some of that tightness for growth at cudaMalloc's cost in the bottom half of the limit "
           "(Note [Runs under a limit]). None (auto, the default): 0.5 with `share`, whose limit keeps "
           "moving so that growth recurs all run long, else 0, where growth under a fixed limit is a "
           "warm-up cost (BENCHMARKS.md, Budget regime).",
           core="run_below_limit"),
    Option("limit_run_granules", 0, _number(0, 1 << 20, integer=True),
           "Under a limit, a run handle (`run_below_limit`) covers at most this many 2 MiB granules, so "
           "that a run goes back whole as soon as its few granules are free and less memory is stranded "
           "in runs partly in use (Note [Runs under a limit]). 0 = a run covers the whole hole. With "
           "`run_below_limit=0.95` and 10, with stitching in the top 5% of the limit "
           "(`stitch_above_limit=0.95,backed_fit=false`), replays of the bundled traces at 1.03-1.12x their "
           "peak make 1.3-4.5x fewer driver calls after warm-up, for a min-cap up to 1.016x; on the H200 (gpt2, "
           "four shapes, 1.05x) it cut only the calls of the first steps at the budget. With the defaults it "
           "moves whole runs after the peak request instead (BENCHMARKS.md, Budget regime).",
           core="limit_run_granules"),
    Option("backed_fit", True, parse_bool,
           "Under a limit, a request whose best fit would need new or moved 2 MiB granules goes where "
           "cached granules already back it instead, inside that fit or in one of the next fits "
           "(Note [Backed placement]). With stitch_above_limit=1, replays of the bundled traces at "
           "1.03-1.12x their peak stay at or under 1.02x min-cap; the cost is packing on churn of mixed "
           "sizes (min-cap of the periodic pattern 1.04 -> 1.09x, under the expandable model's 1.19x). "
           "False: the best fit by size, stitching what it misses (tightest packing, most driver calls).",
           core="backed_fit"),
    Option("alias_reclaim", True, parse_bool,
           "Stitch granules freed on the requesting stream before the GPU finished with them, by "
           "mapping their memory at a second address and unmapping the old one later (keeps "
           "memory low while the GPU lags behind the host). False: wait for the GPU's fence.",
           core="alias_reclaim"),
    Option("stream_order", True, parse_bool,
           "When every cached fit for a request was freed on other streams (FSDP's all-gather stream "
           "beside the compute stream), take the best one behind a device-side wait on those streams "
           "(an event recorded there, cudaStreamWaitEvent on the requesting stream) instead of "
           "waiting on the host for the whole device; with no limit set, also instead of new memory "
           "(Note [Cross-stream reuse]), and on the stream that was current at the free if that was "
           "another, which may have read the tensor (Note [Freed under another stream]). One wait "
           "covers every earlier free of that pair of streams. "
           "False: a device barrier, or new memory, as PyTorch's allocator never shares cached memory "
           "between streams.",
           core="stream_order"),
    Option("step_plan", True, parse_bool,
           "Once the pool has stitched or waited for the whole device (memory is the limit, or "
           "streams compete for it), learn one layout for the step's repeating requests (greedy by "
           "size, all streams in one layout: a range passed between streams waits for its old stream "
           "on the device) and place them there: a repeating step then makes no driver call "
           "and takes no device barrier. Requests the plan does not know, or whose place is taken, are "
           "served as before; a plan that misses more than 1 request in 50 is learnt again (with no "
           "limit set, given up until empty_cache or a limit: its arena's cache would stay stranded), "
           "one that does not fit the budget is not used (Notes [Step plan], [Step plan arena]). False: "
           "always place online.",
           core="step_plan"),
    Option("virtual_bytes", 0, parse_bytes,
           "Virtual address space reserved per heap; 0 = twice the device's memory.",
           core="virtual_bytes"),
    Option("trace_capacity", 0, _number(0, integer=True),
           "Keep the last N allocator events for snapshots' device_traces (0 = off; "
           "record_history() turns it on).",
           core="trace_capacity"),
    Option("time_host_ops", False, parse_bool,
           "Measure the host time the pool spends in every allocation and free (two clock reads "
           "each, more on the step plan's path, which therefore reads a little slow) and report it "
           "as torchmem.host_alloc_ns, host_free_ns and host_plan_ns (the step plan's part) in "
           "memory_stats: how much of a step's host time is the allocator's (Note [Host time]). "
           "Off by default: measuring adds clock reads to every allocation and free.",
           core="time_host_ops"),
    Option("debug_checks", False, parse_bool,
           "Check every pool invariant after every operation (slow; for debugging).",
           core="debug_checks"),
    Option("oom_hook_retries", 3, _number(0, 100, integer=True),
           "How many times OOM hooks (torchmem.on_oom) may free memory and retry one allocation."),
    Option("park_private_frees", False, parse_bool,
           "Blocks freed in a private pool in use (CUDA graphs, torch.compile mode='reduce-overhead') "
           "go back to that pool for its own later allocations, as in PyTorch (False, the default: "
           "a graph tree holds its peak), or wait until the pool is released (True: a tree holds "
           "the sum of its graphs' memory, and graphs sharing a pool never overwrite each other's "
           "freed intermediates)."),
    Option("patch_torch", True, parse_bool,
           "Make torch.cuda.memory_stats / memory_allocated / max_memory_* / memory_summary / "
           "reset_peak_memory_stats answer from torchmem instead of raising."),
    Option("warn_unsupported", True, parse_bool,
           "Kept so that configs which set it still parse; no torch feature is left to warn about "
           "(CUDA IPC works: docs/pluggable_allocator.md)."),
    # Watching and sharing (torchmem/monitor/, docs/monitoring.md, docs/sharing.md).
    Option("monitor", True, parse_bool,
           "Publish this process's figures to a shared-memory record for `python -m torchmem top` "
           "and the metrics (a background thread, never on the allocation path)."),
    Option("monitor_interval", 0.5, _number(0.01, 60.0),
           "Seconds between two publications (0.1 at most while sharing)."),
    Option("metrics_port", 0, _number(0, 65535, integer=True),
           "Serve Prometheus metrics on 127.0.0.1:PORT (0 = off); a port in use is a warning."),
    Option("share", None, _share_group,
           "Share this GPU elastically with the processes of this group name (needs `guarantee`)."),
    Option("guarantee", None, parse_limit,
           "With `share`: the share of the device this process can always get back (bytes or a "
           "fraction); it may borrow what others leave unused."),
    Option("share_wait", 30.0, _number(0.1, 3600.0),
           "With `share`: seconds an allocation within the guarantee waits for borrowers to yield."),
)
_BY_NAME = {option.name: option for option in OPTIONS}


def _unknown_key_error(key):
    return ValueError(f"torchmem config: unknown option {key!r}; allowed: {', '.join(_BY_NAME)}")


class Config:
    """A validated set of options. Attributes have the option names."""

    __slots__ = tuple(_BY_NAME)

    def __init__(self, **options):
        """Defaults, then TORCHMEM_CONF, then `options` (Note [One rule for TORCHMEM_CONF])."""
        self._init(options, from_environment=True)

    def _init(self, options, from_environment):
        for option in OPTIONS:
            object.__setattr__(self, option.name, option.default)
        environment = parse_conf_string(os.environ.get(ENV_VAR, "")) if from_environment else {}
        for key, value in environment.items():
            if key not in options:
                try:
                    object.__setattr__(self, key, _BY_NAME[key].parse(key, value))
                except ValueError as exc:
                    raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: {exc}") from None
        for key, value in options.items():
            if key not in _BY_NAME:
                raise _unknown_key_error(key)
            object.__setattr__(self, key, _BY_NAME[key].parse(key, value))
        self._validate()

    def __setattr__(self, key, value):
        raise AttributeError("torchmem.Config is immutable; use replace(**changes)")

    def _validate(self):
        if self.small_page <= 0 or self.small_page % (2 << 20):
            raise ValueError(
                f"torchmem config 'small_page': must be a positive multiple of 2 MiB (the granule), got {self.small_page}"
            )
        if not 0 < self.small_threshold <= self.small_page // 2:
            raise ValueError(
                f"torchmem config 'small_threshold': must be in (0, small_page/2 = {self.small_page // 2}], "
                f"got {self.small_threshold}"
            )
        if isinstance(self.limit, int) and self.limit < (2 << 20):
            raise ValueError(
                f"torchmem config 'limit': {self.limit} bytes is below one 2 MiB granule; give at least '2MiB'"
            )
        if self.share and (self.guarantee is None or self.limit is not None):
            raise ValueError(
                "torchmem config 'share': give a 'guarantee' (e.g. share=team,guarantee=30GiB) and no 'limit' "
                "(the sharing arbiter sets the limit)"
            )
        if self.guarantee is not None and not self.share:
            raise ValueError("torchmem config 'guarantee': only means something with 'share=GROUP'")
        if isinstance(self.limit, int) and self.reserve > self.limit:
            raise ValueError(f"torchmem config 'reserve' ({self.reserve}) exceeds 'limit' ({self.limit})")

    @classmethod
    def defaults(cls):
        """The defaults alone, whatever TORCHMEM_CONF says."""
        config = cls.__new__(cls)
        config._init({}, from_environment=False)
        return config

    def replace(self, **changes):
        merged = self.as_dict()
        merged.update(changes)
        config = Config.__new__(Config)
        config._init(merged, from_environment=False)
        return config

    def as_dict(self):
        return {name: getattr(self, name) for name in _BY_NAME}

    def limit_bytes(self, total_bytes):
        """The budget in bytes for a device of `total_bytes` (0 = no limit)."""
        if self.limit is None:
            return 0
        if isinstance(self.limit, float):
            return int(self.limit * total_bytes)
        return self.limit

    def pool_options(self):
        """The PoolConfig fields (csrc/core/pool.h) but the limit: the installed allocator gives the
        limit to each device's Budget (csrc/shim/budget.h), which resolves and sets it."""
        fields = {option.core: getattr(self, option.name) for option in OPTIONS if option.core}
        if self.run_below_limit is None:  # auto
            fields["run_below_limit"] = SHARE_RUN_BELOW_LIMIT if self.share else 0.0
        return fields

    def core_dict(self, total_bytes):
        """Every PoolConfig field for a pool of its own on a device of `total_bytes` (a replay's
        simulated pool): pool_options() and the limit resolved in bytes."""
        limit = self.limit_bytes(total_bytes)
        if limit and self.reserve > limit:
            raise ValueError(f"torchmem config 'reserve' ({self.reserve}) exceeds the limit ({limit} bytes)")
        return {"limit_bytes": limit, **self.pool_options()}

    def __eq__(self, other):
        return isinstance(other, Config) and self.as_dict() == other.as_dict()

    def __repr__(self):
        changed = {k: v for k, v in self.as_dict().items() if v != _BY_NAME[k].default}
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in changed.items()) + ")"


def parse_conf_string(text):
    """Parses "key=value,key=value" (TORCHMEM_CONF) into a dict of raw strings."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{ENV_VAR}: expected key=value, got {item!r} (in {text!r})")
        if key not in _BY_NAME:
            raise _unknown_key_error(key)
        if key in options:
            raise ValueError(f"{ENV_VAR}: option {key!r} given twice (in {text!r})")
        options[key] = value.strip()
    return options


def from_env_and_kwargs(**kwargs):
    """The config install() uses: Config(**kwargs), i.e. TORCHMEM_CONF overridden by kwargs."""
    return Config(**kwargs)


def _default_text(option):
    value = option.default
    if value is None:
        return "None"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= (1 << 20) and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return str(value)


def options_markdown():
    """docs/config.md: the options table, generated from OPTIONS (a test keeps the file equal)."""
    lines = [
        "# torchmem configuration",
        "",
        "<!-- Generated by `python -m torchmem.runtime.config --markdown > docs/config.md`; do not edit. -->",
        "",
        "Options go to `torchmem.install(**options)` or, with the same names, to the environment",
        f"variable `{ENV_VAR}=\"key=value,key=value\"`. One rule everywhere: every configuration",
        f"(`install()`, `torchmem.Config()`, `mem_pool_allocator()`, the replay API and",
        f"`python -m torchmem replay`, whose `--config` counts as explicit) starts from the defaults,",
        f"applies `{ENV_VAR}`, then the explicit arguments, which win. `Config.defaults()` ignores",
        "the environment.",
        "Sizes accept bytes or units (`512MiB`, `8GiB`, binary); an unknown key or a bad value raises",
        "`ValueError` naming the key and what is allowed.",
        "",
        "| option | default | meaning |",
        "|---|---|---|",
    ]
    for option in OPTIONS:
        doc = option.doc.replace("|", "\\|")
        lines.append(f"| `{option.name}` | `{_default_text(option)}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m torchmem.runtime.config --markdown   (prints docs/config.md)")
    sys.stdout.write(options_markdown())
