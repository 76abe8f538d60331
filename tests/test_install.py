"""torchmem.install() and the runtime bindings on a machine without a GPU:
errors come in the right order with messages that say what to do, and the
runtime's config parsing rejects bad values. (Swapping the allocator for real
is covered by tests/gpu/test_gpu_allocator.py on the GPU.)"""

import pytest
import torch

import torchmem
from torchmem import _C
from support import run_python

needs_cuda_build = pytest.mark.skipif(not _C.build_info()["cuda_backends"], reason="torchmem built without CUDA")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def test_bad_option_is_a_value_error_before_anything_else():
    for bad in (dict(limit=-1), dict(backend="magic"), dict(no_such_option=1), dict(reclaim_slack="lots")):
        with pytest.raises(ValueError, match="torchmem config"):
            torchmem.install(**bad)
    assert not torchmem.is_installed()


@no_gpu
def test_no_gpu_is_a_clear_runtime_error():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        torchmem.install()
    assert not torchmem.is_installed()
    from torchmem.installer import mem_pool_allocator

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        mem_pool_allocator()


def test_install_module_stays_callable_after_submodule_import():
    proc = run_python(
        """
        import torchmem
        from torchmem.installer import is_installed  # binds the module to torchmem.install
        try:
            torchmem.install(limit=-5)
        except ValueError as exc:
            print("ValueError", exc)
        """
    )
    assert "ValueError torchmem config 'limit'" in proc.stdout


@needs_cuda_build
def test_runtime_bindings_exist():
    for name in ("runtime_allocator_initialized", "runtime_install", "runtime_configure", "runtime_is_installed",
                 "runtime_devices", "runtime_stats", "runtime_reset_peak_stats", "runtime_reset_accumulated_stats",
                 "runtime_snapshot", "runtime_empty_cache", "runtime_set_limit", "runtime_limit",
                 "runtime_set_trace_capacity", "runtime_set_oom_callback", "runtime_set_context_provider",
                 "runtime_check_invariants", "runtime_probe_backend"):
        assert callable(getattr(_C, name)), name
    assert _C.runtime_devices() == []
    assert _C.runtime_empty_cache() == 0


@needs_cuda_build
def test_runtime_config_parsing_errors_name_the_key():
    # In a subprocess: a successful configure fixes the config for the process.
    proc = run_python(
        """
        from torchmem import _C
        cases = [({"limit": 1.5}, "auto"), ({"limit": "lots"}, "auto"), ({"limit_bytes": 5}, "auto"),
                 ({"oom_hook_retries": -1}, "auto"), ({"limit": None}, "magic"), ({"no_such_key": 1}, "auto")]
        for options, backend in cases:
            try:
                _C.runtime_configure(options, backend)
            except ValueError as exc:
                print("ValueError:", exc)
            else:
                print("ACCEPTED", options, backend)
        assert not _C.runtime_is_configured()
        _C.runtime_configure({"limit": 0.5, "oom_hook_retries": 2}, "cuda_malloc")
        _C.runtime_configure({"limit": 0.5, "oom_hook_retries": 2}, "cuda_malloc")  # same: fine
        assert _C.runtime_is_configured()
        _C.runtime_set_oom_callback(lambda device, requested: False)
        _C.runtime_set_oom_callback(None)
        _C.runtime_set_context_provider(lambda: 7)
        _C.runtime_set_context_provider(None)
        print("DONE")
        """
    )
    assert "ACCEPTED" not in proc.stdout, proc.stdout
    assert proc.stdout.count("ValueError:") == 6, proc.stdout
    for key in ("'limit'", "limit_bytes", "oom_hook_retries", "magic", "no_such_key"):
        assert key in proc.stdout, key
    assert "DONE" in proc.stdout
