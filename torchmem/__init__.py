"""torchmem: a fragmentation-aware GPU memory manager for PyTorch.

Call ``torchmem.install()`` right after ``import torch`` to replace PyTorch's CUDA
caching allocator with torchmem's pool. Everything else (stats, snapshots, leak
checks, OOM hooks, the adaptive batch-size controller, the OOM auto-retry
decorator) is imported from here too. Importing torchmem never initializes CUDA.

Names are loaded on first use, so ``import torchmem`` stays cheap, the compiled
module torchmem._C loads only when a name that needs it is used (config, batch
and retry work without a build), and a part that needs an optional dependency
(Lightning, transformers, matplotlib) costs nothing until it is used.
"""

import importlib
import sys
import types

import torch  # noqa: F401  (loads the libraries torchmem._C links against, for a direct `import torchmem._C`)

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    # allocator
    "install": "torchmem.installer",
    "is_installed": "torchmem._loader",
    "build_info": "torchmem._loader",
    "Config": "torchmem.runtime.config",
    # stats and torch compatibility
    "memory_stats": "torchmem.runtime.stats",
    "memory_allocated": "torchmem.runtime.stats",
    "memory_reserved": "torchmem.runtime.stats",
    "max_memory_allocated": "torchmem.runtime.stats",
    "max_memory_reserved": "torchmem.runtime.stats",
    "reset_peak_memory_stats": "torchmem.runtime.stats",
    "memory_summary": "torchmem.runtime.stats",
    "empty_cache": "torchmem.runtime.stats",
    "patch_torch": "torchmem.runtime.patch",
    "unpatch_torch": "torchmem.runtime.patch",
    # snapshots, history, leaks, hooks
    "snapshot": "torchmem.runtime.snapshots",
    "dump_snapshot": "torchmem.runtime.snapshots",
    "record_history": "torchmem.runtime.snapshots",
    "leak_check": "torchmem.runtime.leak",
    "LeakError": "torchmem.runtime.leak",
    "on_oom": "torchmem.runtime.hooks",
    "remove_oom_hook": "torchmem.runtime.hooks",
    # batch size and OOM retry
    "BatchSizeController": "torchmem.batch",
    "oom_retry": "torchmem.batch.retry",
    "is_oom_error": "torchmem.batch.retry",
    # host memory: the pinned pool (a submodule) and activation offload
    "host": None,
    "offload_activations": "torchmem.host.offload",
    "OffloadActivations": "torchmem.host.offload",
    # watching and sharing
    "serve_metrics": "torchmem.monitor",
}

__all__ = ["__version__"] + sorted(_LAZY)

# Module paths from before the subpackages -> where that code lives now. Scripts
# and test harnesses name them (PyTorch's peer-suite runner calls
# importlib.import_module("torchmem.install").installed_config()), so each stays
# importable: an alias module that loads its target on first attribute use.
# Where an old path and a public function share a name (install, snapshot), the
# attribute torchmem.NAME is the function and the import path is the alias.
_MOVED = {
    "install": "torchmem.installer",
    "config": "torchmem.runtime.config",
    "patch": "torchmem.runtime.patch",
    "stats": "torchmem.runtime.stats",
    "hooks": "torchmem.runtime.hooks",
    "snapshot": "torchmem.runtime.snapshots",
    "snapshot_format": "torchmem.runtime.snapshot_format",
    "stacks": "torchmem.runtime.stacks",
    "leak": "torchmem.runtime.leak",
    "torch_alloc_conf": "torchmem.runtime.torch_alloc_conf",
    "trace": "torchmem.analysis.trace",
    "replay": "torchmem.analysis.replay",
    "patterns": "torchmem.analysis.patterns",
    "plot": "torchmem.analysis.plot",
    "offload": "torchmem.host.offload",
    "retry": "torchmem.batch.retry",
    "demo_train": "torchmem.cli.demo_train",
}


def _alias(old, target):
    module = types.ModuleType(f"torchmem.{old}", f"Moved to {target}; this name loads it on first use.")
    module.__getattr__ = lambda attr: getattr(importlib.import_module(target), attr)
    module.__dir__ = lambda: dir(importlib.import_module(target))
    return module


for _old, _target in _MOVED.items():
    sys.modules.setdefault(f"torchmem.{_old}", _alias(_old, _target))
del _old, _target


def __getattr__(name):
    if name not in _LAZY:
        if name in _MOVED:  # `import torchmem.patch` binds no attribute: the alias is found here
            return sys.modules[f"torchmem.{name}"]
        raise AttributeError(f"module 'torchmem' has no attribute {name!r}")
    module_name = _LAZY[name]
    if module_name is None:  # a submodule: torchmem.host
        value = importlib.import_module(f"torchmem.{name}")
    else:
        value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
