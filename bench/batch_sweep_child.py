"""One process of bench/batch_sweep.py: one model, one allocator, one method.

An allocator is chosen once per process (torchmem.install before CUDA starts,
or torch's own capped with set_per_process_memory_fraction), so the parent
runs each (model, allocator, method) here and reads the RESULT line this
prints. With --smoke there is no allocator to keep apart (the CPU), and one
process runs every job it is given (--jobs), a RESULT line each. The
workloads:

- gpt2:  transformers' GPT2LMHeadModel from GPT2Config() (124M), seq 512, fp32
  weights under bf16 autocast, fused AdamW.
- llama: transformers' LlamaForCausalLM from a LlamaConfig of ~0.5B (width
  1536, 16 layers, 12 heads over 4 KV heads, MLP 4096, vocab 32000), seq 512,
  FSDP2 on one rank: fully_shard on each decoder layer and on the root with
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), AdamW; the
  process group is a one-rank group over an in-process store.

Every method trains on synthetic tokens at the same global batch and times
steps the same way: torch.cuda.synchronize() around each step, samples/s =
global batch / median step. With --smoke the models are tiny, everything runs
on the CPU, and the budget is a size limit (a forward pre-hook raises
torch.OutOfMemoryError above --smoke-fit samples): the plumbing, not the
figures.
"""

import argparse
import gc
import json
import statistics
import sys
import time

GiB = 1 << 30


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", required=True,
                        help="MODEL:ALLOCATOR:METHOD:BUDGET, comma-separated (one, except with --smoke); "
                             "models gpt2, llama; allocators torchmem, native; methods sweep, throughput, "
                             "largest, accelerate, lightning; budget e.g. 16GiB")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--grid", default="6:64:2", help="fixed micro-batches: START:STOP:STEP or a list 8,16,24")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per fixed size")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per fixed size and per method")
    parser.add_argument("--settle-steps", type=int, default=10, help="controller steps before the timed ones")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--smoke-fit", type=int, default=3)
    return parser.parse_args(argv)


def parse_bytes(text):
    text = text.strip()
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("GB", 10**9), ("MB", 10**6)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def grid(spec, global_batch):
    if ":" in spec:
        start, stop, step = (int(x) for x in spec.split(":"))
        sizes = list(range(start, stop + 1, step))
    else:
        sizes = [int(x) for x in spec.split(",")]
    return [m for m in sizes if 1 <= m <= global_batch]


class Workload:
    """The model, its optimizer and batches; loss(ids) is one micro-step's mean loss."""

    def __init__(self, args):
        import torch
        self.torch = torch
        self.args = args
        self.device = "cpu" if args.smoke else "cuda"
        torch.manual_seed(0)
        if args.model == "gpt2":
            self._gpt2()
        else:
            self._llama()
        generator = torch.Generator().manual_seed(1)
        self.batches = [torch.randint(0, self.vocab, (args.global_batch, args.seq), generator=generator)
                        .to(self.device) for _ in range(4)]
        if args.smoke:  # the "budget": more than smoke_fit samples at once run out of memory
            def limit(module, positional, kwargs):
                ids = kwargs.get("input_ids", positional[0] if positional else None)
                if ids is not None and ids.shape[0] > args.smoke_fit:
                    raise torch.OutOfMemoryError(f"CUDA out of memory. (smoke budget: {ids.shape[0]} samples)")
            self.model.register_forward_pre_hook(limit, with_kwargs=True)

    def _gpt2(self):
        from transformers import GPT2Config, GPT2LMHeadModel
        torch = self.torch
        config = (GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=self.args.seq)
                  if self.args.smoke else GPT2Config(n_positions=max(1024, self.args.seq)))
        config.use_cache = False
        self.vocab = config.vocab_size
        with torch.device(self.device):  # built where it trains: no copy, no slow CPU init
            self.model = GPT2LMHeadModel(config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=not self.args.smoke)
        self.autocast = not self.args.smoke

    def _llama(self):
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM
        torch = self.torch
        if self.args.smoke:
            config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=self.args.seq)
        else:
            config = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                                 num_attention_heads=12, num_key_value_heads=4,
                                 max_position_embeddings=max(2048, self.args.seq))
        config.use_cache = False
        self.vocab = config.vocab_size
        if not dist.is_initialized():
            dist.init_process_group("gloo" if self.args.smoke else "nccl", store=dist.HashStore(), rank=0,
                                    world_size=1)
        with torch.device(self.device):
            model = LlamaForCausalLM(config)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if not self.args.smoke else None,
                                      reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        self.autocast = False  # FSDP's policy casts the parameters

    def loss(self, ids):
        torch = self.torch
        if self.autocast:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self.model(input_ids=ids, labels=ids).loss
        return self.model(input_ids=ids, labels=ids).loss

    def batch(self, step):
        return self.batches[step % len(self.batches)]

    def fsdp_roots(self):
        from torchmem.batch.parallel import fsdp_roots
        return fsdp_roots(self.model)

    def fixed_step(self, micro, step):
        """One optimizer step at a fixed micro-batch, [m, m, ..., rest], accumulated to the
        global batch; under FSDP2 gradients sync on the last micro-step only."""
        batch = self.batch(step)
        total = batch.shape[0]
        chunks = batch.split(micro)
        roots = self.fsdp_roots()
        for index, chunk in enumerate(chunks):
            for root in roots:
                root.set_requires_gradient_sync(index == len(chunks) - 1)
            (self.loss(chunk) * (chunk.shape[0] / total)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def synchronize(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def timed(self, step_fn, steps, first=0):
        """Seconds of each of `steps` synchronized steps."""
        times = []
        for i in range(steps):
            self.synchronize()
            start = time.perf_counter()
            step_fn(first + i)
            self.synchronize()
            times.append(time.perf_counter() - start)
        return times

    def rate(self, times):
        return self.args.global_batch / statistics.median(times)

    def clean_after_oom(self):
        from torchmem.batch.parallel import GradSync
        GradSync(self.model, "fsdp" if self.fsdp_roots() else "none").reset_after_oom()
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


def run_sweep(args, work):
    """Every fixed micro-batch of the grid; after two sizes in a row run out of memory,
    larger ones are not tried."""
    torch = work.torch
    by_micro, failed_in_a_row = {}, 0
    for micro in grid(args.grid, args.global_batch):
        oom = False
        try:
            work.timed(lambda i: work.fixed_step(micro, i), args.warmup)
            rate = work.rate(work.timed(lambda i: work.fixed_step(micro, i), args.steps, args.warmup))
        except torch.OutOfMemoryError:
            oom = True
        if oom:
            work.clean_after_oom()
            by_micro[micro] = None
            failed_in_a_row += 1
            if failed_in_a_row >= 2:
                break
            continue
        failed_in_a_row = 0
        by_micro[micro] = rate
        work.clean_after_oom()  # each size starts from an empty cache, as a run at that size would
    fitting = {m: r for m, r in by_micro.items() if r is not None}
    best = max(fitting, key=fitting.get) if fitting else None
    return {"by_micro": {str(m): r for m, r in by_micro.items()}, "micro": best,
            "samples_per_s": fitting.get(best), "ooms": sum(r is None for r in by_micro.values())}


def settle_step(history):
    """The step after which the micro-batch did not change again (1-based)."""
    return next(i for i in range(len(history)) if len(set(history[i:])) == 1) + 1


def run_controller(args, work, objective):
    from torchmem.batch import BatchSizeController
    ctl = BatchSizeController(args.global_batch, model=work.model, optimizer=work.optimizer, objective=objective)
    history = []

    def step_fn(i):
        ctl.run(work.loss, work.batch(i))
        ctl.step()
        history.append(ctl.micro_batch)

    for i in range(args.settle_steps):
        step_fn(i)
    times = work.timed(step_fn, args.steps, args.settle_steps)
    figures = ctl.figures()
    return {"micro": ctl.micro_batch, "micro_steps": ctl.accumulation_steps, "steps_to_settle": settle_step(history),
            "ooms": ctl.ooms, "samples_per_s": work.rate(times), "history": history,
            "controller_samples_per_s": figures.get("samples_per_s"),
            "decisions": [(e["step"], e["event"], e["from"], e["to"], e["reason"]) for e in ctl.events]}


def run_accelerate(args, work):
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return {"skipped": "accelerate is not installed"}
    trials, steps_run = [], [0]

    @find_executable_batch_size(starting_batch_size=args.global_batch)
    def train(batch_size):
        trials.append(batch_size)  # Accelerate restarts the function on each OOM
        work.clean_after_oom()
        work.optimizer.state.clear()
        for step in range(3):
            steps_run[0] += 1
            work.fixed_step(batch_size, step)
        return batch_size

    micro = train()
    times = work.timed(lambda i: work.fixed_step(micro, i), args.steps, 3)
    return {"micro": micro, "steps_to_settle": steps_run[0] - 2, "ooms": len(trials) - 1,
            "samples_per_s": work.rate(times), "trials": trials}


def run_lightning(args, work):
    try:
        import lightning as L
        from lightning.pytorch.tuner import Tuner
    except ImportError:
        return {"skipped": "lightning is not installed"}
    torch = work.torch

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            return work.batches[0][i % args.global_batch].cpu()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2
            self.net = work.model

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Data(), batch_size=self.batch_size)

        def training_step(self, batch, batch_idx):
            return self.net(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    trainer = L.Trainer(accelerator="cpu" if args.smoke else "gpu", devices=1,
                        precision="32-true" if args.smoke else "bf16-mixed", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    found = Tuner(trainer).scale_batch_size(Module(), mode="power", init_val=2, steps_per_trial=3, max_trials=25)
    found = min(found, args.global_batch)
    work.model.to(work.device)  # the Trainer's teardown moved the module to the CPU
    work.clean_after_oom()
    trials, size = 1, 2
    while size <= found:  # every power of two from 2 up to the first that failed
        trials += 1
        size *= 2
    times = work.timed(lambda i: work.fixed_step(found, i), args.steps)
    return {"micro": found, "steps_to_settle": 3 * trials, "ooms": 1 if found < args.global_batch else 0,
            "samples_per_s": work.rate(times)}


RUNNERS = {"sweep": run_sweep, "throughput": lambda args, work: run_controller(args, work, "throughput"),
           "largest": lambda args, work: run_controller(args, work, "largest"), "accelerate": run_accelerate,
           "lightning": run_lightning}


def main(argv=None):
    args = parse_args(argv)
    jobs = [job.split(":") for job in args.jobs.split(",")]
    if len(jobs) > 1 and not args.smoke:
        raise SystemExit("batch_sweep_child: one job per process on the GPU (the allocator is chosen once)")
    import torch
    if args.smoke:
        torch.set_num_threads(1)  # a CI machine's cores are shared: spinning OpenMP threads cost seconds a step
    for model, allocator, method, budget in jobs:
        if method not in RUNNERS or allocator not in ("torchmem", "native") or model not in ("gpt2", "llama"):
            raise SystemExit(f"batch_sweep_child: unknown job {model}:{allocator}:{method}")
        if not args.smoke:
            if allocator == "torchmem":
                import torchmem
                torchmem.install(limit=budget)
            else:
                total = torch.cuda.get_device_properties(0).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(budget) / total))
        start = time.perf_counter()
        args.model = model
        result = RUNNERS[method](args, Workload(args))
        result.update(model=model, allocator=allocator, method=method, budget=budget,
                      global_batch=args.global_batch, seq=args.seq, wall_s=round(time.perf_counter() - start, 1),
                      device="cpu (smoke)" if args.smoke else torch.cuda.get_device_name(0), torch=torch.__version__)
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
