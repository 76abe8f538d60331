"""`python -m torchmem top`: a live view of every torchmem process on this node, per GPU.

It reads the per-process records (torchmem/monitor/record.py) that torchmem's
publisher thread writes, so it works from any shell while the jobs run and
needs no GPU of its own. NVML's device totals (nvidia-ml-py, optional) sit
beside torchmem's figures: NVML sees what the driver gave each process
(contexts included), torchmem sees what is live, cached and how fragmented.
Processes are sorted by reserved bytes. `--once` prints one frame; `--json`
prints the figures as one JSON object (for scripts).
"""

import glob
import json
import os
import sys
import time
import uuid as _uuid

from torchmem.monitor import record

HELP = "live per-GPU, per-process view of torchmem's figures (with NVML's totals when available)"


def add_arguments(parser):
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (1.0)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON object and exit")
    parser.add_argument("--dir", default=None, help="record directory (default: $TORCHMEM_MONITOR_DIR or "
                                                     "/dev/shm/torchmem/<uid>)")
    parser.add_argument("--no-nvml", action="store_true", help="do not ask NVML for device totals")


def nvml_devices():
    """{uuid bytes: {index, name, total, used, free, processes: {pid: bytes}}} from NVML, or {}
    when nvidia-ml-py or a driver is missing."""
    try:  # nvidia-ml-py is optional: without it `top` shows torchmem's figures only
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver on this machine (pynvml raises its own NVMLError kinds)
        return {}
    devices = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            text = pynvml.nvmlDeviceGetUUID(handle)
            text = text.decode() if isinstance(text, bytes) else text
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            procs = {}
            try:
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    procs[int(p.pid)] = int(p.usedGpuMemory or 0)
            except Exception:  # containers often cannot see other pids
                pass
            key = _uuid.UUID(text.split("-", 1)[1]).bytes if text.startswith(("GPU-", "MIG-")) else text.encode()[:16]
            devices[key] = {"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                            "uuid": text, "total": int(mem.total), "used": int(mem.used), "free": int(mem.free),
                            "processes": procs}
    finally:
        pynvml.nvmlShutdown()
    return devices


def collect(directory=None, use_nvml=True):
    """The figures `top` shows, as one JSON-ready dict: {"time", "devices": [...]}, each device with
    its NVML totals (or null) and its processes sorted by reserved bytes."""

    nvml = nvml_devices() if use_nvml else {}
    by_device = {}
    now = time.time_ns()
    for rec in record.scan(directory, clean=True, on_error=lambda path, err: None):
        for dev in rec.devices:
            row = dev.as_dict()
            row.update(pid=rec.pid, command=rec.command, group=rec.group, age_s=max(0.0, (now - rec.updated_ns) / 1e9),
                       host_reserved_bytes=rec.host_reserved_bytes, host_active_bytes=rec.host_active_bytes)
            info = nvml.get(dev.uuid)
            row["nvml_used_bytes"] = info["processes"].get(rec.pid) if info else None
            by_device.setdefault(dev.uuid, []).append(row)
    devices = []
    for key in sorted(set(by_device) | set(nvml), key=lambda k: (nvml[k]["index"] if k in nvml else 1 << 20, k)):
        info = nvml.get(key)
        procs = sorted(by_device.get(key, []), key=lambda r: (-r["reserved_bytes"], r["pid"]))
        devices.append({
            "uuid": info["uuid"] if info else key.hex(),
            "nvml": {k: info[k] for k in ("index", "name", "total", "used", "free")} if info else None,
            "torchmem_reserved_bytes": sum(p["reserved_bytes"] for p in procs),
            "torchmem_live_bytes": sum(p["live_bytes"] for p in procs),
            "processes": procs,
        })
    return {"time": time.time(), "devices": devices, "share_groups": share_groups(directory)}


def share_groups(directory=None):
    """The sharing groups' latest decisions (share/agent.py writes one JSON file per group and
    device): [{"file", "capacity", "limits", "borrowers", "trim", ...}]. Unreadable files are
    skipped; a group whose members have all exited is removed."""


    groups = []
    for path in sorted(glob.glob(os.path.join(directory or record.default_dir(), "share-*.json"))):
        try:
            with open(path) as f:
                decision = json.load(f)
        except (OSError, ValueError):
            continue
        if not (isinstance(decision, dict) and isinstance(decision.get("limits"), dict)):
            continue
        if not any(str(pid).isdigit() and record.process_start_ticks(int(pid)) is not None
                   for pid in decision["limits"]):
            for stale in (path, path[:-len(".json")] + ".lock"):  # every member has exited
                try:
                    os.unlink(stale)
                except OSError:
                    pass
            continue
        groups.append(dict(decision, file=os.path.basename(path)))
    return groups


def _group_line(group):
    borrowers = ", ".join(str(p) for p in group.get("borrowers", [])) or "none"
    return (f"{group['file'][len('share-'):-len('.json')]}: capacity {_gib(group.get('capacity', 0))} GiB, "
            f"borrowers {borrowers}" + (" (guarantees scaled down to fit)" if group.get("scaled") else ""))


def _gib(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


_COLUMNS = ("pid", "command", "dev", "live", "reserved", "cached", "free blk", "frag", "limit", "share",
            "micro", "ooms", "reclaims", "drv calls", "nvml", "age")


def _row_cells(p):
    share = "-" if not p["guarantee_bytes"] else f"{_gib(p['guarantee_bytes'])}/{_gib(p['granted_bytes'])}"
    if p["need_bytes"]:
        share += f" wait {_gib(p['need_bytes'])}"
    return (str(p["pid"]), p["command"][:24], str(p["index"]), _gib(p["live_bytes"]), _gib(p["reserved_bytes"]),
            _gib(p["cached_bytes"]), _gib(p["largest_free_bytes"]), f"{p['fragmentation']:.2f}",
            _gib(p["limit_bytes"]) if p["limit_bytes"] else "none", share,
            "-" if p["micro_batch"] < 0 else str(p["micro_batch"]), str(p["ooms"]), str(p["reclaims"]),
            str(p["driver_calls"]), _gib(p["nvml_used_bytes"]), f"{p['age_s']:.1f}s")


def _device_title(dev):
    tm = f"torchmem live {_gib(dev['torchmem_live_bytes'])} / reserved {_gib(dev['torchmem_reserved_bytes'])} GiB"
    if dev["nvml"] is None:
        return f"device {dev['uuid'][:16]} (no NVML): {tm}"
    n = dev["nvml"]
    return (f"GPU {n['index']} {n['name']}: NVML used {_gib(n['used'])} / {_gib(n['total'])} GiB, "
            f"free {_gib(n['free'])} GiB; {tm}")


def render(snapshot):
    """A rich renderable (a Group of one table per device)."""
    # rich is optional (the top extra): only `top` needs it
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if not snapshot["devices"]:
        return Text("no torchmem process publishes on this node (torchmem.install() with monitor=true)")
    tables = []
    for dev in snapshot["devices"]:
        table = Table(title=_device_title(dev), title_justify="left", expand=False)
        for name in _COLUMNS:
            table.add_column(name, justify="left" if name in ("command", "share") else "right")
        for p in dev["processes"]:
            table.add_row(*_row_cells(p))
        tables.append(table)
    tables += [Text("share " + _group_line(g)) for g in snapshot.get("share_groups", [])]
    return Group(*tables)


def plain_text(snapshot):
    """The same frame without rich (when it is not installed)."""
    lines = []
    if not snapshot["devices"]:
        return "no torchmem process publishes on this node (torchmem.install() with monitor=true)\n"
    for dev in snapshot["devices"]:
        lines.append(_device_title(dev))
        rows = [_COLUMNS] + [_row_cells(p) for p in dev["processes"]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append("")
    lines += ["share " + _group_line(g) for g in snapshot.get("share_groups", [])]
    return "\n".join(lines) + "\n"


def run(args):
    if not args.interval > 0:
        raise ValueError(f"--interval must be > 0 seconds, got {args.interval}")
    use_nvml = not args.no_nvml
    if args.json:
        print(json.dumps(collect(args.dir, use_nvml)))
        return 0
    try:  # rich is optional (the top extra): without it `top` prints plain text
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        Console = None
    if args.once or Console is None:
        if Console is None:
            sys.stdout.write(plain_text(collect(args.dir, use_nvml)))
        else:
            # a pipe gets rich's 80 columns by default: too narrow for the table
            console = Console() if sys.stdout.isatty() else Console(width=200)
            console.print(render(collect(args.dir, use_nvml)))
        return 0
    try:
        with Live(render(collect(args.dir, use_nvml)), auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(collect(args.dir, use_nvml)), refresh=True)
    except KeyboardInterrupt:
        return 0
