// private_pools.h: torch's private pools (torch.cuda.MemPool, CUDA graph
// pools) and the pools of a MemPool's own allocator, as torch reaches them
// through the installed allocator; and what graph checkpoints and snapshots
// read of them. Defined in runtime_pools.cpp (and runtime.cpp).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "shim/runtime.h"

namespace torchmem::shim {

void begin_allocate_to_pool(int device, MempoolKey key, std::function<bool(CudaStream)> filter);
void end_allocate_to_pool(int device, MempoolKey key);

// Note [External pool allocators] torch.cuda.MemPool(allocator=X) with the
// user's own allocator X (NCCL's ncclMemAlloc, say): allocations routed to
// that pool come from a pool of their own, a core Pool over X's segments (a
// cuda_malloc-style backend whose cudaMalloc/cudaFree are X's), which caches
// them as PyTorch's allocator caches a MemPool's segments: X is called when
// the pool grows, not per tensor, and its frees happen when the cache is
// emptied. As natively:
// - X's segments count against the device's budget (the device pool sees them
//   as foreign bytes: Note [Foreign bytes] in core/pool.h; the external pool
//   grows only while the two together stay under the limit) and appear in
//   memory_stats (reserved, segments, allocated, ...);
// - a released pool (the MemPool is gone) keeps its cache until an
//   emptyCache of its id or of everything; blocks still live go back to it
//   when freed, so X and its functions outlive the MemPool (the functions own
//   what they need);
// - MemPool(..., use_on_oom=True): a device-pool request that finds no memory
//   may take a cached block of that pool (never a new segment of X; a failed
//   borrow leaves that pool's cache as it was). Unlike natively, the device
//   pool has counted the request's OOM (num_ooms, an "oom" trace entry) by
//   then, also when the borrow succeeds.
// - X's segments are in snapshots (external_pool_snapshots), as segments of
//   that pool.
// Limitation: use_on_oom has no effect on a MemPool without an allocator of
// its own (docs/compatibility.md).
struct ExternalAllocator {
  std::function<void*(std::size_t size, CudaStream stream)> allocate;
  std::function<void(void* ptr)> free;
};
// torch.cuda.MemPool creation / graph pool sharing; `external` only from MemPool(allocator=X).
void incref_pool(int device, MempoolKey key, std::shared_ptr<ExternalAllocator> external = nullptr);
// Whether `ptr` is a live block of an external allocator (Note [External pool allocators]).
bool is_external_block(void* ptr);
int pool_use_count(int device, MempoolKey key);
// torch.cuda.MemPool(allocator=X, use_on_oom=True) (Note [External pool allocators]).
void set_use_on_oom(int device, MempoolKey key, bool use_on_oom);
void release_pool(int device, MempoolKey key);
// torch's emptyCache(mempool_id): (0, 0) empties every pool (empty_cache());
// another key returns that private pool's cached memory only, on every device,
// once the pool is released (a torch.cuda.MemPool's destructor releases it
// first; a pool in use keeps its cache, as natively). Bytes returned.
std::size_t empty_pool_cache(MempoolKey key);

// ---- private-pool checkpoints (csrc/shim/checkpoint.cpp) ----------------------
// Note [Parked private blocks] (runtime_state.h) gives an in-use private pool
// two kinds of blocks the core counts as allocated: blocks torch holds (live)
// and blocks torch freed (parked). Callers serialize calls per pool (torch
// does, under the GIL).
struct PrivateBlocks {
  PoolId pool = 0;           // the core pool; 0 when `key` names no pool in use
  std::vector<Addr> live;    // torch holds them
  std::vector<Addr> parked;  // torch freed them; kept for the pool's graphs
};
PrivateBlocks private_blocks(int device, MempoolKey key);
std::vector<MempoolKey> private_pool_keys(int device);  // the private pools in use
// Note [Parked blocks in snapshots] (runtime_bindings_cuda.cpp): what snapshots
// need to name private pools in torch's terms, read once per snapshot.
struct PrivatePoolNames {
  std::unordered_map<PoolId, MempoolKey> keys;  // core pool -> torch's key (pools in use, released lately)
  std::unordered_set<Addr> parked;              // blocks torch freed that a pool keeps for its graphs
  MempoolKey key_of(PoolId pool) const {
    auto found = keys.find(pool);
    return found == keys.end() ? MempoolKey(0, 0) : found->second;
  }
};
PrivatePoolNames private_pool_names(int device);
// Blocks of `key` that torch frees (`park`: live ones) or holds again
// (`hold`: parked ones, or blocks the core allocated again for the pool).
// After a checkpoint restore: `park` are blocks torch held that the checkpoint
// lacks (parked, or with park_private_frees off already freed by the core),
// `hold` the checkpoint's blocks torch holds again.
void repark_private_blocks(int device, MempoolKey key, const std::vector<Addr>& park, const std::vector<Addr>& hold);
bool parks_private_frees();

}  // namespace torchmem::shim
