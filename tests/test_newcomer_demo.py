"""The CPU demo (`make demo` without a GPU) reads well: 100 columns, one unit, each
figure once, every row explained, and a conclusion with the budget comparison
(torchmem's min-cap given to every allocator: PyTorch's fail there, torchmem
stitches granules). Also the GPU demo's lines and options (its training runs on
a GPU only)."""

import argparse
import io
import json
import re

import pytest

from torchmem.cli import demo_train
from torchmem.cli import demo


def _demo_args(**changes):
    values = dict(all=False, no_min_cap=False, json=False, replay=True)
    values.update(changes)
    return argparse.Namespace(**values)


@pytest.fixture(scope="module")
def text():
    """The demo's whole output, run once for the module."""
    out = io.StringIO()
    assert demo.run_replay(_demo_args(), out=out) == 0
    return out.getvalue()


def test_the_demo_fits_100_columns(text):
    assert max(len(line) for line in text.splitlines()) <= 100


def test_one_unit_three_decimals(text):
    assert re.findall(r"[\d.,]+ MiB", text) == ["2 MiB"] * text.count("2 MiB")  # granules, a size not a figure
    for figure in re.findall(r"(\d[\d,]*\.\d+) GiB", text):
        assert len(figure.split(".")[1]) == 3, figure
    assert "0.0 GiB" not in text and "0.000 GiB" not in text


def _table_rows(text):
    rows = []
    for line in text.splitlines():
        match = re.match(r"^  (\S.*?)\s{2,}(\S+)\s+(\S+)\s+(\S+)$", line)
        if match and not line.startswith("   "):
            rows.append((match.group(1), match.groups()[1:]))
    return rows


def test_every_row_is_explained_and_each_figure_shown_once(text):
    body, legend = text.split("What the rows mean:")
    labels = {label for label, _ in _table_rows(body)}
    assert {"peak reserved (GiB)", "driver calls", "granules stitched", "its own min-cap (GiB)"} <= labels
    explained = [label for label, _ in demo.LEGEND]
    for label in labels - {"runs the trace"}:
        assert any(key in label for key in explained), f"row {label!r} is not explained"
    rows = dict(_table_rows(body))
    # the native model's peak equals the H200's recorded one: printed once, not once per source
    native_peak = rows["peak reserved (GiB)"][1]
    assert text.count(native_peak) == 1, native_peak
    assert "recorded" not in labels


def test_the_budget_part_fails_pytorchs_allocators_and_stitches(text):
    rows = dict(_table_rows(text.split("2. Under a budget")[1]))
    assert rows["runs the trace"] == ("yes", "no", "no")
    assert int(rows["granules stitched"][0].replace(",", "")) > 0
    ours, native, expandable = (float(v) for v in rows["its own min-cap (GiB)"])
    assert ours < expandable < native


def test_it_ends_with_a_conclusion(text):
    conclusion = " ".join(text.split("In short:")[1].split())
    assert text.index("What the rows mean:") < text.index("In short:")
    assert "GiB less than native" in conclusion and "native and expandable fail" in conclusion
    assert "at its min-cap." in conclusion


def test_differences_never_read_zero():
    GiB = 1 << 30
    assert demo._difference(5 * GiB, 5 * GiB, "expandable") == "the same as expandable"
    assert demo._difference(5 * GiB, 5 * GiB + (6 << 20), "expandable") == "0.006 GiB less than expandable"
    assert demo._difference(6 * GiB, 5 * GiB, "native") == "1.000 GiB more than native (20%)"


def test_json_lines_include_the_budget_replays(capsys):
    out = io.StringIO()
    assert demo.run_replay(_demo_args(json=True), out=out) == 0
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["policy"] for r in records] == ["torchmem", "native", "expandable"] * 2
    budget = records[0]["min_cap"]
    assert [r["limit"] for r in records[3:]] == [budget] * 3 and records[3]["reclaims"] > 0


def test_the_gpu_demo_prints_within_100_columns_and_explains_its_options():
    stats = {"requested_bytes": {"all": {"peak": 123_456_789_012}},
             "allocated_bytes": {"all": {"peak": 123_456_800_000}},
             "reserved_bytes": {"all": {"peak": 130_000_000_000}},
             "num_device_alloc": 123_456, "num_reclaims": 98_765, "num_alloc_retries": 1_234, "num_ooms": 12}
    lines = demo_train.summary_lines(stats, steps=1000, median_step_s=12.3456)
    assert all(len(line) <= 100 for line in lines), lines
    assert any("114.978 GiB" in line for line in lines)  # one unit, GiB
    parser = argparse.ArgumentParser()
    demo_train.add_arguments(parser)
    assert [a.dest for a in parser._actions if not a.help] == []
