// convert.cpp: the dict conversions declared in convert.h.
//
// Everything is driven by the X-macros of core/stats.h and by the field lists
// below, written once, so Python sees the same keys from every pool.
#include "bindings/convert.h"

#include <string>
#include <type_traits>

namespace py = pybind11;

namespace torchmem::bindings {

namespace {

py::dict stat_to_dict(const Stat& stat) {
  py::dict d;
  d["current"] = stat.current;
  d["peak"] = stat.peak;
  d["allocated"] = stat.allocated;
  d["freed"] = stat.freed;
  return d;
}

py::dict stat_array_to_dict(const Stat (&stats)[kStatKinds]) {
  py::dict d;
  d["all"] = stat_to_dict(stats[kStatAll]);
  d["small_pool"] = stat_to_dict(stats[kStatSmallPool]);
  d["large_pool"] = stat_to_dict(stats[kStatLargePool]);
  return d;
}

// Reads `value` as T, or raises ValueError naming `key`.
template <typename T>
T field(const std::string& key, const py::handle& value, const char* expected) {
  // bool is an int subclass in Python: refuse it for sizes, and refuse ints
  // other than 0/1 for flags, so a typo does not silently pass.
  if constexpr (std::is_same_v<T, bool>) {
    if (py::isinstance<py::bool_>(value)) return value.cast<bool>();
    if (py::isinstance<py::int_>(value)) {
      long long v = value.cast<long long>();
      if (v == 0 || v == 1) return v == 1;
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!py::isinstance<py::bool_>(value) &&
        (py::isinstance<py::float_>(value) || py::isinstance<py::int_>(value))) {
      return value.cast<T>();
    }
  } else {
    if (!py::isinstance<py::bool_>(value) && py::isinstance<py::int_>(value)) {
      if (value.cast<py::int_>() < py::int_(0)) {
        throw py::value_error("torchmem pool config '" + key + "': must be >= 0, got " +
                              py::repr(value).cast<std::string>());
      }
      return value.cast<T>();
    }
  }
  throw py::value_error("torchmem pool config '" + key + "': expected " + expected + ", got " +
                        py::repr(value).cast<std::string>());
}

}  // namespace

const char* block_state_name(BlockState state) {
  switch (state) {
    case BlockState::kAllocated: return "active_allocated";
    case BlockState::kPendingFree: return "active_pending_free";
    case BlockState::kInactive: return "inactive";
  }
  return "unknown";
}

const char* trace_action_name(TraceAction action) {
  switch (action) {
    case TraceAction::kAlloc: return "alloc";
    case TraceAction::kFreeRequested: return "free_requested";
    case TraceAction::kFreeCompleted: return "free_completed";
    case TraceAction::kSegmentMap: return "segment_map";
    case TraceAction::kSegmentUnmap: return "segment_unmap";
    case TraceAction::kOom: return "oom";
  }
  return "unknown";
}

py::dict stats_to_dict(const PoolStats& stats) {
  py::dict d;
#define TORCHMEM_STAT_ARRAY_TO_DICT(name) d[#name] = stat_array_to_dict(stats.name);
  TORCHMEM_STAT_ARRAYS(TORCHMEM_STAT_ARRAY_TO_DICT)
#undef TORCHMEM_STAT_ARRAY_TO_DICT
#define TORCHMEM_COUNTER_TO_DICT(name) d[#name] = stats.name;
  TORCHMEM_COUNTERS(TORCHMEM_COUNTER_TO_DICT)
#undef TORCHMEM_COUNTER_TO_DICT
  d["largest_free_block"] = stats.largest_free_block;
  d["limit_bytes"] = stats.limit_bytes;
  d["granularity"] = stats.granularity;
  return d;
}

py::dict backend_counters_to_dict(const BackendCounters& c) {
  py::dict d;
#define TORCHMEM_BACKEND_COUNTER_TO_DICT(name) d[#name] = c.name;
  TORCHMEM_BACKEND_COUNTERS(TORCHMEM_BACKEND_COUNTER_TO_DICT)
#undef TORCHMEM_BACKEND_COUNTER_TO_DICT
  return d;
}

py::dict snapshot_to_dict(const PoolSnapshot& snapshot) {
  py::list segments;
  for (const SegmentInfo& seg : snapshot.segments) {
    py::list blocks;
    for (const BlockInfo& b : seg.blocks) {
      py::dict block;
      block["address"] = b.addr;
      block["size"] = b.size;
      block["requested_size"] = b.requested;
      block["state"] = block_state_name(b.state);
      block["stream"] = b.stream;
      block["context"] = b.context;
      blocks.append(std::move(block));
    }
    py::dict s;
    s["address"] = seg.addr;
    s["total_size"] = seg.size;
    s["small_heap"] = seg.small_heap;
    s["pool"] = seg.pool;
    s["stream"] = seg.stream;
    s["blocks"] = std::move(blocks);
    segments.append(std::move(s));
  }
  py::list trace;
  for (const TraceEntry& e : snapshot.trace) {
    py::dict t;
    t["action"] = trace_action_name(e.action);
    t["addr"] = e.addr;
    t["size"] = e.size;
    t["stream"] = e.stream;
    t["pool"] = e.pool;
    t["context"] = e.context;
    t["sequence"] = e.sequence;
    trace.append(std::move(t));
  }
  py::dict d;
  d["segments"] = std::move(segments);
  d["trace"] = std::move(trace);
  return d;
}

namespace {
template <typename T>
const char* expected_kind() {
  if constexpr (std::is_same_v<T, bool>) return "True or False";
  else if constexpr (std::is_same_v<T, double>) return "a number";
  else return "an int";
}
}  // namespace

PoolConfig config_from_dict(const py::dict& config, const PoolConfig& base) {
  PoolConfig c = base;
  for (const auto& item : config) {
    const std::string key = item.first.cast<std::string>();
    const py::handle value = item.second;
#define TORCHMEM_PARSE_POOL_CONFIG(type, name, default_value, doc) \
    if (key == #name) {                                              \
      c.name = field<type>(key, value, expected_kind<type>());       \
      continue;                                                      \
    }
    TORCHMEM_POOL_CONFIG(TORCHMEM_PARSE_POOL_CONFIG)
#undef TORCHMEM_PARSE_POOL_CONFIG
    std::string allowed;
#define TORCHMEM_NAME_POOL_CONFIG(type, name, default_value, doc) allowed += std::string(allowed.empty() ? "" : ", ") + #name;
    TORCHMEM_POOL_CONFIG(TORCHMEM_NAME_POOL_CONFIG)
#undef TORCHMEM_NAME_POOL_CONFIG
    throw py::value_error("torchmem pool config: unknown key '" + key + "'; allowed: " + allowed);
  }
  return c;
}

py::list pool_config_fields() {
  py::list out;
  const PoolConfig defaults;
#define TORCHMEM_DESCRIBE_POOL_CONFIG(type, name, default_value, doc) \
  out.append(py::make_tuple(#name, expected_kind<type>(), py::cast(defaults.name), doc));
  TORCHMEM_POOL_CONFIG(TORCHMEM_DESCRIBE_POOL_CONFIG)
#undef TORCHMEM_DESCRIBE_POOL_CONFIG
  return out;
}

SimCosts sim_costs_from_dict(const pybind11::object& costs, const char* who) {
  namespace py = pybind11;
  SimCosts result;
  if (costs.is_none()) return result;
  if (!py::isinstance<py::dict>(costs)) {
    throw py::value_error(std::string(who) + " costs: expected a dict of microseconds per call");
  }
  for (const auto& item : costs.cast<py::dict>()) {
    const std::string key = py::str(item.first);
    double value;
    try {
      value = item.second.cast<double>();
    } catch (const py::cast_error&) {
      throw py::value_error(std::string(who) + " costs['" + key + "']: expected a number of microseconds");
    }
#define TORCHMEM_PARSE_SIM_COST(name, default_value) \
  if (key == #name) {                                \
    result.name = value;                             \
    continue;                                        \
  }
    TORCHMEM_SIM_COSTS(TORCHMEM_PARSE_SIM_COST)
#undef TORCHMEM_PARSE_SIM_COST
    std::string allowed;
#define TORCHMEM_NAME_SIM_COST(name, default_value) allowed += std::string(allowed.empty() ? "" : ", ") + #name;
    TORCHMEM_SIM_COSTS(TORCHMEM_NAME_SIM_COST)
#undef TORCHMEM_NAME_SIM_COST
    throw py::value_error(std::string(who) + " costs: unknown key '" + key + "'; allowed: " + allowed);
  }
  return result;
}

}  // namespace torchmem::bindings
