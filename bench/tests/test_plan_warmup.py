"""bench/plan_warmup.py: the synthetic sweep's rows and totals (CPU)."""

import pytest

from bench_support import load_bench

plan_warmup = load_bench("plan_warmup")


def test_sweep_totals_add_up_their_rows(capsys):
    totals = plan_warmup.sweep(steps=6, seeds=1, micro_steps=(2,), factors=(1.05,))
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert totals["runs"] == len(rows) == 2  # with and without a side stream
    assert totals["calls"] == sum(int(r.split("|")[5].replace(",", "")) for r in rows) > 0
    assert f"{totals['runs']} runs: {totals['calls']:,} driver calls" in out and totals["ooms"] == 0


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--seeds", "0"]])
def test_bad_options_are_refused(argv):
    with pytest.raises(SystemExit):
        plan_warmup.main(argv)
