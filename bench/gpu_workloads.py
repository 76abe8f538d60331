"""One GPU workload under one allocator, in this process; appends a JSON line.

    python bench/gpu_workloads.py --workload gpt2 --allocator torchmem --steps 30 --seed 0 \\
        --out results.jsonl [--record-trace trace.json.gz]

Why one process per run: an allocator can be chosen only once per process (and
PYTORCH_CUDA_ALLOC_CONF is read when CUDA initializes), so every (workload,
allocator) pair runs fresh; bench/gpu_run.sh (jobs `bench`, `rounds`) and bench/lockstep.py drive it.

Figures per run (each allocator's own where it has one):
  peak_allocated   torchmem allocated_bytes.all.peak / torch.cuda.max_memory_allocated
  peak_requested   requested_bytes.all.peak (unrounded), where the allocator keeps it
  peak_reserved    torchmem reserved_bytes.all.peak / torch.cuda.max_memory_reserved
  device_used_peak max over steps of (total - free) from cudaMemGetInfo, minus the
                   figure measured before the model existed (CUDA context etc.)
  ratio            peak_reserved / peak_allocated
  median_step_s    median wall time of a step (synchronized), after warm-up steps
  step_s           every timed step's wall time, in order
  host_speed       this process's own speed with no allocator (a `torch.empty` churn on the
                   meta device) and its CPU: processes differ by up to 2x (BENCHMARKS.md,
                   How to reproduce); and
                   under its allocator, per kernel launch and per device `torch.empty` (cuda_speed)
  enqueue_s        per timed step (the causal LMs), seconds until the host had queued the
                   whole step (before the loss is read): near step_s, the step is host-bound
                   and an allocator's host cost shows; well below, the GPU sets the pace
  allocs_per_step  per timed step, allocations made (memory_stats' allocation.all.allocated)
  samples_per_step per timed step, the samples it trained on or decoded (batch x micro-steps)
  oom_room         after an out-of-memory step: the device's free bytes, this process's
                   reserved bytes and the failed request (room_at_oom)
  kernel_ms        with --kernel-time, per shape, the device time of one more step under
                   torch.profiler (kernels, copies, memsets): the same under two allocators
                   unless where the memory lies changes how fast the GPU runs
  host_ops         with --kernel-time, the host operators of those profiled steps that took the
                   most host time: [name, calls, self ms]
Under bench/lockstep.py (--lockstep R,W) the process waits at a gate before each step, so that
several allocators' processes take turns step by step; it then reports no device_used_peak,
device_ratio or wall_s (the device holds the others' memory; the wall clock, their turns).
Shapes: with --shapes K (default 4) the run draws K step shapes (batch, sequence
length, resolution...) from the seed and cycles through them; the warm-up covers
each once, so the timed steps see no first use of a kernel or cuBLAS heuristic
(a fresh shape per step made one run's median move 1.3x between runs of the same
allocator). --shapes 0 draws a new shape every step. --batch-scale S runs the same
draws at S times their batch (the allocator's label gets "@S"): where an allocator
cannot fit a budget at the drawn batch, its time per sample at the largest batch it
fits (bench/lockstep.py's per-sample table).
Workloads: gpt2 (GPT-2 124M, AdamW, bf16 autocast, batch 2..16 x seq 64..1024),
llama_ckpt (Llama-style ~300M, 16 layers, 1024 wide, GQA 16/4, gradient
checkpointing, batch 1..8 x seq 128..4096), kv_generate (autoregressive decoding
with a growing KV cache, varying prompt lengths and batch), vision (torchvision
resnet50 training at varying resolutions and batch sizes; a plain-torch
ResNet-50 where torchvision is missing).
"""

import argparse
import collections
import gzip
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from churn_microbench import placement, timed_rounds  # noqa: E402  (the churn bench's loop, beside this file)
from common import append_jsonl, environment, install_allocator  # noqa: E402
from lockstep import Gate  # noqa: E402

ALLOCATORS = ("native", "expandable", "async", "torchmem")
WORKLOADS = ("gpt2", "llama_ckpt", "kv_generate", "vision", "fsdp", "fsdp_accum", "compile")
TRACE_ACTIONS = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_alloc": 3, "segment_free": 4,
                 "segment_map": 5, "segment_unmap": 6, "oom": 7}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--allocator", choices=ALLOCATORS, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--shapes", type=int, default=4, help="step shapes to cycle through (0: a new one each step)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps excluded from the step-time median (default: --shapes, or 3 with --shapes 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON-lines file to append the result to")
    parser.add_argument("--record-trace", metavar="PATH", help="record torch's memory history (native only)")
    parser.add_argument("--torchmem-conf", default="", help="extra torchmem options, key=value,...")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="torch.cuda.set_per_process_memory_fraction before the first step (any allocator)")
    parser.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                        help="as --memory-fraction, the fraction that gives BYTES of this device's memory")
    parser.add_argument("--lockstep", metavar="R,W", default=None,
                        help="run under bench/lockstep.py: wait at a gate (pipe fds) before each step")
    parser.add_argument("--kernel-time", action="store_true",
                        help="after the timed steps, one step per shape under torch.profiler: the GPU's own time "
                             "in kernels and copies, which a slow host does not change")
    parser.add_argument("--batch-scale", type=float, default=1.0,
                        help="each step's batch times this, rounded down, at least 1 (the same draws, a smaller "
                             "batch: an allocator's largest batch under a budget, compared per sample)")
    args = parser.parse_args(argv)
    if args.shapes < 0:
        parser.error("--shapes must be 0 or more")
    if args.warmup is None:
        args.warmup = args.shapes or 3
    if args.record_trace and args.allocator != "native":
        parser.error("--record-trace needs --allocator native (torch's history exists only there)")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
        parser.error("--memory-fraction must be in (0, 1]")
    if args.memory_budget is not None and (args.memory_budget <= 0 or args.memory_fraction is not None):
        parser.error("--memory-budget takes a positive number of bytes, and not with --memory-fraction")
    if not 0 < args.batch_scale <= 1:
        parser.error("--batch-scale must be in (0, 1]: a smaller batch than the workload draws")
    return args


# ---- allocators -----------------------------------------------------------------

def setup_allocator(args):
    """Chooses the allocator; must run before torch initializes CUDA."""
    options = {}
    if args.allocator == "torchmem":
        from torchmem.runtime.config import parse_conf_string

        options = parse_conf_string(args.torchmem_conf)
    return install_allocator(args.allocator, **options)


def allocator_label(args):
    """The allocator's name in the results: torchmem with options is its own row ("torchmem[backend=...]"),
    and so is a smaller batch ("native@0.75": --batch-scale)."""
    label = args.allocator
    if args.allocator == "torchmem" and args.torchmem_conf:
        label = f"torchmem[{args.torchmem_conf}]"
    return label if args.batch_scale == 1.0 else f"{label}@{args.batch_scale:g}"


def scale_batch(shape, scale):
    """A drawn step shape with its batch (always the first field) times `scale`, at least 1."""
    return shape if scale == 1.0 else (max(1, int(shape[0] * scale)), *shape[1:])


def memory_figures(torch, allocator):
    if allocator == "torchmem":
        from torchmem.runtime.stats import raw_stats

        stats = raw_stats()
        return {
            "peak_allocated": stats["allocated_bytes"]["all"]["peak"],
            "peak_requested": stats["requested_bytes"]["all"]["peak"],
            "peak_reserved": stats["reserved_bytes"]["all"]["peak"],
            "num_device_alloc": stats["num_device_alloc"],
            "num_device_free": stats["num_device_free"],
            "num_reclaims": stats.get("num_reclaims"),
            "num_alloc_retries": stats["num_alloc_retries"],
            "backend_calls": stats.get("backend"),
        }
    stats = torch.cuda.memory_stats()
    return {
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_requested": stats.get("requested_bytes.all.peak"),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "num_device_alloc": stats.get("num_device_alloc"),
        "num_device_free": stats.get("num_device_free"),
        "num_alloc_retries": stats.get("num_alloc_retries"),
    }


STEP_COUNTER_KEYS = ("torchmem.num_plans", "torchmem.num_plan_hits", "torchmem.num_plan_misses", "torchmem.num_plan_drops",
             "torchmem.num_plan_passes", "torchmem.plan_pass_us", "torchmem.num_plan_lookups", "torchmem.num_lazy_pins", "torchmem.num_growths", "torchmem.num_reclaims",
             "num_ooms",
             "num_alloc_retries",
             # the driver calls by kind: what a step's calls cost depends on the mix (an unmap waits
             # for more than a map does)
             "torchmem.backend.create_calls", "torchmem.backend.map_calls", "torchmem.backend.unmap_calls",
             "torchmem.backend.release_calls",
             # the pool's own host time (time_host_ops only: 0 otherwise), Note [Host time]
             "torchmem.host_alloc_ns", "torchmem.host_free_ns", "torchmem.host_plan_ns")


def allocator_stats(torch):
    """The installed allocator's counters: torchmem.memory_stats() under torchmem (torch's
    memory_stats() there holds torch's keys only: installed with patch_torch=False, as here),
    else torch.cuda.memory_stats()."""
    if "torchmem" in sys.modules and sys.modules["torchmem"].is_installed():
        return sys.modules["torchmem"].memory_stats()
    return torch.cuda.memory_stats()


def step_counters(torch):
    """torchmem's counters a step's deltas are taken of (STEP_COUNTER_KEYS: the step plan's
    (Note [Step plan]), OOMs, and the driver calls by kind) so far, {} for other allocators."""
    stats = allocator_stats(torch)
    return {k.split(".")[-1]: stats.get(k, 0) for k in STEP_COUNTER_KEYS} if "torchmem.num_plans" in stats else {}


# PyTorch's expandable segments map pages of these sizes (kLargeBuffer, kSmallBuffer), one
# physical handle each.
EXPANDABLE_PAGE_BYTES = {"large_pool": 20 << 20, "small_pool": 2 << 20}


def expandable_page_calls(stats):
    """expandable_segments' driver calls so far, counted as the replay's model of it counts them: a
    cuMemCreate and a cuMemMap per page mapped, a cuMemUnmap and a cuMemRelease per page unmapped.
    Its num_device_alloc counts one per mapped range, however many pages the range holds, so it
    would undercount against torchmem's count of one call per handle."""
    pages = sum((stats.get(f"reserved_bytes.{pool}.allocated", 0) + stats.get(f"reserved_bytes.{pool}.freed", 0))
                // page for pool, page in EXPANDABLE_PAGE_BYTES.items())
    return 2 * pages


def cost_counters(torch):
    """(driver calls, device barriers) so far: torchmem's driver calls as its backend counts them
    (cuMemCreate, cuMemMap, cuMemUnmap, cuMemRelease: a granule or a run each; cudaMalloc and
    cudaFree of a segment under the cuda_malloc backend) and its waits for the whole device; for
    PyTorch's allocators cudaMalloc/cudaFree of segments, or expandable_segments' pages
    (expandable_page_calls), and the cache releases that synchronize the device."""
    stats = allocator_stats(torch)
    if "torchmem.backend.unmap_calls" in stats:  # the backend's own count: alias unmaps and parked granules too
        kinds = ("create", "map", "unmap", "release", "segment_alloc", "segment_free")
        return (sum(stats.get(f"torchmem.backend.{k}_calls", 0) for k in kinds),
                stats["torchmem.num_device_barriers"])
    if "torchmem.num_device_barriers" in stats:
        return (stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)
                + 2 * stats.get("torchmem.num_reclaims", 0), stats["torchmem.num_device_barriers"])
    waits = stats.get("num_sync_all_streams", 0) + stats.get("num_alloc_retries", 0)
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return expandable_page_calls(stats), waits
    return stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0), waits


def allocation_count(torch):
    """Allocations so far on this device (memory_stats' allocation.all.allocated, which torchmem
    answers too): a step's count, times a per-allocation cost, bounds what the allocator's host
    time can add to that step."""
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


def reset_peaks(torch, allocator):
    if allocator == "torchmem":
        import torchmem

        torchmem.reset_peak_memory_stats()
    else:
        torch.cuda.reset_peak_memory_stats()


# ---- workloads: each returns (draw(rng) -> shape, step(shape) -> info) ------------------

def causal_lm_step(torch, model, opt, vocab, batches, seqs):
    """One training step of a causal LM on random tokens, batch and sequence
    length drawn uniformly from the given (low, high) ranges."""

    def draw(rng):
        return rng.randint(*batches), rng.randint(*seqs)

    def step(shape):
        batch, seq = shape
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        enqueued = time.perf_counter()  # the host has queued the whole step; float(loss) waits for the GPU
        return {"batch": batch, "seq": seq, "loss": float(loss), "enqueued_at": enqueued}

    return draw, step


def gpt2_workload(torch):
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("cuda"):  # initialize on the GPU: minutes faster than on the CPU
        model = GPT2LMHeadModel(GPT2Config())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size

    return causal_lm_step(torch, model, opt, vocab, batches=(2, 16), seqs=(64, 1024))


def llama_workload(torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    return causal_lm_step(torch, model, opt, config.vocab_size, batches=(1, 8), seqs=(128, 4096))


def kv_generate_workload(torch):
    """Greedy decoding with HF's growing KV cache (torch.cat per token): every
    request has its own prompt length, batch and output length."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("cuda"):
        model = GPT2LMHeadModel(GPT2Config(n_positions=2048)).to(torch.bfloat16).eval()
    vocab = model.config.vocab_size

    def draw(rng):
        return rng.randint(1, 32), rng.randint(16, 1024), rng.randint(8, 32)

    @torch.no_grad()
    def step(shape):
        batch, prompt, new = shape
        ids = torch.randint(0, vocab, (batch, prompt), device="cuda")
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(new):
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1:].argmax(-1)
        return {"batch": batch, "seq": prompt + new}

    return draw, step


def resnet50(torch):
    """ResNet-50 from plain torch.nn, for machines without torchvision (same
    layer shapes: bottlenecks of 3, 4, 6, 3 blocks, widths 64..512, expansion 4)."""
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Identity() if stride == 1 and cin == cout else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers)


def vision_workload(torch):
    try:
        import torchvision

        model = torchvision.models.resnet50(num_classes=1000)
    except ImportError:
        model = resnet50(torch)
    model = model.cuda().to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def draw(rng):
        return rng.randint(16, 96), rng.choice([128, 160, 192, 224, 256, 288, 320])

    def step(shape):
        batch, size = shape
        images = torch.randn(batch, 3, size, size, device="cuda").to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"batch": batch, "seq": size, "loss": float(loss.detach())}

    return draw, step


def fsdp_llama(torch, layers, hidden, intermediate, heads, kv_heads):
    """A Llama-style model on one rank, fully_shard per decoder layer with bf16 mixed precision,
    and AdamW. One rank still gathers each layer's parameters on a stream of its own, as on
    many, so the pool sees FSDP2's two streams."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.config.use_cache = False
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), config.vocab_size


def fsdp_workload(torch):
    """FSDP2, 12 layers x 1024, batch 2..8 x seq 512..2048, one micro-batch a step."""
    model, opt, vocab = fsdp_llama(torch, layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=4)

    def draw(rng):
        return rng.randint(2, 8), rng.randint(512, 2048)

    def step(shape):
        batch, seq = shape
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        enqueued = time.perf_counter()
        return {"batch": batch, "seq": seq, "loss": float(loss), "enqueued_at": enqueued}

    return draw, step


FSDP_ACCUM_MICRO_STEPS = 32


def fsdp_accum_workload(torch):
    """FSDP2 with long gradient accumulation: 4 layers x 1024, 32 micro-batches of 2 x seq 1024
    a step (a global batch of 64), gradients reduced on the last micro-step only. The same
    shapes every step: the many small steps between optimizer steps are where a pool that
    remaps or waits at the budget shows."""
    model, opt, vocab = fsdp_llama(torch, layers=4, hidden=1024, intermediate=2816, heads=8, kv_heads=8)

    def draw(rng):
        return 2, 1024

    def step(shape):
        batch, seq = shape
        loss = torch.zeros((), device="cuda")
        for i in range(FSDP_ACCUM_MICRO_STEPS):
            model.set_requires_gradient_sync(i == FSDP_ACCUM_MICRO_STEPS - 1)
            ids = torch.randint(0, vocab, (batch, seq), device="cuda")
            part = model(input_ids=ids, labels=ids).loss / FSDP_ACCUM_MICRO_STEPS
            part.backward()
            loss += part.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        enqueued = time.perf_counter()
        return {"batch": batch, "seq": seq, "micro_steps": FSDP_ACCUM_MICRO_STEPS, "loss": float(loss),
                "enqueued_at": enqueued}

    return draw, step


def compile_workload(torch):
    """GPT-2 small under torch.compile(mode="reduce-overhead") (CUDA graph trees record into
    the allocator's private pools), training steps in bf16 autocast, batch 4..16 x seq 256..1024:
    each shape is compiled and recorded in the warm-up, then replayed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("cuda"):
        model = GPT2LMHeadModel(GPT2Config())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size

    def forward_backward(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    compiled = torch.compile(forward_backward, mode="reduce-overhead")

    def draw(rng):
        return rng.choice((4, 8, 16)), rng.choice((256, 512, 1024))

    def step(shape):
        batch, seq = shape
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        enqueued = time.perf_counter()
        return {"batch": batch, "seq": seq, "loss": float(loss), "enqueued_at": enqueued}

    return draw, step


BUILDERS = {"gpt2": gpt2_workload, "llama_ckpt": llama_workload, "kv_generate": kv_generate_workload,
            "vision": vision_workload, "fsdp": fsdp_workload, "fsdp_accum": fsdp_accum_workload,
            "compile": compile_workload}


def host_speed(torch):
    """This process's own speed, with no allocator: seconds per `torch.empty` on the meta device
    (bench/churn_microbench.py's meta loop: the random pattern, 20,000 allocations, median of 3
    rounds) and the CPU it ran on. That loop runs at ~1.1 us in some processes and ~2.2 us in
    others on the same CPU (BENCHMARKS.md, How to reproduce), and an allocator's churn falls in its
    process's band: beside a step time, it tells a slow process from a slow allocator. On a GPU,
    cuda_speed's figures too, which are under this process's allocator."""
    from torchmem.analysis.patterns import sizes_and_slots

    sizes, slots = sizes_and_slots("random", 20_000)
    live = [None] * 64
    meta = torch.device("meta")
    rounds = timed_rounds(3, sizes, slots, live, lambda size: torch.empty(size, dtype=torch.uint8, device=meta))
    speed = {"meta_s_per_alloc": statistics.median(rounds), "placement": placement()}
    if torch.cuda.is_available():
        speed.update(cuda_speed(torch, sizes, slots))
    return speed


def cuda_speed(torch, sizes, slots, device="cuda"):
    """This process's speed at what a host-bound step spends its time on, under its allocator:
    seconds per kernel launch (`add_` on a tensor that exists: no allocation) and per `torch.empty`
    on the device (the meta loop's pattern, sizes capped at 1 MiB so the probe leaves no large
    cache behind; emptied after). Two processes whose step times differ while these agree differ
    elsewhere (Python, autograd); a launch that is slower in one process is its host, not its
    allocator (the allocator is not called in a launch). `device` is for the CPU test."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    settle = torch.cuda.synchronize if on_gpu else (lambda: None)
    x = torch.zeros(1, device=device)
    launches = []
    for _ in range(3):
        settle()
        start = time.perf_counter()
        for _ in range(5_000):
            x.add_(1.0)
        launches.append((time.perf_counter() - start) / 5_000)
    settle()
    live = [None] * 64
    capped = [min(size, 1 << 20) for size in sizes]
    churn = timed_rounds(3, capped, slots, live, lambda size: torch.empty(size, dtype=torch.uint8, device=device))
    del live, x
    settle()
    if on_gpu:
        torch.cuda.empty_cache()
    return {"launch_s": statistics.median(launches), "cuda_s_per_alloc": statistics.median(churn)}


def device_ms(events):
    """Milliseconds of device time in a profiler's key_averages(): the sum of the device's own
    entries' self device time (self_device_time_total, called self_cuda_time_total before torch
    2.4), in us. Host operators are left out: with host activity profiled too, an operator's self
    device time is the kernels it launched, which their own entries count already (summed
    together, every kernel would count twice)."""
    total_us = 0.0
    for event in events:
        if getattr(getattr(event, "device_type", None), "name", "CUDA") == "CPU":
            continue
        value = getattr(event, "self_device_time_total", None)
        if value is None:
            value = getattr(event, "self_cuda_time_total", 0)
        total_us += value
    return total_us / 1e3


def kernel_times(torch, step, shapes):
    """One step per shape under torch.profiler: its device time (ms) per shape, and the host
    operators that took the most of the host's own time over those steps ([name, calls, self ms],
    top HOST_OPS): where a host-bound step's time went, to hold against another allocator's.
    Host profiling slows the host, never a kernel: the device times are as without it."""
    from torch.profiler import ProfilerActivity, profile

    times, host = [], collections.Counter()
    calls = collections.Counter()
    for shape in shapes:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(shape)
            torch.cuda.synchronize()
        events = prof.key_averages()
        times.append(device_ms(events))
        for event in events:
            host[event.key] += event.self_cpu_time_total / 1e3
            calls[event.key] += event.count
    return times, [[name, calls[name], round(ms, 3)] for name, ms in host.most_common(HOST_OPS)]


HOST_OPS = 30


# ---- traces -------------------------------------------------------------------------

def write_trace(torch, path, workload):
    """torch's memory history -> the shared trace format (torchmem/data/traces/README.md)."""
    snapshot = torch.cuda.memory._snapshot()
    device = torch.cuda.current_device()
    events = []
    for entry in snapshot["device_traces"][device]:
        code = TRACE_ACTIONS.get(entry["action"])
        if code is None:
            continue
        addr = entry.get("addr", entry.get("device_free", 0))
        events.append([code, int(addr), int(entry.get("size", 0)), int(entry.get("stream", 0))])
    doc = {"workload": workload, "torch": torch.__version__, "device": torch.cuda.get_device_name(device),
           "actions": {str(code): name for name, code in TRACE_ACTIONS.items()}, "events": events}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return len(events)


def room_at_oom(torch, error):
    """What was left when a step ran out of memory: the device's free bytes (other processes' memory
    is not free; under --lockstep they are parked, so this is the card as the failed request found
    it, after the allocator's own release-and-retry), this process's reserved bytes (the installed
    allocator's, allocator_stats), and the failed request ("Tried to allocate X", both allocators'
    message). lockstep_tables.card_was_full reads them to tell a card filled by other processes from
    a budget that bound."""
    from torchmem.batch.retry import requested_bytes_of

    free, _ = torch.cuda.mem_get_info()
    return {"device_free": free, "reserved": allocator_stats(torch).get("reserved_bytes.all.current", 0),
            "requested": requested_bytes_of(str(error))}


# ---- the run --------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    torch = setup_allocator(args)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    torch.cuda.init()
    if args.memory_budget is not None:
        args.memory_fraction = min(1.0, args.memory_budget / torch.cuda.get_device_properties(0).total_memory)
    if args.memory_fraction is not None:
        # a limit far above the working set: what a user's "leave room for others" costs each allocator
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    total = torch.cuda.mem_get_info()[1]
    baseline_used = total - torch.cuda.mem_get_info()[0]
    if args.record_trace:
        torch.cuda.memory._record_memory_history(max_entries=5_000_000, context=None, stacks="python")
    gate = Gate(args.lockstep)
    gate.wait()  # start-up (imports, CUDA init) ran beside the other lockstep processes; from here, alone
    speed = host_speed(torch)
    draw, step = BUILDERS[args.workload](torch)
    shapes = [scale_batch(draw(rng), args.batch_scale) for _ in range(args.shapes)]
    reset_peaks(torch, args.allocator)
    times, enqueue_times, allocs, samples, device_used_peak, info = [], [], [], [], 0, {}
    oom_at, oom_room, plan_steps = None, None, []
    calls_every_step, barriers_every_step = [], []  # warm-up included: where a pool that varies settles
    plan_before = step_counters(torch)
    allocated = allocation_count(torch)  # nothing allocates between one step's end and the next's start
    costs = cost_counters(torch)
    wall_start = time.perf_counter()
    for i in range(args.steps):
        gate.wait()
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            info = step(shapes[i % len(shapes)] if shapes else scale_batch(draw(rng), args.batch_scale))
        except torch.OutOfMemoryError as error:
            # under a budget this allocator cannot fit: say so (the steps before it stand)
            oom_at, oom_room = i, room_at_oom(torch, error)
            break
        torch.cuda.synchronize()
        end = time.perf_counter()
        enqueued = info.pop("enqueued_at", None)
        allocated, before = allocation_count(torch), allocated
        costs, costs_before = cost_counters(torch), costs
        calls_every_step.append(costs[0] - costs_before[0])
        barriers_every_step.append(costs[1] - costs_before[1])
        if i >= args.warmup:
            times.append(end - start)
            if enqueued is not None:
                enqueue_times.append(enqueued - start)
            allocs.append(allocated - before)
            samples.append(info["batch"] * info.get("micro_steps", 1))
        plan_now = step_counters(torch)
        if plan_now:
            plan_steps.append({k: plan_now[k] - plan_before.get(k, 0) for k in plan_now})
            plan_before = plan_now
        free, _ = torch.cuda.mem_get_info()
        device_used_peak = max(device_used_peak, total - free - baseline_used)
    wall = time.perf_counter() - wall_start
    gate.wait()  # the profiled steps and the result, alone too
    figures = memory_figures(torch, args.allocator)  # before the profiled steps: the timed run's figures
    kernel_ms, host_ops = (kernel_times(torch, step, shapes) if args.kernel_time and shapes and oom_at is None
                           else (None, None))
    result = {
        "workload": args.workload, "allocator": allocator_label(args), "seed": args.seed, "steps": args.steps,
        "warmup": args.warmup, "shapes": args.shapes,
        "memory_fraction": args.memory_fraction, **environment(torch),
        **figures,
        # under --lockstep the device also holds the other processes' memory, which grows while this one waits
        "device_used_peak": None if args.lockstep else device_used_peak,
        "ratio": figures["peak_reserved"] / figures["peak_allocated"] if figures["peak_allocated"] else None,
        "device_ratio": (device_used_peak / figures["peak_allocated"]
                         if figures["peak_allocated"] and not args.lockstep else None),
        "median_step_s": statistics.median(times) if times else None,
        "mean_step_s": statistics.fmean(times) if times else None,
        "total_s": sum(times), "wall_s": None if args.lockstep else wall,  # lockstep: mostly waiting
        "oom_at_step": oom_at, "oom_room": oom_room, "device_total": total,
        # the timed steps' share of every step's counts (the warm-up steps are not timed)
        "driver_calls_per_step": calls_every_step[args.warmup:],
        "barriers_per_step": barriers_every_step[args.warmup:],
        "calls_every_step": calls_every_step, "barriers_every_step": barriers_every_step,
        "plan_per_step": plan_steps,  # every step, warm-up included: deltas of step_counters()
        "step_s": times, "host_speed": speed,
        "enqueue_s": enqueue_times, "allocs_per_step": allocs, "samples_per_step": samples, "kernel_ms": kernel_ms,
        "host_ops": host_ops,
        "last_step": info,
    }
    if args.record_trace:
        result["trace_events"] = write_trace(torch, args.record_trace, args.workload)
        torch.cuda.memory._record_memory_history(enabled=None)
    append_jsonl(args.out, result)
    print(json.dumps({k: result[k] for k in ("workload", "allocator", "peak_allocated", "peak_reserved", "ratio",
                                              "device_used_peak", "median_step_s", "host_speed")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
