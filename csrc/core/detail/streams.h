// streams.h: per-stream fences and reclaimable-granule lists (Note [Fences]).
//
// Every stream the pool has seen freeing memory gets a slot. A slot records
// fences lazily: one backend event covers every free on that stream up to the
// pool sequence number at which it was recorded, so `completed_seq` says
// "every free on this stream with seq <= completed_seq is no longer read by
// queued kernels". Slot 0 is special: memory that was never used (pre-mapped
// reserve) needs no fence, so its completed_seq is the maximum.
//
// Each slot also heads an intrusive list of the mapped granules that no live
// block overlaps and whose last block was freed on that stream, oldest free
// first. Reclaim takes the oldest head among slots whose fence covers it.
#pragma once

#include <cstdint>
#include <deque>
#include <limits>

#include "core/detail/heap.h"
#include "core/types.h"

namespace torchmem::detail {

struct Fence {
  EventHandle event = 0;
  std::uint64_t seq = 0;  // frees with seq <= this are covered
};

struct StreamSlot {
  StreamId stream = 0;
  std::uint64_t completed_seq = 0;   // frees up to here are safe to reuse anywhere
  std::uint64_t last_free_seq = 0;   // the latest free on this stream
  std::deque<Fence> fences;          // recorded, not yet seen complete; oldest first
  // Reclaimable granules freed on this stream, oldest first.
  GranuleRef head, tail;
  std::size_t listed = 0;

  static constexpr std::uint64_t kAlwaysComplete = std::numeric_limits<std::uint64_t>::max();
};

}  // namespace torchmem::detail
