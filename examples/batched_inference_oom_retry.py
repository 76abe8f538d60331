"""Batched inference that never dies of OOM: @torchmem.oom_retry splits the
batch, joins the results, remembers the working size and grows back when
memory frees up.

    python examples/batched_inference_oom_retry.py            # H200: GPT-2 small, 4096 sequences, 8 GiB budget
    python examples/batched_inference_oom_retry.py --limit 4GiB

Prints the chunk sizes tried on each call: the first call OOMs and shrinks,
the second starts at the remembered size (no OOM), and after the budget is
raised the third starts again from the whole batch. Without a GPU it says so
and runs a tiny CPU version whose function raises OOM above 300 rows.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NEEDS = ("Needs a CUDA GPU with more memory than --raised-limit (64 GiB by default: an H200, H100 or "
         "A100-80GB; pass a smaller --raised-limit on a smaller card) and torchmem built with CUDA. Without a "
         "GPU it runs a tiny CPU version whose function raises OOM above 300 rows.")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=NEEDS)
    parser.add_argument("--limit", default="8GiB",
                        help="torchmem budget for the first two calls (default: %(default)s)")
    parser.add_argument("--raised-limit", default="64GiB",
                        help="budget for the third call, to show it grows back (default: %(default)s)")
    parser.add_argument("--sequences", type=int, default=4096, help="sequences to score (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (default: %(default)s)")
    args = parser.parse_args(argv)

    import torch
    import torchmem
    from tiny_gpt import GPT, GPTConfig, synthetic_tokens, tiny

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torchmem.install(limit=args.limit)
        cfg, device = GPTConfig(seq=args.seq), "cuda"
        print(f"torchmem installed with limit {args.limit}")
    else:
        print("No CUDA GPU: running a tiny CPU version; the scoring function raises OOM above 300 rows.")
        cfg, device = tiny(), "cpu"
        args.sequences = min(args.sequences, 1024)
    model = GPT(cfg).to(device).eval()
    if on_gpu:
        model = model.to(torch.bfloat16)
    tried = []
    cpu_rows_that_fit = [300]  # the CPU version's simulated budget

    @torchmem.oom_retry
    def score(ids):
        """Per-sequence mean log-likelihood (one value per row: joinable)."""
        tried.append(ids.shape[0])
        if not on_gpu and ids.shape[0] > cpu_rows_that_fit[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated)")
        with torch.no_grad():
            logits = model(ids[:, :-1]).float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return logp.mean(dim=1)

    data = synthetic_tokens(args.sequences, cfg, torch.Generator().manual_seed(0), device)
    results = []
    for call in range(3):
        if call == 2:
            if on_gpu:
                total = torch.cuda.get_device_properties(0).total_memory
                from torchmem.runtime.config import Config
                raised = Config(limit=args.raised_limit).limit_bytes(total)
                torch.cuda.set_per_process_memory_fraction(raised / total)
                print(f"budget raised to {raised / 2**30:.0f} GiB")
            else:
                print("simulated budget raised to 1024 rows; CPU has no free-memory figure to key on, "
                      "so the remembered size is forgotten by hand (score.reset_sizes())")
                cpu_rows_that_fit[0] = 1024
                score.reset_sizes()
        tried.clear()
        start = time.perf_counter()
        out = score(data)
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        results.append(out)
        sizes = sorted(set(tried), reverse=True)
        print(f"call {call}: {len(tried)} chunks, sizes tried {sizes}, remembered {score.remembered_size()}, "
              f"{args.sequences / elapsed:.0f} sequences/s, result shape {tuple(out.shape)}")
    same = all(torch.allclose(results[0], r, atol=1e-2) for r in results[1:])
    print(f"results agree across chunkings: {same}")
    return 0 if same and results[0].shape[0] == args.sequences else 1


if __name__ == "__main__":
    sys.exit(main())
