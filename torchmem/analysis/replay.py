"""Replay recorded allocator traces under torchmem's pool or a model of PyTorch's
allocator (native, or with expandable segments), on the CPU.

This is how torchmem's fragmentation figures are measured without a GPU: the
trace's allocs and frees run, in order, through the exact pool code that runs on
the GPU (over a simulated device), through ``native_model.h``, a model of
PyTorch's caching allocator that reproduces the recorded segment sequence of the
bundled traces, or through ``expandable_model.h``, a model of the same allocator
with ``expandable_segments:True`` (its peaks match the H200's to 0.05% on the four
bundled traces: tests/test_expandable_model.py). The work happens in C++
(``csrc/replay/replay.cpp``); this module loads traces, turns torchmem options
into the pool's config and returns plain dataclasses.

Figures (see ``ReplayResult``): ``ratio`` = peak reserved / peak requested (1.0 is
no waste); ``min_cap`` = the smallest budget under which the trace replays with no
OOM (bisection to one 2 MiB granule), ``min_cap_ratio`` = min_cap / peak requested.
"""

import dataclasses
import time

import numpy as np

from torchmem._loader import extension
from torchmem.analysis import trace as trace_io
from torchmem.runtime.snapshot_format import to_torch_snapshot
from torchmem.runtime.config import Config, parse_conf_string

# The core loads, and is checked against the installed torch, when this module loads (as
# importing torchmem._C here did): a bad build is reported before anything runs.
_core = extension()

POLICIES = ("torchmem", "native", "expandable")  # expandable: PyTorch with expandable_segments:True (a model)
# The traces' device: an H200 reports ~140 GiB. A replay fails only past this.
DEFAULT_CAPACITY = 140 << 30
GRANULE = 2 << 20

__all__ = [
    "POLICIES", "DEFAULT_CAPACITY", "ReplayResult", "replay", "find_min_cap", "find_min_device",
    "snapshot_at", "torch_snapshot_at_peak", "reserved_timeline", "pool_config",
]


@dataclasses.dataclass
class ReplayResult:
    """What one policy held while replaying one trace."""

    trace: str                 # the path (or name) given
    policy: str                # "torchmem" | "native" | "expandable"
    events: int                # trace rows walked
    peak_requested: int        # peak of live requested bytes
    peak_reserved: int         # peak bytes held from the (simulated) device
    ratio: float               # peak_reserved / peak_requested
    ooms: int                  # allocations that failed (the replay goes on)
    backend_calls: dict        # calls by kind (create/map/unmap/... or segment_alloc/free)
    modeled_backend_us: float  # those calls at the simulator's prices (measured on an H200) or the costs given
    peak_reserved_event: int   # first event index at which peak_reserved was reached
    allocs: int = 0
    frees: int = 0
    reclaims: int = 0          # torchmem: granules stitched from cached free space
    device_barriers: int = 0   # torchmem: waits for the whole device; models: cached-memory releases (cudaFree)
    steady_barriers: int = 0   # the same in the second half of the walk
    plans: int = 0             # torchmem: step plans put in force (Note [Step plan])
    plan_hits: int = 0         # allocations a plan placed
    plan_misses: int = 0       # allocations a plan in force could not place
    plan_passes: int = 0       # planning passes run, adopted or not (Note [Planning pass cost])
    plan_pass_us: int = 0      # their host time on this machine, microseconds
    # The pool's own host time in allocations, frees and the step plan's part of them, ns
    # (config time_host_ops only, Note [Host time]).
    host_alloc_ns: int = 0
    host_free_ns: int = 0
    host_plan_ns: int = 0
    alloc_retries: int = 0
    final_reserved: int = 0
    skipped_frees: int = 0     # frees of allocations that failed
    unmatched_frees: int = 0   # frees of addresses the trace never allocated
    lost_frees: int = 0        # allocs over a live address (the trace lost a free)
    limit: int = 0             # the budget replayed under (0 = device capacity)
    # The second half of the walk only, after warm-up (Note [Steady state], csrc/replay/replay.h)
    steady_backend_us: float = 0.0
    steady_driver_calls: int = 0
    # Growths: bursts of driver calls (Note [Call bursts], csrc/replay/replay.h), in all and in the
    # second half, and the second half's calls by kind: what call_costs.burst_premium_us prices.
    growths: int = 0
    steady_growths: int = 0
    steady_backend_calls: dict = None
    # From the event where the trace's live requested bytes peak (calls_after): set by
    # `replay --limit`, None elsewhere.
    after_peak_driver_calls: int = None
    after_peak_barriers: int = None
    seconds: float = 0.0       # wall time of the replay (and min-cap search)
    recorded_peak_reserved: int = None  # the recording allocator's own peak, if the trace has segment events
    min_cap: int = None        # with min_cap=True
    min_cap_ratio: float = None
    min_cap_replays: int = None
    min_device: int = None     # with min_device=True
    min_device_ratio: float = None
    min_device_replays: int = None

    def as_dict(self):
        """A JSON-ready dict (what `replay --json` prints per line)."""
        return dataclasses.asdict(self)


def _as_trace(source, device=None):
    if isinstance(source, trace_io.Trace):
        return source
    if isinstance(source, np.ndarray) or isinstance(source, (list, tuple)):
        return trace_io.Trace(events=np.asarray(source, dtype=np.int64).reshape(-1, 4))
    return trace_io.load(source, device=device)


def _check_policy(policy):
    if policy not in POLICIES:
        raise ValueError(f"unknown replay policy {policy!r}; expected one of {', '.join(POLICIES)}")


def pool_config(config=None, capacity=DEFAULT_CAPACITY):
    """The pool's config dict (PoolConfig fields) for torchmem options: a Config, a dict
    of options, or a "key=value,..." string (the TORCHMEM_CONF syntax). Options that
    only matter on a GPU (backend, patch_torch, ...) are accepted and ignored."""
    return _as_config(config).core_dict(capacity)


def _as_config(config):
    if config is None:
        return Config()
    if isinstance(config, str):
        return Config(**parse_conf_string(config))
    if isinstance(config, dict):
        return Config(**config)
    if not isinstance(config, Config):
        raise ValueError(f"replay config: expected a torchmem.Config, a dict or 'key=value,...', got {type(config).__name__}")
    return config


def _progress_adapter(progress, label):
    if progress is None:
        return None
    return lambda done, total: progress(label, done, total)


def replay(source, policy="torchmem", *, limit=0, config=None, capacity=DEFAULT_CAPACITY, min_cap=False,
           min_device=False, stop_at=-1, progress=None, device=None, native_config=None, costs=None, name=None,
           event_delay=0, evict_bytes=0, cold_costs=None):
    """Replays a trace (a path, a Trace, or an (N, 4) int64 events array) under `policy`
    ("torchmem" or "native") and returns a ReplayResult.

    ``limit``: budget in bytes for either policy (0 = the config's limit, else the
    device capacity);
    ``config``: torchmem options (see ``pool_config``); ``min_cap``: also find the
    smallest budget with no OOM; ``min_device``: also find the smallest device
    (no budget) with no OOM; ``stop_at``: stop after that event index;
    ``progress(stage, done, total)``: called now and then while it runs;
    ``native_config``: {"max_split_size": bytes} for the native model;
    ``costs``: per-call microseconds overriding the simulated backend's table;
    ``cold_costs``: the same table with the host's caches evicted (a probe's
    evicted run, call_costs.costs_from_probe): the first call of each kind in a
    burst is priced at it, the rest at ``costs`` (Note [Call bursts] in
    csrc/replay/replay.h), in modeled_backend_us and steady_backend_us;
    ``event_delay``: how many polls a simulated stream event stays pending, to
    model a GPU running behind the host (0 = events complete at once);
    ``evict_bytes``: a scratch walk of that many bytes after every alloc and free,
    evicting the pool's data from the CPU caches as a training step's own host
    work does (Note [Cold caches] in csrc/replay/replay.h; host-time
    measurements only, no decision changes)."""
    _check_policy(policy)
    trace = _as_trace(source, device=device)
    core = pool_config(config, capacity)
    # One budget for both policies: `limit`, else the config's.
    budget = int(limit or core["limit_bytes"])
    label = name or (str(source) if isinstance(source, str) else trace.name)
    started = time.perf_counter()
    raw = _core.replay(trace.events, policy, pool_config=core, limit=budget, capacity=int(capacity),
                    stop_at=int(stop_at), progress=_progress_adapter(progress, f"{trace.name} {policy}"),
                    native_config=native_config, costs=costs, event_delay=int(event_delay),
                    evict_bytes=int(evict_bytes))
    result = _result_from(raw, label, policy, trace, budget)
    if cold_costs is not None:
        from torchmem.analysis.call_costs import burst_premium_us

        # Both tables whole: `costs` and `cold_costs` may override part of the simulator's.
        prices = {**_core.sim_costs(), **(costs or {})}
        cold = {**prices, **cold_costs}
        result.modeled_backend_us += burst_premium_us(result.backend_calls, result.growths, result.device_barriers,
                                                      prices, cold)
        result.steady_backend_us += burst_premium_us(result.steady_backend_calls, result.steady_growths,
                                                     result.steady_barriers, prices, cold)
    if min_cap:
        found = find_min_cap(trace, policy, config=config, capacity=capacity, progress=progress,
                             native_config=native_config, costs=costs, event_delay=event_delay)
        result.min_cap = found["min_cap"]
        result.min_cap_ratio = found["min_cap_ratio"]
        result.min_cap_replays = found["replays"]
    if min_device:
        found = find_min_device(trace, policy, config=config, progress=progress, native_config=native_config,
                                costs=costs, event_delay=event_delay)
        result.min_device = found["min_device"]
        result.min_device_ratio = found["min_device_ratio"]
        result.min_device_replays = found["replays"]
    result.seconds = time.perf_counter() - started
    return result


# The driver calls of a replay by kind: torchmem's and the expandable model's VMM calls, then
# the native model's cudaMalloc and cudaFree of a segment (what steady_driver_calls counts).
VMM_CALL_KINDS = ("create_calls", "map_calls", "unmap_calls", "release_calls")
DRIVER_CALL_KINDS = VMM_CALL_KINDS + ("segment_alloc_calls", "segment_free_calls")


def vmm_calls(calls):
    """The VMM driver calls among `calls` (a replay's backend_calls or steady_backend_calls)."""
    return sum(calls[kind] for kind in VMM_CALL_KINDS)


def calls_after(source, at, policy="torchmem", *, limit=0, config=None, capacity=DEFAULT_CAPACITY, event_delay=0,
                whole=None):
    """(driver calls by kind after event `at`, device barriers after it, OOMs over the whole
    trace) of one replay: what a pool does once a trace has passed a point, such as the event
    where its live requested bytes peak (trace.peak_requested_at), after which no step needs
    more memory than one already run. The expandable model counts a 20 MiB page mapped as a
    create and a map, and one unmapped as an unmap and a release. `whole`: the ReplayResult
    of the same replay to the end, if one was run already."""
    trace = _as_trace(source)
    before = replay(trace, policy, limit=limit, config=config, capacity=capacity, stop_at=at, event_delay=event_delay)
    if whole is None:
        whole = replay(trace, policy, limit=limit, config=config, capacity=capacity, event_delay=event_delay)
    kinds = {k: whole.backend_calls.get(k, 0) - before.backend_calls.get(k, 0) for k in DRIVER_CALL_KINDS}
    return kinds, whole.device_barriers - before.device_barriers, whole.ooms


def _result_from(raw, label, policy, trace, limit):
    return ReplayResult(
        trace=label,
        policy=policy,
        events=raw["events"],
        peak_requested=raw["peak_requested"],
        peak_reserved=raw["peak_reserved"],
        ratio=raw["ratio"],
        ooms=raw["ooms"],
        backend_calls=dict(raw["backend_calls"]),
        modeled_backend_us=raw["modeled_backend_us"],
        peak_reserved_event=raw["peak_reserved_event"],
        allocs=raw["allocs"],
        frees=raw["frees"],
        reclaims=raw["reclaims"],
        device_barriers=raw["device_barriers"],
        steady_barriers=raw["steady_barriers"],
        plans=raw["plans"],
        plan_hits=raw["plan_hits"],
        plan_misses=raw["plan_misses"],
        plan_passes=raw["plan_passes"],
        plan_pass_us=raw["plan_pass_us"],
        host_alloc_ns=raw["host_alloc_ns"],
        host_free_ns=raw["host_free_ns"],
        host_plan_ns=raw["host_plan_ns"],
        alloc_retries=raw["alloc_retries"],
        final_reserved=raw["final_reserved"],
        skipped_frees=raw["skipped_frees"],
        unmatched_frees=raw["unmatched_frees"],
        lost_frees=raw["lost_frees"],
        limit=int(limit or 0),
        steady_backend_us=raw["steady_backend_us"],
        steady_driver_calls=raw["steady_driver_calls"],
        growths=raw["growths"],
        steady_growths=raw["steady_growths"],
        steady_backend_calls=dict(raw["steady_backend_calls"]),
        recorded_peak_reserved=trace.recorded_peak_reserved(),
    )


def find_min_cap(source, policy="torchmem", *, config=None, capacity=DEFAULT_CAPACITY, precision=GRANULE,
                 progress=None, device=None, native_config=None, costs=None, event_delay=0):
    """The smallest budget (bytes, a multiple of `precision`) under which the trace
    replays under `policy` with no OOM, found by bisection. Returns a dict with
    min_cap, min_cap_ratio, peak_requested, unlimited_peak_reserved and replays.
    The config's own limit is ignored: the budget is what is searched."""
    _check_policy(policy)
    trace = _as_trace(source, device=device)
    core = pool_config(config, capacity)
    core["limit_bytes"] = 0
    return dict(_core.min_cap(trace.events, policy, pool_config=core, capacity=int(capacity), precision=int(precision),
                           progress=_progress_adapter(progress, f"{trace.name} {policy} min-cap"),
                           native_config=native_config, costs=costs, event_delay=int(event_delay)))


def find_min_device(source, policy="torchmem", *, config=None, precision=GRANULE, progress=None, device=None,
                    native_config=None, costs=None, event_delay=0):
    """The smallest simulated device (bytes, a multiple of `precision`) on which the trace
    replays under `policy` with no OOM and no budget of its own, found by bisection.

    Min-cap answers "the smallest limit"; this answers "the smallest card", where the pool
    has no limit and grows as it does with room to spare (Note [Run handles]: whole runs
    far from the device's capacity, a handle per granule near it). Returns a dict with
    min_device, min_device_ratio (over peak requested), peak_requested and replays. The
    config's own limit is ignored."""
    _check_policy(policy)
    trace = _as_trace(source, device=device)
    config = _as_config(config).replace(limit=None)
    replays = 0

    def fits(capacity):
        nonlocal replays
        replays += 1
        if progress is not None:
            progress(f"{trace.name} {policy} min-device", replays, 0)
        return replay(trace, policy, config=config, capacity=capacity, native_config=native_config,
                      costs=costs, event_delay=event_delay).ooms == 0

    def granules(nbytes):
        return -(-int(nbytes) // precision) * precision

    unlimited = replay(trace, policy, config=config, native_config=native_config, costs=costs,
                       event_delay=event_delay)
    requested = unlimited.peak_requested
    if requested == 0:
        return {"min_device": 0, "min_device_ratio": None, "peak_requested": 0, "replays": 1}
    low = granules(requested) - precision   # nothing fits under what is live at once
    high = granules(unlimited.peak_reserved) + precision
    while not fits(high):
        if high >= DEFAULT_CAPACITY * 4:
            raise ValueError(f"{trace.name}: no simulated device up to {high >> 30} GiB replays it without OOM")
        low, high = high, granules(high * 2)
    while high - low > precision:
        mid = granules((low + high) // 2)  # both are multiples of precision: low < mid < high
        if fits(mid):
            high = mid
        else:
            low = mid
    return {"min_device": high, "min_device_ratio": high / requested, "peak_requested": requested,
            "replays": replays + 1}


def snapshot_at(source, event, policy="torchmem", *, limit=0, config=None, capacity=DEFAULT_CAPACITY, device=None,
                native_config=None):
    """The policy's layout right after trace event index `event`, as the core's
    snapshot dict ({"segments": [...], "trace": [...]}, see csrc/bindings/convert.h)."""
    _check_policy(policy)
    trace = _as_trace(source, device=device)
    core = pool_config(config, capacity)
    raw = _core.replay(trace.events, policy, pool_config=core, limit=int(limit or core["limit_bytes"]),
                    capacity=int(capacity), stop_at=int(event), native_config=native_config, snapshot=True)
    return raw["snapshot"]


def torch_snapshot_at_peak(source, policy="torchmem", *, limit=0, config=None, capacity=DEFAULT_CAPACITY,
                           device=None):
    """Replays up to the policy's peak-reserved event and returns its layout there in
    PyTorch's memory-snapshot format (what torch.cuda.memory._dump_snapshot pickles),
    plus the ReplayResult of the full replay: (snapshot_dict, result)."""

    trace = _as_trace(source, device=device)
    result = replay(trace, policy, limit=limit, config=config, capacity=capacity)
    core = snapshot_at(trace, max(result.peak_reserved_event, 0), policy, limit=limit, config=config,
                       capacity=capacity)
    settings = {"replayed_policy": policy, "replayed_event": result.peak_reserved_event}
    snapshot = to_torch_snapshot(core, device=0, expandable=(policy == "torchmem"), allocator_settings=settings)
    return snapshot, result


def reserved_timeline(source, policy="torchmem", *, limit=0, config=None, capacity=DEFAULT_CAPACITY, device=None):
    """Bytes the policy holds after each trace event: an int64 array, one entry per event."""
    _check_policy(policy)
    trace = _as_trace(source, device=device)
    core = pool_config(config, capacity)
    raw = _core.replay(trace.events, policy, pool_config=core, limit=int(limit or core["limit_bytes"]),
                    capacity=int(capacity), timeline=True)
    return raw["reserved_timeline"]
