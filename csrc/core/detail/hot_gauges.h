// hot_gauges.h: the five gauges every allocation and free moves, laid out for
// the fast path (Note [Hot gauges] in pool_impl.h) rather than as PoolStats'
// arrays, and the copies between the two.
#pragma once

#include <cstdint>

#include "core/stats.h"

namespace torchmem::detail {

// A gauge as the fast path keeps it (Note [Lazy current]): current is
// allocated - freed, computed when needed.
struct HotGauge {
  std::uint64_t allocated = 0;
  std::uint64_t freed = 0;
  std::int64_t peak = 0;

  std::int64_t current() const { return static_cast<std::int64_t>(allocated - freed); }
  void increase(std::uint64_t amount) {
    allocated += amount;
    if (current() > peak) peak = current();
  }
  void decrease(std::uint64_t amount) { freed += amount; }
};

// One stat kind's five: 120 bytes, two cache lines.
struct alignas(64) HotGauges {
  HotGauge allocation, active, allocated_bytes, active_bytes, requested_bytes;
};

// Each hot gauge and the PoolStats array it stands for.
struct HotGaugeName {
  HotGauge HotGauges::*hot;
  Stat (PoolStats::*stat)[kStatKinds];
};
inline constexpr HotGaugeName kHotGauges[] = {
    {&HotGauges::allocation, &PoolStats::allocation},
    {&HotGauges::active, &PoolStats::active},
    {&HotGauges::allocated_bytes, &PoolStats::allocated_bytes},
    {&HotGauges::active_bytes, &PoolStats::active_bytes},
    {&HotGauges::requested_bytes, &PoolStats::requested_bytes},
};

inline void copy_gauge(const HotGauge& from, Stat& to) {
  to.allocated = from.allocated;
  to.freed = from.freed;
  to.peak = from.peak;
  to.current = from.current();
}

inline void copy_gauge(const Stat& from, HotGauge& to) {
  to.allocated = from.allocated;
  to.freed = from.freed;
  to.peak = from.peak;
}

}  // namespace torchmem::detail
