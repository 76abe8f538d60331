"""The wheel works outside the checkout: every package, the bundled data, every public name.

Tests import torchmem from the checkout, so a package or data file missing from
pyproject.toml goes unseen there (torchmem.batch was once left out of the wheel).
This builds the wheel the way a user would get it, installs it into a fresh
directory and imports all of it from a Python that cannot see the checkout.
The wheel's compile shares the in-place build's object directory (build/obj,
setup.py), so after `make build` it only relinks. It also checks what the wheel
tells pip: the exact torch it was built against, and a module without debug info.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from support import REPO
from torchmem.analysis.trace import bundled_traces

pytestmark = pytest.mark.slow

# Run in the installed copy: imports every submodule and public name, reads the bundled data.
CHECK = textwrap.dedent("""
    import importlib, json, os, pkgutil, sys
    import torchmem
    assert os.path.abspath(torchmem.__file__).startswith(os.path.abspath(sys.argv[1])), torchmem.__file__
    modules = sorted(m.name for m in pkgutil.walk_packages(torchmem.__path__, "torchmem."))
    for name in modules:
        importlib.import_module(name)
    for name in torchmem.__all__:
        getattr(torchmem, name)
    from torchmem.analysis import trace
    traces = [os.path.basename(p) for p in trace.bundled_traces()]
    assert len(trace.load(trace.bundled_trace(traces[0]))) > 0
    from torchmem.cli import anchors
    print(json.dumps({"modules": modules, "traces": traces, "anchors": sorted(anchors.load_anchors())}))
""")


def _packages_in_checkout():
    root = os.path.join(REPO, "torchmem")
    found = []
    for folder, _, files in os.walk(root):
        if "__init__.py" in files:
            relative = os.path.relpath(folder, root)
            found.append("torchmem" if relative == "." else "torchmem." + relative.replace(os.sep, "."))
    return sorted(found)


def test_wheel_installs_and_imports_everything_outside_the_checkout(tmp_path):
    env = dict(os.environ)
    # Build as from a fresh clone. setuptools stages the wheel's files in build/lib* and
    # build/bdist* and never empties them, and egg_info reads the files of an earlier
    # build back from *.egg-info/SOURCES.txt: either way a package left out of
    # pyproject.toml would still ship.
    for staged in glob.glob(os.path.join(REPO, "build", "lib*")) + glob.glob(os.path.join(REPO, "build", "bdist*")):
        shutil.rmtree(staged)
    for sources in glob.glob(os.path.join(REPO, "*.egg-info", "SOURCES.txt")):
        os.remove(sources)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", str(wheels), REPO], check=True, env=env, timeout=1200)
    wheel = glob.glob(str(wheels / "torchmem-*.whl"))
    assert len(wheel) == 1, wheel
    with zipfile.ZipFile(wheel[0]) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        module = next(info for info in archive.infolist() if info.filename.startswith("torchmem/_C"))
        built_with = archive.read("torchmem/_built_with.py").decode()
    # The module works only with the torch it was compiled against: the metadata says which.
    import torch

    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires == [f"Requires-Dist: torch=={torch.__version__.split('+')[0]}"], requires
    assert f"TORCH_VERSION = {torch.__version__!r}" in built_with
    # Without debug info: ~2 MB, where it made it ~60 MB.
    assert module.file_size < 10 << 20, module.file_size
    for package in _packages_in_checkout():
        assert package.replace(".", "/") + "/__init__.py" in names, f"{package} is missing from the wheel"
    for path in bundled_traces():
        assert os.path.relpath(path, REPO).replace(os.sep, "/") in names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel[0]],
                   check=True, timeout=600)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # PYTHONPATH puts the installed copy ahead of the checkout's editable install.
    env["PYTHONPATH"] = str(target)
    proc = subprocess.run([sys.executable, "-c", CHECK, str(target)], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(_packages_in_checkout()) - {"torchmem"} <= set(found["modules"])
    assert "torchmem.batch.controller" in found["modules"]
    assert found["traces"] == [os.path.basename(p) for p in bundled_traces()]
    assert found["anchors"], "torchmem/data/anchors.jsonl is missing from the wheel"
