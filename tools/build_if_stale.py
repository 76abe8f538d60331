"""Builds torchmem._C in place (pip install -e, no build isolation) when it is
missing, older than any source under csrc/ or setup.py, or built for another
torch. Keeps `make test` fast on a second run and right after an edit."""

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def newest_source_mtime():
    paths = glob.glob(os.path.join(ROOT, "csrc", "**", "*"), recursive=True)
    paths.append(os.path.join(ROOT, "setup.py"))
    return max(os.path.getmtime(p) for p in paths if os.path.isfile(p))


def built_module():
    found = glob.glob(os.path.join(ROOT, "torchmem", "_C*.so"))
    return found[0] if found else None


def loads_with_this_torch():
    probe = "import torchmem._loader"
    return subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True).returncode == 0


def is_installed():
    probe = "import importlib.metadata as m; m.version('torchmem')"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main():
    module = built_module()
    fresh = module and os.path.getmtime(module) >= newest_source_mtime()
    if fresh and is_installed() and loads_with_this_torch():
        return
    print("building torchmem._C (pip install --no-build-isolation -e .)", flush=True)
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", ROOT],
        cwd=ROOT,
    )


if __name__ == "__main__":
    main()
