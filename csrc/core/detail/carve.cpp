// carve.cpp: blocks: best fit, split, merge, free and deferred frees.
//
// This is the fast path. A cached hit is: one best-fit lookup in the heap's
// FreeIndex, a split, and on free at most two neighbour merges. No stats
// are touched here (Note [Stats apart]); only structural tallies.
#include <algorithm>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Block;
using detail::Heap;

Block* Pool::Impl::find_fit(Heap& heap, std::size_t size, StreamId stream) {
  return best_fit_where(heap, size, [&](const Block& c) { return reusable(c, stream); });
}

Block* Pool::Impl::carve(Block* b, std::size_t size) {
  Heap& heap = *b->heap;
  if (b->size > size) {
    // Split: the rest stays free, with the same fence tag.
    Block* rest = split_off(b, b->addr + size);
    // Note [Deferred carve] (free_index.h); an arena's caller indexes the rest itself.
    if (!heap.arena) heap.free.carve(b, rest);
    b->size = size;
  } else {
    if (!heap.arena) heap.free.carve(b, nullptr);
    --free_blocks[heap.small ? 0 : 1];
  }
  b->state = BlockState::kAllocated;
  return b;
}

void Pool::Impl::merge_tags(Block& into, const Block& other) {
  if (other.free_seq == 0 || behind_barrier(other.free_seq)) return;
  if (into.free_seq == 0 || behind_barrier(into.free_seq)) {
    into.free_stream = other.free_stream;
    into.free_seq = other.free_seq;
    into.reader_slot = other.reader_slot;
    return;
  }
  // Note [Freed under another stream]: one stream's frees, at most one of them
  // with a reader, keep that stream and reader (a third stream waits for both up
  // to the later free), so the stream still reuses the merged block at once: in
  // a capture or a MemPool scope, which refuse waits and barriers, nothing else
  // could hand it over. Otherwise the mixed tag, whose walk over every stream
  // covers a reader (its slot carries the free's sequence, release_block).
  if (into.free_stream == other.free_stream &&
      (into.reader_slot == other.reader_slot || into.reader_slot == 0 || other.reader_slot == 0)) {
    into.reader_slot = into.reader_slot != 0 ? into.reader_slot : other.reader_slot;
  } else {
    into.free_stream = detail::kMixedStreams;
    into.reader_slot = 0;
  }
  into.free_seq = std::max(into.free_seq, other.free_seq);
}

void Pool::Impl::tag_reader(Block& b, StreamId reader) {
  const std::uint32_t r = slot_for(reader);
  slots[r].last_free_seq = seq;
  if (r <= 0xFFFF) {
    b.reader_slot = static_cast<std::uint16_t>(r);
  } else {
    b.free_stream = detail::kMixedStreams;  // past 65,535 streams: the mixed tag's walk covers the reader
  }
}

Block* Pool::Impl::release_block(Block* b, StreamId free_stream, StreamId reader) {
  Heap& heap = *b->heap;
  const int kind = heap.small ? 0 : 1;
  const std::uint32_t slot = slot_for(free_stream);
  slots[slot].last_free_seq = seq;
  if (__builtin_expect(b->plan_item != detail::StepPlan::kNoItem, 0)) {  // Note [Step plan]: its name is free again
    detail::HostClock clock(time_host_ops, stats_.host_plan_ns);  // Note [Host time]
    plan.on_free(b->plan_item);
    b->plan_item = detail::StepPlan::kNoItem;
  }
  if (vmm) unpin(heap, b->addr, b->size, free_stream, seq, /*restore=*/false);
  b->state = BlockState::kInactive;
  // b->requested stays: snapshots show a free block's last request, as PyTorch's do.
  b->context = 0;
  if (!b->uses.empty()) b->uses.clear();
  b->free_stream = free_stream;
  b->free_seq = seq;
  b->reader_slot = 0;
  if (__builtin_expect(reader != kNoStream, 0)) tag_reader(*b, reader);  // Note [Freed under another stream]

  // The merged block takes over the index entry of the first free neighbour
  // (FreeIndex::replace), so a merge costs at most one entry update and one
  // erase.
  bool indexed = false;
  std::size_t old_size = 0;
  Addr old_addr = 0;
  if (Block* p = b->prev; p && p->is_free()) {
    old_size = p->size;
    old_addr = p->addr;
    indexed = true;
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    merge_tags(*p, *b);
    arena.recycle(b);
    b = p;
    --free_blocks[kind];
  }
  if (Block* n = b->next; n && n->is_free()) {
    if (indexed) {
      if (!heap.arena) heap.free.erase(n);
    } else {
      old_size = n->size;
      old_addr = n->addr;
      indexed = true;
    }
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    merge_tags(*b, *n);
    arena.recycle(n);
    --free_blocks[kind];
  }
  ++free_blocks[kind];
  if (__builtin_expect(!heap.arena, 1)) {
    if (indexed) {
      heap.free.replace(old_size, old_addr, b);
    } else {
      heap.free.insert(b);
    }
  } else {
    detail::HostClock clock(time_host_ops, stats_.host_plan_ns);  // Note [Host time]
    arena_note_free(heap, b);
  }
  return b;
}

bool Pool::Impl::poll_deferred(bool wait) {
  bool any = false;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < deferred.size(); ++i) {
    Deferred& d = deferred[i];
    bool done = true;
    for (EventHandle& e : d.events) {
      if (!e) continue;
      if (wait) {
        backend.synchronize_event(e);
      } else if (!backend.event_completed(e)) {
        done = false;
        continue;
      }
      backend.destroy_event(e);
      e = 0;
    }
    if (!done) {
      if (kept != i) deferred[kept] = std::move(d);
      ++kept;
      continue;
    }
    Block* b = d.block;
    const bool small = b->heap->small;
    const std::size_t size = b->size, requested = b->requested;
    const Addr addr = b->addr;
    const StreamId stream = b->stream;
    const PoolId pool = b->heap->pool;
    const std::uint64_t context = b->context;
    release_block(b, stream);
    active_total -= size;
    note_free_completed(small, size);
    trace(TraceAction::kFreeCompleted, addr, requested, stream, pool, context);
    any = true;
  }
  deferred.resize(kept);
  if (any) {
    if (released_pools) maybe_drop_released_pools();
    sync_memory_stats();
  }
  return any;
}

}  // namespace torchmem
