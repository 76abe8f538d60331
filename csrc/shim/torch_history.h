// torch_history.h: PyTorch's own memory history through the allocator's C++
// interface: torch::cuda::_record_memory_history (which hands the allocator
// torch's context recorder) and torch::cuda::_memory_snapshot_pickled (which
// asks the allocator for a SnapshotInfo), answered from torchmem's pools.
// install.cpp's allocator forwards recordHistory and snapshot here.
//
// The Python path (torch.cuda.memory._record_memory_history / _snapshot,
// patched by torchmem/runtime/patch.py) does not come here: it records torchmem's own
// stack ids (torchmem/runtime/stacks.py) and converts the pool's snapshot in Python.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include "shim/runtime.h"

namespace torchmem::shim {

using TorchSnapshot = c10::cuda::CUDACachingAllocator::SnapshotInfo;
using TorchRecorder = c10::cuda::CUDACachingAllocator::CreateContextFn;
using TorchRecordContext = c10::cuda::CUDACachingAllocator::RecordContext;

// Note [Torch's recorder] While torch's recorder is followed, every
// allocation (and with RecordContext::ALL every free) calls it and keeps the
// context it returns under an id of the pool's trace and blocks. nullptr
// (or RecordContext::NEVER) stops calling it; blocks keep their contexts.
void follow_torch_recorder(TorchRecorder recorder, TorchRecordContext when);

// Every device's segments (only private pool `key`'s when it is not (0, 0))
// and, with `include_traces`, trace, in torch's structs, with the contexts
// torch's recorder gave.
TorchSnapshot torch_snapshot(MempoolKey key, bool include_traces);

}  // namespace torchmem::shim
