// stream_reuse.cpp: which stream may reuse a free block, and what it costs.
//
// A free block remembers the stream that freed it (Note [Cross-stream reuse]
// in pool.h). That stream reuses it at once; another stream only behind a
// device barrier, or behind a device-side wait on the freeing stream (Note
// [Reuse behind a stream wait] below). The pool's ladder (pool.cpp) and the
// step plan's arena (plan_pool.cpp) both ask here.
#include <algorithm>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Block;
using detail::Heap;

Block* Pool::Impl::find_fit_ordered(Heap& heap, std::size_t size, StreamId stream) {
  return best_fit_where(heap, size, [&](const Block& c) { return reusable_ordered(c, stream); });
}

bool Pool::Impl::fenced_fit(Heap& heap, std::size_t size, StreamId stream) {
  return best_fit_where(heap, size, [&](const Block& c) { return !reusable(c, stream); }) != nullptr;
}

Block* Pool::Impl::find_backed_fit_ordered(Heap& heap, std::size_t size, StreamId stream) {
  return best_fit_where(heap, size, [&](const Block& c) {
    return !reusable(c, stream) && backed(heap, c.addr, size) && reusable_ordered(c, stream);
  });
}

bool Pool::Impl::backed(const Heap& heap, Addr addr, std::size_t size) const {
  const std::size_t g0 = first_granule(heap, addr), g1 = end_granule(heap, addr + size);
  if (g1 > heap.granules.size()) return false;
  for (std::size_t i = g0; i < g1; ++i) {
    const detail::Granule& g = heap.granules[i];
    if (!g.backed()) return false;
  }
  return true;
}

// Note [Reuse behind a stream wait]
// Memory one stream freed may be given to another (Note [Cross-stream
// reuse] in pool.h): the ladder's step 3b when every fit is fenced by other
// streams, and the step plan's arena, which lays out every stream's requests
// in one range (a side stream's buffers fit in the main stream's gaps; apart,
// each stream's region would add its own peak). Instead of a device barrier,
// the new owner's stream waits for an event recorded on the freeing stream,
// which covers every free there so far (the host does not wait, and the
// pipeline keeps running). A free block merged from several
// streams' frees waits for each of them. What one wait covers is
// remembered per pair of streams, so a step whose pattern repeats pays one
// wait per pair and handover, not per block. This is the same promise as
// PyTorch's allocator makes to the freeing stream itself: work that used
// the memory on a stream other than the freeing one is covered only if the
// program ordered it before the free (record_stream, or an event), as it
// must be for any reuse.
bool Pool::Impl::reusable_ordered(const Block& f, StreamId stream) {
  if (reusable(f, stream)) return true;
  if (f.free_stream != detail::kMixedStreams) {
    // Note [Freed under another stream]: a third stream waits for the reader too.
    const bool reader_ordered = f.reader_slot == 0 || slots[f.reader_slot].stream == stream ||
                                order_after(stream, slots[f.reader_slot].stream, f.free_seq);
    return reader_ordered && order_after(stream, f.free_stream, f.free_seq);
  }
  for (std::size_t s = 1; s < slots.size(); ++s) {  // slot 0: memory never used
    const detail::StreamSlot& slot = slots[s];
    if (slot.stream == stream || slot.last_free_seq == 0) continue;
    if (!order_after(stream, slot.stream, std::min(f.free_seq, slot.last_free_seq))) return false;
  }
  return true;
}

// Note [Unmapped tail]
// No kernel can be using the part of a VMM heap's range past its last granule
// that holds memory (or waits to be unmapped): it was never used, or its
// memory was unmapped, which the pool does only behind a device barrier that
// began after the last free there (Note [Device barrier]). So any stream may
// take it with no wait, whatever the tags of the free block it lies in. The
// OOM ladder's last step before giving up, when the device barrier was
// refused (a capture, or a MemPool scope such as the warm-up of
// torch.compile's cudagraph trees) and every cached fit is fenced by another
// stream's frees: the request takes memory there, as PyTorch's allocator makes
// a new segment, instead of running out of memory with the device empty. The
// free block that runs to the end of the range holds that tail; it is split at
// the tail's first granule, and its upper part tagged as never used.
Block* Pool::Impl::take_unmapped_tail(Heap& heap, std::size_t size, StreamId stream) {
  std::size_t first = heap.granules.size();
  while (first > 0) {
    const detail::Granule& g = heap.granules[first - 1];
    if (g.backed() || g.stale || g.live) break;
    --first;
  }
  const Addr line = heap.base + first * gran;
  const Addr end = heap.base + heap.span;
  if (line >= end || end - line < size) return nullptr;
  const std::size_t missing = pin(heap, line, size);
  if (missing && !acquire(heap, line, size, missing, size, stream)) {
    unpin(heap, line, size, 0, 0, /*restore=*/true);
    return nullptr;
  }
  // Split only now, so that a failure leaves the blocks as they were.
  Block* tail = nullptr;
  heap.free.for_each_descending([&](Block* c) {  // the tail is nearly always the largest
    if (c->end() == end) tail = c;
    return tail == nullptr;
  });
  if (!tail || tail->addr > line) {  // not seen: a block past the line would hold a backed granule
    unpin(heap, line, size, 0, 0, /*restore=*/true);
    return nullptr;
  }
  Block* fresh = split_free_at(tail, line);
  fresh->free_stream = 0;
  fresh->free_seq = 0;
  fresh->reader_slot = 0;
  return carve(fresh, size);
}

bool Pool::Impl::order_after(StreamId waiter, StreamId signaler, std::uint64_t free_seq) {
  auto it = std::find_if(stream_orders.begin(), stream_orders.end(),
                         [&](const StreamOrder& o) { return o.waiter == waiter && o.signaler == signaler; });
  if (it != stream_orders.end() && it->seq >= free_seq) return true;
  if (!backend.order_streams(waiter, signaler)) return false;
  if (it == stream_orders.end()) {
    stream_orders.push_back(StreamOrder{waiter, signaler, seq});
  } else {
    it->seq = seq;
  }
  return true;
}

}  // namespace torchmem
