"""The GPU demo's model and its no-GPU answer (the training itself runs on the
H200: bench/gpu_run.sh's `demo` job)."""

import math

import pytest
import torch

from torchmem.cli import demo_train


def test_demo_model_starts_at_the_loss_of_a_uniform_guess():
    torch.manual_seed(0)
    vocab = 1000
    model = demo_train.build_model(torch, vocab, width=64, layers=2, heads=2, max_seq=64)
    ids = torch.randint(0, vocab, (4, 33))
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    # GPT-2's N(0, 0.02) init: near ln(vocab) (N(0, 1) embeddings gave ~30x that)
    assert abs(loss.item() - math.log(vocab)) < 1.0, loss.item()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_demo_without_a_gpu_says_so(capsys):
    assert demo_train.main(None) == 1
    assert "no CUDA GPU here" in capsys.readouterr().out
