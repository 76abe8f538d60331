"""On a GPU: a real torch memory snapshot (recorded under PyTorch's native
allocator) reads as a trace, and the native model replays it to the peak the
real allocator reached. This checks torchmem/analysis/trace.py's snapshot reader against
what torch actually writes (the CPU tests use hand-made snapshots)."""

import json

import pytest

from support import run_python

pytestmark = pytest.mark.gpu


def test_dumped_snapshot_replays_like_the_real_allocator(tmp_path):
    path = tmp_path / "snap.pickle"
    proc = run_python(
        f"""
        import json, random, torch
        keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # live before recording
        torch.cuda.memory._record_memory_history(context=None)
        random.seed(0)
        live = []
        for step in range(200):
            size = random.choice([1 << 10, 300 << 10, 3 << 20, 7 << 20, 24 << 20, (40 << 20) + 512])
            live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            if len(live) > 12:
                live.pop(random.randrange(len(live)))
        del keep
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot({str(path)!r})
        torch.cuda.memory._record_memory_history(enabled=None)
        print(json.dumps({{"peak_reserved": torch.cuda.max_memory_reserved()}}))
        """
    )
    measured = json.loads(proc.stdout.strip().splitlines()[-1])

    from torchmem.analysis import replay as replay_api
    from torchmem.analysis import trace as trace_io

    trace = trace_io.load(path)
    assert trace.prologue >= 1  # `keep` was allocated before recording and freed in it
    native = replay_api.replay(trace, "native")
    ours = replay_api.replay(trace, "torchmem")
    assert native.ooms == 0 and ours.ooms == 0 and native.unmatched_frees == 0
    assert trace.recorded_peak_reserved() == measured["peak_reserved"]
    assert abs(native.peak_reserved / measured["peak_reserved"] - 1) <= 0.05
    assert ours.peak_reserved <= native.peak_reserved
