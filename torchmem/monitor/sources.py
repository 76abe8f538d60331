"""Where a publishing process reads its own figures: the installed allocator, or a
simulated pool.

A source reads, never acts: `rows()` (a list of DeviceFigures, one per device
with a pool), `host()` (pinned host bytes: reserved, active) and
`device_free(index)`. The levers GPU sharing pulls (set a limit, give cached
memory back) are share/levers.py's, over these same sources.
`process_identity()` is who the process is among its job's processes (rank,
local rank, world size, job), from the launcher's environment; the publisher
writes it into the record for the node exporter's labels.
`RuntimeSource` reads torchmem._C's runtime stats, the same counters
torchmem.memory_stats() reports, never the allocation path: one stats call per
device per tick takes the pool's mutex for a copy of its counters. Tests give
the publisher a `PoolSource` over a simulated _C.Pool, or a fake of their own.
"""

import os
import sys
import uuid as _uuid

import torch

from torchmem._loader import extension
from torchmem.monitor.record import DeviceFigures

__all__ = ["figures_from_raw", "RuntimeSource", "PoolSource", "process_command", "process_identity",
           "distributed_identity"]

# Where launchers put a process's place in its job: (rank, local rank, world size)
# variables, the first launcher whose rank is set wins. torchrun's come before
# Slurm's: under `srun torchrun`, SLURM_PROCID numbers the torchrun agents (one
# per node), not the workers.
LAUNCHER_VARS = (
    ("RANK", "LOCAL_RANK", "WORLD_SIZE"),                                   # torchrun, accelerate, deepspeed
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),                      # srun
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),                            # MPICH, Intel MPI
    ("PMIX_RANK", "PMIX_LOCAL_RANK", "PMIX_SIZE"),                          # PMIx launchers
)
# TORCHMEM_JOB names the job explicitly (a Kubernetes pod sets it from its Job's name).
JOB_VARS = ("TORCHMEM_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "PBS_JOBID")


def _driver_calls(raw):
    backend = raw.get("backend") or {}
    return sum(int(v) for k, v in backend.items() if k.endswith("_calls") and isinstance(v, int))


def figures_from_raw(raw, index, uuid=b""):
    """DeviceFigures from a core stats dict (the shape of _C.Pool.stats() / _C.runtime_stats)."""
    live = int(raw["allocated_bytes"]["all"]["current"])
    reserved = int(raw["reserved_bytes"]["all"]["current"])
    cached = max(0, reserved - int(raw["active_bytes"]["all"]["current"]))
    largest = int(raw.get("largest_free_block", 0))
    return DeviceFigures(
        index=index, uuid=bytes(uuid)[:16].ljust(16, b"\0"),
        live_bytes=live, reserved_bytes=reserved, cached_bytes=cached, largest_free_bytes=largest,
        limit_bytes=int(raw.get("limit_bytes", 0)),
        peak_live_bytes=int(raw["allocated_bytes"]["all"]["peak"]),
        peak_reserved_bytes=int(raw["reserved_bytes"]["all"]["peak"]),
        ooms=int(raw.get("num_ooms", 0)), reclaims=int(raw.get("num_reclaims", 0)),
        barriers=int(raw.get("num_device_barriers", 0)),
        driver_calls=_driver_calls(raw), alloc_retries=int(raw.get("num_alloc_retries", 0)),
        device_total_bytes=int(raw.get("device_total", 0)), device_free_bytes=int(raw.get("device_free", 0)),
        fragmentation=(1.0 - largest / cached) if cached else 0.0,
    )


def process_command():
    """A short name for `top`: the script or module the process runs."""
    argv = [a for a in sys.argv if a]
    if not argv or argv[0] == "-":
        return os.path.basename(sys.executable)
    if argv[0] == "-c":
        return os.path.basename(sys.executable) + " -c"
    return os.path.basename(argv[0])


def _int(environ, name):
    text = environ.get(name, "").strip()
    return int(text) if text.lstrip("-").isdigit() else None


def process_identity(job=None, environ=None):
    """{"rank", "local_rank", "world_size", "job"} of this process from its launcher's environment
    (torchrun, Slurm, Open MPI, MPICH, PMIx; the job also from LSF and PBS): -1, -1, 0 and ""
    where nothing says. An explicit `job` wins over the environment."""
    environ = os.environ if environ is None else environ
    rank, local_rank, world_size = None, _int(environ, "LOCAL_RANK"), None
    for rank_var, local_var, world_var in LAUNCHER_VARS:
        rank = _int(environ, rank_var)
        if rank is not None:
            local_rank, world_size = _int(environ, local_var), _int(environ, world_var)
            break
    if not job:
        # torchrun's run id is "none" unless --rdzv-id names one: no job then
        job = next((environ[n].strip() for n in JOB_VARS
                    if environ.get(n, "").strip() and environ[n].strip() != "none"), "")
    return {"rank": -1 if rank is None else rank, "local_rank": -1 if local_rank is None else local_rank,
            "world_size": world_size or 0, "job": str(job)}


def distributed_identity():
    """(rank, world size) of torch.distributed's default group once the process initialized it,
    else None. Never imports torch.distributed: a process that did not import it has no group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # a group being torn down; the next tick asks again
        return None
    return None


class RuntimeSource:
    """The installed allocator of this process (torchmem.install())."""

    def __init__(self):
        self._core = extension()
        self._uuids = {}

    def _uuid(self, index):
        if index not in self._uuids:
            text = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
            try:
                self._uuids[index] = _uuid.UUID(text.replace("GPU-", "")).bytes
            except ValueError:
                self._uuids[index] = index.to_bytes(16, "little")  # no uuid: the ordinal names the device
        return self._uuids[index]

    def rows(self):
        return [figures_from_raw(self._core.runtime_stats(d), d, self._uuid(d)) for d in self._core.runtime_devices()]

    def host(self):
        # host_memory_stats reads torch's host allocator counters: no CUDA call.
        if not (torch.cuda.is_initialized() and hasattr(torch.cuda, "host_memory_stats")):
            return 0, 0
        stats = torch.cuda.host_memory_stats()
        return int(stats.get("allocated_bytes.current", 0)), int(stats.get("active_bytes.current", 0))

    def device_free(self, index):
        # Through the runtime, whose CUDA calls run in relaxed capture mode: from
        # this background thread, torch.cuda.mem_get_info would invalidate a CUDA
        # graph another thread is capturing in global mode.
        return int(self._core.runtime_stats(index)["device_free"])


class PoolSource:
    """One simulated torchmem._C.Pool as device `index` (tests, demos without a GPU).
    Its device is the pool's backend capacity, `capacity` bytes."""

    def __init__(self, pool, capacity, index=0, uuid=b"sim-device"):
        self.pool, self.capacity, self.index, self.uuid = pool, capacity, index, uuid

    def rows(self):
        raw = dict(self.pool.stats())
        reserved = raw["reserved_bytes"]["all"]["current"]
        raw.setdefault("device_total", self.capacity)
        raw.setdefault("device_free", self.capacity - reserved)
        return [figures_from_raw(raw, self.index, self.uuid)]

    def host(self):
        return 0, 0

    def device_free(self, index):
        return self.rows()[0].device_free_bytes
