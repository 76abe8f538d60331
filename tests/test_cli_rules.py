"""One rule across the subcommands (torchmem/cli/options.py): bundled trace names
everywhere a trace is read, one reading of --limit, errors that name what the user
typed, bad options refused before any replay runs, and a subcommand's own usage
for a mistyped option."""

import json
import os
import sys

import pytest

from torchmem.analysis import trace as trace_io
from torchmem.cli import main
from torchmem.cli.options import CliError, limit_bytes, parse_limit
from support import REPO

GiB = 1 << 30


@pytest.mark.parametrize("text, expected", [
    ("1", 1.0), ("0.5", 0.5), ("50%", 0.5), ("100%", 1.0), ("20GiB", 20 * GiB), ("4294967296", 4 * GiB),
    ("512 MiB", 512 << 20), (None, None),
])
def test_limit_reads_by_one_rule(text, expected):
    assert parse_limit(text) == expected


@pytest.mark.parametrize("text, words", [
    ("0", ["--limit 0", "leaves no memory", "leave --limit out"]),
    ("0GiB", ["--limit 0GiB", "leaves no memory"]),
    ("1.5", ["--limit 1.5", "above 1 is bytes"]),
    ("150%", ["--limit 150%", "(0, 1]"]),
    ("lots", ["--limit 'lots'", "20GiB"]),
])
def test_limit_refusals_name_the_flag(text, words):
    with pytest.raises(CliError) as info:
        parse_limit(text)
    for word in words:
        assert word in str(info.value)


def test_limit_in_bytes_is_refused_below_a_granule_and_above_the_device():
    assert limit_bytes(1.0, 140 * GiB) == 140 * GiB
    with pytest.raises(CliError, match="below one 2 MiB granule"):
        limit_bytes(4096, 140 * GiB)
    with pytest.raises(CliError, match=r"1,024.00 GiB is more than the simulated device's 140.00 GiB"):
        limit_bytes(1 << 40, 140 * GiB)


def _replay_must_not_run(monkeypatch):
    from torchmem.analysis import replay as replay_api

    def refuse(*args, **kwargs):
        raise AssertionError("a replay ran before the options were checked")
    monkeypatch.setattr(replay_api, "replay", refuse)


@pytest.mark.parametrize("argv, words", [
    (["--limit", "1000"], ["--limit: 1,000 bytes is below one 2 MiB granule"]),
    (["--limit", "1TiB"], ["--limit: 1,024.00 GiB is more than the simulated device's 140.00 GiB"]),
    (["--limit", "0"], ["--limit 0: a budget of 0 leaves no memory"]),
    (["--config", "limit"], ["--config: expected key=value"]),
    (["--config", "limit=1TiB"], ["--config limit: 1,024.00 GiB is more than"]),
    (["--config", "reclaim_slack=lots"], ["--config: torchmem config 'reclaim_slack'"]),
    (["--capacity", "huge"], ["--capacity 'huge': expected a size"]),
    (["--capacity", "1MiB"], ["--capacity 1MiB: the simulated device needs at least one 2 MiB granule"]),
    (["--config", "reserve=200GiB"], ["--config reserve: 200.00 GiB is more than the simulated device (--capacity)"]),
    (["--limit", "50%", "--config", "reserve=100GiB"],
     ["--config reserve: 100.00 GiB is more than the budget (--limit)"]),
    (["--min-cap", "--config", "reserve=8GiB"], ["--config reserve: 8.00 GiB is at least", "--min-cap"]),
    (["--snapshot", "/no/such/folder/peak.pickle"], ["--snapshot", "folder /no/such/folder does not exist"]),
    (["--snapshot", "{tmp}/peak.pickle", "--policy", "expandable"], ["--snapshot", "expandable model keeps no"]),
    (["--snapshot", "{tmp}"], ["--snapshot", "is a folder"]),
])
def test_replay_refuses_bad_options_before_replaying(tmp_path, capsys, monkeypatch, argv, words):
    _replay_must_not_run(monkeypatch)
    assert main(["replay", "vision"] + [a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("torchmem replay: error: ")
    for word in words:
        assert word in err
    for internal in ("PoolConfig", "limit_bytes", "TORCHMEM_CONF"):
        assert internal not in err


def test_limit_1_is_the_whole_simulated_device(capsys):
    assert main(["replay", "vision", "--json", "--policy", "torchmem", "--limit", "1", "--capacity", "8GiB"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["limit"] == 8 * GiB and record["ooms"] == 0


def test_torchmem_conf_is_named_only_when_it_is_the_source(capsys, monkeypatch):
    _replay_must_not_run(monkeypatch)
    monkeypatch.setenv("TORCHMEM_CONF", "limit=1TiB")
    assert main(["replay", "vision"]) == 2
    assert "TORCHMEM_CONF limit: 1,024.00 GiB is more than" in capsys.readouterr().err


def test_help_states_the_limit_rule(capsys):
    for command in ("replay", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert "1 for all of it" in help_text and "0 is refused" in help_text


def test_a_mistyped_option_prints_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["replay", "vision", "--polcy", "all"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m torchmem replay ")
    assert "unrecognized arguments: --polcy" in err and "did you mean --policy?" in err


def test_bundled_names_work_in_every_subcommand(tmp_path, capsys):
    assert main(["stats", "vision", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == 25885
    assert main(["convert", "vision", str(tmp_path / "vision.pickle")]) == 0
    assert "25885 trace entries" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    png = tmp_path / "vision.png"
    assert main(["plot", "vision", "-o", str(png), "--no-replay"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {png}: timeline of 25,885 events")
    for argv in (["stats", "no_such_trace"], ["plot", "no_such_trace", "-o", str(png)],
                 ["convert", "no_such_trace", str(tmp_path / "x.pickle")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "neither a file nor a bundled trace" in err and "gpt2_train" in err


def test_convert_blames_an_input_that_is_no_trace(tmp_path, capsys):
    garbage = tmp_path / "garbage.pickle"
    garbage.write_bytes(b"this is not a pickle at all")
    assert main(["convert", str(garbage), str(tmp_path / "out.json.gz")]) == 2
    err = capsys.readouterr().err
    assert "IN:" in err and "garbage.pickle" in err and "not a trace" in err and "OUT" not in err


def test_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", "vision", "-o", str(tmp_path / "out.png")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("pip install matplotlib")


def test_plot_legend_stays_off_the_curves():
    pytest.importorskip("matplotlib")
    from torchmem.analysis import plot

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure, _ = plot.timeline_figure(trace_io.bundled_trace("vision"), replay=False)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    top = figure.axes[0]
    legend = top.get_legend().get_window_extent(renderer)
    plotting_area = top.get_window_extent(renderer)
    assert legend.y0 >= plotting_area.y1, (legend, plotting_area)


def test_stats_without_a_file_says_where_live_figures_are(capsys):
    assert main(["stats"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "one-shot CLI process" in line and "python -m torchmem top" in line and "SNAPSHOT" not in line
    with open(os.path.join(REPO, "README.md")) as f:
        row = next(line for line in f if line.startswith("| `stats"))
    assert "`stats FILE`" in row and "`top`" in row


def test_demo_help_names_all_four_traces_and_explains_every_option(capsys):
    from torchmem.cli import build_parser

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in ("gpt2_train", "llama_ckpt_train", "kv_generate", "vision"):
        assert name in help_text
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    assert [a.dest for a in demo._actions if not a.help] == []


def test_limit_as_a_multiple_of_each_traces_peak_request(capsys):
    """`replay --limit 1.05x`: each trace's own peak request times 1.05; the table then gives
    driver calls and device waits per step after warm-up (Note [Step plan])."""
    assert main(["replay", "vision", "--policy", "torchmem", "--limit", "1.05x", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["limit"] == int(1.05 * result["peak_requested"])
    assert "steady_barriers" in result and "plans" in result
    assert main(["replay", "vision", "--policy", "torchmem", "--limit", "abcx"]) == 2
    assert "--limit 'abcx'" in capsys.readouterr().err
    assert main(["replay", "vision", "--policy", "torchmem", "--limit", "1.05x"]) == 0
    assert "device waits after warm-up" in capsys.readouterr().out
