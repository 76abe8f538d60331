// host_clock.h: the pool's own host time, counted only when asked
// (PoolConfig::time_host_ops).
//
// Note [Host time]
// A step that is host-bound is as fast as its host work, and the pool's work
// per allocation is part of it. The counters host_alloc_ns, host_free_ns and
// host_plan_ns say how much, measured where it happens rather than guessed
// from a step's total: a step's time moves with its process's pace far more
// than with the pool. The clock is read inside the lock (contention is not the
// pool's work) and never when the option is off: measuring adds clock reads
// to every allocation and free, so it is a diagnosis, not a default. Each
// clock also adds its reads to what it measures: the plan's part is read
// inside the totals (one more pair in a planned allocation, two in a planned
// free), so with the option on the plan path reads slower than it runs by
// about three clock pairs per allocation and free.
#pragma once

#include <chrono>
#include <cstdint>

namespace torchmem::detail {

class HostClock {
 public:
  // Adds the nanoseconds until destruction to `total` when `on`.
  HostClock(bool on, std::uint64_t& total) : total_(on ? &total : nullptr), start_(on ? now() : Time{}) {}
  ~HostClock() {
    if (total_ != nullptr) {
      *total_ += static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now() - start_).count());
    }
  }
  HostClock(const HostClock&) = delete;
  HostClock& operator=(const HostClock&) = delete;

 private:
  using Time = std::chrono::steady_clock::time_point;
  static Time now() { return std::chrono::steady_clock::now(); }
  std::uint64_t* total_;
  Time start_;
};

}  // namespace torchmem::detail
