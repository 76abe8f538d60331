# setup.py: builds torchmem's one extension module, torchmem._C.
#
# Why it looks like this: the CUDA parts are decided by the installed torch
# (torch.version.cuda) and a CUDA toolkit found on disk, never by
# torch.cuda.is_available(), because build machines usually have no GPU. With no
# CUDA, the core and the simulated backend still build, so trace replay and the
# CPU tests work everywhere.
#
# Layout rule (so adding a file needs no edit here): every .cpp under csrc/ is
# compiled, except that csrc/shim/ and any file named *_cuda.cpp are compiled only
# in CUDA builds, which also define TORCHMEM_WITH_CUDA=1.
#
# Release builds ship without debug info (-g0 over Python's own -g, and --strip-debug
# at link): with it the module is ~30x larger. The package's metadata pins the torch it
# is built against (Requires-Dist torch==X.Y.Z), because the module works only with
# that torch's C++ ABI; torchmem/_built_with.py records it for the import-time message.
#
# Environment: CUDA_HOME (toolkit root), TORCH_CUDA_ARCH_LIST (default below),
# DEBUG=1 (-O0 -g, unstripped, expensive invariant checks on), TORCHMEM_FORCE_CPU=1
# (skip the CUDA parts), TORCHMEM_BUILD_DIR (ninja's object directory, default build/obj).

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _has_cuda_headers(root):
    return bool(root) and os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h"))


def find_cuda_home():
    """The CUDA toolkit root: $CUDA_HOME if set, else the first directory that
    holds include/cuda_runtime_api.h. torch guesses the root from where `nvcc`
    sits on PATH, which is wrong when nvcc is a wrapper script (as on our build
    machines), so we look for the headers instead."""
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        return explicit if _has_cuda_headers(explicit) else None
    candidates = ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for path_dir in os.environ.get("PATH", "").split(os.pathsep):
        nvcc = os.path.join(path_dir, "nvcc")
        if os.path.isfile(nvcc):
            candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
            try:  # a wrapper script: `exec /usr/local/cuda-13.0/bin/nvcc "$@"`
                with open(nvcc, "rb") as f:
                    head = f.read(4096).decode("utf-8", "replace")
                for word in head.split():
                    if word.endswith("/bin/nvcc"):
                        candidates.append(os.path.dirname(os.path.dirname(word)))
            except OSError:
                pass
    for candidate in candidates:
        if _has_cuda_headers(candidate):
            return candidate
    return None


# torch.utils.cpp_extension reads CUDA_HOME when imported, so settle it first.
CUDA_HOME = None if os.environ.get("TORCHMEM_FORCE_CPU") == "1" else find_cuda_home()
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME
# No kernels are compiled, but cpp_extension queries the device when the list is
# unset, and that initializes CUDA on a machine that has one.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

WITH_CUDA = bool(torch.version.cuda) and CUDA_HOME is not None
DEBUG = os.environ.get("DEBUG", "0") == "1"
TORCH_BASE_VERSION = torch.__version__.split("+")[0]
# Seconds of one core per source file at -O3 (torch's headers dominate), from a build on
# the 2-core CI machine (about 4 min for 40 files); only used to say how long a build takes.
SECONDS_PER_SOURCE = 12


def is_cuda_only(path):
    rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
    return rel.startswith("csrc/shim/") or rel.endswith("_cuda.cpp")


def sources():
    found = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True))
    chosen = [p for p in found if WITH_CUDA or not is_cuda_only(p)]
    return [os.path.relpath(p, ROOT) for p in chosen]


def compile_args():
    # C++20: torch >= 2.10 headers need it (std::strong_ordering in c10), and cpp_extension asks for it too.
    flags = ["-std=c++20", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
    # -g0 comes after Python's CFLAGS (which carry -g) and so wins.
    flags += ["-O0", "-g"] if DEBUG else ["-O3", "-DNDEBUG", "-g0"]
    macros = [
        f"-DTORCHMEM_TORCH_VERSION=\"{torch.__version__}\"",
        f"-DTORCHMEM_CUDA_VERSION=\"{torch.version.cuda if WITH_CUDA else ''}\"",
        f"-DTORCHMEM_DEBUG={1 if DEBUG else 0}",
        f"-DTORCHMEM_WITH_CUDA={1 if WITH_CUDA else 0}",
    ]
    return flags + macros


def link_args():
    # Strips what -g0 cannot reach (debug info in the static parts linked in) but keeps the
    # symbol table: torch's unwinder names torchmem's C++ frames in memory snapshots from it.
    return [] if DEBUG else ["-Wl,--strip-debug"]


def install_requires():
    """The module links against this torch's C++ ABI, so the package requires exactly it
    (any local variant: torch==2.14.1 accepts 2.14.1+cu130 and 2.14.1+cpu)."""
    return [f"torch=={TORCH_BASE_VERSION}", "numpy"]


def build_plan():
    """One line saying what the build compiles and about how long it takes from scratch."""
    count = len(sources())
    cores = os.cpu_count() or 1
    minutes = max(1, round(count * SECONDS_PER_SOURCE / cores / 60))
    return (f"torchmem: compiling torchmem._C: {count} source files, about {minutes} min on {cores} "
            f"cores from scratch (only changed files after that), one line per file below")


def built_with_text():
    """torchmem/_built_with.py: what the module was built against, readable without loading it."""
    return ("# Written by setup.py when torchmem._C is built; not in git.\n"
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"CUDA_VERSION = {(torch.version.cuda if WITH_CUDA else None)!r}\n")


def extension():
    common = dict(
        name="torchmem._C",
        sources=sources(),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": compile_args()},
        extra_link_args=link_args(),
    )
    if WITH_CUDA:
        # The driver API (cuMem*) is reached through cudaGetDriverEntryPoint, so
        # there is no hard link to libcuda.so: the module imports on machines
        # without a driver.
        return CUDAExtension(**common)
    return CppExtension(**common)


class Build(BuildExtension):
    def initialize_options(self):
        super().initialize_options()
        # One object directory for every build of this checkout (in place, wheel), so
        # ninja recompiles only what changed (tests/test_wheel.py builds a wheel).
        self.build_temp = os.environ.get("TORCHMEM_BUILD_DIR") or os.path.join(ROOT, "build", "obj")

    def run(self):
        print(f"torchmem: building with CUDA={'yes (' + CUDA_HOME + ')' if WITH_CUDA else 'no'}, "
              f"torch {torch.__version__}, DEBUG={int(DEBUG)}", file=sys.stderr)
        print(build_plan(), file=sys.stderr, flush=True)
        super().run()
        # Next to the module, in place and in a wheel's staging folder alike.
        folder = os.path.dirname(self.get_ext_fullpath("torchmem._C"))
        with open(os.path.join(folder, "_built_with.py"), "w") as f:
            f.write(built_with_text())


# Metadata lives in pyproject.toml; only the extension and the torch it needs are described here.
setup(
    install_requires=install_requires(),
    ext_modules=[extension()],
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
)
