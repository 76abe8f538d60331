"""Per-process figure records in shared memory: the layout, the writer, the reader.

Every torchmem process that publishes owns one small file,
``/dev/shm/torchmem/<uid>/<pid>.rec`` (``TORCHMEM_MONITOR_DIR`` overrides the
directory): a fixed-layout header and one slot per device. ``top``, the
Prometheus collector and the sharing arbiter all read these files; nothing runs
as a daemon and nothing needs root.

Note [Seqlock]
The writer (one background thread per process) bumps the sequence number to an
odd value, writes the body, then bumps it to the next even value, each with
pwrite. A reader copies the whole file and accepts it only if the sequence was
even and unchanged across the copy; otherwise it reads again. The file is
created at its full size with posix_fallocate and renamed into place, so a
reader never sees a half-created file and a full tmpfs fails at creation with
ENOSPC (a clear message), never later inside a write.

Note [Dead records]
A pid can be reused, so a record names its process by pid plus the kernel's
start time (/proc/<pid>/stat field 22). A record whose pid is gone or whose
start time differs belongs to a dead process: readers skip it and `clean_dead`
removes it (only in our own uid's directory). Liveness is judged in the
reader's PID namespace, so a reader in another one (a container without the
writer's PID namespace) sees every writer as dead; the node exporter therefore
skips such records and never removes them (monitor/exporter.py).

Note [Record versions]
Version 2 appends the writer's identity after the device slots: its rank,
local rank and world size (-1, -1, 0 when unknown) and a job name, which the
node exporter turns into labels. Everything before it is laid out as in
version 1, so the seqlock's offset is the same. Readers accept both versions
(a version-1 record has no identity); a reader from before version 2 skips a
version-2 record as one of the wrong size, never fatally, so a node should run
one torchmem version for its records to be seen by every reader.
"""

import dataclasses
import errno
import os
import struct
import sys
import tempfile
import time

MAGIC = b"TORCHMEM"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_DEVICES = 16
NAME_BYTES = 32
JOB_BYTES = 64

_HEADER = struct.Struct("<8sIIqqQQI32s48sQQ")
_SEQ_OFFSET = 8 + 4 + 4 + 8 + 8  # magic, version, ndev, pid, start
_SEQ = struct.Struct("<Q")
# index, uuid, then 18 unsigned figures, the micro-batch (signed) and fragmentation
_SLOT = struct.Struct("<i16s18Qqd")
# version 2's tail (Note [Record versions]): rank, local rank, world size, job, then per
# device slot the device barriers so far (Note [Device barrier] in csrc/core/pool.h)
_IDENTITY = struct.Struct(f"<iii{JOB_BYTES}s")
_BARRIERS = struct.Struct(f"<{MAX_DEVICES}Q")
RECORD_BYTES_V1 = _HEADER.size + MAX_DEVICES * _SLOT.size
RECORD_BYTES = RECORD_BYTES_V1 + _IDENTITY.size + _BARRIERS.size
_SIZES = {1: RECORD_BYTES_V1, 2: RECORD_BYTES}

# The unsigned per-device figures, in slot order (bytes unless named otherwise).
DEVICE_FIELDS = (
    "live_bytes", "reserved_bytes", "cached_bytes", "largest_free_bytes", "limit_bytes",
    "peak_live_bytes", "peak_reserved_bytes", "ooms", "reclaims", "driver_calls", "alloc_retries",
    "guarantee_bytes", "need_bytes", "device_total_bytes", "device_free_bytes", "granted_bytes", "recent_ooms",
    "constrained",
)


class RecordError(ValueError):
    """A file in the record directory that is not a readable torchmem record."""


@dataclasses.dataclass
class DeviceFigures:
    """One device's figures in one process. `micro_batch` is -1 when no controller reported."""

    index: int
    uuid: bytes = b"\0" * 16
    live_bytes: int = 0
    reserved_bytes: int = 0
    cached_bytes: int = 0
    largest_free_bytes: int = 0
    limit_bytes: int = 0
    peak_live_bytes: int = 0
    peak_reserved_bytes: int = 0
    ooms: int = 0
    reclaims: int = 0
    driver_calls: int = 0
    alloc_retries: int = 0
    guarantee_bytes: int = 0   # sharing: this process's guaranteed share (0 = not sharing)
    need_bytes: int = 0        # sharing: bytes an allocation waits for (0 = none pending)
    device_total_bytes: int = 0
    device_free_bytes: int = 0
    granted_bytes: int = 0     # sharing: the limit the arbiter granted (0 = none yet)
    recent_ooms: int = 0       # OOMs over the publisher's window (a member pressed against its limit)
    constrained: int = 0       # 1 while its controller splits batches it could run whole with more memory
    micro_batch: int = -1
    fragmentation: float = 0.0  # 1 - largest free block / cached bytes (0..1)
    barriers: int = 0           # waits for the whole device so far (version 2 records; 0 in version 1)

    def as_dict(self):
        out = dataclasses.asdict(self)
        out["uuid"] = self.uuid.hex()
        return out


@dataclasses.dataclass
class Record:
    """A process's record: who it is (pid, and where known its rank and job), when it last
    wrote, its sharing group and its devices."""

    pid: int
    start_ticks: int
    seq: int = 0
    updated_ns: int = 0
    interval_ms: int = 0
    group: str = ""
    command: str = ""
    host_reserved_bytes: int = 0
    host_active_bytes: int = 0
    devices: list = dataclasses.field(default_factory=list)
    rank: int = -1        # the global rank under torch.distributed or a launcher (-1: none)
    local_rank: int = -1  # the rank among the node's processes (-1: none)
    world_size: int = 0   # 0: not known
    job: str = ""         # the job it belongs to (Slurm job id, torchrun run id, the `job` option)

    def as_dict(self):
        out = dataclasses.asdict(self)
        out["devices"] = [d.as_dict() for d in self.devices]
        return out


def default_dir():
    """Where records live: $TORCHMEM_MONITOR_DIR, else /dev/shm/torchmem/<uid> (tmpfs),
    else the temp directory when /dev/shm does not exist."""
    explicit = os.environ.get("TORCHMEM_MONITOR_DIR")
    if explicit:
        return explicit
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "torchmem", str(os.getuid()))


def process_start_ticks(pid):
    """The kernel's start time of `pid` in clock ticks, or None when the process does not exist.
    0 where /proc is missing (then only the pid is checked)."""
    if not os.path.isdir("/proc"):
        return 0 if _pid_exists(pid) else None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0 if _pid_exists(pid) else None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = text[text.rindex(b")") + 2:].split()
    return int(fields[19])


def _pid_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_alive(record):
    """True while the process that wrote `record` still runs (Note [Dead records])."""
    ticks = process_start_ticks(record.pid)
    if ticks is None:
        return False
    if ticks == 0 or record.start_ticks == 0:  # no start time to compare (no /proc): the pid decides
        return True
    return ticks == record.start_ticks


def _text(raw, size):
    # cut on a character boundary, so a long name never ends in a broken character
    return raw.encode("utf-8", "replace")[:size].decode("utf-8", "ignore").encode("utf-8")


def _int32(value):
    return max(-1, min(int(value), (1 << 31) - 1))


def encode(record):
    """The record's bytes (RECORD_BYTES long)."""
    if len(record.devices) > MAX_DEVICES:
        raise ValueError(f"torchmem monitor: a record holds at most {MAX_DEVICES} devices, got {len(record.devices)}")
    header = _HEADER.pack(
        MAGIC, VERSION, len(record.devices), record.pid, record.start_ticks, record.seq, record.updated_ns,
        record.interval_ms, _text(record.group, NAME_BYTES), _text(record.command, 48),
        record.host_reserved_bytes, record.host_active_bytes,
    )
    slots = [
        _SLOT.pack(d.index, bytes(d.uuid)[:16].ljust(16, b"\0"),
                   *(max(0, int(getattr(d, name))) for name in DEVICE_FIELDS), int(d.micro_batch), float(d.fragmentation))
        for d in record.devices
    ]
    body = header + b"".join(slots)
    body += b"\0" * (RECORD_BYTES_V1 - len(body))
    barriers = [max(0, int(d.barriers)) for d in record.devices] + [0] * (MAX_DEVICES - len(record.devices))
    return (body + _IDENTITY.pack(_int32(record.rank), _int32(record.local_rank), max(0, _int32(record.world_size)),
                                  _text(record.job, JOB_BYTES)) + _BARRIERS.pack(*barriers))


def decode(data, source="record"):
    """A Record from bytes; RecordError for anything that is not a torchmem record of a version
    this torchmem reads (Note [Record versions])."""
    if len(data) not in _SIZES.values():
        raise RecordError(f"{source}: {len(data)} bytes, a torchmem record has {RECORD_BYTES} (foreign or truncated file)")
    (magic, version, ndev, pid, start, seq, updated, interval, group, command,
     host_reserved, host_active) = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise RecordError(f"{source}: not a torchmem record (bad magic {magic!r})")
    if version not in READABLE_VERSIONS:
        raise RecordError(f"{source}: record version {version}, this torchmem reads versions "
                          f"{', '.join(map(str, READABLE_VERSIONS))}")
    if len(data) != _SIZES[version]:
        raise RecordError(f"{source}: {len(data)} bytes, a version-{version} torchmem record has "
                          f"{_SIZES[version]} (truncated file)")
    if ndev > MAX_DEVICES or pid <= 0:
        raise RecordError(f"{source}: corrupt record (devices={ndev}, pid={pid})")
    devices = []
    for i in range(ndev):
        values = _SLOT.unpack_from(data, _HEADER.size + i * _SLOT.size)
        figures = dict(zip(DEVICE_FIELDS, values[2:2 + len(DEVICE_FIELDS)]))
        devices.append(DeviceFigures(index=values[0], uuid=values[1], micro_batch=values[-2],
                                     fragmentation=values[-1], **figures))
    identity = {}
    if version >= 2:
        rank, local_rank, world_size, job = _IDENTITY.unpack_from(data, RECORD_BYTES_V1)
        identity = dict(rank=rank, local_rank=local_rank, world_size=world_size,
                        job=job.rstrip(b"\0").decode("utf-8", "replace"))
        barriers = _BARRIERS.unpack_from(data, RECORD_BYTES_V1 + _IDENTITY.size)
        for device, count in zip(devices, barriers):
            device.barriers = count
    return Record(pid=pid, start_ticks=start, seq=seq, updated_ns=updated, interval_ms=interval,
                  group=group.rstrip(b"\0").decode("utf-8", "replace"),
                  command=command.rstrip(b"\0").decode("utf-8", "replace"),
                  host_reserved_bytes=host_reserved, host_active_bytes=host_active, devices=devices, **identity)


def record_path(directory, pid):
    return os.path.join(directory, f"{pid}.rec")


class RecordWriter:
    """The owning process's side: creates its record file and rewrites it in place (Note [Seqlock])."""

    def __init__(self, directory=None, pid=None):
        self.directory = directory or default_dir()
        self.pid = pid or os.getpid()
        self.start_ticks = process_start_ticks(self.pid) or 0
        self.path = record_path(self.directory, self.pid)
        self._seq = 0
        self._fd = None

    def open(self, record):
        """Creates the file at full size and renames it into place. Raises OSError with a message
        that names the directory and the fix (ENOSPC: a full tmpfs; EACCES: permissions)."""
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.pid}.", suffix=".tmp", dir=self.directory)
        except OSError as exc:
            raise OSError(exc.errno, f"torchmem monitor: cannot create a record in {self.directory}: "
                                     f"{exc.strerror}. Set TORCHMEM_MONITOR_DIR to a writable directory, "
                                     f"or monitor=false to publish nothing") from None
        try:
            _allocate(fd, RECORD_BYTES)
            record.seq = 0
            os.pwrite(fd, encode(record), 0)
            os.replace(tmp, self.path)
        except OSError as exc:
            os.close(fd)
            os.unlink(tmp)
            hint = ("the shared-memory filesystem is full: free space in it (df -h " + self.directory + ")"
                    if exc.errno == errno.ENOSPC else exc.strerror)
            raise OSError(exc.errno, f"torchmem monitor: cannot write a record in {self.directory}: {hint}. "
                                     f"Training goes on without publishing; set TORCHMEM_MONITOR_DIR "
                                     f"elsewhere or monitor=false") from None
        self._fd = fd

    def write(self, record):
        """Rewrites the record under the seqlock; the record's seq is set here."""
        record.pid, record.start_ticks = self.pid, self.start_ticks
        body = encode(record)
        self._seq += 1
        os.pwrite(self._fd, _SEQ.pack(self._seq), _SEQ_OFFSET)  # odd: a write is in progress
        self._seq += 1
        record.seq = self._seq
        os.pwrite(self._fd, body[:_SEQ_OFFSET], 0)
        os.pwrite(self._fd, body[_SEQ_OFFSET + _SEQ.size:], _SEQ_OFFSET + _SEQ.size)
        os.pwrite(self._fd, _SEQ.pack(self._seq), _SEQ_OFFSET)

    def close(self, remove=True):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if remove:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass


def _allocate(fd, size):
    """Reserves the file's blocks now, so a full tmpfs fails here (ENOSPC), not in a later write."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)


def read_record(path, attempts=50):
    """The record at `path`, read consistently (Note [Seqlock]). RecordError for a foreign or
    corrupt file; FileNotFoundError when it vanished (its process exited)."""
    with open(path, "rb") as f:
        for _ in range(attempts):
            data = os.pread(f.fileno(), RECORD_BYTES + 1, 0)
            record = decode(data, source=path)
            seq_after = _SEQ.unpack(os.pread(f.fileno(), _SEQ.size, _SEQ_OFFSET))[0]
            if record.seq % 2 == 0 and record.seq == seq_after:
                return record
            time.sleep(0.0005)
    raise RecordError(f"{path}: the writer never finished a write while it was read ({attempts} attempts)")


def scan(directory=None, clean=True, on_error=None, on_dead=None):
    """The live records in `directory`, sorted by pid. Dead processes' records are passed to
    on_dead(path, record) when given and removed when `clean` (Note [Dead records]); foreign or
    corrupt files are skipped and passed to on_error(path, error) (default: a line on stderr),
    never fatal."""
    directory = directory or default_dir()
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    records = []
    for name in names:
        if not name.endswith(".rec"):
            continue
        path = os.path.join(directory, name)
        try:
            record = read_record(path)
        except FileNotFoundError:
            continue
        except (RecordError, OSError) as exc:  # foreign, corrupt, or another user's file
            (on_error or _report)(path, exc)
            continue
        if not is_alive(record):
            if on_dead is not None:
                on_dead(path, record)
            if clean:
                _remove_quietly(path)
            continue
        records.append(record)
    return sorted(records, key=lambda r: r.pid)


def _report(path, error):
    print(f"torchmem monitor: skipping {path}: {error}", file=sys.stderr)


def _remove_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def clean_dead(directory=None):
    """Removes the records of processes that no longer run; returns how many."""
    directory = directory or default_dir()
    removed = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        if not name.endswith(".rec"):
            continue
        try:
            record = read_record(path)
        except (OSError, RecordError):
            continue
        if not is_alive(record):
            _remove_quietly(path)
            removed += 1
    return removed
