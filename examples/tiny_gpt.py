"""A GPT-2-style decoder in plain torch, shared by the batch-size examples and
bench/batch_compare.py (no downloads, no transformers).

GPT-2 small is `GPTConfig()` (124M parameters at vocab 50257); `tiny()` is a
CPU-sized version. Causal attention uses scaled_dot_product_attention.
"""

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 50257
    seq: int = 1024
    width: int = 768
    layers: int = 12
    heads: int = 12


def tiny():
    return GPTConfig(vocab=512, seq=64, width=64, layers=2, heads=4)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for block in self.blocks:
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.T

    def loss(self, ids):
        """Next-token cross-entropy, mean over the micro-batch's tokens."""
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def synthetic_tokens(n, cfg, generator=None, device="cpu"):
    """Token sequences with learnable structure (a noisy repeating pattern), so loss falls fast."""
    start = torch.randint(0, cfg.vocab, (n, 1), generator=generator)
    step = torch.randint(1, 7, (n, 1), generator=generator)
    ids = (start + step * torch.arange(cfg.seq + 1)) % cfg.vocab
    noise = torch.rand(ids.shape, generator=generator) < 0.05
    ids = torch.where(noise, torch.randint(0, cfg.vocab, ids.shape, generator=generator), ids)
    return ids.to(device)


def example_args(description, argv=None, steps=30, needs=None):
    """The options every training example takes: the torchmem budget, steps,
    global batch and sequence length. `needs`: what the example needs to run,
    shown at the end of --help."""
    import argparse

    parser = argparse.ArgumentParser(description=description, epilog=needs)
    parser.add_argument("--limit", default="24GiB",
                        help="torchmem memory budget: a size such as 24GiB, or a fraction of the GPU such as 0.5 "
                             "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=steps, help="training steps (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=64,
                        help="samples per optimizer step, kept whatever the micro-batch (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default: %(default)s)")
    return parser.parse_args(argv)
