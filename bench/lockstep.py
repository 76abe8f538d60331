"""Several allocators' processes taking turns, one step at a time, on one GPU and CPU set.

    python bench/lockstep.py --workload llama_ckpt --allocators native expandable torchmem \\
        --per-allocator 2 --steps 12 --shapes 4 --seeds 1 2 --out lockstep.jsonl
    python bench/lockstep.py table lockstep.jsonl [more.jsonl ...]   (the tables again, of one or more calls)

Why: a host-bound step's time moves with its process's pace, and that pace moved
0.5-1.6x from one process to the next and from minute to minute (BENCHMARKS.md
sections 19-21), far more than any allocator's cost. Run one after the other, a
slow minute or a slow process decides the comparison. Here every process of a
group (same workload and seed, so the same step shapes) is alive at once and
each waits at a gate before every step; the coordinator opens one gate at a time,
so no two processes ever run together, and step i of every process runs within
the same second or two. A slow minute then slows every allocator's step i alike,
and `--per-allocator N` puts N processes behind each allocator so that one slow
process shows as one among N.

Protocol (bench/gpu_workloads.py --lockstep R,W): the worker writes "ready" on W
when it reaches a gate and blocks reading "go" from R. Segments between gates run
alone. The worker's last segment ends with its exit (EOF on W).
Not measured here: device-wide memory (mem_get_info counts the other processes),
so gpu_workloads reports no device_used_peak under --lockstep.
"""

import argparse
import json
import math
import os
import select
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


class Gate:
    """The worker's side: wait() parks this process until the coordinator says go."""

    def __init__(self, spec):
        self.reader = self.writer = None
        if spec:
            read_fd, write_fd = (int(fd) for fd in spec.split(","))
            self.reader = os.fdopen(read_fd, "r")
            self.writer = os.fdopen(write_fd, "w")

    def wait(self):
        if self.writer is None:
            return
        self.writer.write("ready\n")
        self.writer.flush()
        if self.reader.readline().strip() != "go":
            raise SystemExit("lockstep: the coordinator went away")


class Worker:
    """The coordinator's side of one worker process."""

    def __init__(self, name, argv):
        go_read, go_write = os.pipe()
        ready_read, ready_write = os.pipe()
        self.name = name
        self.process = subprocess.Popen(argv + ["--lockstep", f"{go_read},{ready_write}"],
                                        pass_fds=(go_read, ready_write))
        os.close(go_read)
        os.close(ready_write)
        self.go = os.fdopen(go_write, "w")
        self.ready = os.fdopen(ready_read, "r")
        self.segments = 0

    def await_gate(self, timeout_s):
        """True when the worker reached its next gate, False when it exited."""
        readable, _, _ = select.select([self.ready], [], [], timeout_s)
        if not readable:
            raise TimeoutError(f"lockstep: {self.name} did not reach a gate in {timeout_s:.0f} s")
        line = self.ready.readline()
        if line == "":
            self.ready.close()
            self.go.close()
            return False
        return True

    def release(self):
        self.go.write("go\n")
        self.go.flush()
        self.segments += 1

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()


def run_lockstep(commands, timeout_s=300.0):
    """Starts every command (name, argv) at once, then lets them run one segment at a time; the
    order rotates by one place each turn so that no process always follows the same one. Returns
    {name: exit code}."""
    workers = [Worker(name, argv) for name, argv in commands]
    try:
        alive = [w for w in workers if w.await_gate(timeout_s)]  # start-up (imports, CUDA init): together
        turn = 0
        while alive:
            shift = turn % len(alive)
            for worker in alive[shift:] + alive[:shift]:
                worker.release()
                if not worker.await_gate(timeout_s):
                    alive.remove(worker)
            turn += 1
        return {w.name: w.process.wait(timeout=timeout_s) for w in workers}
    finally:
        for worker in workers:
            worker.kill()


def geomean(values):
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def paired_steps(rows, baseline="native"):
    """Each allocator against `baseline`, step by step within a group: per group (workload, seed)
    and timed step i, the median over an allocator's processes of step i's time, divided by the
    baseline's. Returns {(workload, allocator): {"steps": n, "geomean": g, "low": .., "high": ..,
    "processes": k}} (the ratio's geometric mean over every group's steps, and its range)."""
    steps = {}
    for row in rows:
        key = (row["workload"], row["lockstep"]["group"], row["allocator"])
        steps.setdefault(key, []).append(row["step_s"])
    out = {}
    for (workload, group, allocator), runs in steps.items():
        base = steps.get((workload, group, baseline))
        if allocator == baseline or not base:
            continue
        mine = [statistics.median(column) for column in zip(*runs)]
        theirs = [statistics.median(column) for column in zip(*base)]
        entry = out.setdefault((workload, allocator), {"ratios": [], "processes": 0})
        entry["ratios"] += [a / b for a, b in zip(mine, theirs)]
        entry["processes"] += len(runs)
    return {key: {"steps": len(e["ratios"]), "geomean": geomean(e["ratios"]), "low": min(e["ratios"]),
                  "high": max(e["ratios"]), "processes": e["processes"]} for key, e in out.items()}


def process_table(rows):
    """Per allocator: its processes' totals (min, median, max), to show how far processes differ."""
    totals = {}
    for row in rows:
        totals.setdefault((row["workload"], row["allocator"]), []).append(row["total_s"] * 1e3)
    lines = ["| workload | allocator | processes | total ms: min / median / max |", "|---|---|---|---|"]
    for (workload, allocator), values in sorted(totals.items()):
        lines.append(f"| {workload} | {allocator} | {len(values)} | "
                     f"{min(values):,.0f} / {statistics.median(values):,.0f} / {max(values):,.0f} |")
    return "\n".join(lines)


def paired_table(rows, baseline="native"):
    lines = [f"| workload | allocator | processes | steps | step / {baseline}: geomean (range) |",
             "|---|---|---|---|---|"]
    for (workload, allocator), e in sorted(paired_steps(rows, baseline).items()):
        lines.append(f"| {workload} | {allocator} | {e['processes']} | {e['steps']} | "
                     f"{e['geomean']:.3f} ({e['low']:.2f}-{e['high']:.2f}) |")
    return "\n".join(lines)


def worker_argv(workload, allocator, seed, args, out):
    name, _, conf = allocator.partition(":")  # "torchmem:OPTIONS" is torchmem with those options
    argv = [sys.executable, os.path.join(HERE, "gpu_workloads.py"), "--workload", workload, "--allocator", name,
            "--steps", str(args.steps), "--shapes", str(args.shapes), "--seed", str(seed), "--out", out]
    return argv + (["--torchmem-conf", conf] if conf else []) + (["--kernel-time"] if args.kernel_time else [])


def print_tables(rows):
    print(process_table(rows))
    print()
    print(paired_table(rows))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:
        rows = []
        for path in argv[1:]:
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
        print_tables(rows)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--allocators", nargs="+", default=["native", "expandable", "torchmem"])
    parser.add_argument("--per-allocator", type=int, default=2, help="processes behind each allocator")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--shapes", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="one group of processes per seed")
    parser.add_argument("--kernel-time", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one segment may take")
    parser.add_argument("--out", required=True, help="JSON-lines file the tagged results are appended to")
    args = parser.parse_args(argv)
    rows, failed = [], 0
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            commands = []
            for k in range(args.per_allocator):  # interleaved: native, expandable, torchmem, native, ...
                for allocator in args.allocators:
                    name = f"{allocator}#{k}"
                    commands.append((name, worker_argv(args.workload, allocator, seed, args, f"{tmp}/{len(commands)}")))
            codes = run_lockstep(commands, args.timeout)
            group = []
            for index, (name, _) in enumerate(commands):
                if codes[name] != 0:
                    print(f"lockstep: {name} (seed {seed}) exited {codes[name]}", file=sys.stderr)
                    failed += 1
                    continue
                with open(f"{tmp}/{index}") as f:
                    row = json.loads(f.readline())
                row["lockstep"] = {"group": f"{args.workload}/{seed}", "process": name, "start_rank": index}
                group.append(row)
        with open(args.out, "a") as f:  # after each group: a call cut at its limit keeps what finished
            f.writelines(json.dumps(row) + "\n" for row in group)
        rows += group
    print_tables(rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
