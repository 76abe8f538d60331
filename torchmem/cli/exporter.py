"""`python -m torchmem exporter --port N`: the node's Prometheus endpoint for every torchmem process.

Run one per node, beside the training processes (a Kubernetes sidecar, a
Slurm step with --ntasks-per-node=1; docs/monitoring.md has both). It needs no
GPU and no torch CUDA: it reads the shared-memory records the processes publish
(torchmem/monitor/exporter.py). `--once` prints one scrape and exits.
"""

import signal
import sys
import threading

from torchmem.monitor import exporter

HELP = "serve every torchmem process on this node on one Prometheus endpoint (labels pid, device, rank, job)"


def add_arguments(parser):
    parser.add_argument("--port", type=int, default=None, help="port to serve /metrics on (0: any free port)")
    parser.add_argument("--host", default="0.0.0.0",
                        help="address to listen on (0.0.0.0: every interface, so that Prometheus can scrape it; "
                             "127.0.0.1 keeps it on the node)")
    parser.add_argument("--job", default="", help="job label for the processes whose record names no job")
    parser.add_argument("--dir", action="append", default=None,
                        help="record directory (repeatable; default: $TORCHMEM_MONITOR_DIR or /dev/shm/torchmem/<uid>)")
    parser.add_argument("--all-users", action="store_true",
                        help="also every other user's record directory beside the default one (needs root)")
    parser.add_argument("--once", action="store_true", help="print one scrape on stdout and exit")


def run(args):
    collector = exporter.NodeCollector(args.dir, job=args.job, all_users=args.all_users)
    if args.once:
        sys.stdout.write(exporter.exposition(collector))
        return 0
    if args.port is None:
        raise ValueError("--port is required (or --once to print one scrape)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    try:
        server = exporter.serve(collector, args.port, args.host)
    except OSError as exc:
        print(exc.strerror or exc, file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    print(f"torchmem exporter: serving http://{host}:{port}/metrics from {', '.join(collector.directories)}",
          flush=True)
    stop = threading.Event()
    # Kubernetes and Slurm stop a step with SIGTERM: leave with status 0 as for Ctrl-C.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    server.shutdown()
    return 0
