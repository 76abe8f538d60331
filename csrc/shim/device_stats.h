// device_stats.h: what the runtime reports of a device's pools: stats as torch
// sees them, peak and accumulated resets, the trace ring, and the segments of
// external pools for snapshots. Defined in runtime.cpp and runtime_pools.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "shim/runtime.h"

namespace torchmem::shim {

// The device pool's stats as torch reports them: parked private-pool blocks
// count as freed (Note [Parked stats], runtime.cpp).
PoolStats device_stats(int device);
// torch's resetPeakStats / resetAccumulatedStats: the device pool and its external pools.
void reset_peak_stats(int device);
void reset_accumulated_stats(int device);
// Trace ring size for pools made from now on and for live pools (which keep
// their newest entries that fit; 0 stops tracing). clear_trace() empties
// every live pool's ring (torch's _record_memory_history(clear_history=True)).
void set_trace_capacity(std::size_t entries);
void clear_trace();
// The device pool's operation counter (Pool::sequence), 0 if it has no pool yet.
std::uint64_t pool_sequence(int device);
// The segments of every MemPool(allocator=X) pool of `device` whose X is not
// torchmem itself, with torch's key of each (snapshots show them as natively).
std::vector<std::pair<MempoolKey, PoolSnapshot>> external_pool_snapshots(int device);

}  // namespace torchmem::shim
