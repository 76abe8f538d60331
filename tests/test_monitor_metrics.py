"""Prometheus scrape over real HTTP on 127.0.0.1, a port in use, `top --once --json` from another
process, the callbacks' dict, and the config options of watching and sharing."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from support import REPO
from torchmem import monitor
from torchmem import installer
from torchmem.runtime import config
from torchmem.monitor import metrics, record

PUBLISHER = r"""
import sys, time
sys.path.insert(0, "tests")
from sim_pool import make_pool
from torchmem import monitor
from torchmem.monitor.sources import PoolSource
from torchmem.runtime import budget
pool = make_pool(limit=256 << 20)
keep = pool.allocate(40 << 20, 0)
gone = pool.allocate(24 << 20, 0)
pool.free(gone)
budget.report_micro_batch(24)
assert monitor.start(source=PoolSource(pool, 8 << 30), interval=0.05) is not None
print(pool.stats()["reserved_bytes"]["all"]["current"], flush=True)
sys.stdin.read()  # runs until the test closes stdin
"""


@pytest.fixture
def publisher(tmp_path):
    env = dict(os.environ, TORCHMEM_MONITOR_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    reserved = int(proc.stdout.readline())
    yield proc, reserved, str(tmp_path)
    proc.stdin.close()
    proc.wait(timeout=30)
    assert proc.returncode == 0
    assert os.listdir(tmp_path) == []  # the record left with its process


def _scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _sample(text, name, **labels):
    """The value of the one sample of `name` whose labels include `labels`, read with
    prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {k: str(v) for k, v in labels.items()}
    found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == name and wanted.items() <= s.labels.items()]
    assert len(found) == 1, f"{name}{wanted}: {len(found)} samples in the scrape:\n{text}"
    return found[0]


def test_http_scrape_of_every_process(publisher, monkeypatch):
    proc, reserved, directory = publisher
    monkeypatch.setenv("TORCHMEM_MONITOR_DIR", directory)
    server = monitor.serve_metrics(0, all_processes=True)
    try:
        text = _scrape(server.server_port)
    finally:
        server.shutdown()
    labels = {"device": 0, "pid": proc.pid}
    assert _sample(text, "torchmem_reserved_bytes", **labels) == reserved
    assert _sample(text, "torchmem_live_bytes", **labels) == 40 << 20
    assert _sample(text, "torchmem_limit_bytes", **labels) == 256 << 20
    assert _sample(text, "torchmem_micro_batch", **labels) == 24
    assert _sample(text, "torchmem_ooms_total", **labels) == 0
    assert _sample(text, "torchmem_driver_calls_total", **labels) > 0
    assert 0.0 <= _sample(text, "torchmem_fragmentation_ratio", **labels) <= 1.0
    assert "# TYPE torchmem_reclaims_total counter" in text


def test_port_in_use_is_a_warning_and_training_goes_on():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        with pytest.warns(RuntimeWarning, match=f"cannot serve on 127.0.0.1:{taken.getsockname()[1]}.*goes on"):
            assert monitor.serve_metrics(taken.getsockname()[1]) is None
    finally:
        taken.close()
    with pytest.raises(ValueError, match="port must be an int"):
        monitor.serve_metrics(70000)


def test_top_once_json_sees_the_other_process(publisher):
    proc, reserved, directory = publisher
    env = dict(os.environ, TORCHMEM_MONITOR_DIR=directory)
    out = subprocess.run([sys.executable, "-m", "torchmem", "top", "--json", "--no-nvml"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    snapshot = json.loads(out)
    (device,) = snapshot["devices"]
    (row,) = device["processes"]
    assert row["pid"] == proc.pid and row["reserved_bytes"] == reserved == device["torchmem_reserved_bytes"]
    assert row["live_bytes"] == 40 << 20 and row["micro_batch"] == 24 and row["age_s"] < 5
    text = subprocess.run([sys.executable, "-m", "torchmem", "top", "--once", "--no-nvml"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=True).stdout
    assert str(proc.pid) in text and "reserved" in text


def test_top_with_nothing_published(tmp_path):
    env = dict(os.environ, TORCHMEM_MONITOR_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "torchmem", "top", "--json", "--no-nvml"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert json.loads(out)["devices"] == []


def test_flat_figures_for_the_callbacks():
    rec = record.Record(pid=1, start_ticks=0, host_reserved_bytes=5, devices=[
        record.DeviceFigures(index=0, live_bytes=3, reserved_bytes=7, ooms=2, micro_batch=16)])
    figures = metrics.flat_figures(rec, 0)
    assert figures["reserved_bytes"] == 7 and figures["live_bytes"] == 3 and figures["ooms_total"] == 2
    assert figures["micro_batch"] == 16 and figures["host_reserved_bytes"] == 5
    assert metrics.flat_figures(rec, 1) == {}


def test_config_options_of_watching_and_sharing():
    cfg = config.Config(**config.parse_conf_string("share=team,guarantee=30GiB,metrics_port=9400"))
    assert cfg.share == "team" and cfg.guarantee == 30 << 30 and cfg.metrics_port == 9400 and cfg.monitor
    assert config.Config(share="a", guarantee="33%").guarantee == pytest.approx(0.33)
    with pytest.raises(ValueError, match="'guarantee'"):
        config.Config(share="team")
    with pytest.raises(ValueError, match="no 'limit'"):
        config.Config(share="team", guarantee="1GiB", limit="2GiB")
    with pytest.raises(ValueError, match="only means something with 'share"):
        config.Config(guarantee="1GiB")
    with pytest.raises(ValueError, match="group name"):
        config.Config(share="a/b", guarantee="1GiB")
    with pytest.raises(ValueError, match="metrics_port"):
        config.Config(metrics_port=70000)
    assert config.Config(monitor="false").monitor is False


def test_install_wiring_starts_and_stops_the_publisher(tmp_path, monkeypatch):
    """What torchmem.install() calls after the swap (installer.start_from_config), on the runtime
    source; without a GPU the runtime has no device yet, so the record lists none."""
    monkeypatch.setenv("TORCHMEM_MONITOR_DIR", str(tmp_path))
    pub = installer.start_from_config(config.Config(monitor_interval=0.05))
    try:
        assert pub is monitor.publisher() is not None
        (rec,) = record.scan(str(tmp_path))
        assert rec.pid == os.getpid() and rec.devices == []
        assert installer.start_from_config(config.Config()) is pub  # once per process
    finally:
        monitor.stop()
    assert monitor.publisher() is None and os.listdir(tmp_path) == []
    assert installer.start_from_config(config.Config(monitor=False)) is None


def test_top_lists_live_share_groups_and_removes_dead_ones(tmp_path):
    from torchmem.cli import top

    alive = {"limits": {str(os.getpid()): 5 << 30}, "borrowers": [os.getpid()], "trim": [], "capacity": 10 << 30,
             "scaled": False}
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = dict(alive, limits={child.stdout.strip(): 5 << 30}, borrowers=[])
    (tmp_path / "share-live-00.json").write_text(json.dumps(alive))
    (tmp_path / "share-gone-00.json").write_text(json.dumps(dead))
    (tmp_path / "share-gone-00.lock").write_text("")
    (tmp_path / "share-junk-00.json").write_text("{not json")
    (group,) = top.share_groups(str(tmp_path))
    assert group["file"] == "share-live-00.json" and group["borrowers"] == [os.getpid()]
    assert sorted(os.listdir(tmp_path)) == ["share-junk-00.json", "share-live-00.json"]
    line = top._group_line(group)
    assert line.startswith("live-00: capacity 10.00 GiB") and str(os.getpid()) in line
