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
#include <map>
#include <memory>
#include <vector>

#include "core/detail/block.h"
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
};

// Freed nodes of one std::map, kept for its next insert: the map's nodes are
// all one size, and the pool's lock covers the map, so a plain list will do.
class NodeCache {
 public:
  NodeCache() = default;
  NodeCache(const NodeCache&) = delete;
  NodeCache& operator=(const NodeCache&) = delete;
  ~NodeCache() {
    for (void* p : free_) ::operator delete(p);
  }
  void* take(std::size_t bytes) {
    if (bytes == node_bytes_ && !free_.empty()) {
      void* p = free_.back();
      free_.pop_back();
      return p;
    }
    return ::operator new(bytes);
  }
  void give(void* p, std::size_t bytes) {
    if (node_bytes_ == 0) node_bytes_ = bytes;
    if (bytes == node_bytes_) {
      free_.push_back(p);
    } else {
      ::operator delete(p);
    }
  }

 private:
  std::size_t node_bytes_ = 0;
  std::vector<void*> free_;
};

// A std allocator over a NodeCache (single objects; arrays go to operator new).
template <class T>
struct RecyclingAllocator {
  using value_type = T;
  NodeCache* cache;
  explicit RecyclingAllocator(NodeCache* c) : cache(c) {}
  template <class U>
  RecyclingAllocator(const RecyclingAllocator<U>& o) : cache(o.cache) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(n == 1 ? cache->take(sizeof(T)) : ::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) {
    if (n == 1) {
      cache->give(p, sizeof(T));
    } else {
      ::operator delete(p);
    }
  }
  template <class U>
  bool operator==(const RecyclingAllocator<U>& o) const { return cache == o.cache; }
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
      free_by_addr.emplace(b->addr, b);
    } else {
      free.insert(b);
    }
  }
  std::size_t free_count() const { return arena ? free_by_addr.size() : free.size(); }
  bool holds_free(const Block* b) const {
    if (!arena) return free.contains(b);
    auto it = free_by_addr.find(b->addr);
    return it != free_by_addr.end() && it->second == b;
  }
  // A planned request and its free each insert and erase entries here: their
  // nodes are recycled (NodeCache) rather than taken from malloc every time.
  NodeCache free_by_addr_nodes;
  std::map<Addr, Block*, std::less<Addr>, RecyclingAllocator<std::pair<const Addr, Block*>>> free_by_addr{
      RecyclingAllocator<std::pair<const Addr, Block*>>(&free_by_addr_nodes)};
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
