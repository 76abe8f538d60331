"""Adaptive batch size: torchmem.BatchSizeController and its parts.

- controller.py: BatchSizeController (split, weight, accumulate, recover, agree over ranks)
- policy.py:     SizingPolicy, the sizes memory allows (pure arithmetic)
- model.py:      the linear peak-memory model the policy jumps with
- throughput.py: ThroughputChooser, the count of micro-steps measured fastest (pure)
- timing.py:     StepTimer, micro-step times from CUDA events or the wall clock
- probe.py:      where peak bytes and the budget come from (torchmem, torch, synthetic, none)
- split.py:      splitting nested batches (balanced or not) and joining per-chunk results
- parallel.py:   gradient sync under DDP and FSDP2, and FSDP2's state after an OOM
- recovery.py:   the controller's errors and the cleanup of a failed attempt
- distributed.py: the one agreement collective and the controller's gradient average
- offload_rung.py: activation offload when even the smallest micro-batch does not fit
- sampler.py:    AdaptiveBatchSampler, for the opt-in changing global batch
"""

from torchmem.batch.controller import BatchSizeController, MicroBatchOOMError, OptimizerStepOOMError
from torchmem.batch.model import LinearMemoryModel
from torchmem.batch.probe import (MemoryProbe, NullProbe, SyntheticMemory, TorchmemProbe, TorchProbe,
                                  default_probe)
from torchmem.batch.sampler import AdaptiveBatchSampler
from torchmem.batch.split import balanced_sizes, batch_size_of, concat_results, split_batch, split_sizes
from torchmem.batch.throughput import ThroughputChooser

__all__ = [
    "BatchSizeController", "MicroBatchOOMError", "OptimizerStepOOMError", "LinearMemoryModel",
    "MemoryProbe", "NullProbe", "SyntheticMemory", "TorchmemProbe", "TorchProbe", "default_probe",
    "AdaptiveBatchSampler", "ThroughputChooser", "balanced_sizes", "batch_size_of", "concat_results",
    "split_batch", "split_sizes",
]
