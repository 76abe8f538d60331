// heap.h: a heap (the small or the large one of a pool id), its granule table
// (VMM) or its segments (cuda_malloc).
//
// VMM: a heap reserves one virtual range at creation and never grows it. Its
// blocks tile the whole range; the last free block is the unlimited tail that
// new space is carved from. Physical memory is tracked per granule: whether
// it is mapped (and with which handle) and how many live blocks (allocated or
// pending free) overlap it. A mapped granule with no live overlap sits on a
// reclaimable list (see streams.h) until it is reused in place, moved
// elsewhere (stitching) or released.
//
// cuda_malloc: a heap is a set of segments; blocks tile each segment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/detail/block.h"
#include "core/detail/free_by_addr.h"
#include "core/detail/free_index.h"
#include "core/types.h"

namespace torchmem::detail {

// A granule of some heap, by heap id and index inside the heap's range.
struct GranuleRef {
  std::uint32_t heap = kNone;
  std::uint32_t index = 0;
  static constexpr std::uint32_t kNone = ~std::uint32_t{0};
  bool empty() const { return heap == kNone; }
  bool operator==(const GranuleRef& o) const { return heap == o.heap && index == o.index; }
};

struct Granule {
  GranuleHandle handle = 0;  // 0: not mapped
  std::uint32_t live = 0;    // live blocks overlapping this granule
  // Reclaimable list links (valid while on_list): the list of `slot`'s stream.
  bool on_list = false;
  std::uint32_t slot = 0;    // stream slot whose fence guards the granule
  std::uint64_t seq = 0;     // pool sequence of the free that emptied it
  GranuleRef prev, next;
  // Stream slot of every free that touched this granule since its handle was
  // mapped here: 0 none yet, kMixedSlot for more than one stream. Only a
  // granule freed on one stream alone may be aliased (Note [Alias reclaim]).
  std::uint32_t owner = 0;
  // Pending unmap (Note [Pending unmaps]): `stale` is a handle that is live
  // at another address now but still mapped here until a device barrier
  // begins after the free `stale_seq`. For the pool the granule is unmapped
  // (handle == 0).
  GranuleHandle stale = 0;
  std::uint64_t stale_seq = 0;
  // Note [Run handles] (runs.cpp): run_count > 0 marks a granule of a
  // run handle shared by the run_count granules from run_first on; such a
  // granule is never listed as reclaimable (it cannot move alone). On the
  // run's first granule, run_busy counts the run's granules with live blocks.
  std::uint32_t run_first = 0;
  std::uint32_t run_count = 0;
  std::uint32_t run_busy = 0;
  // Note [Map groups] (inspect.cpp): which growth mapped the granule here.
  std::uint32_t group = 0;
  // Physical memory is mapped here: a granule handle or part of a run.
  bool backed() const { return handle != 0 || run_count != 0; }
  static constexpr std::uint32_t kMixedSlot = ~std::uint32_t{0};
  // `owner` once a free on `slot` (or on kMixedSlot's several streams) touched it too.
  static std::uint32_t merged_owner(std::uint32_t owner, std::uint32_t slot) {
    return owner == 0 || owner == slot ? slot : kMixedSlot;
  }
};

struct Segment {
  Addr addr = 0;
  std::size_t size = 0;
  bool pinned = false;  // holds reserve_bytes: kept by release_cached
  Block* first = nullptr;
};

struct Heap {
  std::uint32_t id = 0;
  PoolId pool = 0;
  bool small = false;
  // An in-use private pool's heap: its free memory is never reclaimed, moved
  // or released (Note [Private pools]); cleared at release_private_pool().
  bool frozen = false;
  // A step plan's arena (Note [Step plan arena] in plan_pool.cpp): blocks go
  // only where the plan says, found through free_by_addr (its free blocks by
  // address). Frozen while its plan is in force.
  bool arena = false;
  // The free set: an arena's is its address index, every other heap's its FreeIndex.
  void insert_free(Block* b) {
    if (arena) {
      free_by_addr.insert(b);
    } else {
      free.insert(b);
    }
  }
  std::size_t free_count() const { return arena ? free_by_addr.size() : free.size(); }
  bool holds_free(const Block* b) const { return arena ? free_by_addr.holds(b) : free.contains(b); }
  FreeByAddr free_by_addr;  // Note [Arena address index] (free_by_addr.h)
  // Note [Lazy pins] (plan_pool.cpp): blocks wholly below pins_lazy_below
  // (0: none) move no granule's counts; the frees among them are summed here.
  Addr pins_lazy_below = 0;
  std::uint64_t lazy_free_seq = 0;   // the latest such free's pool sequence (0: none yet)
  std::uint32_t lazy_free_slot = 0;  // its stream slot
  std::uint32_t lazy_free_owner = 0;  // every such free's slot, or Granule::kMixedSlot
  // VMM
  Addr base = 0;
  std::size_t span = 0;
  std::vector<Granule> granules;  // grows on demand, up to span / granularity
  std::size_t mapped = 0;         // granules mapped
  std::size_t stale = 0;          // granules pending unmap (not in `mapped`)
  // cuda_malloc
  std::vector<std::unique_ptr<Segment>> segments;
  std::size_t segment_bytes = 0;

  FreeIndex free;          // an arena's stays empty (Note [Arena free set] in plan_pool.cpp)
  Block* first = nullptr;  // VMM: the lowest block of the range
  // Tallies of live blocks, kept by the carving code for invariants and for
  // largest-free and snapshot queries (stats proper live in PoolStats).
  std::size_t live_blocks = 0;
};

}  // namespace torchmem::detail
