// segments.cpp: cuda_malloc mode (backend without VMM): memory comes in
// segments that can never be stitched, so the pool behaves like PyTorch's
// native allocator with torchmem's ladder on top: small requests share
// small_page_bytes segments; a large request gets max(20 MiB, size rounded to
// 2 MiB) (just the rounded size when 20 MiB would break the budget); empty
// segments go back on release_cached() and on the OOM ladder.
#include <algorithm>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Block;
using detail::Heap;
using detail::Segment;

namespace {
constexpr std::size_t kLargeSegment = 20 * kMiB;
constexpr std::size_t kRoundLarge = 2 * kMiB;
}  // namespace

bool Pool::Impl::grow_segments(Heap& heap, std::size_t size) {
  const std::size_t limit = budget();
  const std::size_t rounded = (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
  std::size_t bytes = heap.small ? config.small_page_bytes : std::max(kLargeSegment, rounded);
  if (held + bytes > limit && !heap.small) bytes = rounded;
  if (held + bytes > limit) return false;
  const Addr addr = segment_ops->allocate_segment(bytes);
  if (!addr) return false;
  auto seg = std::make_unique<Segment>();
  seg->addr = addr;
  seg->size = bytes;
  Block* b = arena.make();
  b->addr = addr;
  b->size = bytes;
  b->heap = &heap;
  b->segment = seg.get();
  seg->first = b;
  heap.free.insert(b);
  const int kind = heap.small ? 0 : 1;
  ++free_blocks[kind];
  heap.segment_bytes += bytes;
  heap.segments.push_back(std::move(seg));
  held += bytes;
  memory_dirty = true;
  ++segment_count[kind];
  mapped_bytes[kind] += bytes;
  ++stats_.num_device_alloc;
  trace(TraceAction::kSegmentMap, addr, bytes, 0, heap.pool, op_context);
  return true;
}

void Pool::Impl::free_segment(Heap& heap, Segment* seg) {
  Block* b = seg->first;
  heap.free.erase(b);
  arena.recycle(b);
  const int kind = heap.small ? 0 : 1;
  --free_blocks[kind];
  segment_ops->free_segment(seg->addr, seg->size);
  held -= seg->size;
  memory_dirty = true;
  heap.segment_bytes -= seg->size;
  --segment_count[kind];
  mapped_bytes[kind] -= seg->size;
  ++stats_.num_device_free;
  trace(TraceAction::kSegmentUnmap, seg->addr, seg->size, 0, heap.pool, op_context);
  auto it = std::find_if(heap.segments.begin(), heap.segments.end(),
                         [seg](const std::unique_ptr<Segment>& s) { return s.get() == seg; });
  heap.segments.erase(it);
}

std::size_t Pool::Impl::release_empty_segments(bool include_pinned) {
  std::size_t released = 0;
  for (auto& heap : heaps) {
    if (heap) released += release_empty_segments_of(*heap, include_pinned);
  }
  return released;
}

std::size_t Pool::Impl::release_empty_segments_of(Heap& heap, bool include_pinned) {
  if (heap.frozen) return 0;  // Note [Private pools]
  std::size_t released = 0;
  for (std::size_t i = heap.segments.size(); i-- > 0;) {
    Segment* s = heap.segments[i].get();
    if ((s->pinned && !include_pinned) || !s->first->is_free() || s->first->next) continue;
    released += s->size;
    free_segment(heap, s);
  }
  return released;
}

}  // namespace torchmem
