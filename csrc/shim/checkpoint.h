// checkpoint.h: what torch's CUDA graph trees ask of an allocator's private
// pools (getCheckpointState, setCheckpointPoolState, checkPoolLiveAllocations),
// answered from torchmem's pools. install.cpp's allocator forwards its three
// overrides here; csrc/shim/checkpoint.cpp says how.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <memory>
#include <unordered_set>

#include "shim/runtime.h"

namespace torchmem::shim {

using TorchAllocatorState = c10::cuda::CUDACachingAllocator::AllocatorState;
using TorchCheckpointDelta = c10::cuda::CUDACachingAllocator::CheckpointDelta;

// The blocks torch holds in private pool `key` of `device`. Throws
// std::runtime_error when `key` names no private pool in use there.
std::shared_ptr<TorchAllocatorState> checkpoint_state(int device, MempoolKey key);
// Makes the blocks torch holds in the checkpoint's pool those of the
// checkpoint; returns every block torch held before (ptrs_freed) and a
// DataPtr with torchmem's deleter for each block of the checkpoint.
TorchCheckpointDelta restore_checkpoint(int device, const std::shared_ptr<TorchAllocatorState>& state);
// Whether the blocks torch holds in pool `key` are exactly `expected`.
bool pool_live_allocations_are(int device, MempoolKey key, const std::unordered_set<void*>& expected);

}  // namespace torchmem::shim
