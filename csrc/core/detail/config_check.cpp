// config_check.cpp: checks a PoolConfig against its backend before a pool is
// built, so a bad option fails with a message that names the field and the fix
// (PoolError) and nothing is reserved or mapped.
#include <cmath>
#include <string>

#include "core/detail/pool_impl.h"

namespace torchmem {

// Validates `c` against `backend`; throws PoolError naming the field.
void validate_config(const PoolConfig& c, Backend& backend, std::size_t capacity) {
  const std::size_t g = backend.granularity();
  if (g < kMinBlockSize || (g & (g - 1)) != 0) {
    throw PoolError("backend granularity " + std::to_string(g) +
                    " is not a power of two >= 512 bytes (a backend bug)");
  }
  if (c.limit_bytes != 0 && c.limit_bytes < g) {
    throw PoolError("PoolConfig.limit_bytes = " + mib(c.limit_bytes) +
                    " is below one granule (" + mib(g) + "); give at least one granule or 0 for no limit");
  }
  if (c.small_page_bytes == 0 || c.small_page_bytes % g != 0) {
    throw PoolError("PoolConfig.small_page_bytes = " + std::to_string(c.small_page_bytes) +
                    " is not a positive multiple of the backend granularity (" + std::to_string(g) + ")");
  }
  if (c.small_threshold == 0 || c.small_threshold > c.small_page_bytes) {
    throw PoolError("PoolConfig.small_threshold = " + std::to_string(c.small_threshold) +
                    " must be in (0, small_page_bytes = " + std::to_string(c.small_page_bytes) + "]");
  }
  if (!(c.reclaim_slack >= 0.0) || !std::isfinite(c.reclaim_slack)) {
    throw PoolError("PoolConfig.reclaim_slack = " + std::to_string(c.reclaim_slack) +
                    " must be a finite number >= 0");
  }
  if (!(c.stitch_above >= 0.0 && c.stitch_above <= 1.0)) {
    throw PoolError("PoolConfig.stitch_above = " + std::to_string(c.stitch_above) +
                    " must be in [0, 1] (a fraction of the budget)");
  }
  if (!(c.stitch_above_limit >= 0.0 && c.stitch_above_limit <= 1.0)) {
    throw PoolError("PoolConfig.stitch_above_limit = " + std::to_string(c.stitch_above_limit) +
                    " must be in [0, 1] (a fraction of the limit)");
  }
  if (!(c.run_below >= 0.0 && c.run_below <= 1.0)) {
    throw PoolError("PoolConfig.run_below = " + std::to_string(c.run_below) +
                    " must be in [0, 1] (a fraction of the budget; 0 = a handle per granule)");
  }
  if (!(c.run_below_limit >= 0.0 && c.run_below_limit <= 1.0)) {
    throw PoolError("PoolConfig.run_below_limit = " + std::to_string(c.run_below_limit) +
                    " must be in [0, 1] (a fraction of the limit; 0 = a handle per granule under a limit)");
  }
  const std::size_t limit = c.limit_bytes ? c.limit_bytes : capacity;
  if (c.reserve_bytes > limit) {
    throw PoolError("PoolConfig.reserve_bytes = " + mib(c.reserve_bytes) + " exceeds the limit, " +
                    mib(limit) + "; lower reserve_bytes or raise limit_bytes");
  }
  if (c.virtual_bytes != 0 && c.virtual_bytes < g) {
    throw PoolError("PoolConfig.virtual_bytes = " + std::to_string(c.virtual_bytes) +
                    " is below one granule; use 0 for the default (twice the device memory)");
  }
}

}  // namespace torchmem
