"""What torchmem takes from PyTorch's own PYTORCH_ALLOC_CONF (torchmem/runtime/torch_alloc_conf.py)."""

import pytest

from torchmem.runtime import torch_alloc_conf


def test_pairs_keep_bracketed_lists_whole():
    text = "expandable_segments:True, roundup_power2_divisions:[256:1,512:2,>:4],per_process_memory_fraction:0.5"
    assert torch_alloc_conf.parse_pairs(text) == {
        "expandable_segments": "True", "roundup_power2_divisions": "[256:1,512:2,>:4]",
        "per_process_memory_fraction": "0.5"}


@pytest.mark.parametrize("value, wanted", [("0.0", 0.0), ("0.5", 0.5), ("1", 1.0)])
def test_fraction_is_read_from_either_name(value, wanted):
    assert torch_alloc_conf.memory_fraction({"PYTORCH_CUDA_ALLOC_CONF": f"per_process_memory_fraction:{value}"}) == wanted
    assert torch_alloc_conf.memory_fraction({"PYTORCH_ALLOC_CONF": f"per_process_memory_fraction:{value}"}) == wanted


def test_the_newer_name_wins_as_in_torch():
    env = {"PYTORCH_ALLOC_CONF": "per_process_memory_fraction:0.25",
           "PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.75"}
    assert torch_alloc_conf.memory_fraction(env) == 0.25


def test_no_fraction_named():
    assert torch_alloc_conf.memory_fraction({}) is None
    assert torch_alloc_conf.memory_fraction({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is None


@pytest.mark.parametrize("value", ["-0.1", "1.1", "half", "nan"])
def test_a_bad_fraction_is_refused_in_torchs_words(value):
    with pytest.raises(ValueError, match=r"PYTORCH_CUDA_ALLOC_CONF: per_process_memory_fraction is invalid, "
                                         r"set it in \[0.0, 1.0\]"):
        torch_alloc_conf.memory_fraction({"PYTORCH_CUDA_ALLOC_CONF": f"per_process_memory_fraction:{value}"})
