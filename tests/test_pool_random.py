"""Randomized operation sequences against the pool's invariants and a model.

The bulk (over a million operations per run) runs in C++ through
_C._random_ops: seeded, checked against a reference model of live blocks and
check_invariants() every few hundred operations; a failure names the seed and
the operation. Hypothesis adds short, shrinkable sequences driven from Python
so a failure comes back as a minimal list of steps."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchmem._loader import _C

MiB = 1 << 20

# (seed, operations, options): 1.76 million operations in all, ~5 s on 2 cores. Every case
# also frees some blocks while another stream reads them and is current (declared_readers,
# Note [Freed under another stream]): memory handed to a third stream under such a read with
# no wait fails the run; with three streams (seeds 3, 6, 7) a pool that ignored the reader
# failed within 300 operations.
CASES = [
    (1, 300_000, None),                                         # VMM, 2 streams, private pools
    (2, 250_000, {"vmm": False}),                               # cuda_malloc segments
    (3, 250_000, {"event_delay": 3, "streams": 3}),             # slow fences, deferred frees
    (4, 200_000, {"reclaim_slack": 0.05, "limit": 256 * MiB}),  # slack and a budget
    (5, 200_000, {"capacity": 2 << 30, "max_live": 2000, "check_every": 500}),
    # Run handles (Note [Run handles]) near a small device with lagging fences: runs are
    # made below half of it, released whole when free, and never unmapped under a reader.
    (6, 200_000, {"stitch_above": 0.95, "capacity": 256 * MiB, "event_delay": 2, "streams": 3}),
    # Runs under a limit (Note [Runs under a limit]): runs below half the budget, granules above.
    (7, 150_000, {"limit": 256 * MiB, "run_below_limit": 0.5, "event_delay": 2, "streams": 3}),
    # Captures and MemPool scopes (Note [Unmapped tail]): barriers and stream waits refused for
    # stretches of ~200 operations, under a budget, with lagging fences and three streams; a
    # fenced request takes the heap's unmapped tail, which must never be memory a kernel reads.
    (8, 150_000, {"scopes": 200, "limit": 256 * MiB, "event_delay": 3, "streams": 3}),
    # Short scopes, slow fences, four streams: a block goes from stream to stream behind
    # waits while a reader still runs, which the sim follows transitively (an event covers
    # what its stream waited for); the direct-only check failed this seed at op 1,214.
    (112, 60_000, {"scopes": 50, "event_delay": 10, "streams": 4}),
]


@pytest.mark.parametrize("seed, ops, options", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_random_ops(seed, ops, options):
    summary = _C._random_ops(seed, ops, options)
    assert summary["ops"] == ops
    assert summary["allocs"] > ops // 4 and summary["frees"] == summary["allocs"]
    assert summary["checks"] >= ops // 1000
    if not (options or {}).get("vmm", True):
        assert summary["reclaims"] == 0
    else:
        assert summary["reclaims"] > 0  # the workload is tight enough to stitch
    # Stitching keeps held memory close to the live high-water mark.
    assert summary["peak_held"] <= (options or {}).get("capacity", 512 * MiB)
    if (options or {}).get("scopes"):
        assert summary["scope_allocs"] > ops // 10  # the scopes held a share of the workload


def test_random_ops_reports_bad_options():
    with pytest.raises(ValueError, match="unknown option"):
        _C._random_ops(1, 10, {"bogus": 1})


# ---- hypothesis: short shrinkable sequences -----------------------------------------

sizes = st.one_of(st.integers(1, 4096), st.integers(4097, MiB), st.integers(MiB + 1, 24 * MiB))
steps = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), sizes, st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 63)),
        st.tuples(st.just("record"), st.integers(0, 63), st.integers(0, 2)),
        st.tuples(st.just("release_cached")),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps, vmm=st.booleans(), delay=st.integers(0, 2))
def test_short_sequences_match_the_model(steps, vmm, delay):
    sim = _C.SimBackend(capacity=64 * MiB, vmm=vmm, event_delay=delay)
    pool = _C.Pool(sim, {"limit_bytes": 48 * MiB})
    live = {}  # addr -> (requested, rounded)
    for step in steps:
        if step[0] == "alloc":
            _, size, stream = step
            addr = pool.allocate(size, stream)
            if addr:
                rounded = (size + 511) // 512 * 512
                for other, (_, other_rounded) in live.items():
                    assert addr + rounded <= other or other + other_rounded <= addr, "overlap"
                live[addr] = (size, rounded)
        elif step[0] == "free" and live:
            addr = sorted(live)[step[1] % len(live)]
            del live[addr]
            pool.free(addr)
        elif step[0] == "record" and live:
            pool.record_stream(sorted(live)[step[1] % len(live)], step[2])
        elif step[0] == "release_cached":
            pool.release_cached()
        pool.check_invariants()
        s = pool.stats()
        assert s["allocated_bytes"]["all"]["current"] == sum(r for _, r in live.values())
        assert s["requested_bytes"]["all"]["current"] == sum(q for q, _ in live.values())
        assert s["reserved_bytes"]["all"]["current"] == sim.device_used() <= 48 * MiB
    for addr in list(live):
        pool.free(addr)
    pool.release_cached()
    assert sim.device_used() == 0


def test_the_hand_run_sweep_runs_every_configuration(capsys):
    """tools/random_ops_sweep.py, the deeper sweep run by hand before a reuse rule goes to a
    GPU: one seed of every configuration, and its refusal of an empty sweep."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "random_ops_sweep.py"
    spec = importlib.util.spec_from_file_location("random_ops_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert sweep.main(["--seeds", "1", "--ops", "3000"]) == 0
    assert f"{len(sweep.CONFIGS)} runs, {len(sweep.CONFIGS) * 3000:,} operations, 0 failed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sweep.main(["--seeds", "0"])
