"""The extension builds, imports without a GPU and reports what it was built with."""

import subprocess
import sys

import torch

import torchmem
from support import REPO, run_python


def test_build_info_matches_installed_torch():
    info = torchmem.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert info["cuda_backends"] == (info["cuda_version"] is not None)
    if info["cuda_backends"]:
        assert torch.version.cuda is not None
    assert info["optimized"] is (not info["debug"])
    assert info["cplusplus"] >= 201703


def test_import_does_not_initialize_cuda():
    proc = run_python(
        """
        import torch, torchmem
        torchmem.build_info()
        print(torch.cuda.is_initialized())
        """
    )
    assert proc.stdout.strip() == "False"


def test_mismatched_torch_build_fails_with_rebuild_hint():
    proc = run_python(
        """
        import torchmem._C as C
        import torchmem._loader as loader
        real = C.build_info
        C.build_info = lambda: dict(real(), torch_version="1.0.0")
        loader.load_extension()
        """,
        check=False,
    )
    assert proc.returncode != 0
    assert "built against torch 1.0.0" in proc.stderr
    assert "pip install --no-build-isolation -e ." in proc.stderr


def test_cli_says_in_one_line_which_torch_the_module_was_built_for():
    # A wheel or build for another torch: `python -m torchmem ...` prints one line, no traceback.
    proc = run_python(
        """
        import sys
        import torchmem._C as C
        real = C.build_info
        C.build_info = lambda: dict(real(), torch_version="1.0.0+cu118")
        from torchmem.cli import main
        sys.exit(main(["info"]))
        """,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("torchmem info: error: torchmem._C was built against torch 1.0.0+cu118, but torch ")
    assert "Install torch==1.0.0" in line and "pip install --no-build-isolation -e ." in line


def test_a_module_that_cannot_load_names_the_torch_it_was_built_for():
    # Against another torch's ABI the import itself fails (undefined symbol): the version
    # comes from torchmem/_built_with.py, which setup.py writes beside the module.
    proc = run_python(
        """
        import sys, types
        sys.modules["torchmem._C"] = None
        sys.modules["torchmem._built_with"] = types.SimpleNamespace(TORCH_VERSION="1.0.0")
        from torchmem.cli import main
        sys.exit(main(["info"]))
        """,
        check=False,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert "torchmem._C was built against torch 1.0.0" in line and "cannot load" in line


def test_the_build_records_the_torch_it_was_built_against():
    from torchmem import _loader

    assert _loader.built_for() == torchmem.build_info()["torch_version"]


def test_cli_info_prints_build_info():
    out = subprocess.run([sys.executable, "-m", "torchmem", "info"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert '"torch_version"' in out


def test_unknown_attribute_is_an_attribute_error():
    try:
        torchmem.no_such_thing
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_pure_python_parts_work_without_the_compiled_module():
    # sys.modules[...] = None makes `from torchmem import _C` fail as a missing build would.
    proc = run_python(
        """
        import sys
        sys.modules["torchmem._C"] = None
        import torch, torchmem
        assert "torchmem._C" not in sys.modules or sys.modules["torchmem._C"] is None
        torchmem.Config(limit="8GiB")
        assert not torchmem.is_installed()
        from torchmem.batch import BatchSizeController, NullProbe
        BatchSizeController(8, model=torch.nn.Linear(2, 1), probe=NullProbe())
        torchmem.oom_retry(lambda x: x)
        try:
            torchmem.build_info()
        except ImportError as exc:
            print(exc)
        """
    )
    assert "could not be loaded" in proc.stdout and "pip install --no-build-isolation -e ." in proc.stdout
