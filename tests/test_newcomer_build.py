"""What a newcomer sees while `make demo` / `make test` install and build: each long
step says what it does and about how long, the build shows a short line per file,
and the module it builds ships without debug info and pins the torch it needs.

The build itself is not run here (minutes); setup.py is loaded with setup() stubbed,
and the progress filter is fed the lines a real build prints."""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from support import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))
import build_if_stale  # noqa: E402
import ensure_deps  # noqa: E402

NINJA_LINE = (f"[3/40] c++ -MMD -MF {REPO}/build/obj/csrc/core/pool.o.d -Wsign-compare -DNDEBUG -g -fwrapv -O3 "
              f"-I{REPO}/csrc -c -c {REPO}/csrc/core/pool.cpp -o {REPO}/build/obj/csrc/core/pool.o -std=c++20 -g0\n")
LINK_LINE = (f"g++ -Wsign-compare -DNDEBUG -g -fwrapv -O3 -Wall -shared {REPO}/build/obj/csrc/core/pool.o -s "
             f"-o build/lib.linux-x86_64-cpython-311/torchmem/_C.cpython-311-x86_64-linux-gnu.so\n")


def test_build_output_is_one_short_line_per_step():
    assert build_if_stale.progress_line(NINJA_LINE) == "  [3/40] csrc/core/pool.cpp"
    assert build_if_stale.progress_line(LINK_LINE) == "  linking torchmem._C"
    assert build_if_stale.progress_line("torchmem: compiling torchmem._C: 40 source files\n").startswith("torchmem:")
    ours = f"{REPO}/csrc/core/pool.cpp:12:3: warning: unused variable 'x'\n"
    assert build_if_stale.progress_line(ours) == ours.rstrip("\n")
    # torch's headers warn in every file: hidden; errors always shown
    torch_header = "/venv/torch/include/ATen/core/CachingHostAllocator.h:55:16: warning: use of 'std::x'\n"
    assert build_if_stale.progress_line(torch_header) is None
    assert build_if_stale.progress_line("x.cpp:1:1: error: expected ';'\n") is not None
    for noise in ("running build_ext\n", "copying build/lib/torchmem/_C.so -> torchmem\n", "  corresp(dist)\n"):
        assert build_if_stale.progress_line(noise) is None


def test_a_failed_build_prints_the_end_of_its_output(tmp_path, capsys):
    script = tmp_path / "fake_build.py"
    script.write_text("import sys\n"
                      f"sys.stdout.write({NINJA_LINE!r})\n"
                      "print('some detail the user needs')\n"
                      "sys.exit(3)\n")
    assert build_if_stale.run_showing_progress([sys.executable, str(script)]) == 3
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "  [3/40] csrc/core/pool.cpp"
    assert "the build failed (exit 3)" in out and "some detail the user needs" in out


def test_installs_say_what_and_about_how_long(monkeypatch, capsys):
    needed = dict(ensure_deps.NEEDED["demo"], **ensure_deps.NEEDED["test"])
    assert "about 10-30 s" in ensure_deps.announcement(["ninja", "wheel"], needed)
    assert "about 2-5 min" in ensure_deps.announcement(["pytest", "transformers"], needed)
    calls = []
    monkeypatch.setattr(ensure_deps.importlib.util, "find_spec", lambda name: None if name == "ninja" else True)
    monkeypatch.setattr(ensure_deps.subprocess, "check_call", calls.append)
    ensure_deps.main(["demo"])
    assert capsys.readouterr().out == "installing missing packages: ninja (about 10-30 s)\n"
    assert calls[0][-1] == "ninja" and "-q" not in calls[0]  # pip's own progress stays visible


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_announces_the_torch_install():
    dry = subprocess.run(["make", "-n", "setup", "PYTHON=python3"], cwd=REPO, capture_output=True, text=True,
                         timeout=60).stdout
    assert "installing torch==2.14.1 (about 1-3 min" in dry
    assert "install -q" not in dry.split("tools/ensure_deps.py")[0]


# Loads setup.py as a release and as a DEBUG=1 build (setup() stubbed) and prints what each would do.
SETUP_PROBE = """
import json, os, runpy, setuptools
setuptools.setup = lambda **kwargs: None
answers = {}
for debug in ("0", "1"):
    os.environ["DEBUG"] = debug
    ns = runpy.run_path("setup.py")
    answers[debug] = {"plan": ns["build_plan"](), "cxx": ns["compile_args"](), "link": ns["link_args"](),
                      "requires": ns["install_requires"](), "sources": len(ns["sources"]())}
print(json.dumps(answers))
"""


def test_release_builds_drop_debug_info_and_pin_torch():
    proc = subprocess.run([sys.executable, "-c", SETUP_PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    release, debug = answers["0"], answers["1"]
    assert "-g0" in release["cxx"] and "-g" not in release["cxx"] and release["link"] == ["-Wl,--strip-debug"]
    assert release["requires"] == [f"torch=={torch.__version__.split('+')[0]}", "numpy"]
    assert f"compiling torchmem._C: {release['sources']} source files, about " in release["plan"]
    assert " min on " in release["plan"]
    assert "-g" in debug["cxx"] and "-g0" not in debug["cxx"] and debug["link"] == []


def _section_names(path):
    """Section names of a 64-bit little-endian ELF file (what `readelf -S` lists)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    names_offset = struct.unpack_from("<Q", data, shoff + names_index * entry_size + 0x18)[0]
    names = []
    for index in range(count):
        start = names_offset + struct.unpack_from("<I", data, shoff + index * entry_size)[0]
        names.append(data[start:data.index(b"\0", start)].decode())
    return names


@pytest.mark.skipif(sys.platform != "linux", reason="reads the ELF sections of the built module")
def test_the_built_module_has_no_debug_info():
    from torchmem import _C, build_info

    if build_info()["debug"]:
        pytest.skip("a DEBUG=1 build keeps its debug info")
    names = _section_names(_C.__file__)
    assert ".text" in names
    assert not [name for name in names if name.startswith(".debug")], names
    # the symbol table stays: torch's unwinder names torchmem's C++ frames from it (tests/test_stacks.py)
    assert ".symtab" in names


def test_the_readmes_venv_is_ignored():
    with open(os.path.join(REPO, ".gitignore")) as f:
        assert ".venv/" in f.read().split()
