"""The node exporter: ranks and jobs from the launchers' environments, the version-2 record
that carries them (version 1 still read), labels and drop-out over fake records of real
processes, and `python -m torchmem exporter` scraped over HTTP while two publishing processes
with different ranks run and one is killed. Scrapes are read with prometheus_client's parser."""

import os
import signal
import subprocess
import sys
import time
import types
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import REPO
from torchmem.monitor import exporter, record
from torchmem.monitor.publisher import identity_now
from torchmem.monitor.record import DeviceFigures, Record, RecordError, RecordWriter
from torchmem.monitor.sources import process_identity


def _samples(text):
    """{(name, frozenset(labels)): value} of a scrape, parsed by prometheus_client."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _series(samples, name, **labels):
    """[(labels dict, value)] of `name` whose labels include `labels`."""
    wanted = {k: str(v) for k, v in labels.items()}.items()
    return [(dict(key), value) for (n, key), value in samples.items() if n == name and wanted <= dict(key).items()]


@pytest.mark.parametrize("environ, expected", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "run7"}, (3, 1, 8, "run7")),
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "2", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "4242"}, (5, 2, 16, "4242")),
    # srun torchrun: torchrun's worker rank, not Slurm's agent number; the Slurm job names the job
    ({"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
      "SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "abc"}, (9, 1, 16, "77")),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, (1, 0, 2, "")),
    ({"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0"}, (-1, 0, 0, "")),  # torchrun's default run id names no job
    ({"TORCHMEM_JOB": "llama-70b", "SLURM_JOB_ID": "4242", "RANK": "x"}, (-1, -1, 0, "llama-70b")),
    ({}, (-1, -1, 0, "")),
])
def test_identity_from_the_launchers_environment(environ, expected):
    got = process_identity(environ=environ)
    assert (got["rank"], got["local_rank"], got["world_size"], got["job"]) == expected
    assert process_identity(job="explicit", environ=environ)["job"] == "explicit"


def test_torch_distributed_rank_wins_once_the_group_exists(monkeypatch):
    """mp.spawn sets no RANK: the publisher reads the default group's rank when there is one."""
    base = process_identity(environ={"SLURM_JOB_ID": "1"})
    assert identity_now(base)["rank"] in (-1, base["rank"])
    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 get_rank=lambda: 6, get_world_size=lambda: 8)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    now = identity_now(base)
    assert (now["rank"], now["world_size"], now["job"]) == (6, 8, "1")


def _rec(pid, rank=-1, job="", ndev=1, live=1 << 20):
    return Record(pid=pid, start_ticks=record.process_start_ticks(pid) or 0, command="train.py", group="",
                  updated_ns=time.time_ns(), rank=rank, local_rank=max(rank, -1), world_size=2 if rank >= 0 else 0,
                  job=job, devices=[DeviceFigures(index=i, uuid=bytes([i]) * 16, live_bytes=live + i,
                                                  reserved_bytes=2 * live, micro_batch=8) for i in range(ndev)])


def test_version_2_carries_the_identity_and_version_1_is_still_read():
    rec = _rec(os.getpid(), rank=3, job="j" * 100)  # a job name longer than the record holds
    back = record.decode(record.encode(rec))
    assert (back.rank, back.local_rank, back.world_size) == (3, 3, 2)
    assert back.job == "j" * record.JOB_BYTES
    accented = record.decode(record.encode(_rec(os.getpid(), job="é" * 40)))
    assert accented.job == "é" * (record.JOB_BYTES // 2)  # cut between characters, never inside one
    v1 = bytearray(record.encode(rec)[:record.RECORD_BYTES_V1])
    v1[8:12] = (1).to_bytes(4, "little")
    old = record.decode(bytes(v1))
    assert (old.rank, old.local_rank, old.world_size, old.job) == (-1, -1, 0, "")
    assert old.devices[0].live_bytes == rec.devices[0].live_bytes
    v1[8:12] = (2).to_bytes(4, "little")
    with pytest.raises(RecordError, match=r"version-2 torchmem record has \d+ \(truncated"):
        record.decode(bytes(v1))


@pytest.fixture
def sleepers():
    procs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
             for _ in range(2)]
    yield procs
    for p in procs:
        if p.poll() is None:
            p.stdin.close()
            p.wait(timeout=30)


def test_labels_and_dead_processes_drop_out(tmp_path, sleepers):
    """Two processes' records (ranks 0 and 1, two devices each): every series has pid, device, rank
    and job; when one process dies its series go, its file stays (Note [The exporter never
    removes records]), and a dead-looking record that is still rewritten counts as invisible."""
    writers = []
    for rank, proc in enumerate(sleepers):
        writer = RecordWriter(str(tmp_path), pid=proc.pid)
        writer.open(_rec(proc.pid, rank=rank, job="" if rank else "jobA", ndev=2))
        writers.append(writer)
    collector = exporter.NodeCollector([str(tmp_path)], job="fallback")
    samples = _samples(exporter.exposition(collector))
    for rank, proc in enumerate(sleepers):
        rows = _series(samples, "torchmem_live_bytes", pid=proc.pid)
        assert sorted(labels["device"] for labels, _ in rows) == ["0", "1"]
        job = "fallback" if rank else "jobA"
        assert all(labels["rank"] == str(rank) and labels["job"] == job for labels, _ in rows)
        assert {v for labels, v in rows} == {float(1 << 20), float((1 << 20) + 1)}
        (info,) = _series(samples, "torchmem_process_info", pid=proc.pid)
        assert info[0]["world_size"] == "2" and info[0]["command"] == "train.py" and info[1] == 1.0
        assert _series(samples, "torchmem_host_reserved_bytes", pid=proc.pid, rank=rank, job=job)
        assert _series(samples, "torchmem_ooms_total", pid=proc.pid, rank=rank)  # counters: *_total
    assert _series(samples, "torchmem_exporter_records", state="live")[0][1] == 2

    gone = sleepers[1]
    gone.stdin.close()
    gone.wait(timeout=30)
    samples = _samples(exporter.exposition(collector))
    assert not [k for k in samples if dict(k[1]).get("pid") == str(gone.pid)]
    assert _series(samples, "torchmem_live_bytes", pid=sleepers[0].pid)
    assert _series(samples, "torchmem_exporter_records", state="dead")[0][1] == 1
    assert os.path.exists(writers[1].path)

    rewritten = _rec(gone.pid, rank=1)
    rewritten.updated_ns += 1
    writers[1].write(rewritten)  # as a writer in another PID namespace would
    with pytest.warns(RuntimeWarning, match="another PID namespace.*shareProcessNamespace"):
        samples = _samples(exporter.exposition(collector))
    assert _series(samples, "torchmem_exporter_records", state="invisible")[0][1] == 1
    for writer in writers:
        writer.close()


PUBLISHER = r"""
import sys
from torchmem import monitor
from torchmem.monitor.record import DeviceFigures

class Source:
    def rows(self):
        return [DeviceFigures(index=0, uuid=b"fake-gpu-0000000", live_bytes=(1 + int(sys.argv[1])) << 30,
                              reserved_bytes=3 << 30)]
    def host(self):
        return 0, 0

assert monitor.start(source=Source(), interval=0.05) is not None
print("ready", flush=True)
sys.stdin.read()
"""


def _scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return _samples(response.read().decode())


def test_exporter_command_serves_two_ranks_and_drops_a_killed_one(tmp_path):
    env = dict(os.environ, TORCHMEM_MONITOR_DIR=str(tmp_path), SLURM_JOB_ID="4242", WORLD_SIZE="2")
    env.pop("TORCHMEM_JOB", None)
    ranks = [subprocess.Popen([sys.executable, "-c", PUBLISHER, str(rank)], cwd=REPO, text=True,
                              env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for rank in range(2)]
    served = subprocess.Popen([sys.executable, "-m", "torchmem", "exporter", "--port", "0", "--host", "127.0.0.1"],
                              cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert [p.stdout.readline().strip() for p in ranks] == ["ready", "ready"]
        line = served.stdout.readline()
        assert str(tmp_path) in line, served.stderr.read() if served.poll() is not None else line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        samples = _scrape(port)
        for rank, proc in enumerate(ranks):
            ((labels, value),) = _series(samples, "torchmem_live_bytes", pid=proc.pid)
            assert labels == {"device": "0", "pid": str(proc.pid), "rank": str(rank), "job": "4242"}
            assert value == (1 + rank) << 30

        ranks[1].send_signal(signal.SIGKILL)  # no atexit: its record stays behind
        ranks[1].wait(timeout=30)
        assert os.path.exists(os.path.join(tmp_path, f"{ranks[1].pid}.rec"))
        samples = _scrape(port)
        assert [labels["rank"] for labels, _ in _series(samples, "torchmem_live_bytes")] == ["0"]
        assert _series(samples, "torchmem_exporter_records", state="dead")[0][1] == 1
        assert _series(samples, "torchmem_record_age_seconds", rank=0)[0][1] < 10

        served.send_signal(signal.SIGTERM)
        assert served.wait(timeout=30) == 0
    finally:
        for proc in ranks + [served]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def test_exporter_command_errors(tmp_path, monkeypatch, capsys):
    from torchmem.cli import main

    monkeypatch.setenv("TORCHMEM_MONITOR_DIR", str(tmp_path))
    assert main(["exporter", "--once"]) == 0
    assert _series(_samples(capsys.readouterr().out), "torchmem_exporter_records", state="live")[0][1] == 0
    assert main(["exporter"]) == 2 and "--port is required" in capsys.readouterr().err
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        assert main(["exporter", "--port", str(taken.getsockname()[1]), "--host", "127.0.0.1"]) == 1
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert "cannot serve on 127.0.0.1" in err and "--port" in err


def test_an_unreadable_directory_or_record_is_counted_not_fatal(tmp_path, caplog):
    (tmp_path / "not-a-dir").write_text("")
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "1.rec").write_bytes(b"junk")
    collector = exporter.NodeCollector([str(tmp_path / "not-a-dir"), str(tmp_path / "records")])
    with caplog.at_level("WARNING", logger="torchmem.monitor"):
        samples = _samples(exporter.exposition(collector))
        exporter.exposition(collector)
    assert _series(samples, "torchmem_exporter_records", state="unreadable")[0][1] == 2
    assert sum("cannot read" in r.message for r in caplog.records) == 1  # once, not at every scrape
    assert sum("1.rec" in r.message for r in caplog.records) == 1
