"""Loads the compiled module torchmem._C, on first use, and says clearly when it cannot.

Loading is lazy so that `import torchmem` and the pure-Python parts (config,
batch, retry) work without a build: `_C` is loaded when something first reads
`torchmem._loader._C` (``from torchmem._loader import _C``) or calls
``extension()``. A module built against one torch and imported with another
fails with an undefined-symbol ImportError, or worse, loads and misbehaves. We
check the torch version the module was built against (build_info, or, when the
module cannot even load, torchmem/_built_with.py, which setup.py writes beside it)
and turn both cases into an ExtensionLoadError: one line that says which torch the
module was built for, which is installed, and how to rebuild. The CLI prints it as
that one line.

``is_installed()`` is the one answer to "is torchmem's allocator installed in
this process?"; every other module asks it.
"""

import threading

import torch

REBUILD_HINT = (
    "Rebuild it against the torch in this environment: "
    "`pip install --no-build-isolation -e .` from the torchmem checkout (or `make build`)."
)

_module = None
_lock = threading.Lock()


class ExtensionLoadError(ImportError):
    """torchmem._C is missing, or built for another torch; the message says how to fix it."""


def _base_version(version):
    return version.split("+")[0]


def built_for():
    """The torch version the compiled module was built against, read without loading it
    (torchmem/_built_with.py), or None when the build did not record it."""
    try:  # written by setup.py beside the module; absent in a build that did not record it
        from torchmem import _built_with
    except ImportError:
        return None
    return getattr(_built_with, "TORCH_VERSION", None)


def _mismatch(built, installed, detail=""):
    return ExtensionLoadError(
        f"torchmem._C was built against torch {built}, but torch {installed} is installed{detail}. "
        f"Install torch=={_base_version(built)} (what the package requires), or: {REBUILD_HINT}"
    )


def load_extension():
    """Imports torchmem._C and checks it matches the installed torch; raises ExtensionLoadError saying how to fix it."""
    try:  # the one import of the compiled module (tests/test_layout.py): loaded on first use only
        from torchmem import _C
    except ImportError as exc:
        reason = " ".join(str(exc).split())
        built = built_for()
        if built and _base_version(built) != _base_version(torch.__version__):
            raise _mismatch(built, torch.__version__, f", and the module cannot load ({reason})") from exc
        raise ExtensionLoadError(
            f"torchmem's compiled module torchmem._C could not be loaded ({reason}). It is "
            f"missing, or it was built for another torch than the one installed "
            f"(torch {torch.__version__}). {REBUILD_HINT}"
        ) from exc
    built = _C.build_info()["torch_version"]
    if _base_version(built) != _base_version(torch.__version__):
        raise _mismatch(built, torch.__version__)
    return _C


def extension():
    """torchmem._C, loaded and checked on the first call."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                _module = load_extension()
    return _module


def __getattr__(name):
    if name == "_C":
        return extension()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_info():
    """What the compiled module was built against: torch and CUDA versions,
    whether the CUDA backends (vmm, cuda_malloc) and the allocator shim were
    compiled, and compiler flags of note. Safe without a GPU."""

    info = dict(extension().build_info())
    info["torch_runtime_version"] = torch.__version__
    return info


def is_installed():
    """True when torchmem's pool is PyTorch's current CUDA allocator in this process.

    Never loads the compiled module: install() loads it, so while it is not
    loaded torchmem cannot be installed. A CPU-only build has no runtime."""
    module = _module
    if module is None or not module.build_info()["cuda_backends"]:
        return False
    return bool(module.runtime_is_installed())
