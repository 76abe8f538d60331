// budget_test.cpp: Note [Budget rule] (csrc/shim/budget.h) on a simulated
// device, with plain g++ and no torch or CUDA: a Budget over a core Pool on a
// SimBackend. Built and run by tests/test_budget_rule.py (or `make test-budget`);
// prints "ok" and exits 0, or names the first failed check and exits 1.
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backend/sim_backend.h"
#include "core/pool.h"
#include "shim/budget.h"

using torchmem::kGiB;
using torchmem::kMiB;
using torchmem::Pool;
using torchmem::PoolConfig;
using torchmem::PoolError;
using torchmem::SimBackend;
using torchmem::SimConfig;
using torchmem::shim::Budget;
using torchmem::shim::LimitSpec;

namespace {

int failures = 0;

void check(bool ok, const char* what, int line) {
  if (!ok) {
    std::printf("FAILED line %d: %s\n", line, what);
    ++failures;
  }
}
#define CHECK(cond) check((cond), #cond, __LINE__)

template <class E, class F>
bool throws_with(F&& f, const std::string& text) {
  try {
    f();
  } catch (const E& e) {
    return std::string(e.what()).find(text) != std::string::npos;
  }
  return false;
}

constexpr std::size_t kTotal = 64 * kGiB;
constexpr std::size_t kGranule = 2 * kMiB;

SimConfig device() {
  SimConfig c;
  c.capacity_bytes = kTotal;
  c.granularity = kGranule;
  return c;
}

LimitSpec bytes(std::size_t b) { return {LimitSpec::Kind::kBytes, b, 0.0}; }
LimitSpec fraction(double f) { return {LimitSpec::Kind::kFraction, 0, f}; }

// A pool made as the runtime makes one: its limit is the install limit.
struct Device {
  SimBackend backend{device()};
  Pool pool;
  Budget budget;
  Device(LimitSpec install, double initial_fraction = -1.0)
      : pool(backend, config(install)), budget(&pool, install, initial_fraction, kTotal, kGranule) {}
  static PoolConfig config(LimitSpec install) {
    PoolConfig c;
    c.limit_bytes = install.resolve(kTotal);
    return c;
  }
  bool agrees() const { return pool.limit() == budget.limit_bytes(); }
};

void no_limit() {
  Device d(LimitSpec{});
  CHECK(d.budget.limit_bytes() == 0 && d.pool.limit() == 0);
  CHECK(d.budget.memory_fraction() == 1.0);
  CHECK(std::string(d.budget.state().source) == "none");
  CHECK(!d.budget.refuses_all());
}

void install_limit_then_fraction_then_grant_last_set_wins() {
  Device d(bytes(16 * kGiB));
  CHECK(d.budget.limit_bytes() == 16 * kGiB && d.agrees());
  CHECK(d.budget.memory_fraction() == 0.25);  // the install limit as a fraction of the device
  d.budget.set_fraction(0.5);  // upwards: replaces the install limit
  CHECK(d.budget.limit_bytes() == 32 * kGiB && d.agrees());
  CHECK(std::string(d.budget.state().source) == "fraction");
  d.budget.set_fraction(1.0);  // the whole device: no limit
  CHECK(d.budget.limit_bytes() == 0 && d.agrees());
  CHECK(d.budget.memory_fraction() == 1.0);
  d.budget.set_grant(40 * kGiB);
  CHECK(d.budget.limit_bytes() == 40 * kGiB && d.agrees());
  CHECK(d.budget.memory_fraction() == 1.0);  // a grant is not a fraction
  d.budget.set_fraction(0.25);
  CHECK(d.budget.limit_bytes() == 16 * kGiB && d.agrees());
}

void share_grant_exceeds_the_guarantee() {
  Device d(bytes(8 * kGiB));  // a sharing process starts at its guarantee
  d.budget.set_grant(24 * kGiB);
  CHECK(d.budget.limit_bytes() == 24 * kGiB && d.agrees());
  CHECK(d.budget.state().granted && d.budget.state().grant_bytes == 24 * kGiB);
  d.budget.set_grant(0);  // the whole device
  CHECK(d.budget.limit_bytes() == 0 && d.agrees());
}

void fraction_limit_and_initial_fraction() {
  Device d(fraction(0.5));
  CHECK(d.budget.limit_bytes() == 32 * kGiB && d.agrees());
  CHECK(d.budget.memory_fraction() == 0.5);
  Device e(LimitSpec{}, 0.25);  // PYTORCH_ALLOC_CONF's per_process_memory_fraction
  CHECK(e.budget.limit_bytes() == 16 * kGiB && e.agrees());
  CHECK(e.budget.memory_fraction() == 0.25);
  CHECK(std::string(e.budget.state().source) == "fraction");
}

void fraction_under_a_granule_refuses_everything_until_the_next_fraction() {
  Device d(bytes(16 * kGiB));
  d.budget.set_fraction(0.0);
  CHECK(d.budget.refuses_all());
  CHECK(d.pool.limit() == 16 * kGiB && d.agrees());  // the pool keeps the limit it had
  CHECK(d.budget.memory_fraction() == 0.0);
  d.budget.set_grant(8 * kGiB);  // a grant does not lift the refusal
  CHECK(d.budget.refuses_all() && d.agrees());
  d.budget.set_fraction(0.5);
  CHECK(!d.budget.refuses_all() && d.budget.limit_bytes() == 32 * kGiB && d.agrees());
}

void bad_values_are_refused_with_the_fix_and_change_nothing() {
  Device d(bytes(16 * kGiB));
  CHECK(throws_with<std::invalid_argument>([&] { d.budget.set_fraction(1.5); }, "must be in [0, 1], got 1.5"));
  CHECK(throws_with<std::invalid_argument>([&] { d.budget.set_fraction(-0.1); }, "must be in [0, 1]"));
  CHECK(throws_with<PoolError>([&] { d.budget.set_grant(kMiB); }, "give at least one granule or 0 for no limit"));
  CHECK(d.budget.limit_bytes() == 16 * kGiB && d.agrees() && !d.budget.refuses_all());
  CHECK(throws_with<std::invalid_argument>([] { Budget::check_limit(fraction(1.5)); },
                                           "'limit': a fraction must be in (0, 1], got 1.5"));
  CHECK(throws_with<std::invalid_argument>([] { Budget::check_limit(fraction(0.0)); }, "(0, 1]"));
  CHECK(throws_with<std::invalid_argument>([] { Budget::check_limit(bytes(0)); }, "None for no limit"));
  CHECK(throws_with<std::invalid_argument>([] { Budget::check_initial_fraction(2.0); }, "'initial_fraction'"));
  Budget::check_limit(LimitSpec{});
  Budget::check_limit(fraction(1.0));
  Budget::check_initial_fraction(0.0);
}

}  // namespace

int main() {
  no_limit();
  install_limit_then_fraction_then_grant_last_set_wins();
  share_grant_exceeds_the_guarantee();
  fraction_limit_and_initial_fraction();
  fraction_under_a_granule_refuses_everything_until_the_next_fraction();
  bad_values_are_refused_with_the_fix_and_change_nothing();
  if (failures != 0) return 1;
  std::printf("ok\n");
  return 0;
}
