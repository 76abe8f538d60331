"""Builds torchmem._C in place (pip install -e, no build isolation) when it is
missing, older than any source under csrc/ or setup.py, or built for another
torch (--force: always; `make build`). Keeps `make test` fast on a second run and
right after an edit.

A build from scratch takes minutes, so it shows its steps: setup.py's own lines
(what it compiles, about how long) and one short line per file ninja compiles
("[12/40] csrc/core/pool.cpp"), instead of pip's silence or ninja's full
compiler command lines. Errors and warnings in csrc/ pass through; when the build
fails, the end of its full output is printed.
"""

import collections
import glob
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ninja -v (torch's cpp_extension runs it so): "[3/40] c++ ... -c /path/x.cpp -o /path/x.o ..."
_NINJA = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)$")
_SOURCE = re.compile(r"\s-c\s+(\S+\.(?:cpp|cu|cc))\b")
_LINK = re.compile(r"\s-shared\s.*\s-o\s+\S*_C[^/\s]*\.so\b")
LOG_TAIL_LINES = 80


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


def progress_line(line):
    """What to show of one line of the build's output, or None to hide it."""
    text = line.rstrip("\n")
    stripped = text.strip()
    ninja = _NINJA.match(text)
    if ninja:
        source = _SOURCE.search(ninja.group(3))
        what = os.path.relpath(source.group(1), ROOT) if source else ninja.group(3)[:80]
        return f"  [{ninja.group(1)}/{ninja.group(2)}] {what}"
    if stripped.startswith("torchmem:"):
        return stripped
    if _LINK.search(text):
        return "  linking torchmem._C"
    if re.search(r"\berror\b:", text) or stripped.startswith(("FAILED:", "ninja: build stopped")):
        return text
    # Warnings in torchmem's own sources; torch's headers warn in every file and say nothing new.
    if re.search(r"\bwarning\b:", text) and stripped.startswith(os.path.join(ROOT, "csrc")):
        return text
    return None


def run_showing_progress(command, out=None):
    """Runs `command`, printing progress_line() of each output line as it comes; on
    failure, the last LOG_TAIL_LINES lines of the full output. Returns the exit code."""
    out = out or sys.stdout
    tail = collections.deque(maxlen=LOG_TAIL_LINES)
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    for line in proc.stdout:
        tail.append(line)
        shown = progress_line(line)
        if shown is not None:
            print(shown, file=out, flush=True)
    code = proc.wait()
    if code:
        print(f"the build failed (exit {code}); the end of its output:", file=out)
        out.write("".join(tail))
        out.flush()
    return code


def main(argv):
    force = argv == ["--force"]
    if argv and not force:
        sys.exit("usage: python tools/build_if_stale.py [--force]")
    module = built_module()
    fresh = module and os.path.getmtime(module) >= newest_source_mtime()
    if not force and fresh and is_installed() and loads_with_this_torch():
        return
    print("building torchmem._C (pip install --no-build-isolation -e .)", flush=True)
    started = time.monotonic()
    # -v: pip passes the build's output on, which run_showing_progress shortens.
    code = run_showing_progress([sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation",
                                 "--no-deps", "-e", ROOT])
    if code:
        sys.exit(code)
    minutes, seconds = divmod(round(time.monotonic() - started), 60)
    print(f"built and installed torchmem in {minutes} min {seconds} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
