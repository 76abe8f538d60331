// stats.cpp: Pool::Impl's counters (Note [Stats apart] in core/pool.h): the
// derived gauges refreshed when memory moves, stats() itself, and the public
// reads and resets of them (Pool::stats, reset_peak_stats,
// reset_accumulated_stats). The
// per-operation updates the fast path makes (note_alloc, note_free_*) and
// trace() are inline in pool_impl.h.
#include <cstdint>
#include <mutex>

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

void Pool::Impl::hot_into(PoolStats& s) const {
  for (const detail::HotGaugeName& g : detail::kHotGauges) {
    for (int i = 0; i < kStatKinds; ++i) detail::copy_gauge(hot_[i].*g.hot, (s.*g.stat)[i]);
  }
}

void Pool::Impl::sync_current() { hot_into(stats_); }

void Pool::Impl::load_hot() {
  for (const detail::HotGaugeName& g : detail::kHotGauges) {
    for (int i = 0; i < kStatKinds; ++i) detail::copy_gauge((stats_.*g.stat)[i], hot_[i].*g.hot);
  }
}

void Pool::Impl::sync_memory_stats() {
  sync_current();  // inactive_split_bytes below reads active_bytes' current
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

// ---- the public reads and resets (Pool) ------------------------------------

PoolStats Pool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return impl_->stats();
}

namespace {

// `reset` on every stat array of `s` (Note [Stats apart]).
void reset_each_stat(PoolStats& s, void (Stat::*reset)()) {
#define TORCHMEM_RESET_STAT_ARRAY(name) \
  for (Stat& st : s.name) (st.*reset)();
  TORCHMEM_STAT_ARRAYS(TORCHMEM_RESET_STAT_ARRAY)
#undef TORCHMEM_RESET_STAT_ARRAY
}

}  // namespace

void Pool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  impl_->sync_memory_stats();
  reset_each_stat(impl_->stats_, &Stat::reset_peak);
  impl_->load_hot();  // Note [Hot gauges]
}

void Pool::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  impl_->sync_memory_stats();
  PoolStats& s = impl_->stats_;
  reset_each_stat(s, &Stat::reset_accumulated);
  impl_->load_hot();  // Note [Hot gauges]
#define TORCHMEM_RESET_COUNTER(name) s.name = 0;
  TORCHMEM_COUNTERS(TORCHMEM_RESET_COUNTER)
#undef TORCHMEM_RESET_COUNTER
}

}  // namespace torchmem
