"""Test helpers: run a body of Python in a fresh interpreter.

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
