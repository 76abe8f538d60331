// replay_bindings.cpp: trace replay and the native allocator model, for Python
// (torchmem/analysis/replay.py is the documented API over these).
//
//   _C.replay(events, policy="torchmem", pool_config=None, limit=0,
//             capacity=140 GiB, stop_at=-1, progress=None, native_config=None,
//             costs=None, snapshot=False, timeline=False, event_delay=0,
//             evict_bytes=0) -> dict
//   _C.min_cap(events, policy="torchmem", pool_config=None, capacity=...,
//              precision=2 MiB, progress=None, native_config=None, costs=None,
//              event_delay=0) -> dict
// event_delay: the simulated device's events answer "not done" to that many
// polls (SimConfig.event_delay), modelling a GPU that lags behind the host.
// evict_bytes: a scratch walk after every alloc and free (Note [Cold caches]
// in replay.h), for host-time measurements.
//   _C.NativeModel(capacity=..., limit=0, max_split_size=None): the model alone,
//             for tests (allocate/free/release_cached/stats/segments/check_invariants)
//   _C.ExpandableModel(capacity=..., limit=0): expandable_segments' model alone
//             (allocate/free/release_cached/stats/check_invariants)
//
// `events` is an int64 array of shape (N, 4) (rows action, addr, size, stream)
// or anything numpy turns into one. The GIL is released while a trace
// replays; a `progress(done, total)` callable is called with it re-acquired.
// With snapshot=True the dict carries "snapshot": the target's layout after
// the last replayed event, in the core's snapshot shape (convert.h), for both
// torchmem and native (the native model's segments are not expandable; the
// expandable model has none to give and refuses); with
// timeline=True, "reserved_timeline": held bytes after every event (int64 array).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/convert.h"
#include "replay/expandable_model.h"
#include "replay/native_model.h"
#include "replay/replay.h"

namespace py = pybind11;

namespace torchmem::bindings {

namespace {

using EventArray = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

EventArray as_event_array(const py::object& events) {
  EventArray array;
  try {
    array = EventArray::ensure(events);
  } catch (const py::error_already_set&) {
    array = EventArray();
  }
  if (!array) {
    throw py::value_error("replay: events must be an int64 array of shape (N, 4) or a list of [action, addr, size, stream] rows");
  }
  if (array.size() == 0) return EventArray(std::vector<py::ssize_t>{0, 4});
  if (array.ndim() != 2 || array.shape(1) != 4) {
    throw py::value_error("replay: events must have shape (N, 4) (rows action, addr, size, stream), got ndim " +
                          std::to_string(array.ndim()));
  }
  return array;
}

const TraceEvent* event_rows(const EventArray& array) {
  static_assert(sizeof(TraceEvent) == 4 * sizeof(std::int64_t), "TraceEvent must match a row of 4 int64");
  return reinterpret_cast<const TraceEvent*>(array.data());
}

NativeConfig native_from_dict(const py::object& config) {
  NativeConfig result;
  if (config.is_none()) return result;
  for (auto item : config.cast<py::dict>()) {
    const auto key = item.first.cast<std::string>();
    if (key == "max_split_size") {
      result.max_split_size = item.second.is_none() ? result.max_split_size : item.second.cast<std::size_t>();
    } else {
      throw py::value_error("native model config: unknown key '" + key + "'; allowed: max_split_size");
    }
  }
  return result;
}

ReplayOptions make_options(const std::string& policy, const py::object& pool_config, std::size_t limit,
                           std::size_t capacity, std::int64_t stop_at, const py::object& native_config,
                           const py::object& costs, std::uint64_t event_delay) {
  ReplayOptions options;
  options.sim.event_delay = event_delay;
  options.policy = parse_policy(policy);
  if (!pool_config.is_none()) options.pool = config_from_dict(pool_config.cast<py::dict>());
  options.native = native_from_dict(native_config);
  options.sim.costs = sim_costs_from_dict(costs, "replay");
  options.limit_bytes = limit;
  if (capacity == 0) throw py::value_error("replay: capacity must be > 0 bytes (the simulated device's memory)");
  options.capacity_bytes = capacity;
  options.stop_at = stop_at;
  return options;
}

// Calls a Python progress(done, total) from the replay thread (GIL released).
std::function<void(std::size_t, std::size_t)> progress_callback(const py::object& progress) {
  if (progress.is_none()) return nullptr;
  auto holder = std::make_shared<py::object>(progress);
  return [holder](std::size_t done, std::size_t total) {
    py::gil_scoped_acquire gil;
    (*holder)(done, total);
  };
}

py::dict result_to_dict(const ReplayResult& r, ReplayPolicy policy) {
  py::dict d;
  d["policy"] = policy_name(policy);
  d["events"] = r.events;
  d["allocs"] = r.allocs;
  d["frees"] = r.frees;
  d["skipped_frees"] = r.skipped_frees;
  d["unmatched_frees"] = r.unmatched_frees;
  d["lost_frees"] = r.lost_frees;
  d["peak_requested"] = r.peak_requested;
  d["peak_reserved"] = r.peak_reserved;
  d["peak_reserved_event"] = r.peak_reserved_event;
  d["final_reserved"] = r.final_reserved;
  d["ratio"] = r.peak_requested ? static_cast<double>(r.peak_reserved) / static_cast<double>(r.peak_requested) : 0.0;
  d["ooms"] = r.ooms;
  d["alloc_retries"] = r.alloc_retries;
  d["reclaims"] = r.reclaims;
  d["device_barriers"] = r.device_barriers;
  d["steady_barriers"] = r.steady_barriers;
  d["plans"] = r.plans;
  d["plan_drops"] = r.plan_drops;
  d["plan_hits"] = r.plan_hits;
  d["plan_misses"] = r.plan_misses;
  d["plan_passes"] = r.plan_passes;
  d["plan_pass_us"] = r.plan_pass_us;
  d["host_alloc_ns"] = r.host_alloc_ns;
  d["host_free_ns"] = r.host_free_ns;
  d["host_plan_ns"] = r.host_plan_ns;
  d["backend_calls"] = backend_counters_to_dict(r.backend_calls);
  d["modeled_backend_us"] = r.modeled_backend_us;
  d["steady_backend_us"] = r.steady_backend_us;
  d["steady_driver_calls"] = r.steady_driver_calls;
  d["growths"] = r.growths;
  d["steady_growths"] = r.steady_growths;
  d["steady_backend_calls"] = backend_counters_to_dict(r.steady_backend_calls);
  return d;
}

// The native model's layout in the core's snapshot shape (convert.h).
py::dict native_snapshot_to_dict(const NativeModel& model) {
  py::list segments;
  for (const NativeSegment& segment : model.segments()) {
    py::list blocks;
    for (const NativeSegment::Block& block : segment.blocks) {
      py::dict b;
      b["address"] = block.addr;
      b["size"] = block.size;
      b["requested_size"] = block.requested;
      b["state"] = block.allocated ? "active_allocated" : "inactive";
      b["stream"] = segment.stream;
      b["context"] = 0;
      blocks.append(b);
    }
    py::dict s;
    s["address"] = segment.addr;
    s["total_size"] = segment.size;
    s["small_heap"] = segment.small_pool;
    s["pool"] = 0;
    s["stream"] = segment.stream;
    s["blocks"] = blocks;
    segments.append(s);
  }
  py::dict snapshot;
  snapshot["segments"] = segments;
  snapshot["trace"] = py::list();
  return snapshot;
}

py::dict replay_py(const py::object& events, const std::string& policy, const py::object& pool_config,
                   std::size_t limit, std::size_t capacity, std::int64_t stop_at, const py::object& progress,
                   const py::object& native_config, const py::object& costs, bool snapshot, bool timeline,
                   std::uint64_t event_delay, std::size_t evict_bytes) {
  const EventArray array = as_event_array(events);
  ReplayOptions options =
      make_options(policy, pool_config, limit, capacity, stop_at, native_config, costs, event_delay);
  options.progress = progress_callback(progress);
  options.cache_evict_bytes = evict_bytes;
  std::vector<std::int64_t> held_after;
  if (timeline) options.timeline = &held_after;
  const TraceEvent* rows = event_rows(array);
  const auto count = static_cast<std::size_t>(array.shape(0));

  if (snapshot && options.policy == ReplayPolicy::kExpandable) {
    throw py::value_error("replay: no snapshot for the expandable model (it keeps no segment layout to show); "
                          "use policy 'torchmem' or 'native'");
  }
  Replayer replayer(options);
  ReplayResult result;
  {
    py::gil_scoped_release release;
    result = replayer.run(rows, count);
  }
  py::dict d = result_to_dict(result, options.policy);
  if (timeline) {
    py::array_t<std::int64_t> curve(static_cast<py::ssize_t>(held_after.size()));
    std::copy(held_after.begin(), held_after.end(), curve.mutable_data());
    d["reserved_timeline"] = curve;
  }
  if (snapshot) {
    if (replayer.pool()) {
      d["snapshot"] = snapshot_to_dict(replayer.pool()->snapshot());
    } else {
      d["snapshot"] = native_snapshot_to_dict(*replayer.native());
    }
  }
  return d;
}

py::dict min_cap_py(const py::object& events, const std::string& policy, const py::object& pool_config,
                    std::size_t capacity, std::size_t precision, const py::object& progress,
                    const py::object& native_config, const py::object& costs, std::uint64_t event_delay) {
  const EventArray array = as_event_array(events);
  ReplayOptions options = make_options(policy, pool_config, 0, capacity, -1, native_config, costs, event_delay);
  options.progress = progress_callback(progress);
  if (precision == 0) throw py::value_error("min_cap: precision must be > 0 bytes");
  MinCapResult found;
  {
    py::gil_scoped_release release;
    found = find_min_cap(event_rows(array), static_cast<std::size_t>(array.shape(0)), options, precision);
  }
  py::dict d;
  d["policy"] = policy_name(options.policy);
  d["min_cap"] = found.min_cap;
  d["peak_requested"] = found.peak_requested;
  d["unlimited_peak_reserved"] = found.unlimited_peak_reserved;
  d["min_cap_ratio"] = found.peak_requested
                           ? static_cast<double>(found.min_cap) / static_cast<double>(found.peak_requested)
                           : 0.0;
  d["replays"] = found.replays;
  d["precision"] = precision;
  return d;
}

py::dict native_stats_to_dict(const NativeStats& s) {
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["allocated_bytes"] = s.allocated_bytes;
  d["peak_allocated_bytes"] = s.peak_allocated_bytes;
  d["requested_bytes"] = s.requested_bytes;
  d["peak_requested_bytes"] = s.peak_requested_bytes;
  d["segments"] = s.segments;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_allocs"] = s.num_allocs;
  d["num_frees"] = s.num_frees;
  d["modeled_us"] = s.modeled_us;
  return d;
}

py::dict expandable_stats_to_dict(const ExpandableStats& s) {
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["allocated_bytes"] = s.allocated_bytes;
  d["requested_bytes"] = s.requested_bytes;
  d["peak_requested_bytes"] = s.peak_requested_bytes;
  d["pages_mapped"] = s.pages_mapped;
  d["pages_unmapped"] = s.pages_unmapped;
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["modeled_us"] = s.modeled_us;
  return d;
}

}  // namespace

void bind_replay(py::module_& m) {
  m.def("replay", &replay_py, py::arg("events"), py::arg("policy") = "torchmem", py::arg("pool_config") = py::none(),
        py::arg("limit") = 0, py::arg("capacity") = kReplayCapacity, py::arg("stop_at") = -1,
        py::arg("progress") = py::none(), py::arg("native_config") = py::none(), py::arg("costs") = py::none(),
        py::arg("snapshot") = false, py::arg("timeline") = false, py::arg("event_delay") = 0,
        py::arg("evict_bytes") = 0,
        "Replays a trace's allocs and frees under a policy ('torchmem', 'native' or 'expandable'); returns a dict of "
        "peaks, OOMs and backend calls (see csrc/replay/replay.h)");
  m.def("min_cap", &min_cap_py, py::arg("events"), py::arg("policy") = "torchmem",
        py::arg("pool_config") = py::none(), py::arg("capacity") = kReplayCapacity,
        py::arg("precision") = 2 * kMiB, py::arg("progress") = py::none(), py::arg("native_config") = py::none(),
        py::arg("costs") = py::none(), py::arg("event_delay") = 0,
        "The smallest budget under which the trace replays with no OOM, by bisection (Note [Min-cap])");

  py::class_<NativeModel>(m, "NativeModel", "A model of PyTorch's native caching allocator (native_model.h)")
      .def(py::init([](std::size_t capacity, std::size_t limit, py::object max_split_size) {
             NativeConfig config;
             config.capacity_bytes = capacity;
             config.limit_bytes = limit;
             if (!max_split_size.is_none()) config.max_split_size = max_split_size.cast<std::size_t>();
             return new NativeModel(config);
           }),
           py::arg("capacity") = kReplayCapacity, py::arg("limit") = 0, py::arg("max_split_size") = py::none())
      .def("allocate", &NativeModel::allocate, py::arg("size"), py::arg("stream") = 0,
           "Address of a new block, or 0 when the allocation fails (an OOM)")
      .def("free", &NativeModel::deallocate, py::arg("addr"))
      .def("release_cached", &NativeModel::release_cached, "empty_cache: frees unsplit cached segments")
      .def("set_limit", &NativeModel::set_limit, py::arg("bytes"))
      .def("stats", [](const NativeModel& model) { return native_stats_to_dict(model.stats()); })
      .def("snapshot", [](const NativeModel& model) { return native_snapshot_to_dict(model); })
      .def("check_invariants",
           [](const NativeModel& model) {
             const std::string problem = model.check_invariants();
             if (!problem.empty()) throw std::runtime_error("native model invariant violated: " + problem);
           })
      .def_static("round_size", &NativeModel::round_size, py::arg("size"))
      .def_static("segment_size", &NativeModel::segment_size, py::arg("rounded_size"));

  py::class_<ExpandableModel>(m, "ExpandableModel",
                              "A model of PyTorch's allocator with expandable_segments:True (expandable_model.h)")
      .def(py::init([](std::size_t capacity, std::size_t limit) {
             ExpandableConfig config;
             config.capacity_bytes = capacity;
             config.limit_bytes = limit;
             return new ExpandableModel(config);
           }),
           py::arg("capacity") = kReplayCapacity, py::arg("limit") = 0)
      .def("allocate", &ExpandableModel::allocate, py::arg("size"), py::arg("stream") = 0,
           "Address of a new block, or 0 when the allocation fails (an OOM)")
      .def("free", &ExpandableModel::deallocate, py::arg("addr"))
      .def("release_cached", &ExpandableModel::release_cached, "empty_cache: unmaps the whole pages of free blocks")
      .def("stats", [](const ExpandableModel& model) { return expandable_stats_to_dict(model.stats()); })
      .def("check_invariants", [](const ExpandableModel& model) {
        const std::string problem = model.check_invariants();
        if (!problem.empty()) throw std::runtime_error("expandable model invariant violated: " + problem);
      });
}

}  // namespace torchmem::bindings
