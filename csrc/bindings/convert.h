// convert.h: the pool's value types to and from Python dicts, in one place.
//
// Both torchmem._C.Pool (core_bindings.cpp) and the installed allocator's
// runtime bindings (runtime_bindings_cuda.cpp) answer stats() and snapshot()
// with these helpers, so a simulated pool and a real one give dicts of exactly
// the same shape, and the Python layer (torchmem.stats, snapshot_format) reads
// one format. Keys come from the X-macros in core/stats.h, so a new counter
// appears here without an edit.
//
// Shapes:
//   stats_to_dict: {"<stat>": {"all"|"small_pool"|"large_pool":
//                     {"current","peak","allocated","freed"}}, ... for every
//                   TORCHMEM_STAT_ARRAYS name, "<counter>": int for every
//                   TORCHMEM_COUNTERS name, "largest_free_block", "limit_bytes",
//                   "granularity"}
//   backend_counters_to_dict: {BackendCounters field: int}
//   snapshot_to_dict: {"segments": [{"address","total_size","small_heap","pool",
//                        "stream","blocks": [{"address","size","requested_size",
//                        "state","stream","context"}]}],
//                      "trace": [{"action","addr","size","stream","pool",
//                        "context","sequence"}]}
//   config_from_dict: keys are PoolConfig field names; an unknown key or a value
//                     of the wrong type raises ValueError naming the key.
//   sim_costs_from_dict: {SimCosts field ("map_us", ...): microseconds}, or None for
//                    the defaults; SimBackend(costs=) and replay(costs=) take it.
#pragma once

#include <pybind11/pybind11.h>

#include "backend/sim_backend.h"
#include "core/backend.h"
#include "core/pool.h"
#include "core/stats.h"

namespace torchmem::bindings {

pybind11::dict stats_to_dict(const PoolStats& stats);
pybind11::dict backend_counters_to_dict(const BackendCounters& counters);
pybind11::dict snapshot_to_dict(const PoolSnapshot& snapshot);
// Starts from `base` (default PoolConfig{}) and overrides the keys present.
PoolConfig config_from_dict(const pybind11::dict& config, const PoolConfig& base = PoolConfig{});
// [(name, kind, default, doc)] for every PoolConfig field (TORCHMEM_POOL_CONFIG).
pybind11::list pool_config_fields();
// SimCosts from {"<cost>_us": number} (None: the defaults); keys come from
// TORCHMEM_SIM_COSTS. An unknown key or a non-number raises ValueError naming
// it and `who` (the caller, for the message).
SimCosts sim_costs_from_dict(const pybind11::object& costs, const char* who);

// Names used in snapshots: "active_allocated" | "active_pending_free" |
// "inactive", and "alloc" | "free_requested" | "free_completed" |
// "segment_map" | "segment_unmap" | "oom".
const char* block_state_name(BlockState state);
const char* trace_action_name(TraceAction action);

}  // namespace torchmem::bindings
