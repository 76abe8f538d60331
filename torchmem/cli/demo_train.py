"""The GPU demo: train a small GPT-style model with torchmem installed.

``python -m torchmem demo`` calls ``main(args)`` when a GPU is present. It
installs torchmem, trains a decoder-only transformer built from plain torch
(no downloads) for ~30 steps with a random batch size and sequence length per
step (the shape churn that fragments PyTorch's native cache), and prints loss,
step time and torchmem's peak requested / reserved bytes and their ratio, in
lines of at most 100 columns. Under a minute on an H200.
"""

import argparse
import random
import textwrap
import time

import torch

import torchmem
from torchmem._loader import extension
from torchmem.cli.options import LIMIT_HELP
from torchmem.cli.options import parse_limit

WIDTH = 100  # columns of every printed line


def build_model(torch, vocab, width, layers, heads, max_seq):
    """A GPT-style decoder: token + position embeddings, causal pre-norm blocks, tied head."""
    nn = torch.nn

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Embedding(max_seq, width)
            block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            # GPT-2's initialization: the head is tied to the token embedding, and
            # nn.Embedding's N(0, 1) would start the loss near 30x ln(vocab).
            nn.init.normal_(self.tokens.weight, std=0.02)
            nn.init.normal_(self.positions.weight, std=0.02)

        def forward(self, ids):
            seq = ids.shape[1]
            x = self.tokens(ids) + self.positions(torch.arange(seq, device=ids.device))
            mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
            x = self.blocks(x, mask=mask, is_causal=True)
            return self.norm(x) @ self.tokens.weight.T

    return GPT()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="torchmem demo (GPU)", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser):
    """Options of the GPU demo (the CLI's `demo` command adds these)."""

    parser.add_argument("--steps", type=int, default=30, help="training steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the shapes (default: %(default)s)")
    parser.add_argument("--width", type=int, default=768, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=24,
                        help="largest batch; each step draws one in 1..this (default: %(default)s)")
    parser.add_argument("--max-seq", type=int, default=1024,
                        help="longest sequence; each step draws one in 32..this (default: %(default)s)")
    parser.add_argument("--limit", default=None, metavar="BUDGET",
                        help="torchmem's " + LIMIT_HELP.replace("%", "%%").replace("the device", "the GPU"))


def _option(args, name, default):
    return getattr(args, name, default) if args is not None else default


def main(args=None):
    """Trains with torchmem installed; returns a process exit code."""


    steps = _option(args, "steps", 30)
    seed = _option(args, "seed", 0)
    width = _option(args, "width", 768)
    layers = _option(args, "layers", 8)
    max_batch = _option(args, "max_batch", 24)
    max_seq = _option(args, "max_seq", 1024)
    limit = _option(args, "limit", None)

    if not torch.cuda.is_available():
        print("torchmem demo: no CUDA GPU here; run `python -m torchmem demo` for the trace replay instead")
        return 1

    options = {"warn_unsupported": False}
    if limit is not None:
        options["limit"] = parse_limit(limit)
    config = torchmem.install(**options)
    device = torch.cuda.current_device()
    print(f"torchmem installed on {torch.cuda.get_device_name(device)}, backend {extension().runtime_backend_name(device)}")
    print(textwrap.fill(f"config: {config!r}", width=WIDTH, subsequent_indent="  "))

    rng = random.Random(seed)
    torch.manual_seed(seed)
    vocab = 32000
    model = build_model(torch, vocab, width, layers, max(1, width // 64), max_seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"{layers} layers x {width} wide; batch 1..{max_batch} x seq 32..{max_seq} per step")

    times = []
    for step in range(steps):
        batch, seq = rng.randint(1, max_batch), rng.randint(32, max_seq)
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  batch {batch:3d} x seq {seq:5d}  loss {float(loss.detach()):7.3f}  {elapsed * 1e3:7.1f} ms")
        del logits, loss, ids

    times.sort()
    for line in summary_lines(extension().runtime_stats(device), steps, times[len(times) // 2]):
        print(line)
    return 0


def summary_lines(stats, steps, median_step_s):
    """The closing figures from the pool's stats (_C.runtime_stats), each explained, in GiB."""
    requested = stats["requested_bytes"]["all"]["peak"]
    allocated = stats["allocated_bytes"]["all"]["peak"]
    reserved = stats["reserved_bytes"]["all"]["peak"]
    gib = float(1 << 30)
    return [
        f"after {steps} steps (median step {median_step_s * 1e3:.1f} ms), torchmem's peaks:",
        f"  requested  {requested / gib:8.3f} GiB  the most the model asked for at once",
        f"  allocated  {allocated / gib:8.3f} GiB  the same, in torchmem's 512 B blocks",
        f"  reserved   {reserved / gib:8.3f} GiB  held from the GPU by the pool",
        f"  reserved / requested {reserved / max(requested, 1):.3f} (1.000 = no memory wasted)",
        f"  {stats['num_device_alloc']:,} granules/segments created (driver calls), "
        f"{stats.get('num_reclaims', 0):,} granules stitched from free space",
        f"  {stats['num_alloc_retries']:,} allocations released cached memory and retried; "
        f"{stats['num_ooms']:,} failed (OOM)",
    ]


if __name__ == "__main__":
    raise SystemExit(main(parse_args()))
