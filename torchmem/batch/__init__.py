"""Adaptive batch size: torchmem.BatchSizeController and its parts.

- controller.py: BatchSizeController (split, weight, accumulate, recover, agree over ranks)
- model.py:      the linear peak-memory model the controller jumps with
- probe.py:      where peak bytes and the budget come from (torchmem, torch, synthetic, none)
- split.py:      splitting nested batches and joining per-chunk results
- distributed.py: the one agreement collective and the controller's gradient average
- sampler.py:    AdaptiveBatchSampler, for the opt-in changing global batch
"""

from torchmem.batch.controller import BatchSizeController, MicroBatchOOMError, OptimizerStepOOMError
from torchmem.batch.model import LinearMemoryModel
from torchmem.batch.probe import (MemoryProbe, NullProbe, SyntheticMemory, TorchmemProbe, TorchProbe,
                                  default_probe)
from torchmem.batch.sampler import AdaptiveBatchSampler
from torchmem.batch.split import batch_size_of, concat_results, split_batch, split_sizes

__all__ = [
    "BatchSizeController", "MicroBatchOOMError", "OptimizerStepOOMError", "LinearMemoryModel",
    "MemoryProbe", "NullProbe", "SyntheticMemory", "TorchmemProbe", "TorchProbe", "default_probe",
    "AdaptiveBatchSampler", "batch_size_of", "concat_results", "split_batch", "split_sizes",
]
