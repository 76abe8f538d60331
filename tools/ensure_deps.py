"""Installs the Python packages a make target needs, but only those missing: a
machine without network (the GPU machine) has them already.

    python tools/ensure_deps.py demo   # build torchmem and run the demo
    python tools/ensure_deps.py test   # also what the tests need

The demo needs only the build tools; the test suite also needs pytest, hypothesis,
matplotlib and the frameworks the integrations are tested against (Lightning,
Transformers, Accelerate: several GB), so only `make test` installs those.
It says what it installs and about how long that takes before pip starts, and
leaves pip's own progress visible: a silent minute looks like a hang.
"""

import importlib.util
import subprocess
import sys

# import name -> pip requirement, per target
NEEDED = {
    "demo": {
        "ninja": "ninja",
        "numpy": "numpy",
        "setuptools": "setuptools>=64",
        "wheel": "wheel",
    },
    "test": {
        "pytest": "pytest",
        "hypothesis": "hypothesis",
        "matplotlib": "matplotlib",
        # The Lightning and Hugging Face integrations are tested against the real
        # frameworks on CI too (only GPU tests may skip there).
        "lightning": "lightning",
        "transformers": "transformers",
        "accelerate": "accelerate",
        # `python -m torchmem top`, the Prometheus metrics and NVML's device totals (torchmem/monitor/)
        "rich": "rich",
        "prometheus_client": "prometheus-client",
        "pynvml": "nvidia-ml-py",
    },
}
# The big ones: with their dependencies, a few GB and a few minutes to download.
LARGE = {"lightning", "transformers", "accelerate"}


def announcement(missing_names, needed):
    """The line printed before installing: what, and about how long."""
    requirements = " ".join(needed[name] for name in missing_names)
    if LARGE & set(missing_names):
        duration = "about 2-5 min and a few GB: the frameworks bring their own dependencies"
    else:
        duration = "about 10-30 s"
    return f"installing missing packages: {requirements} ({duration})"


def main(argv):
    if len(argv) != 1 or argv[0] not in NEEDED:
        sys.exit(f"usage: python tools/ensure_deps.py {{{'|'.join(NEEDED)}}}")
    needed = dict(NEEDED["demo"])
    if argv[0] == "test":
        needed.update(NEEDED["test"])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        print(announcement(missing, needed), flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", *(needed[name] for name in missing)])


if __name__ == "__main__":
    main(sys.argv[1:])
