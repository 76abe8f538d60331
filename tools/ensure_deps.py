"""Installs the Python packages torchmem's build, demo and tests need, but only
those missing: a machine without network (the GPU machine) has them already."""

import importlib.util
import subprocess
import sys

# import name -> pip requirement
NEEDED = {
    "ninja": "ninja",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "setuptools": "setuptools>=64",
    "wheel": "wheel",
    # The Lightning and Hugging Face integrations are tested against the real
    # frameworks on CI too (only GPU tests may skip there).
    "lightning": "lightning",
    "transformers": "transformers",
    "accelerate": "accelerate",
    # `python -m torchmem top`, the Prometheus metrics and NVML's device totals (torchmem/monitor/)
    "rich": "rich",
    "prometheus_client": "prometheus-client",
    "pynvml": "nvidia-ml-py",
}


def main():
    missing = [req for name, req in NEEDED.items() if importlib.util.find_spec(name) is None]
    if missing:
        print(f"installing missing packages: {' '.join(missing)}", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *missing])


if __name__ == "__main__":
    main()
