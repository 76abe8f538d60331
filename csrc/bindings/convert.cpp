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

PoolConfig config_from_dict(const py::dict& config, const PoolConfig& base) {
  PoolConfig c = base;
  for (const auto& item : config) {
    if (!py::isinstance<py::str>(item.first)) {
      throw py::value_error("torchmem pool config: keys must be strings, got " +
                            py::repr(item.first).cast<std::string>());
    }
    const std::string key = item.first.cast<std::string>();
    const py::handle value = item.second;
    if (key == "limit_bytes") {
      c.limit_bytes = field<std::size_t>(key, value, "an int of bytes");
    } else if (key == "reserve_bytes") {
      c.reserve_bytes = field<std::size_t>(key, value, "an int of bytes");
    } else if (key == "small_threshold") {
      c.small_threshold = field<std::size_t>(key, value, "an int of bytes");
    } else if (key == "small_page_bytes") {
      c.small_page_bytes = field<std::size_t>(key, value, "an int of bytes");
    } else if (key == "reclaim_slack") {
      c.reclaim_slack = field<double>(key, value, "a number");
    } else if (key == "virtual_bytes") {
      c.virtual_bytes = field<std::size_t>(key, value, "an int of bytes");
    } else if (key == "alias_reclaim") {
      c.alias_reclaim = field<bool>(key, value, "True or False");
    } else if (key == "debug_checks") {
      c.debug_checks = field<bool>(key, value, "True or False");
    } else if (key == "trace_capacity") {
      c.trace_capacity = field<std::size_t>(key, value, "an int");
    } else {
      throw py::value_error(
          "torchmem pool config: unknown key '" + key +
          "'; allowed: limit_bytes, reserve_bytes, small_threshold, small_page_bytes, "
          "reclaim_slack, alias_reclaim, virtual_bytes, debug_checks, trace_capacity");
    }
  }
  return c;
}

SimCosts costs_from_dict(const pybind11::object& costs) {
  SimCosts result;
  if (costs.is_none()) return result;
  if (!pybind11::isinstance<pybind11::dict>(costs)) {
    throw pybind11::value_error("costs: expected a dict of microseconds per backend call, or None");
  }
  for (auto item : costs.cast<pybind11::dict>()) {
    const std::string key = pybind11::str(item.first);
    double value;
    try {
      value = item.second.cast<double>();
    } catch (const pybind11::cast_error&) {
      throw pybind11::value_error("costs['" + key + "']: expected a number of microseconds");
    }
#define TORCHMEM_COST_FIELD(field) \
  if (key == #field) {             \
    result.field = value;          \
    continue;                      \
  }
    TORCHMEM_COST_FIELD(reserve_us)
    TORCHMEM_COST_FIELD(create_us)
    TORCHMEM_COST_FIELD(release_us)
    TORCHMEM_COST_FIELD(map_us)
    TORCHMEM_COST_FIELD(set_access_us)
    TORCHMEM_COST_FIELD(unmap_us)
    TORCHMEM_COST_FIELD(segment_alloc_us)
    TORCHMEM_COST_FIELD(segment_free_us)
    TORCHMEM_COST_FIELD(event_record_us)
    TORCHMEM_COST_FIELD(event_query_us)
#undef TORCHMEM_COST_FIELD
    throw pybind11::value_error("costs: unknown key '" + key +
                                "'; allowed: reserve_us, create_us, release_us, map_us, set_access_us, unmap_us, "
                                "segment_alloc_us, segment_free_us, event_record_us, event_query_us");
  }
  return result;
}

}  // namespace torchmem::bindings
