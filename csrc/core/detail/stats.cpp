// stats.cpp: Pool::Impl's counters (Note [Stats apart] in core/pool.h): the
// per-operation updates the fast path makes, the derived gauges refreshed when
// memory moves, and the trace ring's one entry point.
#include <cstdint>

#include "core/detail/pool_impl.h"

namespace torchmem {

namespace {

// Sets a gauge to `value`, recording the change as an increase or decrease.
inline void set_gauge(Stat& stat, std::int64_t value) {
  if (value > stat.current) {
    stat.increase(value - stat.current);
  } else if (value < stat.current) {
    stat.decrease(stat.current - value);
  }
}

}  // namespace

void Pool::Impl::note_alloc(bool small, std::size_t size, std::size_t requested) {
  const int k = small ? kStatSmallPool : kStatLargePool;
  for (int i : {int(kStatAll), k}) {
    stats_.allocation[i].increase(1);
    stats_.active[i].increase(1);
    stats_.allocated_bytes[i].increase(static_cast<std::int64_t>(size));
    stats_.active_bytes[i].increase(static_cast<std::int64_t>(size));
    stats_.requested_bytes[i].increase(static_cast<std::int64_t>(requested));
  }
  ++stats_.num_allocs;
}

void Pool::Impl::note_free_requested(bool small, std::size_t size, std::size_t requested, bool) {
  const int k = small ? kStatSmallPool : kStatLargePool;
  for (int i : {int(kStatAll), k}) {
    stats_.allocation[i].decrease(1);
    stats_.allocated_bytes[i].decrease(static_cast<std::int64_t>(size));
    stats_.requested_bytes[i].decrease(static_cast<std::int64_t>(requested));
  }
  ++stats_.num_frees;
}

void Pool::Impl::note_free_completed(bool small, std::size_t size) {
  const int k = small ? kStatSmallPool : kStatLargePool;
  for (int i : {int(kStatAll), k}) {
    stats_.active[i].decrease(1);
    stats_.active_bytes[i].decrease(static_cast<std::int64_t>(size));
  }
}

void Pool::Impl::sync_memory_stats() {
  memory_dirty = false;
  std::int64_t total_segments = 0, total_reserved = 0, total_free = 0;
  const int kinds[2] = {kStatSmallPool, kStatLargePool};
  for (int j = 0; j < 2; ++j) {
    const int k = kinds[j];
    const std::int64_t segments =
        static_cast<std::int64_t>(vmm ? mapped_bytes[j] / gran : segment_count[j]);
    const std::int64_t reserved = static_cast<std::int64_t>(mapped_bytes[j]);
    // A VMM heap's tail is free space, not a cached block.
    const std::int64_t free_count = static_cast<std::int64_t>(free_blocks[j] - (vmm ? heap_count[j] : 0));
    set_gauge(stats_.segment[k], segments);
    set_gauge(stats_.reserved_bytes[k], reserved);
    set_gauge(stats_.inactive_split[k], free_count);
    set_gauge(stats_.inactive_split_bytes[k], reserved - stats_.active_bytes[k].current);
    total_segments += segments;
    total_reserved += reserved;
    total_free += free_count;
  }
  set_gauge(stats_.segment[kStatAll], total_segments);
  set_gauge(stats_.reserved_bytes[kStatAll], total_reserved);
  set_gauge(stats_.inactive_split[kStatAll], total_free);
  set_gauge(stats_.inactive_split_bytes[kStatAll], total_reserved - stats_.active_bytes[kStatAll].current);
}

PoolStats Pool::Impl::stats() {
  // The inactive gauges are derived (free blocks, reserved - active): the fast
  // path leaves them alone and they are refreshed here and whenever memory moves.
  sync_memory_stats();
  PoolStats s = stats_;
  s.largest_free_block = largest_free_block();
  s.limit_bytes = config.limit_bytes;
  s.granularity = gran;
  return s;
}

void Pool::Impl::trace(TraceAction action, Addr addr, std::size_t size, StreamId stream, PoolId pool,
                       std::uint64_t context) {
  if (ring.enabled()) ring.push(TraceEntry{action, addr, size, stream, pool, context, seq});
}

}  // namespace torchmem
