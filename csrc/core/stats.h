// stats.h: the pool's counters, declared once (an X-macro) so the struct, the
// Python binding and the printers cannot drift apart.
//
// Names follow PyTorch's DeviceStats where a figure means the same thing, so the
// Python layer can answer torch.cuda.memory_stats() keys directly:
//   <stat>.{all,small_pool,large_pool}.{current,peak,allocated,freed}
// Stats are updated only after an operation succeeded, never inside split/merge
// code (see Note [Stats apart] in pool.h).
#pragma once

#include <algorithm>
#include <cstdint>

namespace torchmem {

// A gauge with its history: `allocated` and `freed` are running totals of the
// amounts added and removed, so current == allocated - freed always holds.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::uint64_t allocated = 0;
  std::uint64_t freed = 0;

  void increase(std::int64_t amount) {
    current += amount;
    allocated += static_cast<std::uint64_t>(amount);
    peak = std::max(peak, current);
  }
  void decrease(std::int64_t amount) {
    current -= amount;
    freed += static_cast<std::uint64_t>(amount);
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = static_cast<std::uint64_t>(current); freed = 0; }
};

// Index of the breakdown, as in PyTorch: all requests, then by heap.
enum StatKind : int { kStatAll = 0, kStatSmallPool = 1, kStatLargePool = 2, kStatKinds = 3 };

// Gauges broken down by StatKind.
//   allocation           live blocks (count)
//   segment              mapped granules (vmm) or segments (cuda_malloc) (count)
//   active               live blocks plus freed blocks still waiting on stream events (count)
//   inactive_split       free cached blocks (count)
//   allocated_bytes      live bytes, rounded to kMinBlockSize
//   reserved_bytes       bytes held from the backend (mapped granules or segments)
//   active_bytes         allocated_bytes plus bytes of freed blocks waiting on events
//   inactive_split_bytes free cached bytes inside mapped memory
//   requested_bytes      live bytes as requested (not rounded)
// inactive_split and inactive_split_bytes are derived (free blocks; reserved -
// active): the pool refreshes them when memory is mapped or unmapped and when
// stats are read, not on every cached malloc/free, so their peaks are sampled.
#define TORCHMEM_STAT_ARRAYS(X) \
  X(allocation)                 \
  X(segment)                    \
  X(active)                     \
  X(inactive_split)             \
  X(allocated_bytes)            \
  X(reserved_bytes)             \
  X(active_bytes)               \
  X(inactive_split_bytes)       \
  X(requested_bytes)

// Event counters (monotonic until reset_accumulated_stats).
//   num_alloc_retries     allocations that had to release cached memory and retry
//   num_ooms              allocations the pool could not satisfy
//   num_sync_all_streams  times the pool blocked on every pending event
//   num_device_alloc      granules created (vmm) or segments allocated (cuda_malloc)
//   num_device_free       granules released or segments freed
//   num_reclaims          granules moved from cached free space to a new block (stitching)
//   num_deferred_frees    frees that waited on foreign-stream events
//   num_cache_releases    release_cached() calls (empty_cache)
//   num_allocs, num_frees every successful allocate / deallocate
//   num_device_barriers   waits for the whole device (Note [Device barrier]), for any reason
//   num_plans             step plans put in force (Note [Step plan])
//   num_plan_hits         allocations placed where the plan in force said
//   num_plan_misses       allocations a plan in force could not place (served as before)
//   num_plan_drops        plans ended (misses, OOM, empty_cache, a lower budget)
//   num_plan_passes       planning passes run, whether or not their plan was put in force
//   plan_pass_us          host microseconds those passes took (Note [Planning pass cost])
//   num_backed_moves      fits moved to where cached granules back them (Note [Backed placement])
//   num_plan_lookups      requests the step plan named by hash lookups, its prediction missed
//                         (Note [Naming on the host])
//   num_lazy_pins         plan arenas found wholly mapped, which stopped counting per granule
//                         (Note [Lazy pins])
//   num_growths           mappings of new or moved memory, each one burst of driver calls
//                         (Note [Map groups]); num_device_alloc counts their granules
//   host_alloc_ns         host nanoseconds inside allocate, lock included (time_host_ops only)
//   host_free_ns          the same for deallocate
//   host_plan_ns          of host_alloc_ns and host_free_ns, the step plan's part (naming, placing)
#define TORCHMEM_COUNTERS(X) \
  X(num_alloc_retries)       \
  X(num_ooms)                \
  X(num_sync_all_streams)    \
  X(num_device_alloc)        \
  X(num_device_free)         \
  X(num_reclaims)            \
  X(num_deferred_frees)      \
  X(num_cache_releases)      \
  X(num_allocs)              \
  X(num_frees)               \
  X(num_device_barriers)     \
  X(num_plans)               \
  X(num_plan_hits)           \
  X(num_plan_misses)         \
  X(num_plan_drops)          \
  X(num_plan_passes)         \
  X(plan_pass_us)            \
  X(num_backed_moves)        \
  X(num_plan_lookups)        \
  X(num_lazy_pins)           \
  X(num_growths)             \
  X(host_alloc_ns)           \
  X(host_free_ns)            \
  X(host_plan_ns)

struct PoolStats {
#define TORCHMEM_DECLARE_STAT_ARRAY(name) Stat name[kStatKinds];
  TORCHMEM_STAT_ARRAYS(TORCHMEM_DECLARE_STAT_ARRAY)
#undef TORCHMEM_DECLARE_STAT_ARRAY
#define TORCHMEM_DECLARE_COUNTER(name) std::uint64_t name = 0;
  TORCHMEM_COUNTERS(TORCHMEM_DECLARE_COUNTER)
#undef TORCHMEM_DECLARE_COUNTER

  // Figures computed when stats are read, not maintained incrementally.
  std::uint64_t largest_free_block = 0;  // largest free block that needs no new memory
  std::uint64_t limit_bytes = 0;         // the budget in force (0 = device capacity)
  std::uint64_t granularity = 0;         // backend granule size
};

}  // namespace torchmem
