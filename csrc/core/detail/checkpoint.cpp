// checkpoint.cpp: checkpoints of a private pool and restoring one (Note [Pool
// checkpoints] in pool.h).
//
// CUDA graph trees (torch.compile mode="reduce-overhead") record several graphs
// into one private pool. Before recording a new graph off an earlier point of
// the tree, torch asks the allocator to put the pool back as it was at that
// point, so the new graph's allocations avoid exactly the memory the earlier
// graphs' outputs still occupy. This file is the core half of that: pure
// block bookkeeping, no CUDA (the torch-facing half is csrc/shim/checkpoint.cpp).
//
// Note [Restoring at exact addresses]
// restore_private_pool() first checks the whole checkpoint (ascending, aligned,
// each block inside the pool's own memory: its heap's virtual range (VMM) or a
// segment the heap still holds (cuda_malloc)), so a checkpoint that cannot be
// met changes nothing. Then it frees the live blocks the checkpoint lacks (or
// has at another size) through the ordinary free path, waits for deferred frees
// (Note [Record stream]: a pending block may sit where a checkpoint block goes),
// and allocates each missing block. Its range is free space of its heap by
// then, inside one free block (free neighbours are always merged), which is
// split around it. VMM: the range's granules are pinned and unmapped ones
// acquired as for a new block, before any split, so a failure to get memory
// leaves the blocks as they are. Fences are not consulted: the caller restores
// blocks that its own stream order covers, as PyTorch's setCheckpointPoolState
// does for its native pools.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Block;
using detail::Heap;

namespace {

// The first block of the range of `heap` that holds [addr, end), or null when
// no range of the heap holds all of it.
Block* range_holding(Heap& heap, bool vmm, Addr addr, Addr end) {
  if (vmm) return (addr >= heap.base && end <= heap.base + heap.span) ? heap.first : nullptr;
  for (auto& s : heap.segments) {
    if (addr >= s->addr && end <= s->addr + s->size) return s->first;
  }
  return nullptr;
}

// The allocated blocks of `heap`, in address order per range.
void collect_live(Heap& heap, bool vmm, std::vector<Block*>* out) {
  auto walk = [&](Block* first) {
    for (Block* b = first; b; b = b->next) {
      if (b->state == BlockState::kAllocated) out->push_back(b);
    }
  };
  if (vmm) {
    walk(heap.first);
  } else {
    for (auto& s : heap.segments) walk(s->first);
  }
}

std::string pool_name(PoolId pool) { return "private pool " + std::to_string(pool); }

}  // namespace

Pool::Impl::PoolHeaps& Pool::Impl::checkpointable_pool(PoolId pool, const char* what) {
  if (pool == 0) {
    throw PoolError(std::string(what) +
                    ": pool 0 is the default pool; checkpoints are of private pools (create_private_pool)");
  }
  auto it = pools.find(pool);
  if (it == pools.end()) {
    throw PoolError(std::string(what) + ": no " + pool_name(pool) + "; call create_private_pool first");
  }
  if (it->second.released) {
    throw PoolError(std::string(what) + ": " + pool_name(pool) +
                    " was released; checkpoints of a released pool can be neither taken nor restored");
  }
  return it->second;
}

PoolCheckpoint Pool::Impl::checkpoint_private_pool(PoolId pool) {
  PoolHeaps& ph = checkpointable_pool(pool, "checkpoint_private_pool");
  std::vector<Block*> blocks;
  for (Heap* h : {ph.small, ph.large}) collect_live(*h, vmm, &blocks);
  std::sort(blocks.begin(), blocks.end(), [](const Block* a, const Block* b) { return a->addr < b->addr; });
  PoolCheckpoint out;
  out.pool = pool;
  out.blocks.reserve(blocks.size());
  for (const Block* b : blocks) out.blocks.push_back(CheckpointBlock{b->addr, b->size, b->requested, b->stream, b->context});
  return out;
}

RestoreDelta Pool::Impl::restore_private_pool(const PoolCheckpoint& checkpoint) {
  PoolHeaps& ph = checkpointable_pool(checkpoint.pool, "restore_private_pool");
  const std::string where = "restore_private_pool (" + pool_name(checkpoint.pool) + ")";

  // 1. Check the whole checkpoint before changing anything.
  std::vector<Heap*> homes;
  homes.reserve(checkpoint.blocks.size());
  Addr previous_end = 0;
  for (const CheckpointBlock& c : checkpoint.blocks) {
    if (c.size == 0 || c.size % kMinBlockSize != 0 || c.requested == 0 || c.requested > c.size) {
      throw PoolError(where + ": checkpoint block " + hex(c.addr) + " has size " + std::to_string(c.size) +
                      " and requested size " + std::to_string(c.requested) +
                      "; pass a checkpoint that checkpoint_private_pool returned");
    }
    if (c.addr < previous_end) {
      throw PoolError(where + ": checkpoint block " + hex(c.addr) +
                      " is out of address order or overlaps the one before it; pass a checkpoint that "
                      "checkpoint_private_pool returned");
    }
    Heap* home = nullptr;
    for (Heap* h : {ph.small, ph.large}) {
      if (range_holding(*h, vmm, c.addr, c.addr + c.size)) home = h;
    }
    if (home == nullptr) {
      throw PoolError(where + ": block " + hex(c.addr) + " (" + mib(c.size) + ") lies outside the pool's memory" +
                      (vmm ? " (not in its address ranges): the checkpoint is of another pool"
                           : ": its segment was returned to the device since the checkpoint (release_cached)") +
                      "; restore a pool only to its own checkpoints, taken while its memory was held");
    }
    homes.push_back(home);
    previous_end = c.addr + c.size;
  }

  // 2. Classify: a live block at a checkpoint block's address and size stays.
  std::vector<Block*> now;
  for (Heap* h : {ph.small, ph.large}) collect_live(*h, vmm, &now);
  std::sort(now.begin(), now.end(), [](const Block* a, const Block* b) { return a->addr < b->addr; });
  std::vector<Addr> to_free;
  std::vector<std::size_t> to_allocate;  // indexes into checkpoint.blocks
  // A kept block takes the checkpoint's request, stream and context (after
  // step 1 nothing throws PoolError, so changing it now is safe).
  auto keep = [&](Block* b, const CheckpointBlock& c) {
    const int kind = b->heap->small ? kStatSmallPool : kStatLargePool;
    for (int k : {int(kStatAll), kind}) {  // Note [Hot gauges] (pool_impl.h)
      if (c.requested > b->requested) {
        hot_[k].requested_bytes.increase(c.requested - b->requested);
      } else if (c.requested < b->requested) {
        hot_[k].requested_bytes.decrease(b->requested - c.requested);
      }
    }
    b->requested = c.requested;
    b->stream = c.stream;
    b->context = c.context;
  };
  std::size_t i = 0, j = 0;
  while (i < now.size() || j < checkpoint.blocks.size()) {
    if (j == checkpoint.blocks.size() || (i < now.size() && now[i]->addr < checkpoint.blocks[j].addr)) {
      to_free.push_back(now[i++]->addr);
    } else if (i == now.size() || checkpoint.blocks[j].addr < now[i]->addr) {
      to_allocate.push_back(j++);
    } else {
      if (now[i]->size != checkpoint.blocks[j].size) {
        to_free.push_back(now[i]->addr);
        to_allocate.push_back(j);
      } else {
        keep(now[i], checkpoint.blocks[j]);
      }
      ++i;
      ++j;
    }
  }

  // 3. Free, then let deferred frees complete (Note [Restoring at exact addresses]).
  RestoreDelta delta;
  for (Addr addr : to_free) {
    deallocate(addr);
    delta.freed.push_back(addr);
  }
  if (!deferred.empty()) poll_deferred(/*wait=*/true);

  // 4. Allocate the missing blocks at their addresses.
  for (std::size_t k : to_allocate) {
    allocate_at(*homes[k], checkpoint.blocks[k]);
    delta.allocated.push_back(checkpoint.blocks[k].addr);
  }
  if (memory_dirty) sync_memory_stats();
  return delta;
}

void Pool::Impl::allocate_at(Heap& heap, const CheckpointBlock& c) {
  const Addr end = c.addr + c.size;
  Block* f = range_holding(heap, vmm, c.addr, end);
  while (f && f->end() <= c.addr) f = f->next;
  if (!f || !f->is_free() || f->end() < end) {
    // Step 3 freed every live block the checkpoint lacks and the checkpoint
    // does not overlap itself, so this is a bug, not a caller error.
    throw std::logic_error("torchmem restore_private_pool: the range of block " + hex(c.addr) +
                           " is not free space after the frees");
  }
  if (vmm) {
    const std::size_t missing = pin(heap, c.addr, c.size);
    if (missing && !acquire(heap, c.addr, c.size, missing, c.size, c.stream)) {
      unpin(heap, c.addr, c.size, 0, 0, /*restore=*/true);
      throw std::runtime_error("torchmem restore_private_pool: no memory to back block " + hex(c.addr) + " (" +
                               mib(c.size) + ") of " + pool_name(heap.pool) + " again: the budget (" +
                               mib(budget()) + ") or the device is full; free memory or raise the limit, then "
                               "restore again");
    }
  }
  f = split_free_at(f, c.addr);  // the free space below the block stays free
  Block* b = carve(f, c.size);
  ++seq;
  b->requested = c.requested;
  b->stream = c.stream;
  b->context = c.context;
  live.insert(b->addr, b);
  ++heap.live_blocks;
  active_total += b->size;
  note_alloc(heap.small, b->size, c.requested);
  trace(TraceAction::kAlloc, b->addr, c.requested, c.stream, heap.pool, c.context);
}

// ---- Pool: the public surface -----------------------------------------------

PoolCheckpoint Pool::checkpoint_private_pool(PoolId pool) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return impl_->checkpoint_private_pool(pool);
}

RestoreDelta Pool::restore_private_pool(const PoolCheckpoint& checkpoint) {
  std::lock_guard<std::mutex> lock(mutex_);
  RestoreDelta delta;
  try {
    delta = impl_->restore_private_pool(checkpoint);
  } catch (const std::runtime_error&) {
    // Out of memory part way: what was done stays done (pool.h); keep the
    // gauges true and the invariants checked.
    impl_->sync_memory_stats();
    impl_->after_op("restore_private_pool");
    throw;
  }
  impl_->after_op("restore_private_pool");
  return delta;
}

}  // namespace torchmem
