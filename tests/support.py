"""Test helpers: run a body of Python in a fresh interpreter, and run gloo ranks.

The CUDA allocator can be swapped only once per process and only before CUDA
initializes, so every test that installs torchmem runs its body in a subprocess.
"""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, env=None, timeout=600, check=True):
    """Runs `code` (dedented) in a new interpreter from the repo root and returns
    the CompletedProcess. With check=True, a non-zero exit fails with both output
    streams in the message."""
    full_env = dict(os.environ)
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc


def last_json(proc):
    """The last line of `proc`'s stdout that is a JSON object, parsed."""
    import json

    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def run_snippet(mode, body, env=None, check=True):
    """Runs `body` in a fresh interpreter with `import json, os, sys, torch` done, on the native
    allocator (mode "native") or with torchmem installed ("torchmem"), and returns its last JSON
    line (check=True) or the CompletedProcess (check=False). The GPU tests compare both modes."""
    prelude = "import json, os, sys\nimport torch\n"
    if mode == "torchmem":
        prelude += "import torchmem\ntorchmem.install(warn_unsupported=False)\n"
    body = textwrap.dedent(body)
    if mode == "torchmem":
        body += "\nassert torchmem.is_installed()\n"
    proc = run_python(prelude + body, env=env, check=check)
    return last_json(proc) if check else proc


def run_both(body, env=None):
    """(native result, torchmem result) of the same snippet (run_snippet)."""
    return run_snippet("native", body, env), run_snippet("torchmem", body, env)


def gloo_rank(rank, out_dir, port, world, train, modes):
    """One rank of run_ranks: joins a gloo group through the parent's TCP store, writes
    {mode: train(rank, mode)} to out_dir/rank{rank}.json."""
    import datetime
    import json

    import torch
    import torch.distributed as dist

    # Rendezvous through a TCPStore the parent serves on a port it already holds
    # (port 0: the kernel picks it), so no port is picked free and released for
    # another process to take, and no FileStore is shared (a rank once aborted
    # in gloo with "terminate called without an active exception" under both).
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.set_num_threads(1)
        results = {mode: train(rank, mode) for mode in modes}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        # No rank tears its gloo group down while the other still talks to it: a
        # peer closing mid-collective aborts gloo's worker threads (std::terminate).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(train, modes, out_dir, world, timeout_s):
    """Spawns `world` gloo ranks (gloo_rank) that each run train(rank, mode) for every mode,
    fails the test if they have not finished in `timeout_s` (a hang), and returns each rank's
    {mode: result}. A rank killed by a signal (gloo's threads aborted
    with "terminate called without an active exception" about once in fifteen full runs on the
    2-core machine, never in torchmem's code) gets one fresh set of processes, with a warning;
    a second death, an exception or a hang fails."""
    import warnings

    import torch.multiprocessing as mp

    try:
        return _run_ranks_once(train, modes, out_dir, world, timeout_s)
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None:
            raise
        warnings.warn(f"a rank died ({exc}); running the ranks once more", RuntimeWarning)
        again = os.path.join(str(out_dir), "again")
        os.makedirs(again, exist_ok=True)
        return _run_ranks_once(train, modes, again, world, timeout_s)


def _run_ranks_once(train, modes, out_dir, world, timeout_s):
    import datetime
    import json
    import time

    import pytest
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    context = mp.start_processes(gloo_rank, args=(str(out_dir), store.port, world, train, modes), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ranks did not finish within {timeout_s} s (hang)")
    del store
    return [json.load(open(f"{out_dir}/rank{r}.json")) for r in range(world)]
