"""bench/plan_warmup.py: the step a repeating step goes quiet from, and the synthetic sweep's totals (CPU)."""

import numpy as np
import pytest

from bench_support import load_bench
from torchmem.analysis import patterns
from torchmem.analysis import trace as trace_io

plan_warmup = load_bench("plan_warmup")


def test_quiet_from_counts_the_repeated_steps_until_the_last_call():
    """FSDP2's recording run two steps longer: with room to spare (1.10x) the pool holds its
    layout with no plan, so every repeated step is quiet; the step count matches the calls
    the whole run made before them."""
    rows, period = patterns.repeat_last_step(trace_io.load(trace_io.bundled_trace("fsdp_train")).events, 2)
    events = np.asarray(rows, dtype=np.int64)
    peak = plan_warmup.run(events, 0)["peak_requested"]
    quiet, whole = plan_warmup.quiet_from(events, period, 2, int(1.10 * peak))
    assert quiet == 0 and whole["ooms"] == 0 and plan_warmup.driver_calls(whole) > 0


def test_synthetic_totals_add_up_their_rows(capsys):
    totals = plan_warmup.synthetic(steps=6, seeds=1, micro_steps=(2,), factors=(1.05,))
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert totals["runs"] == len(rows) == 2  # with and without a side stream
    assert totals["calls"] == sum(int(r.split("|")[5].replace(",", "")) for r in rows)
    assert f"{totals['runs']} runs: {totals['calls']:,} driver calls" in out and totals["ooms"] == 0


@pytest.mark.parametrize("argv", [["traces", "--budgets", "0.9"], ["synthetic", "--steps", "1"]])
def test_bad_options_are_refused(argv):
    with pytest.raises(SystemExit):
        plan_warmup.main(argv)
