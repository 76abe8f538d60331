"""The examples tell the truth and say what they need: every runnable example's
--help says it needs a CUDA GPU (and what else), and the CPU version of
gpt2_finetune_budget.py describes what its controller really does there."""

import importlib.util
import os

import pytest
import torch

from support import REPO

EXAMPLES = ("gpt2_finetune_budget", "batched_inference_oom_retry", "hf_trainer_example", "lightning_example")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_says_what_the_example_needs(name, capsys):
    module = _load(name)
    entry = module.parse_args if hasattr(module, "parse_args") else module.main
    with pytest.raises(SystemExit) as info:
        entry(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Needs a CUDA GPU with more memory than" in text and "torchmem built with CUDA" in text
    assert "(default:" in text  # every option says its default
    if name in ("hf_trainer_example", "lightning_example"):
        assert "pip install" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU version runs only without a GPU")
def test_the_cpu_version_says_what_the_controller_does(capsys):
    module = _load("gpt2_finetune_budget")
    assert module.main(["--steps", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    story = out.split("model:")[0]
    assert "halves the micro-batch" in story and "after 32 and 16 fail it runs 8" in story
    # ... and that is what happened: the two shrinks first, then the split next to it is timed
    assert "decisions: [(0, 'shrink', 32, 16), (0, 'shrink', 16, 8), " in out
    assert "'try'" in out
    assert "final micro-batch: 8 (x 4 accumulation = 32)" in out
