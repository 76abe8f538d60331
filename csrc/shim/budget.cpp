// budget.cpp: the rule of Note [Budget rule] (budget.h) and its checks.
#include "shim/budget.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/format.h"
#include "core/pool.h"

namespace torchmem::shim {

std::size_t LimitSpec::resolve(std::size_t total_bytes) const {
  switch (kind) {
    case Kind::kNone: return 0;
    case Kind::kBytes: return bytes;
    case Kind::kFraction: return static_cast<std::size_t>(fraction * static_cast<double>(total_bytes));
  }
  return 0;
}

void Budget::check_limit(const LimitSpec& limit) {
  switch (limit.kind) {
    case LimitSpec::Kind::kNone: return;
    case LimitSpec::Kind::kFraction:
      if (!(limit.fraction > 0.0 && limit.fraction <= 1.0)) {
        throw std::invalid_argument("torchmem config 'limit': a fraction must be in (0, 1], got " +
                                    std::to_string(limit.fraction));
      }
      return;
    case LimitSpec::Kind::kBytes:
      if (limit.bytes == 0) throw std::invalid_argument("torchmem config 'limit': bytes must be > 0 (None for no limit)");
      return;
  }
}

void Budget::check_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw std::invalid_argument("torchmem: memory fraction must be in [0, 1], got " + std::to_string(fraction));
  }
}

void Budget::check_initial_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw std::invalid_argument("torchmem runtime config 'initial_fraction': expected None or a fraction in [0, 1]");
  }
}

Budget::Budget(Pool* pool, LimitSpec install, double initial_fraction, std::size_t total_bytes,
               std::size_t granularity)
    : pool_(pool),
      install_(install),
      install_bytes_(install.resolve(total_bytes)),
      total_bytes_(total_bytes),
      granularity_(granularity) {
  check_limit(install_);
  if (initial_fraction >= 0.0) check_initial_fraction(initial_fraction);
  std::lock_guard<std::mutex> lock(mutex_);
  // The pool was made with install_bytes_ as its limit: nothing to push.
  limit_bytes_ = install_bytes_;
  source_ = install_.kind == LimitSpec::Kind::kNone ? Source::kNone : Source::kInstall;
  if (initial_fraction >= 0.0) apply_fraction(initial_fraction);
}

void Budget::set_fraction(double fraction) {
  check_fraction(fraction);
  std::lock_guard<std::mutex> lock(mutex_);
  apply_fraction(fraction);
}

void Budget::set_grant(std::size_t bytes) {
  if (bytes != 0 && bytes < granularity_) {
    throw PoolError("set_limit: " + mib(bytes) + " is below one granule (" + mib(granularity_) +
                    "); give at least one granule or 0 for no limit");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  push(bytes);
  grant_bytes_ = bytes;
  granted_ = true;
  source_ = Source::kGrant;
}

// 1.0 is the whole device, which is also "no limit".
void Budget::apply_fraction(double fraction) {
  const auto bytes = static_cast<std::size_t>(fraction * static_cast<double>(total_bytes_));
  const bool refuse = fraction < 1.0 && bytes < granularity_;
  if (!refuse) {
    push(fraction < 1.0 ? bytes : 0);
    source_ = Source::kFraction;
  }
  refuses_all_.store(refuse, std::memory_order_relaxed);
  fraction_ = fraction;
}

void Budget::push(std::size_t bytes) {
  if (pool_ != nullptr) pool_->set_limit(bytes);
  limit_bytes_ = bytes;
}

std::size_t Budget::limit_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_bytes_;
}

double Budget::memory_fraction() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fraction_ >= 0.0) return fraction_;
  if (install_.kind == LimitSpec::Kind::kFraction) return install_.fraction;
  if (install_.kind == LimitSpec::Kind::kNone || total_bytes_ == 0) return 1.0;
  return std::min(1.0, static_cast<double>(install_.bytes) / static_cast<double>(total_bytes_));
}

BudgetState Budget::state() const {
  BudgetState out;
  out.memory_fraction = memory_fraction();
  std::lock_guard<std::mutex> lock(mutex_);
  out.install = install_;
  out.install_bytes = install_bytes_;
  out.fraction = fraction_;
  out.grant_bytes = grant_bytes_;
  out.granted = granted_;
  switch (source_) {
    case Source::kNone: out.source = "none"; break;
    case Source::kInstall: out.source = "limit"; break;
    case Source::kFraction: out.source = "fraction"; break;
    case Source::kGrant: out.source = "grant"; break;
  }
  out.limit_bytes = limit_bytes_;
  out.refuses_all = refuses_all();
  out.total_bytes = total_bytes_;
  out.granularity = granularity_;
  return out;
}

}  // namespace torchmem::shim
