"""call_costs: the driver-call prices the replay's time model charges, from a GPU's own probe.

The simulated backend prices each call at figures measured in isolation on one H200
(torchmem._C.sim_costs()). The same calls cost another machine more or less: on the H100s
this project measured, a create and a map cost about twice as much. `python -m torchmem
replay --costs probe.json` and `bench/lockstep.py table --costs probe.json` take the
machine's own prices from `bench/gpu_probe.py --out probe.json`, so the model answers for
the machine the step times come from.

Calls come in bursts: one growth (Note [Call bursts], csrc/replay/replay.h) makes its
creates and maps one after another, and the framework's work between two growths evicts
the host's caches, so a burst's first call of each kind costs what the probe measures with
its caches evicted, the rest what it measures idle (`--costs-cold LIVE,MIB`: the evicted
run's conditions). Idle prices alone leave out what the evictions cost; evicted prices for
every call count them on calls that find the caches warm (BENCHMARKS.md, The replay's time
model against the GPU).
"""

import json

# gpu_probe's keys (a run of one granule per call: a handle per granule, as the pool grows under
# a limit) -> the simulator's. The probe times cuMemMap and cuMemSetAccess as one call, and the
# simulator charges map_us + set_access_us once per handle, so the pair's price goes to set_access_us.
PROBE_KEYS = {
    "reserve_us": "cuMemAddressReserve_us",
    "create_us": "cuMemCreate_us_per_granule",
    "set_access_us": "map_and_set_access_us_per_call",
    "unmap_us": "cuMemUnmap_us_per_call",
    "release_us": "cuMemRelease_us_per_granule",
    "event_record_us": "event_record_us",
    "event_query_us": "event_query_us",
    "stream_wait_us": "stream_wait_us",
    "segment_alloc_us": "cudaMalloc_20MiB_us",
    "segment_free_us": "cudaFree_20MiB_us",
}


def costs_from_probe(probe, live_granules=0, evict_bytes=0):
    """The simulator's cost table (sim_costs() keys, microseconds) with what `probe` measured.

    `probe` is gpu_probe's JSON (a dict, or the path of its file): its run of one granule per
    call gives the per-handle prices; prices it does not measure (runs of many granules, a
    device barrier) stay the simulator's. `live_granules` and `evict_bytes` pick the run timed
    in those conditions (Note [Probe conditions]; runs of older probes, which lack the keys,
    count as 0). Raises ValueError naming what is missing."""
    from torchmem._loader import extension

    if not isinstance(probe, dict):
        try:
            with open(probe) as f:
                probe = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"costs: cannot read {probe!s} as bench/gpu_probe.py's JSON ({e})") from None
    runs = probe.get("runs") if isinstance(probe, dict) else None
    wanted = (1, live_granules, evict_bytes)
    run = next((r for r in runs or [] if (r.get("granules_per_map"), r.get("live_granules", 0),
                                          r.get("evict_bytes", 0)) == wanted), None)
    if run is None:
        conditions = (f" with {live_granules} live granules and {evict_bytes} bytes walked"
                      if live_granules or evict_bytes else "")
        raise ValueError(f"costs: the probe has no run of one granule per call{conditions} (its 'runs' list); "
                         "make it with `python bench/gpu_probe.py --granules 1 16 --out probe.json` on the GPU"
                         + (" (--live-granules, --evict-mib)" if conditions else ""))
    missing = [theirs for theirs in PROBE_KEYS.values() if theirs not in run]
    if missing:
        raise ValueError(f"costs: the probe lacks {', '.join(missing)}; rerun bench/gpu_probe.py with this torchmem")
    costs = dict(extension().sim_costs())
    costs.update({ours: float(run[theirs]) for ours, theirs in PROBE_KEYS.items()})
    costs["map_us"] = 0.0  # in set_access_us: the probe times the two together
    return costs


# The driver calls by kind ("<kind>_calls" counts) and the cost-table keys each is charged.
CALL_PRICES = {"create": ("create_us",), "map": ("map_us", "set_access_us"), "unmap": ("unmap_us",),
               "release": ("release_us",)}


def call_cost_us(calls, prices):
    """What `calls` (a dict of "<kind>_calls" counts) cost, each at its price in `prices`
    (sim_costs() keys: the simulator's, or a GPU probe's): the replay's model of driver time."""
    return sum(calls.get(f"{kind}_calls", 0) * sum(prices[key] for key in keys) for kind, keys in CALL_PRICES.items())


def burst_premium_us(calls, growths, barriers, prices, cold):
    """What `calls` (a dict of "<kind>_calls" counts) cost over their `prices` when the first call
    of each kind in a burst is priced at `cold` (both cost tables, sim_costs() keys). Bursts: the
    growths for creates and maps, the growths and device barriers for unmaps and releases (the
    places a barrier frees are unmapped after it); at most one cold call per call."""
    bursts = {"create": growths, "map": growths, "unmap": growths + barriers, "release": growths + barriers}
    return sum(min(calls.get(f"{kind}_calls", 0), bursts[kind]) * sum(cold[key] - prices[key] for key in keys)
               for kind, keys in CALL_PRICES.items())


def parse_conditions(text, option):
    """"LIVE,MIB" -> (live granules, bytes walked): a probe run's conditions (gpu_probe.py
    --live-granules, --evict-mib). Raises ValueError naming `option` and the form it takes."""
    try:
        live, mib = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{option} {text!r}: give LIVE,MIB, the probe run's --live-granules and --evict-mib "
                         "(e.g. 5000,64)") from None
    if live < 0 or mib < 0:
        raise ValueError(f"{option} {text!r}: LIVE and MIB are counts, 0 or more")
    return live, mib << 20
