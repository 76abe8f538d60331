"""Shared-memory records: layout round trip, the seqlock under a concurrent writer, dead
and foreign records, and figures read from a real (simulated) torchmem pool."""

import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from sim_pool import MiB, make_pool
from torchmem.monitor import record
from torchmem.monitor.record import DeviceFigures, Record, RecordError, RecordWriter
from torchmem.monitor.sources import PoolSource, figures_from_raw


def _record(pid, value, ndev=2):
    return Record(pid=pid, start_ticks=record.process_start_ticks(pid) or 0, group="team", command="train.py",
                  host_reserved_bytes=value, devices=[
                      DeviceFigures(index=i, uuid=bytes([i]) * 16, **{f: value + i for f in record.DEVICE_FIELDS},
                                    micro_batch=value % 1000, fragmentation=0.25)
                      for i in range(ndev)])


def test_round_trip(tmp_path):
    writer = RecordWriter(str(tmp_path))
    rec = _record(os.getpid(), 123456789)
    writer.open(rec)
    writer.write(rec)
    back = record.read_record(writer.path)
    assert back.pid == os.getpid() and back.group == "team" and back.command == "train.py"
    assert back.seq == rec.seq and back.seq % 2 == 0
    assert [d.as_dict() for d in back.devices] == [d.as_dict() for d in rec.devices]
    assert record.scan(str(tmp_path))[0].pid == os.getpid()
    writer.close()
    assert not os.path.exists(writer.path)


def test_seqlock_reader_never_sees_a_torn_record(tmp_path):
    """The writer rewrites a record whose every figure equals one counter; a torn read would mix two."""
    writer = RecordWriter(str(tmp_path))
    writer.open(_record(os.getpid(), 1))
    stop = threading.Event()

    def write_forever():
        value = 1
        while not stop.is_set():
            value += 1
            writer.write(_record(os.getpid(), value, ndev=8))
            # a publisher writes every interval, not back to back: a writer that never pauses
            # can hold the GIL through all of a reader's retries on a loaded 2-core machine
            time.sleep(0.0002)

    thread = threading.Thread(target=write_forever)
    thread.start()
    try:
        seen = set()
        for _ in range(2000):
            rec = record.read_record(writer.path)
            values = {getattr(d, f) - d.index for d in rec.devices for f in record.DEVICE_FIELDS}
            values.add(rec.host_reserved_bytes)
            assert len(values) == 1, values
            seen |= values
        assert len(seen) > 10  # the reads did overlap many writes
    finally:
        stop.set()
        thread.join()
        writer.close()


def test_dead_process_record_is_recognized_and_removed(tmp_path):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)
    writer = RecordWriter(str(tmp_path), pid=dead_pid)
    writer.start_ticks = 12345
    writer.open(_record(dead_pid, 7))
    # our own pid with another start time: a reused pid, so the record is stale too
    stale = RecordWriter(str(tmp_path))
    stale.start_ticks += 1
    stale.open(_record(os.getpid(), 7))
    stale.write(_record(os.getpid(), 7))
    assert record.scan(str(tmp_path), clean=False) == []
    assert sorted(os.listdir(tmp_path)) == sorted([f"{dead_pid}.rec", f"{os.getpid()}.rec"])
    assert record.clean_dead(str(tmp_path)) == 2
    assert os.listdir(tmp_path) == []


def test_foreign_and_corrupt_files_are_reported_not_fatal(tmp_path):
    (tmp_path / "1.rec").write_bytes(b"hello")
    (tmp_path / "2.rec").write_bytes(b"\0" * record.RECORD_BYTES)
    bad_version = bytearray(record.encode(_record(os.getpid(), 3)))
    bad_version[8] = 99
    (tmp_path / "3.rec").write_bytes(bytes(bad_version))
    (tmp_path / "notes.txt").write_text("not a record")
    errors = {}
    assert record.scan(str(tmp_path), on_error=lambda p, e: errors.setdefault(os.path.basename(p), str(e))) == []
    assert set(errors) == {"1.rec", "2.rec", "3.rec"}
    assert "truncated" in errors["1.rec"] and "bad magic" in errors["2.rec"] and "version 99" in errors["3.rec"]
    with pytest.raises(RecordError, match="not a torchmem record"):
        record.read_record(str(tmp_path / "2.rec"))


def test_full_shared_memory_filesystem_is_a_clear_error(tmp_path, monkeypatch):
    def no_space(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record, "_allocate", no_space)
    writer = RecordWriter(str(tmp_path))
    with pytest.raises(OSError, match="shared-memory filesystem is full.*Training goes on"):
        writer.open(_record(os.getpid(), 1))
    assert os.listdir(tmp_path) == []  # no half-made file left behind


def test_publisher_warns_and_the_job_goes_on_when_the_directory_is_full(tmp_path, monkeypatch):
    from torchmem.monitor.publisher import Publisher

    monkeypatch.setattr(record, "_allocate", lambda fd, size: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    pool = make_pool()
    pub = Publisher(PoolSource(pool, 8 << 30), directory=str(tmp_path))
    with pytest.warns(RuntimeWarning, match="filesystem is full"):
        assert pub.start() is False
    assert pool.allocate(4 * MiB, 0)  # the allocator is untouched


def test_figures_from_a_simulated_pool():
    pool = make_pool(limit=64 * MiB)
    keep = pool.allocate(10 * MiB, 0)
    gone = pool.allocate(6 * MiB, 0)
    pool.free(gone)
    raw = pool.stats()
    fig = figures_from_raw(raw, 3, b"u" * 16)
    assert fig.index == 3 and keep
    assert fig.live_bytes == raw["allocated_bytes"]["all"]["current"] == 10 * MiB
    assert fig.reserved_bytes == raw["reserved_bytes"]["all"]["current"]
    assert fig.cached_bytes == fig.reserved_bytes - raw["active_bytes"]["all"]["current"] > 0
    assert fig.largest_free_bytes == raw["largest_free_block"] <= fig.cached_bytes
    assert fig.limit_bytes == 64 * MiB
    assert fig.driver_calls == sum(v for k, v in raw["backend"].items() if k.endswith("_calls")) > 0
    assert fig.fragmentation == pytest.approx(1 - fig.largest_free_bytes / fig.cached_bytes)
    assert fig.peak_live_bytes == 16 * MiB
