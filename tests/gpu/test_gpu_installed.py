"""One answer to "is torchmem installed?" on a real GPU, and TORCHMEM_CONF read by every Config.

torchmem._loader.is_installed() is what install(), stats, hooks, patch, the batch
controller's probe and the training-loop figures all ask; it never loads the
compiled module itself. Each test runs in a fresh interpreter (tests/support.py).
"""

import json

import pytest

from support import run_python

pytestmark = pytest.mark.gpu


def test_every_part_sees_the_install_through_one_answer():
    proc = run_python(
        """
        import json, sys
        import torch, torchmem
        before = {"is_installed": torchmem.is_installed(), "C_loaded": "torchmem._C" in sys.modules}
        cfg = torchmem.install()
        from torchmem._loader import is_installed
        from torchmem.batch.probe import default_probe
        from torchmem.integrations import figures
        from torchmem.runtime import patch
        x = torch.empty(1 << 20, device="cuda")
        after = {
            "is_installed": torchmem.is_installed(),
            "same_function": torchmem.is_installed is is_installed,
            "probe": type(default_probe()).__name__,
            "patched_stats_answer": torch.cuda.memory_allocated() == torchmem.memory_allocated(),
            "figures_from_torchmem": figures._installed(),
            "limit": cfg.limit,
        }
        print(json.dumps({"before": before, "after": after}))
        """,
        env={"TORCHMEM_CONF": "limit=0.5"},
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["before"] == {"is_installed": False, "C_loaded": False}
    after = result["after"]
    assert after["is_installed"] and after["same_function"] and after["figures_from_torchmem"]
    assert after["probe"] == "TorchmemProbe" and after["patched_stats_answer"]
    assert after["limit"] == 0.5  # install() read TORCHMEM_CONF, as Config() does
