"""Shapes that vary under a budget: once a trace has run its largest step, the pool makes no
more driver calls than the expandable model (PyTorch's expandable_segments) at the same limit.

The bundled traces of training and inference that draw a new batch shape every step (GPT-2,
a Llama with activation checkpointing, KV-cache decoding, ResNet-50 at varying resolutions),
under 1.03, 1.06 and 1.12x their peak request. Counted from the event where the live requested
bytes peak: before it, every allocator grows (torchmem by 2 MiB granules, the model by 20 MiB
pages); after it, no step needs more memory than one already run, so what calls remain are a
pool rearranging itself for a shape it has seen the like of. The defaults (stitch_above_limit=1,
backed_fit) grow to the limit before they move anything and then place requests where cached
granules already back them (Note [When to stitch], Note [Backed placement]); on a GPU the same
shows in bench/lockstep.py --shapes 0 (BENCHMARKS.md, Budget regime)."""

import numpy as np
import pytest

from torchmem.analysis import replay
from torchmem.analysis import trace as trace_io

from sim_pool import STITCHING_CONF

TRACES = ["gpt2_train", "llama_ckpt_train", "kv_generate", "vision"]
LAG = 10  # polls a simulated event stays pending: the GPU runs behind the host


# A GPU that keeps up with its host (events done by the next poll) as well as one that runs behind:
# with no lag, llama_ckpt's pool maps at a pending place after its peak, and the barrier that takes
# must not bring the whole warm-up's stitched places down with it (Note [Pending unmaps]).
@pytest.mark.parametrize("lag", [0, LAG])
@pytest.mark.parametrize("name", TRACES)
def test_after_the_peak_request_no_more_calls_than_the_expandable_model(name, lag):
    trace = trace_io.load(trace_io.bundled_trace(name))
    at, peak = trace_io.peak_requested_at(trace.events.tolist())
    for budget in (1.03, 1.06, 1.12):
        limit = int(peak * budget)
        ours, our_barriers, our_ooms = replay.calls_after(trace, at, "torchmem", limit=limit, event_delay=lag)
        theirs, their_barriers, their_ooms = replay.calls_after(trace, at, "expandable", limit=limit,
                                                                event_delay=lag)
        assert our_ooms == 0, (name, budget)
        assert sum(ours.values()) <= sum(theirs.values()), (name, budget, ours, theirs)
        assert our_barriers <= their_barriers, (name, budget, our_barriers, their_barriers)


def test_stitching_in_the_top_of_the_limit_moves_memory_after_the_peak():
    """What the defaults take away: a pool that stitches in the top 5% of its limit and fills
    fits by size moves granules after the peak request, many times the model's calls."""
    trace = trace_io.load(trace_io.bundled_trace("llama_ckpt_train"))
    at, peak = trace_io.peak_requested_at(trace.events.tolist())
    limit = int(peak * 1.03)
    stitching, _, _ = replay.calls_after(trace, at, "torchmem", limit=limit, event_delay=LAG,
                                         config=STITCHING_CONF)
    theirs, _, _ = replay.calls_after(trace, at, "expandable", limit=limit, event_delay=LAG)
    assert sum(stitching.values()) > sum(theirs.values())


def test_calls_after_an_event_are_the_whole_run_less_those_before_it():
    # grow to a peak, then free and allocate the same sizes again: with room to spare the pool
    # reuses its cache, so nothing after the peak calls the driver
    mib, alloc, free = 1 << 20, trace_io.ALLOC, trace_io.FREE_REQUESTED
    events = []
    for rep in range(3):
        addrs = [0x10000 * (rep * 8 + k + 1) for k in range(4)]
        events += [(alloc, a, (k + 1) * 3 * mib, 0) for k, a in enumerate(addrs)]
        events += [(free, a, 0, 0) for a in addrs]
    events = np.asarray(events, dtype=np.int64)
    at, peak = trace_io.peak_requested_at(events.tolist())
    assert at == 3 and peak == replay.replay(events).peak_requested
    kinds, barriers, ooms = replay.calls_after(events, at)
    assert kinds == dict.fromkeys(replay.DRIVER_CALL_KINDS, 0) and barriers == 0 and ooms == 0
    # from the first event on, the growth counts
    kinds, _, _ = replay.calls_after(events, 0)
    assert kinds["create_calls"] > 0 and kinds["map_calls"] > 0
