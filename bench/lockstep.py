"""Several allocators' processes taking turns, one step at a time, on one GPU and CPU set.

    python bench/lockstep.py --workload llama_ckpt --allocators native expandable torchmem \\
        --per-allocator 2 --steps 12 --shapes 4 --seeds 1 2 --out lockstep.jsonl
    python bench/lockstep.py table lockstep.jsonl [more.jsonl ...]   (the tables again, of one or more calls)
    ... --budgets 1.05 1.10   (also under budgets: each a multiple of the workload's peak request)

Why: a host-bound step's time moves with its process's pace, and that pace moved
0.5-1.6x from one process to the next and from minute to minute (BENCHMARKS.md,
Step time), far more than any allocator's cost. Run one after the other, a
slow minute or a slow process decides the comparison. Here every process of a
group (same workload and seed, so the same step shapes) is alive at once and
each waits at a gate before every step; the coordinator opens one gate at a time,
so no two processes ever run together, and step i of every process runs within
the same second or two. A slow minute then slows every allocator's step i alike,
and `--per-allocator N` puts N processes behind each allocator so that one slow
process shows as one among N.

Budgets (--budgets B ...): after each seed's unconstrained group, the same group again per B,
every process under torch.cuda.set_per_process_memory_fraction(B x peak requested / device
memory), the peak taken from the unconstrained group (the same steps; --peak-request BYTES
gives it instead, from an earlier run, and the unconstrained group is not run): PyTorch's allocators
and torchmem (which answers the same call) under one budget. A process that runs out of
memory there reports its OOM step and no time; the tables say which allocators fit, and mark
"card full" an OOM that the process's budget still had room for (the group did not fit the card).
Each budget group also runs --per-allocator processes of the reference allocator (--reference,
default native) with no budget, taking turns with the others: where the reference cannot fit
the budget, the steps of those who can are compared with its unconstrained steps of the same
group, at the same pace, not with another group's run minutes apart.

Per sample (--allocators native native@0.75 native@0.5 torchmem --budgets 1.05): "NAME@S" runs
NAME on the same draws at S times the batch. Where the baseline cannot fit the budget at the drawn
batch, the per-sample table sets torchmem's time per sample against the baseline's at the largest
batch it fit, in the same group.

Shapes that vary (--shapes 0: a new shape every step): a table of each process's driver calls
and barriers over the second half of its steps, warm-up included in the halving (what the replay
calls "after warm-up"), against the same group's expandable_segments processes, whose calls are
counted by page as the replay's model counts them.

Protocol (bench/gpu_workloads.py --lockstep R,W): the worker writes "ready" on W
when it reaches a gate and blocks reading "go" from R. Segments between gates run
alone. The worker's last segment ends with its exit (EOF on W).
Not measured here: device-wide memory (mem_get_info counts the other processes),
so gpu_workloads reports no device_used_peak under --lockstep.

This file runs the processes; bench/lockstep_tables.py reads their results into tables.
"""

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile

from common import append_jsonl  # bench/common.py, beside this file
from lockstep_tables import batch_scale, budget_label, print_tables, reference_label

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


def worker_argv(workload, allocator, seed, args, out, fraction=None, budget_bytes=None):
    # "torchmem:OPTIONS" is torchmem with those options; "NAME@S" runs at S times the drawn batch
    spec, scale = batch_scale(allocator)
    name, _, conf = spec.partition(":")
    argv = [sys.executable, os.path.join(HERE, "gpu_workloads.py"), "--workload", workload, "--allocator", name,
            "--steps", str(args.steps), "--shapes", str(args.shapes), "--seed", str(seed), "--out", out]
    return (argv + (["--torchmem-conf", conf] if conf else [])
            + (["--batch-scale", f"{scale:g}"] if scale != 1.0 else [])
            + (["--kernel-time"] if args.kernel_time else [])
            + (["--memory-fraction", f"{fraction:.6f}"] if fraction else [])
            + (["--memory-budget", str(budget_bytes)] if budget_bytes else []))


def budget_fraction(rows, budget):
    """The memory fraction that gives `budget` x the group's peak request (None: no peak known)."""
    peaks = [r["peak_requested"] for r in rows if r.get("peak_requested") and r.get("oom_at_step") is None]
    totals = [r["device_total"] for r in rows if r.get("device_total")]
    if not peaks or not totals:
        return None
    return min(1.0, budget * max(peaks) / totals[0])


def run_group(args, seed, budget=None, fraction=None, budget_bytes=None):
    """One lockstep group (every allocator x per-allocator processes); its tagged rows. A budget
    group's limit is `fraction` of the device, or `budget_bytes` (--peak-request)."""
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        commands = []
        reference = getattr(args, "reference", None) if budget is not None else None
        # A smaller batch ("NAME@S") is there to fit a budget: the unconstrained group runs without it.
        allocators = [a for a in args.allocators if budget is not None or "@" not in a]
        for k in range(args.per_allocator):  # interleaved: native, expandable, torchmem, native, ...
            for allocator in allocators:
                name = f"{allocator}#{k}"
                commands.append((name, worker_argv(args.workload, allocator, seed, args, f"{tmp}/{len(commands)}",
                                                   fraction, budget_bytes)))
            if reference:  # the same group's pace with no budget (module docstring)
                commands.append((f"{reference_label(reference)}#{k}",
                                 worker_argv(args.workload, reference, seed, args, f"{tmp}/{len(commands)}")))
        codes = run_lockstep(commands, args.timeout)
        for index, (name, _) in enumerate(commands):
            if codes[name] != 0:
                print(f"lockstep: {name} (seed {seed}, budget {budget_label(budget)}) exited {codes[name]}",
                      file=sys.stderr)
                failed += 1
                continue
            with open(f"{tmp}/{index}") as f:
                row = json.loads(f.readline())
            row["budget"] = budget
            if reference and name.startswith(f"{reference_label(reference)}#"):
                row["allocator"], row["reference"] = reference_label(row["allocator"]), True
            row["lockstep"] = {"group": f"{args.workload}/{seed}/{budget_label(budget)}", "process": name,
                               "start_rank": index}
            rows.append(row)
    append_jsonl(args.out, *rows)  # after each group: a call cut at its limit keeps what finished
    return rows, failed


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:
        # table FILE... [--costs PROBE.json [--costs-run LIVE,MIB] [--costs-cold LIVE,MIB]]: the warm-up
        # table's model at that GPU's own call prices
        table = argparse.ArgumentParser(prog="lockstep.py table")
        table.add_argument("files", nargs="+")
        table.add_argument("--costs", default=None, help="bench/gpu_probe.py's JSON from the GPU the rows ran on")
        table.add_argument("--costs-run", default=None, metavar="LIVE,MIB",
                           help="with --costs: the probe's run timed with LIVE granules mapped and MIB of host "
                                "memory walked before each call (gpu_probe.py --live-granules, --evict-mib)")
        table.add_argument("--costs-cold", default=None, metavar="LIVE,MIB",
                           help="with --costs: price the first call of each kind in a growth at the probe's run "
                                "in those conditions (host caches evicted: e.g. 5000,64), the rest as --costs-run; "
                                "runs that recorded num_growths only")
        opts = table.parse_args(argv[1:])
        from torchmem.analysis.call_costs import costs_from_probe, parse_conditions

        def conditions(option, text):
            if text is not None and not opts.costs:
                table.error(f"{option} picks a run of the probe: give the probe with --costs PROBE.json")
            try:
                return parse_conditions(text or "0,0", option)
            except ValueError as e:
                table.error(str(e))

        run, cold_run = conditions("--costs-run", opts.costs_run), conditions("--costs-cold", opts.costs_cold)
        prices = cold = None
        if opts.costs:  # read once, and refused here, before any table is printed
            try:
                prices = costs_from_probe(opts.costs, *run)
                cold = costs_from_probe(opts.costs, *cold_run) if opts.costs_cold is not None else None
            except ValueError as e:
                table.error(str(e))
        rows = []
        for path in opts.files:
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
        print_tables(rows, prices, cold)
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
    parser.add_argument("--budgets", type=float, nargs="*", default=[],
                        help="also run each seed under these budgets: multiples of its peak request (e.g. 1.05)")
    parser.add_argument("--reference", default="native",
                        help="with --budgets: this allocator also runs in each budget group with no budget, "
                             "the baseline where it cannot fit the budget ('none': not run)")
    parser.add_argument("--no-unconstrained", action="store_true",
                        help="with --budgets: report only the budget groups (the unconstrained one still runs "
                             "first, to measure the peak request)")
    parser.add_argument("--peak-request", type=int, default=None, metavar="BYTES",
                        help="with --budgets: the workload's peak request, known from an earlier run of the same "
                             "steps and seed (its unconstrained rows' peak_requested); the unconstrained group is "
                             "not run and each budget is that many times BYTES (a workload that compiles, whose "
                             "processes take minutes to start)")
    parser.add_argument("--out", required=True, help="JSON-lines file the tagged results are appended to")
    args = parser.parse_args(argv)
    if args.peak_request is not None and (not args.budgets or args.peak_request <= 0):
        parser.error("--peak-request needs --budgets and a positive number of bytes")
    if args.reference == "none":
        args.reference = None
    if any(b < 1.0 for b in args.budgets):
        parser.error("--budgets are multiples of the peak request: each must be >= 1")
    for allocator in args.allocators:
        try:
            scale = batch_scale(allocator)[1]
        except ValueError:
            scale = 0.0
        if not 0 < scale <= 1:
            parser.error(f"--allocators {allocator}: the batch scale after '@' must be a number in (0, 1], "
                         "e.g. native@0.75")
    rows, failed = [], 0
    for seed in args.seeds:
        if not args.peak_request:  # the unconstrained group measures the peak request
            group, bad = run_group(args, seed)
            failed += bad
            if not args.no_unconstrained or not args.budgets:
                rows += group
        for budget in args.budgets:
            fraction = budget_bytes = None
            if args.peak_request:
                budget_bytes = int(budget * args.peak_request)
            else:
                fraction = budget_fraction(group, budget)
                if fraction is None:
                    print(f"lockstep: no peak request measured for seed {seed}; budget {budget} skipped",
                          file=sys.stderr)
                    continue
            group_rows, bad = run_group(args, seed, budget, fraction, budget_bytes)
            failed += bad
            rows += group_rows
    print_tables(rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
