"""The tables of a lockstep run (bench/lockstep.py): its JSON lines, one per process, read
into per-allocator comparisons. Kept apart from the runner because they are read again and
again, long after the run (`python bench/lockstep.py table lockstep.jsonl ...`), from results
of any age: a field a row lacks (an older run) leaves its cell "-" or its row out.

Every comparison is within a lockstep group (same workload, seed and budget), whose
processes took turns and so shared the machine's pace; the module docstring of
bench/lockstep.py says why.
"""

import math
import statistics


def geomean(values):
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def reference_label(allocator):
    """The label of the reference processes a budget group runs with no budget."""
    return f"{allocator} (no budget)"


def group_key(row):
    """(workload, budget): a budget's rows are compared only with the same budget's."""
    return row["workload"], row.get("budget")


def paired_steps(rows, baseline="native"):
    """Each allocator against `baseline`, step by step within a group: per group (workload, seed)
    and timed step i, the median over an allocator's processes of step i's time, divided by the
    baseline's. Returns {(workload, allocator): {"steps": n, "geomean": g, "low": .., "high": ..,
    "processes": k}} (the ratio's geometric mean over every group's steps, and its range)."""
    steps = {}
    for row in rows:
        if row.get("oom_at_step") is not None:
            continue  # did not fit: no time to compare
        key = (group_key(row), row["lockstep"]["group"], row["allocator"])
        steps.setdefault(key, []).append(row["step_s"])
    out = {}
    for (workload, group, allocator), runs in steps.items():
        base = steps.get((workload, group, baseline))
        if allocator == baseline or not base:
            continue
        mine = [statistics.median(column) for column in zip(*runs)]
        theirs = [statistics.median(column) for column in zip(*base)]
        if not mine or not theirs:
            continue
        entry = out.setdefault((workload, allocator), {"ratios": [], "processes": 0})
        entry["ratios"] += [a / b for a, b in zip(mine, theirs)]
        entry["processes"] += len(runs)
    return {key: {"steps": len(e["ratios"]), "geomean": geomean(e["ratios"]), "low": min(e["ratios"]),
                  "high": max(e["ratios"]), "processes": e["processes"]} for key, e in out.items()}


def budget_label(budget):
    return "none" if budget is None else f"{budget:g}x"


def card_was_full(row):
    """True when a process ran out of memory because the card had no room for the request while
    its own budget still had (gpu_workloads' oom_room, read just after the OOM with the group's
    other processes parked): the group's processes did not fit the card together, and the OOM
    says nothing of the allocator. False for a budget that bound, for an OOM the card had room
    for (the allocator's own), and for rows from before oom_room was recorded."""
    room = row.get("oom_room")
    if row.get("oom_at_step") is None or not room or not room.get("requested"):
        return False
    fraction = row.get("memory_fraction")
    budget_left = math.inf if fraction is None else fraction * row["device_total"] - room["reserved"]
    return room["device_free"] < room["requested"] <= budget_left


def card_ran_out(rows):
    """True when some of `rows` ran out of memory and every one of them on a full card."""
    ran_out = [r for r in rows if r.get("oom_at_step") is not None]
    return bool(ran_out) and all(card_was_full(r) for r in ran_out)


def oom_label(rows):
    return "OOM (card full)" if card_ran_out(rows) else "OOM"


def process_table(rows):
    """Per allocator: its processes' totals (min, median, max), to show how far processes differ;
    how many ran out of memory; per timed step, driver calls and device barriers (median)."""
    cells = {}
    for row in rows:
        cells.setdefault((*group_key(row), row["allocator"]), []).append(row)
    lines = ["| workload | budget | allocator | processes | OOM | total ms: min / median / max "
             "| driver calls / step | barriers / step |", "|---|---|---|---|---|---|---|---|"]
    for (workload, budget, allocator), group in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
        fit = [r for r in group if r.get("oom_at_step") is None]
        totals = [r["total_s"] * 1e3 for r in fit]
        calls = [c for r in fit for c in r.get("driver_calls_per_step") or []]
        waits = [c for r in fit for c in r.get("barriers_per_step") or []]
        span = f"{min(totals):,.0f} / {statistics.median(totals):,.0f} / {max(totals):,.0f}" if totals else "-"
        full = sum(card_was_full(r) for r in group)
        ran_out = f"{len(group) - len(fit)}" + (f" ({full} card full)" if full else "")
        lines.append(f"| {workload} | {budget_label(budget)} | {allocator} | {len(group)} | {ran_out} | "
                     f"{span} | {statistics.median(calls) if calls else '-'} | {statistics.median(waits) if waits else '-'} |")
    return "\n".join(lines)


def paired_table(rows, baseline="native"):
    lines = [f"| workload | allocator | processes | steps | step / {baseline}: geomean (range) |",
             "|---|---|---|---|---|"]
    for ((workload, budget), allocator), e in sorted(paired_steps(rows, baseline).items(),
                                                      key=lambda kv: (kv[0][0][0], kv[0][0][1] or 0, kv[0][1])):
        lines.append(f"| {workload} {budget_label(budget)} | {allocator} | {e['processes']} | {e['steps']} | "
                     f"{e['geomean']:.3f} ({e['low']:.2f}-{e['high']:.2f}) |")
    return "\n".join(lines)


def steady_steps(row, quiet=None):
    """The timed steps left once warm, in whole shape cycles (at least one): every step from `quiet`
    (the first of the steps that made no driver call nor barrier) when that spans a cycle, else the
    last third."""
    shapes = max(1, row.get("shapes") or 1)
    if quiet is not None and (len(row["step_s"]) - quiet) // shapes >= 1:
        return (len(row["step_s"]) - quiet) // shapes * shapes
    cycles = max(1, len(row["step_s"]) // shapes // 3)
    return cycles * shapes


def quiet_from(row):
    """The first timed step from which no step made a driver call or a device barrier (None: the
    last step still did). Says whether the steady steps are warm, or the run ended too soon."""
    calls = row.get("driver_calls_per_step") or []
    waits = row.get("barriers_per_step") or [0] * len(calls)
    quiet = len(calls)
    while quiet > 0 and calls[quiet - 1] == 0 and waits[quiet - 1] == 0:
        quiet -= 1
    return quiet if quiet < len(calls) else None


def budget_rows(rows):
    """The processes that ran under a budget (not the reference processes with none), in table
    order: workload, budget, allocator, seed."""
    return sorted((r for r in rows if r.get("budget") is not None and not r.get("reference")),
                  key=lambda r: (r["workload"], r["budget"], r["allocator"], r["seed"]))


def steady_table(rows, baseline="native"):
    """Each group at a budget once warm: its timed steps from the one it went quiet (no driver call, no
    barrier after it) in whole shape cycles, or the last third if it never did, with
    their driver calls and device barriers, and their time against the `baseline` allocator's same
    steps: in the same group (same workload, seed and budget) where the baseline fit the budget,
    else the same group's reference processes with no budget (--reference), else the unconstrained
    group. The process total mixes in the warm-up, where a pool at the
    budget learns its layout; this is the step a long run repeats. "Quiet from" is the first timed
    step after which no step made a driver call or a barrier: a run that ends before it settles
    shows "never" there, and its steady steps are warm-up still.
    Only the same group's baseline is a fair one: processes of one group take turns step by step and
    so share the machine's pace, while two groups run one after the other, and the pace can move
    between them by more than the differences being measured (BENCHMARKS.md, Budget regime)."""
    runs, bands = baseline_runs(rows, baseline)
    medians = {key: [statistics.median(step) for step in zip(*r)] for key, r in runs.items()}
    lines = [f"| workload | budget | allocator | quiet from step | steady steps | driver calls | barriers | "
             f"time / {baseline}, same steps | {baseline} of | host band, us: this / {baseline}'s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in budget_rows(rows):
        if row["allocator"] == baseline and row.get("oom_at_step") is None:
            continue
        label = f"| {row['workload']} | {budget_label(row['budget'])} | {row['allocator']} |"
        if row.get("oom_at_step") is not None:
            lines.append(f"{label} {oom_label([row])} | - | - | - | - | - | {host_band(row)} / - |")
            continue
        quiet = quiet_from(row)
        n = steady_steps(row, quiet)
        key_used, against = fairest_baseline(row, medians)
        base = medians.get(key_used)
        ratio = f"{sum(row['step_s'][-n:]) / sum(base[-n:]):.3f}" if base and len(base) >= n else "-"
        calls = sum((row.get("driver_calls_per_step") or [])[-n:])
        waits = sum((row.get("barriers_per_step") or [])[-n:])
        theirs = " ".join(bands.get(key_used, [])) or "-"
        lines.append(f"{label} {'never' if quiet is None else quiet} | {n} | {calls} | {waits} | {ratio} | "
                     f"{against if base else '-'} | {host_band(row)} / {theirs} |")
    return "\n".join(lines)


def baseline_runs(rows, baseline):
    """(workload, seed, budget, no budget?) -> the baseline's step times per process, and their host bands."""
    runs, bands = {}, {}
    for row in rows:
        if row["allocator"] in (baseline, reference_label(baseline)) and row.get("oom_at_step") is None:
            key = (row["workload"], row["seed"], row.get("budget"), bool(row.get("reference")))
            runs.setdefault(key, []).append(row["step_s"])
            bands.setdefault(key, []).append(host_band(row))
    return runs, bands


def fairest_baseline(row, available):
    """(key, label) of the fairest baseline run for `row` among `available`'s keys, (None, None) if none:
    the same group at the budget, the same group with no budget, then the unconstrained group (run
    minutes apart)."""
    return next(((key, label) for key, label in (
        ((row["workload"], row["seed"], row["budget"], False), "the same budget"),
        ((row["workload"], row["seed"], row["budget"], True), "no budget, same group"),
        ((row["workload"], row["seed"], None, False), "no budget (another group)")) if key in available),
        (None, None))


def pooled_table(rows, baseline="native", line=1.03):
    """Each allocator's steady steps at a budget against its fairest baseline, pooled over processes:
    per step, the mean over the allocator's processes over the mean over the baseline's, then the
    geometric mean over the steps (every step weighs the same, where steady_table divides summed
    times) with a 95% interval (Student's t over the per-step log ratios). Steps of one process vary
    by more than the 3% that #34 reads against, so one process's ratio cannot resolve it; the
    interval says whether these steps do: "under" when all of it lies below `line`, "over" when all
    of it lies above, else "unresolved" (more steps needed). Only a baseline of the same group gets a
    verdict (another group ran minutes apart, at its own pace); fewer than two steps get no row."""
    runs, _ = baseline_runs(rows, baseline)
    groups = {}
    for row in budget_rows(rows):
        if row.get("oom_at_step") is not None or row["allocator"] == baseline:
            continue
        groups.setdefault((row["workload"], row.get("budget"), row["seed"], row["allocator"]), []).append(row)
    lines = [f"| workload | budget | seed | allocator | processes | steady steps | time / {baseline}, pooled: "
             f"geomean (95%) | against | {line:.2f} line |", "|---|---|---|---|---|---|---|---|---|"]
    for (workload, budget, seed, allocator), members in groups.items():  # in budget_rows' order
        key, against = fairest_baseline(members[0], runs)
        if key is None:
            continue
        base = runs[key]
        n = min([steady_steps(r, quiet_from(r)) for r in members] + [len(r["step_s"]) for r in members]
                + [len(b) for b in base])
        if n < 2:
            continue
        logs = [math.log(statistics.mean(r["step_s"][-n + i] for r in members)
                         / statistics.mean(b[-n + i] for b in base)) for i in range(n)]
        mean = statistics.mean(logs)
        half = student_t95(n - 1) * statistics.stdev(logs) / math.sqrt(n)
        low, high = math.exp(mean - half), math.exp(mean + half)
        verdict = "under" if high < line else "over" if low > line else "unresolved"
        if key[2] is None:  # the unconstrained group: run minutes apart
            verdict = "- (another group)"
        lines.append(f"| {workload} | {budget_label(budget)} | {seed} | {allocator} | {len(members)} | {n} | "
                     f"{math.exp(mean):.3f} ({low:.3f}-{high:.3f}) | {against} | {verdict} |")
    return "\n".join(lines)


def per_sample_table(rows, baseline="native"):
    """Time per sample at a budget, for where the baseline fits only a smaller batch (#34: where only
    torchmem fits the larger batch, its time per sample at or under the baseline's at the baseline's
    own largest). Per group (workload, budget, seed) and allocator label: the steady steps' time over
    the samples they ran (ms per sample, the mean over its processes), and that over the baseline
    family's largest batch that fit in every process: the baseline and its "@S" rows (--allocators
    native native@0.75 ...: the same draws at S times the batch, gpu_workloads --batch-scale). The
    family runs in the same group, taking turns, so this compares at one pace. Where a larger batch
    of the family ran out of a full card (card_was_full), its own budget may still have fit it: no
    ratio then, since the largest batch that fits is not known."""
    groups = {}
    for row in budget_rows(rows):
        if row.get("samples_per_step") is None:
            continue  # a run from before samples were recorded
        key = (row["workload"], row["budget"], row["seed"])
        groups.setdefault(key, {}).setdefault(row["allocator"], []).append(row)
    lines = [f"| workload | budget | seed | allocator | batch scale | processes | ms per sample | / {baseline} at "
             f"its largest batch that fits |", "|---|---|---|---|---|---|---|---|"]
    for (workload, budget, seed), by_label in groups.items():
        per_sample = {}
        for label, members in by_label.items():
            if any(r.get("oom_at_step") is not None for r in members):
                per_sample[label] = None  # did not fit this budget at this batch
                continue
            values = []
            for r in members:
                n = steady_steps(r, quiet_from(r))
                samples = sum(r["samples_per_step"][-n:])
                if samples:
                    values.append(sum(r["step_s"][-n:]) / samples * 1e3)
            per_sample[label] = statistics.mean(values) if values else None
        scales = {label: batch_scale(label) for label in per_sample}  # label: (base, scale)
        fitting = [(scale, label) for label, (base, scale) in scales.items()
                   if base == baseline and per_sample[label] is not None]
        best = max(fitting)[1] if fitting else None
        best_scale = scales[best][1] if best else 0.0
        unknown = any(base == baseline and scale > best_scale and card_ran_out(by_label[label])
                      for label, (base, scale) in scales.items())
        for label in sorted(per_sample, key=lambda l: (scales[l][0], -scales[l][1])):
            ms = per_sample[label]
            base, scale = scales[label]
            if ms is None:
                cells = f"{oom_label(by_label[label])} | -"
            elif base == baseline or best is None:
                cells = f"{ms:.3f} | -"
            elif unknown:
                cells = f"{ms:.3f} | - (a larger {baseline} batch met a full card)"
            else:
                cells = f"{ms:.3f} | {ms / per_sample[best]:.3f} ({best})"
            lines.append(f"| {workload} | {budget_label(budget)} | {seed} | {label} | {scale:g} | "
                         f"{len(by_label[label])} | {cells} |")
    return "\n".join(lines)


# Student's t, two-sided 95%, by degrees of freedom (1-30; the normal 1.96 beyond).
T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13,
       2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)


def student_t95(dof):
    return T95[dof - 1] if dof <= len(T95) else 1.96


def host_band(row):
    """The process's own host pace: us per `torch.empty` on the meta device (gpu_workloads.host_speed).
    Processes fall in bands up to 2x apart on one CPU; on host-bound steps a ratio between two
    processes of different bands measures the bands, not the allocators."""
    speed = (row.get("host_speed") or {}).get("meta_s_per_alloc")
    return f"{speed * 1e6:.2f}" if speed else "-"


def warmup_table(rows, prices=None, cold=None):
    """Where a group at a budget spent its warm-up: the timed steps before it went quiet, their
    driver calls, device barriers and planning passes (Note [Planning pass cost]), and the time they
    took over the same shape once quiet (per step: minus the median of that shape's quiet steps in
    the same process), less the group's drift (group_drift_ms: what the same steps took over their
    quiet ones in the group's processes that made no driver call). "Per call" is what is left of
    that time once the passes and each barrier's drain (a third of a step, at most the step's lag
    where enqueue_s was recorded: Note [Barrier cost]) are taken out, divided by the calls: the
    in-situ cost of a driver call that the replay's time model has to match. `prices`: the calls'
    prices (torchmem._C.sim_costs() keys), e.g. a GPU probe's
    (torchmem.analysis.call_costs.costs_from_probe); by default the simulator's. `cold`: the same
    probe's prices with host caches evicted; where the run recorded its growths, each burst's first
    calls are priced at them (cold_burst_us)."""
    from torchmem._loader import _C  # the simulator's call prices (imports torch: here only)
    from torchmem.analysis.call_costs import CALL_PRICES, call_cost_us
    from torchmem.cli.anchors import step_cost_us  # the replay's own barrier price

    prices = prices or _C.sim_costs()
    lines = ["| workload | budget | allocator | process | warm-up steps | driver calls | of them unmaps | barriers | "
             "planning passes: ms | time added, ms | of it the group's drift, ms | per call, us | model, ms | "
             "model error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    modeled = {}  # (workload, budget, allocator) -> [(net ms, model ms, own noise ms, drift noise ms)] per process
    for row in budget_rows(rows):
        quiet = quiet_from(row)
        if row.get("oom_at_step") is not None or not quiet:
            continue
        medians = shape_medians(row, quiet)
        if medians is None:
            continue  # no whole quiet cycle: no warm time for every shape
        by_shape, warm = medians
        steps, shapes = row["step_s"], len(warm)
        calls = (row.get("driver_calls_per_step") or [])[:quiet]
        waits = (row.get("barriers_per_step") or [0] * quiet)[:quiet]
        plans = row.get("plan_per_step") or []
        plans = plans[len(plans) - len(steps):][:quiet]  # the counters cover the untimed warm-up too
        passes = sum(p.get("num_plan_passes", 0) for p in plans)
        # The backend's calls by kind per step, where the run recorded them (older runs did not).
        by_kind = bool(plans) and all("unmap_calls" in p for p in plans)
        unmaps = f"{sum(p['unmap_calls'] for p in plans):,}" if by_kind else "-"
        # Growths (num_growths, Note [Map groups]): the bursts the calls came in, where recorded.
        growths = (f" in {sum(p['num_growths'] for p in plans):,} growths"
                   if plans and all("num_growths" in p for p in plans) else "")
        if by_kind:  # the backend's count, the one the model prices (older runs' counts left out alias unmaps)
            calls = [sum(p.get(f"{kind}_calls", 0) for kind in CALL_PRICES) for p in plans]
        pass_ms = sum(p.get("plan_pass_us", 0) for p in plans) / 1e3
        gross_ms = added_ms(row, quiet, warm)
        drift_ms, drift_noise_ms = group_drift_ms(row, rows, quiet)
        net_ms = gross_ms - (drift_ms or 0.0)
        own_noise_ms = added_noise_ms(by_shape, quiet)
        noise_ms = math.hypot(own_noise_ms, drift_noise_ms)
        lag = shape_lags(row, quiet)
        drain_ms = sum(step_cost_us(0.0, waits[i], warm[i % shapes] * 1e3,
                                    None if lag is None else lag[i % shapes] * 1e3) for i in range(quiet)) / 1e3
        inside_noise = abs(net_ms) <= noise_ms
        per_call = (f"{(net_ms - pass_ms - drain_ms) * 1e3 / sum(calls):.1f}" if sum(calls) and not inside_noise
                    else "-")
        model, error = "-", "-"
        key = (row["workload"], budget_label(row["budget"]), row["allocator"])
        if by_kind:
            model_ms = sum(call_cost_us(p, prices) for p in plans) / 1e3 + pass_ms + drain_ms
            if cold:
                model_ms += sum(cold_burst_us(p, waits[i], prices, cold) for i, p in enumerate(plans)) / 1e3
            model = f"{model_ms:.0f}"
            error = model_error(model_ms, net_ms, noise_ms)
            modeled.setdefault(key, []).append((net_ms, model_ms, own_noise_ms, drift_noise_ms))
        process = (row.get("lockstep") or {}).get("process", "")
        lines.append(f"| {' | '.join(key)} | {process} | "
                     f"{quiet} | {sum(calls):,}{growths} | {unmaps} | {sum(waits)} | {passes}: {pass_ms:.0f} | {gross_ms:.0f} | "
                     f"{'-' if drift_ms is None else f'{drift_ms:.0f}'} | {per_call} | {model} | {error} |")
    # Twin processes of one group make the same calls and differ in what those added by more than the
    # model's error; their mean divides each one's own spread by sqrt(n), not the group's drift, which
    # they share.
    for key, entries in modeled.items():
        if len(entries) < 2:
            continue
        n = len(entries)
        net_ms = sum(e[0] for e in entries) / n
        model_ms = sum(e[1] for e in entries) / n
        noise_ms = math.hypot(math.sqrt(sum(e[2] ** 2 for e in entries)) / n, sum(e[3] for e in entries) / n)
        lines.append(f"| {' | '.join(key)} | mean of {n} | | | | | | {net_ms:.0f} (net of drift) | | | "
                     f"{model_ms:.0f} | {model_error(model_ms, net_ms, noise_ms)} |")
    return "\n".join(lines)


def model_error(model_ms, net_ms, noise_ms):
    """The model against the time the warm-up added (net of the group's drift), read against that
    time's noise: a percentage where the added time stands out of the noise (with "within noise"
    where the model is inside it too), else the excess in ms."""
    inside_noise = abs(net_ms) <= noise_ms
    if abs(model_ms - net_ms) <= noise_ms:
        point = "" if inside_noise or net_ms <= 0 else f"{model_ms / net_ms - 1:+.0%}, "
        return f"{point}within noise (±{noise_ms:.0f} ms)"
    if inside_noise or net_ms <= 0:
        return f"{model_ms - net_ms:+.0f} ms (added within ±{noise_ms:.0f} ms)"
    return f"{model_ms / net_ms - 1:+.0%}"


def shape_medians(row, quiet):
    """(shape -> the times of its steps from `quiet` on, shape -> their median), or None where the
    steps from `quiet` on hold no whole cycle of shapes."""
    steps, shapes = row["step_s"], max(1, row.get("shapes") or 1)
    if len(steps) - quiet < shapes:
        return None
    by_shape = quiet_by_shape(steps, quiet, shapes)
    return by_shape, {k: statistics.median(times) for k, times in by_shape.items()}


def shape_lags(row, quiet):
    """shape -> the median, over its quiet steps, of the step's time after the host had queued it
    (step_s - enqueue_s): what a device wait can drain (Note [Barrier cost]); None where the run
    did not record enqueue_s (or, as for shape_medians, its quiet steps hold no whole cycle)."""
    steps, enqueue = row["step_s"], row.get("enqueue_s") or []
    if len(enqueue) != len(steps):
        return None
    lags = shape_medians(dict(row, step_s=[step - queued for step, queued in zip(steps, enqueue)]), quiet)
    return lags and lags[1]


def added_ms(row, quiet, warm):
    """What a process's first `quiet` timed steps took over `warm` (shape -> the median of its steps
    from `quiet` on: shape_medians), in ms."""
    return sum(step - warm[i % len(warm)] for i, step in enumerate(row["step_s"][:quiet])) * 1e3


def group_drift_ms(row, rows, quiet):
    """(drift, its noise) in ms: what the first `quiet` timed steps took over the later ones in the
    processes of `row`'s lockstep group that made no driver call nor barrier in any timed step (the
    reference processes with no budget, or native where it fits), averaged; (None, 0) where there
    is none. Processes that take turns share the machine's pace, and a group's early steps can all
    run slower or faster than its later ones (the GPU's clocks, the other processes' own warm-up):
    that part of a warm-up's added time is not the allocator's. The noise is two standard errors
    of the mean over those processes (0 with one: unknown, not zero)."""
    group = (row.get("lockstep") or {}).get("group")
    peers = [peer for peer in rows
             if group and (peer.get("lockstep") or {}).get("group") == group and peer.get("oom_at_step") is None
             and len(peer.get("step_s") or []) == len(row["step_s"]) and peer.get("shapes") == row.get("shapes")
             and quiet_from(peer) == 0]  # `row` itself made calls: not among them
    drifts = []
    for peer in peers:
        medians = shape_medians(peer, quiet)
        if medians is not None:
            drifts.append(added_ms(peer, quiet, medians[1]))
    if not drifts:
        return None, 0.0
    noise = 2 * statistics.stdev(drifts) / math.sqrt(len(drifts)) if len(drifts) > 1 else 0.0
    return statistics.fmean(drifts), noise


def quiet_by_shape(steps, quiet, shapes):
    """shape -> the times of its steps from `quiet` on (a timed step i ran shape i % shapes)."""
    return {k: [steps[i] for i in range(quiet, len(steps)) if i % shapes == k] for k in range(shapes)}


def added_noise_ms(by_shape, warmup_steps):
    """How much of a warm-up's added time its steps' own spread can make: two standard deviations of
    a sum of the `warmup_steps` first steps, each as spread as the quiet steps of its shape
    (`by_shape`, quiet_by_shape; 0 where a shape has a single quiet step: the spread is then unknown,
    not zero, and the figure says too little). A percentage error against an added time inside it
    would be an error against noise. It leaves out the error of the quiet medians that every
    warm-up step is measured from."""
    shapes = len(by_shape)
    variance = sum(statistics.variance(by_shape[i % shapes]) if len(by_shape[i % shapes]) > 1 else 0.0
                   for i in range(warmup_steps))
    return 2 * math.sqrt(variance) * 1e3


def cold_burst_us(step, barriers, prices, cold):
    """What a step's driver calls cost over their warm prices when the first call of each kind in a
    burst finds the host's caches evicted (Note [Call bursts] in csrc/replay/replay.h: the step's
    growths, num_growths, recorded per step; call_costs.burst_premium_us). 0 where the step's
    growths were not recorded."""
    from torchmem.analysis.call_costs import burst_premium_us  # imports torch: here only

    if "num_growths" not in step:
        return 0.0
    return burst_premium_us(step, step["num_growths"], barriers, prices, cold)


def batch_scale(label):
    """An allocator label's base name and batch scale: "native@0.75" -> ("native", 0.75)."""
    base, sep, scale = label.rpartition("@")
    return (base, float(scale)) if sep else (label, 1.0)


def by_process(rows):
    """(row, process name) for each process, in table order: workload, budget, allocator, process."""
    order = sorted(rows, key=lambda r: (r["workload"], r.get("budget") or 0, r["allocator"],
                                        (r.get("lockstep") or {}).get("process", "")))
    return [(row, (row.get("lockstep") or {}).get("process", row["allocator"])) for row in order]


def median_ms(times):
    return f"{statistics.median(times) * 1e3:.1f}" if times else "-"


def has_host_time(row):
    """Whether the process counted the pool's own host time (time_host_ops)."""
    return any(s.get("host_alloc_ns") for s in row.get("plan_per_step") or [])


def after_warmup_counts(row):
    """(driver calls, device barriers) over the second half of a process's steps, warm-up steps
    included in the steps halved: what the replay calls "after warm-up" (BENCHMARKS.md, Replay at
    the budget: shapes that vary). None for a process that ran out of memory or a row from before
    every step's calls were recorded."""
    calls = row.get("calls_every_step")
    if row.get("oom_at_step") is not None or not calls:
        return None
    half = len(calls) // 2
    return sum(calls[half:]), sum((row.get("barriers_every_step") or [])[half:])


def after_warmup_table(rows, against="expandable"):
    """Per group (workload, budget, seed) and process: the driver calls and barriers after warm-up,
    and the calls against the median of the same group's `against` processes: with shapes that
    vary, the bar a pool at the budget is held to is expandable_segments' calls (counted by page,
    as the replay's model counts them: gpu_workloads.expandable_page_calls)."""
    groups = {}
    for row in rows:
        if "calls_every_step" in row and not row.get("reference"):
            groups.setdefault((row["workload"], row.get("budget"), row["seed"]), []).append(row)
    lines = [f"| workload | budget | seed | allocator | steps | calls after warm-up | barriers | calls / {against}'s |",
             "|---|---|---|---|---|---|---|---|"]
    for key in sorted(groups, key=lambda k: (k[0], k[1] or 0, k[2])):
        group = groups[key]
        theirs = [after_warmup_counts(r) for r in group if r["allocator"] == against]
        theirs = [c[0] for c in theirs if c is not None]
        reference = statistics.median(theirs) if theirs else None
        for row in sorted(group, key=lambda r: r["allocator"]):
            label = f"| {key[0]} | {budget_label(key[1])} | {key[2]} | {row['allocator']} |"
            counted = after_warmup_counts(row)
            if counted is None:
                ran_out = oom_label([row]) if row.get("oom_at_step") is not None else "-"
                lines.append(f"{label} - | {ran_out} | - | - |")
                continue
            if reference is None:
                versus = "-"
            elif reference == 0:
                versus = "equal (0)" if counted[0] == 0 else "over (theirs 0)"
            else:
                versus = f"{counted[0] / reference:.2f}"
            lines.append(f"{label} {len(row['calls_every_step'])} | {counted[0]:,} | {counted[1]} | {versus} |")
    return "\n".join(lines)


def shape_table(rows):
    """Where a step's time goes, per shape: each process's steady steps (steady_steps) by shape, the
    median step and the median time until the host had queued it (enqueue_s), in ms. A shape whose
    step outlasts its enqueue by little is host-bound: a gap between allocators there is host time;
    where the GPU is the bottleneck the step is the GPU's, and the host's time is hidden."""
    lines = ["| workload | budget | allocator | process | per shape, steady steps: step / enqueue, ms |",
             "|---|---|---|---|---|"]
    for row, process in by_process(rows):
        steps, enqueue, shapes = row["step_s"], row.get("enqueue_s") or [], row.get("shapes") or 0
        if row.get("oom_at_step") is not None or shapes < 1 or not steps:
            continue
        start = len(steps) - steady_steps(row, quiet_from(row))
        step_by_shape = quiet_by_shape(steps, start, shapes)
        queued_by_shape = quiet_by_shape(enqueue, start, shapes) if len(enqueue) == len(steps) else {}
        cells = [f"{median_ms(step_by_shape[k])} / {median_ms(queued_by_shape.get(k))}" for k in range(shapes)]
        lines.append(f"| {row['workload']} | {budget_label(row.get('budget'))} | {row['allocator']} | {process} | "
                     f"{'; '.join(cells)} |")
    return "\n".join(lines)


def host_time_table(rows):
    """The pool's own host time over each process's steady steps (torchmem with time_host_ops, Note
    [Host time]): per allocation, allocate's and free's nanoseconds and the step plan's part of both;
    per step, their sum beside the step's median enqueue. Says how much of a host-bound step's time
    is the pool's, and so whether a gap between allocators is the pool's work or the step's."""
    lines = ["| workload | budget | allocator | process | steady steps | pool ns per allocation: alloc + free "
             "(of them, plan) | pool ms per step | enqueue ms per step |", "|---|---|---|---|---|---|---|---|"]
    for row, process in by_process(rows):
        per_step, steps = row.get("plan_per_step") or [], row["step_s"]
        if row.get("oom_at_step") is not None or not steps or len(per_step) < len(steps) or not has_host_time(row):
            continue
        n = steady_steps(row, quiet_from(row))
        steady, allocs = per_step[-n:], sum((row.get("allocs_per_step") or [])[-n:])
        if allocs <= 0:
            continue
        alloc_ns, free_ns, plan_ns = (sum(s.get(k, 0) for s in steady) for k in
                                      ("host_alloc_ns", "host_free_ns", "host_plan_ns"))
        enqueue_ms = median_ms((row.get("enqueue_s") or [])[-n:])
        lines.append(f"| {row['workload']} | {budget_label(row.get('budget'))} | {row['allocator']} | {process} | "
                     f"{n} | {alloc_ns / allocs:,.0f} + {free_ns / allocs:,.0f} ({plan_ns / allocs:,.0f}) | "
                     f"{(alloc_ns + free_ns) / n / 1e6:.2f} | {enqueue_ms} |")
    return "\n".join(lines)


def card_full_note(rows):
    """A line above the tables when any process ran out of a full card (card_was_full), else ""."""
    full = sum(card_was_full(r) for r in rows)
    if not full:
        return ""
    return (f"{full} process(es) ran out of device memory that their budget still allowed: the card was full, "
            "the group's processes do not fit it together, and those OOMs say nothing of the allocator "
            "(fewer processes: --per-allocator 1, --reference none; or a larger card)\n")


def print_tables(rows, prices=None, cold=None):
    note = card_full_note(rows)
    if note:
        print(note)
    print(process_table(rows))
    print()
    print(paired_table(rows))
    if any(row.get("budget") is not None for row in rows):
        print()
        print(steady_table(rows))
        print()
        print(pooled_table(rows))
        print()
        print(warmup_table(rows, prices, cold))
        if any(row.get("samples_per_step") is not None for row in budget_rows(rows)):
            print()
            print(per_sample_table(rows))
    if any(row.get("calls_every_step") and row.get("shapes") == 0 for row in rows):
        print()
        print(after_warmup_table(rows))
    if any(row.get("enqueue_s") and row.get("shapes") for row in rows):
        print()
        print(shape_table(rows))
    if any(has_host_time(row) for row in rows):
        print()
        print(host_time_table(rows))
