// checkpoint.cpp: CUDA graph trees (torch.compile mode="reduce-overhead") on
// torchmem's private pools.
//
// A graph tree records many graphs into one private pool. Before recording a
// graph off an earlier point of the tree, torch takes the pool back to that
// point: getCheckpointState() saved which blocks were live then,
// setCheckpointPoolState() makes exactly those live again, at the same
// addresses, and hands torch a DataPtr for each (torch gives them to the
// storages of the tree's live outputs, whose tensors were built from raw
// pointers, and drops the rest: their blocks stay live until torch frees them
// by address). checkPoolLiveAllocations() is torch's debug check of the result.
//
// Note [Checkpoints over parked blocks] While a private pool is in use, blocks
// torch frees are parked, not freed (Note [Parked private blocks],
// runtime.cpp): the core counts them as allocated, so no address of the pool
// is reused while any graph of it may replay. A checkpoint therefore records
// the blocks torch holds (live, not parked), and a restore is mostly a move
// between the two sets: live blocks the checkpoint lacks are parked (torch
// freed them), parked blocks of the checkpoint are held again. The core pool
// is restored (Pool::restore_private_pool) to the checkpoint's blocks plus
// every block parking keeps; that allocates again, at its exact address, any
// checkpoint block the core no longer has and changes nothing else. The cost
// of parking: a pool's memory is not reused across the graphs of one tree, so
// a tree holds the sum of its graphs' memory rather than their peak.
#include "shim/checkpoint.h"
#include "shim/allocation.h"
#include "shim/private_pools.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace torchmem::shim {

namespace {

struct TorchmemPoolState final : TorchAllocatorState {
  int device = 0;
  MempoolKey key;
  PoolCheckpoint checkpoint;  // the blocks torch held (Note [Checkpoints over parked blocks])
};

std::string describe(int device, MempoolKey key) {
  return "private pool (" + std::to_string(key.first) + ", " + std::to_string(key.second) + ") of device " +
         std::to_string(device);
}

PrivateBlocks in_use_pool(int device, MempoolKey key, const char* what) {
  PrivateBlocks blocks = private_blocks(device, key);
  if (blocks.pool == 0) {
    throw std::runtime_error(std::string("torchmem: ") + what + ": " + describe(device, key) +
                             " is not in use (never captured into, or released); torch checkpoints only the pools "
                             "of live CUDA graphs");
  }
  return blocks;
}

}  // namespace

std::shared_ptr<TorchAllocatorState> checkpoint_state(int device, MempoolKey key) {
  PrivateBlocks blocks = in_use_pool(device, key, "getCheckpointState");
  const std::unordered_set<Addr> held(blocks.live.begin(), blocks.live.end());
  PoolCheckpoint all = device_pool(device).checkpoint_private_pool(blocks.pool);
  auto state = std::make_shared<TorchmemPoolState>();
  state->device = device;
  state->key = key;
  state->checkpoint.pool = all.pool;
  for (const CheckpointBlock& b : all.blocks) {
    if (held.count(b.addr)) state->checkpoint.blocks.push_back(b);
  }
  return state;
}

TorchCheckpointDelta restore_checkpoint(int device, const std::shared_ptr<TorchAllocatorState>& state) {
  const auto* ours = dynamic_cast<const TorchmemPoolState*>(state.get());
  if (ours == nullptr) {
    throw std::runtime_error(
        "torchmem: setCheckpointPoolState: this checkpoint was not taken by torchmem's getCheckpointState (was it "
        "taken before torchmem.install(), or by another allocator?); take it again under torchmem");
  }
  if (ours->device != device) {
    throw std::runtime_error("torchmem: setCheckpointPoolState: the checkpoint is of device " +
                             std::to_string(ours->device) + ", not of device " + std::to_string(device));
  }
  PrivateBlocks now = in_use_pool(device, ours->key, "setCheckpointPoolState");
  if (now.pool != ours->checkpoint.pool) {
    throw std::runtime_error("torchmem: setCheckpointPoolState: " + describe(device, ours->key) +
                             " was released and made again since the checkpoint; its blocks are gone");
  }
  std::unordered_set<Addr> wanted;
  for (const CheckpointBlock& b : ours->checkpoint.blocks) wanted.insert(b.addr);
  const std::unordered_set<Addr> held(now.live.begin(), now.live.end());

  // The core's target: the checkpoint's blocks plus, when frees are parked,
  // every other block the pool holds now (all parked after this restore).
  // Without parking the core frees the blocks the checkpoint lacks.
  Pool& pool = device_pool(device);
  PoolCheckpoint target = ours->checkpoint;
  if (parks_private_frees()) {
    for (const CheckpointBlock& b : pool.checkpoint_private_pool(now.pool).blocks) {
      if (!wanted.count(b.addr)) target.blocks.push_back(b);
    }
  }
  std::sort(target.blocks.begin(), target.blocks.end(),
            [](const CheckpointBlock& a, const CheckpointBlock& b) { return a.addr < b.addr; });
  pool.restore_private_pool(target);

  std::vector<Addr> park, hold;
  for (Addr addr : now.live) {
    if (!wanted.count(addr)) park.push_back(addr);
  }
  for (const CheckpointBlock& b : ours->checkpoint.blocks) {
    if (!held.count(b.addr)) hold.push_back(b.addr);
  }
  repark_private_blocks(device, ours->key, park, hold);

  // As PyTorch's own allocator: every block torch held counts as freed, and
  // every checkpoint block comes back as a fresh DataPtr.
  TorchCheckpointDelta delta;
  delta.ptrs_freed.reserve(now.live.size());
  for (Addr addr : now.live) delta.ptrs_freed.push_back(reinterpret_cast<void*>(addr));
  const auto cuda = c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  for (const CheckpointBlock& b : ours->checkpoint.blocks) {
    void* ptr = reinterpret_cast<void*>(b.addr);
    delta.dataptrs_allocd.emplace_back(ptr, tag_with_device(ptr, device), &delete_tagged_block, cuda);
  }
  return delta;
}

bool pool_live_allocations_are(int device, MempoolKey key, const std::unordered_set<void*>& expected) {
  PrivateBlocks blocks = in_use_pool(device, key, "checkPoolLiveAllocations");
  if (blocks.live.size() != expected.size()) return false;
  return std::all_of(blocks.live.begin(), blocks.live.end(),
                     [&](Addr addr) { return expected.count(reinterpret_cast<void*>(addr)) != 0; });
}

}  // namespace torchmem::shim
