"""AdaptiveBatchSampler: batches whose size follows the controller's global batch,
and the learning-rate rules that go with a changing global batch (LR_RULES).

Only for the opt-in throughput mode (BatchSizeController(adapt_global=True)):
there the global batch follows memory, so the data loader must hand out
batches of `controller.local_batch` samples, read afresh for every batch. Pass
it as a DataLoader's batch_sampler; with num_workers > 0 the workers prefetch
a few batches at the old size, which run() handles like any other size.
"""

import math

from torch.utils.data import Sampler

__all__ = ["AdaptiveBatchSampler", "LR_RULES"]

# lr x rule(new global batch / base): linear for SGD (Goyal et al.), sqrt for Adam-type optimizers
LR_RULES = {
    "linear": lambda ratio: ratio,
    "sqrt": math.sqrt,
}


class AdaptiveBatchSampler(Sampler):
    """Groups the indices of `sampler` into lists of controller.local_batch."""

    def __init__(self, sampler, controller, drop_last=False):
        self.sampler = sampler
        self.controller = controller
        self.drop_last = drop_last

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) >= self.controller.local_batch:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self):
        # an estimate at the current size: the size may change while iterating
        size = self.controller.local_batch
        count = len(self.sampler)
        return count // size if self.drop_last else -(-count // size)
