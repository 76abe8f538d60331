// budget.h: one device's memory budget, the one place a limit is set.
//
// A limit reaches a device pool from four places: the install config's
// `limit` (bytes or a fraction of the device), a starting fraction (torch's
// PYTORCH_ALLOC_CONF per_process_memory_fraction), torch's
// set_per_process_memory_fraction, and the share grant the sharing arbiter
// sets (torchmem/monitor/share.py, through _C.runtime_set_limit). Budget holds
// each of them, checks each set once, decides the limit in force by one rule
// (Note [Budget rule]) and pushes it to the core pool. Like RMM's
// limiting_resource_adaptor it is one object with one rule; unlike it, the
// bytes are counted by the pool, which enforces the limit it is given.
//
// Pure C++: no torch and no CUDA, so it is unit-tested with plain g++
// (tests/cpp/budget_test.cpp, tests/test_budget_rule.py).
//
// Note [Budget rule] The limit in force is the one set last: the install limit
// when the pool is made, then the starting fraction if one is given, then each
// set_per_process_memory_fraction and each share grant in the order they come.
// A later set replaces an earlier one, also upwards (a fraction of 1.0 lifts an
// install limit; a grant may exceed the install limit, which for a sharing
// process is its guarantee). It is not the minimum of what was set: a sharing
// process grows past its guarantee only because the grant replaces it, and
// torch's set_per_process_memory_fraction is documented to change the budget
// (docs/config.md). A fraction is f x the device's total memory; 1.0 means no
// limit. A fraction under one granule refuses every allocation (as PyTorch's
// allocator does for 0.0): the pool keeps the limit it had, and the refusal
// lasts until the next fraction is set (a grant does not lift it).
//
// Threading: setters serialize on the Budget's mutex, then take the pool's
// (budget -> pool, never the reverse). refuses_all() is one relaxed atomic
// load, read on the allocation path with no lock.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>

namespace torchmem {
class Pool;
}

namespace torchmem::shim {

// A limit as the user gave it: none, bytes, or a fraction of the device.
struct LimitSpec {
  enum class Kind { kNone, kBytes, kFraction };
  Kind kind = Kind::kNone;
  std::size_t bytes = 0;
  double fraction = 0.0;

  bool operator==(const LimitSpec& o) const { return kind == o.kind && bytes == o.bytes && fraction == o.fraction; }
  // Bytes on a device of `total_bytes`; 0 for none.
  std::size_t resolve(std::size_t total_bytes) const;
};

// What a Budget holds, for the bindings (_C.runtime_budget_state) and tests.
struct BudgetState {
  LimitSpec install;                 // the install config's limit, as given
  std::size_t install_bytes = 0;     // ... resolved on this device (0: none)
  double fraction = -1.0;            // the memory fraction last set (< 0: never)
  std::size_t grant_bytes = 0;       // the share grant last set (0: none or "whole device")
  bool granted = false;              // a grant was set
  const char* source = "none";       // which set is in force: none, limit, fraction, grant
  std::size_t limit_bytes = 0;       // the limit in force, pushed to the pool (0: none)
  bool refuses_all = false;          // a fraction under one granule is in force
  double memory_fraction = 1.0;      // what get_per_process_memory_fraction answers
  std::size_t total_bytes = 0;       // the device's memory
  std::size_t granularity = 0;       // the pool's granule
};

class Budget {
 public:
  // Checks, shared by the parsers and the setters: each throws
  // std::invalid_argument naming the bad value and what to give instead.
  static void check_limit(const LimitSpec& limit);     // the install config's 'limit'
  static void check_fraction(double fraction);         // set_per_process_memory_fraction
  static void check_initial_fraction(double fraction);  // the starting fraction, when one is given

  // Called with the pool made from the config, whose limit_bytes is
  // `install.resolve(total_bytes)`; applies `initial_fraction` when >= 0
  // (< 0: none).
  // `pool` may be null (tests of the rule alone).
  Budget(Pool* pool, LimitSpec install, double initial_fraction, std::size_t total_bytes, std::size_t granularity);

  // torch's set_per_process_memory_fraction(f), 0 <= f <= 1.
  void set_fraction(double fraction);
  // The sharing arbiter's grant: bytes (0 = the whole device). Throws
  // PoolError under one granule, as Pool::set_limit does.
  void set_grant(std::size_t bytes);

  // Every allocation is refused (Note [Budget rule]).
  bool refuses_all() const { return refuses_all_.load(std::memory_order_relaxed); }
  // The limit in force in bytes, 0 for none.
  std::size_t limit_bytes() const;
  // The fraction last set, else the install limit as a fraction of the device, else 1.0.
  double memory_fraction() const;
  BudgetState state() const;

 private:
  enum class Source { kNone, kInstall, kFraction, kGrant };
  void apply_fraction(double fraction);  // under mutex_
  void push(std::size_t bytes);          // under mutex_: to the pool

  Pool* const pool_;
  const LimitSpec install_;
  const std::size_t install_bytes_;
  const std::size_t total_bytes_;
  const std::size_t granularity_;

  mutable std::mutex mutex_;  // guards the fields below
  double fraction_ = -1.0;
  std::size_t grant_bytes_ = 0;
  bool granted_ = false;
  Source source_ = Source::kNone;
  std::size_t limit_bytes_ = 0;
  std::atomic<bool> refuses_all_{false};
};

// ---- each device's Budget (runtime.cpp; the device's pool is made first) ----
// Note [Memory fraction] torch's set_per_process_memory_fraction(f): the
// budget becomes f * device total (0 <= f <= 1; a budget under one granule
// refuses every allocation). memory_fraction() answers the fraction last set,
// else the install limit as a fraction of the device, else 1.0.
void set_memory_fraction(double fraction, int device);
double memory_fraction(int device);
// The sharing arbiter's grant in bytes (0 = the whole device): _C.runtime_set_limit.
void set_share_grant(int device, std::size_t bytes);
std::size_t budget_limit(int device);  // the limit in force, 0 for none
BudgetState budget_state(int device);

}  // namespace torchmem::shim
