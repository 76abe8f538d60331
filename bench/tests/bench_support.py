"""What bench's own tests share: the repository root and loading a bench script as a module.

The benches are scripts, not a package (each imports torch only in main(), so loading one is
cheap and needs no GPU). Their tests live here, beside them, so torchmem's tests (tests/) never
import bench; pytest runs both folders (pyproject.toml, testpaths).
"""

import importlib.util
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH)


def load_bench(name):
    """bench/<name>.py as a module. bench/ goes on sys.path as it does when the script runs, for
    the helpers it imports beside it (bench/common.py)."""
    if BENCH not in sys.path:
        sys.path.append(BENCH)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
