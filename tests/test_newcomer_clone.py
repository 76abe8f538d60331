"""`python -m torchmem info` from the folder above a clone named torchmem.

There the current directory comes first on sys.path, so Python takes the clone's
folder for a namespace package named torchmem, and an editable install (whose
finder comes after the path finder) supplies only the submodules: torchmem's own
top level is missing. The CLI must say so in one line, with what to do.

The layout is built in a temporary directory, and the editable install is a small
finder shaped like setuptools' (it maps torchmem.* to this checkout), so the test
does not depend on how the machine installed torchmem."""

import os
import subprocess
import sys
import textwrap

from support import REPO

# Installs an editable-install finder for this checkout, then runs `python -m torchmem ARGS...`.
RUN_AS_MODULE = textwrap.dedent("""
    import importlib.abc, importlib.machinery, importlib.util, os, runpy, sys
    repo = sys.argv[1]

    class Editable(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "torchmem" and not fullname.startswith("torchmem."):
                return None
            base = os.path.join(repo, *fullname.split("."))
            if os.path.isfile(os.path.join(base, "__init__.py")):
                return importlib.util.spec_from_file_location(
                    fullname, os.path.join(base, "__init__.py"), submodule_search_locations=[base])
            for suffix in [".py"] + importlib.machinery.EXTENSION_SUFFIXES:
                if os.path.isfile(base + suffix):
                    return importlib.util.spec_from_file_location(fullname, base + suffix)
            return None

    sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder) + 1, Editable())
    sys.argv = ["torchmem"] + sys.argv[2:]
    runpy.run_module("torchmem", run_name="__main__", alter_sys=True)
""")


def _run(cwd, *args):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the checkout must come only through the finder
    return subprocess.run([sys.executable, "-c", RUN_AS_MODULE, REPO, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _clone_layout(tmp_path):
    parent = tmp_path / "work"
    clone = parent / "torchmem"  # the repository's root: no __init__.py
    clone.mkdir(parents=True)
    (clone / "README.md").write_text("# torchmem\n")
    (clone / "setup.py").write_text("")
    return parent, clone


def test_from_above_a_clone_one_line_says_what_to_do(tmp_path):
    parent, clone = _clone_layout(tmp_path)
    proc = _run(parent, "info")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert f"`torchmem` here is the folder {clone}" in line and "not the torchmem package" in line
    assert "cd torchmem" in line and "install" in line
    assert "cannot import name" not in line


def test_elsewhere_the_same_install_works(tmp_path):
    _clone_layout(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run(elsewhere, "info")
    assert proc.returncode == 0, proc.stderr
    assert '"torch_version"' in proc.stdout
