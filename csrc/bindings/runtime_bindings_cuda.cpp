// runtime_bindings_cuda.cpp: torchmem._C.runtime_*: the installed allocator
// seen from Python (install, stats, snapshots, budget, callbacks).
//
// pybind11 only: the shim is reached through its headers (csrc/shim/runtime.h
// lists them), which include no torch headers, so this file compiles in seconds. Stats and
// snapshots go through convert.h, so they have exactly the shape of the
// simulated _C.Pool's (the Python layer reads one format).
//
// Note [Python callbacks] The OOM callback and the context provider are
// Python callables called from allocation paths, which may run on threads that
// do not hold the GIL (autograd's backward threads) or during interpreter
// shutdown. So each call takes the GIL, is skipped once Python is finalizing,
// and the callable is released under the GIL whichever thread drops it last.
// A Python exception inside a callback is reported as a warning and treated as
// "freed nothing" (OOM) or context 0 (provider): an allocation never fails
// because of a hook.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <Python.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "bindings/bindings.h"
#include "bindings/convert.h"
#include "shim/allocation.h"
#include "shim/budget.h"
#include "shim/callbacks.h"
#include "shim/device_stats.h"
#include "shim/diagnostics.h"
#include "shim/private_pools.h"
#include "shim/runtime.h"

namespace py = pybind11;

namespace torchmem::bindings {

namespace {

using shim::Budget;
using shim::LimitSpec;
using shim::RuntimeConfig;

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A Python object whose last reference may be dropped on any thread.
std::shared_ptr<py::object> share_callable(py::object callable) {
  return std::shared_ptr<py::object>(new py::object(std::move(callable)), [](py::object* held) {
    if (python_finalizing()) return;  // leak it: the interpreter is going away
    py::gil_scoped_acquire gil;
    delete held;
  });
}

void warn_callback_error(const char* which, py::error_already_set& error) {
  std::string text = std::string("torchmem: the ") + which + " raised " + error.what() + "; treated as " +
                     (std::string(which) == "OOM callback" ? "'freed nothing'" : "context 0");
  try {
    py::module_::import("warnings").attr("warn")(text, py::module_::import("builtins").attr("RuntimeWarning"), 2);
  } catch (py::error_already_set&) {
    PyErr_Clear();
  }
}

RuntimeConfig runtime_config_from(const py::dict& options, const std::string& backend) {
  py::dict rest;
  RuntimeConfig config;
  for (auto item : options) {
    std::string key = py::str(item.first);
    py::handle value = item.second;
    if (key == "limit") {
      if (value.is_none()) {
        config.limit.kind = LimitSpec::Kind::kNone;
      } else if (py::isinstance<py::float_>(value)) {
        config.limit.kind = LimitSpec::Kind::kFraction;
        config.limit.fraction = value.cast<double>();
      } else if (py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value)) {
        const long long bytes = value.cast<long long>();
        config.limit.kind = LimitSpec::Kind::kBytes;
        config.limit.bytes = bytes > 0 ? static_cast<std::size_t>(bytes) : 0;  // 0: refused by check_config
      } else {
        throw py::value_error("torchmem config 'limit': expected None, a fraction (float) or bytes (int), got " +
                              std::string(py::str(py::repr(value))));
      }
    } else if (key == "oom_hook_retries") {
      if (!py::isinstance<py::int_>(value) || value.cast<long long>() < 0) {
        throw py::value_error("torchmem config 'oom_hook_retries': expected an int >= 0");
      }
      config.oom_hook_retries = value.cast<int>();
    } else if (key == "park_private_frees") {
      if (!py::isinstance<py::bool_>(value)) {
        throw py::value_error("torchmem config 'park_private_frees': expected True or False");
      }
      config.park_private_frees = value.cast<bool>();
    } else if (key == "initial_fraction") {
      config.initial_fraction = value.is_none() ? -1.0 : value.cast<double>();  // checked by check_config
    } else if (key == "limit_bytes") {
      throw py::value_error("torchmem runtime config: give 'limit' (None, fraction or bytes), not 'limit_bytes'");
    } else {
      rest[item.first] = value;
    }
  }
  config.pool = config_from_dict(rest);
  config.backend = backend;
  return config;
}

py::dict budget_state(int device) {
  const shim::BudgetState s = shim::budget_state(device);
  py::dict out;
  switch (s.install.kind) {
    case LimitSpec::Kind::kNone: out["limit"] = py::none(); break;
    case LimitSpec::Kind::kBytes: out["limit"] = s.install.bytes; break;
    case LimitSpec::Kind::kFraction: out["limit"] = s.install.fraction; break;
  }
  out["limit_resolved_bytes"] = s.install_bytes;
  out["fraction"] = s.fraction < 0.0 ? py::object(py::none()) : py::object(py::float_(s.fraction));
  out["grant_bytes"] = s.granted ? py::object(py::int_(s.grant_bytes)) : py::object(py::none());
  out["source"] = s.source;
  out["limit_bytes"] = s.limit_bytes;
  out["refuses_all"] = s.refuses_all;
  out["memory_fraction"] = s.memory_fraction;
  out["total_bytes"] = s.total_bytes;
  out["granularity"] = s.granularity;
  return out;
}

py::dict runtime_stats(int device) {
  Pool& pool = shim::device_pool(device);
  PoolStats stats;
  BackendCounters counters;
  std::string backend_name;
  MemInfo mem;
  {
    py::gil_scoped_release released;
    stats = shim::device_stats(device);  // parked blocks count as freed, as torch sees them
    counters = pool.backend().counters();
    backend_name = pool.backend().name();
    mem = shim::device_mem_info(device);
  }
  py::dict out = stats_to_dict(stats);
  out["backend"] = backend_counters_to_dict(counters);
  out["backend_name"] = backend_name;
  out["device_total"] = mem.total_bytes;
  out["device_free"] = mem.free_bytes;
  out["device"] = device;
  out["failed_deleter_frees"] = shim::failed_deleter_frees();  // all devices: a bad free has no device
  return out;
}

py::dict runtime_snapshot(int device) {
  Pool& pool = shim::device_pool(device);
  PoolSnapshot snapshot;
  {
    py::gil_scoped_release released;
    snapshot = pool.snapshot();
  }
  py::dict out = snapshot_to_dict(snapshot);
  out["device"] = device;
  // Note [Parked blocks in snapshots] torch reads a private pool's segments by
  // its own key (segment_pool_id; CUDA graph trees and PyTorch's tests do), and
  // a block torch freed is free to torch even while the pool keeps it for its
  // graphs (Note [Parked private blocks], runtime.cpp): segments of a pool in
  // use get "pool_key", and its parked blocks read "inactive" with "parked".
  const shim::PrivatePoolNames names = shim::private_pool_names(device);
  // Note [External pool allocators]: a MemPool(allocator=X)'s segments, under that pool's key
  py::list segments = out["segments"].cast<py::list>();
  std::vector<std::pair<shim::MempoolKey, PoolSnapshot>> externals;
  {
    // an external pool's lock may be held by a thread whose X waits for the GIL
    py::gil_scoped_release released;
    externals = shim::external_pool_snapshots(device);
  }
  for (auto& [key, external] : externals) {
    for (py::handle item : snapshot_to_dict(external)["segments"].cast<py::list>()) {
      py::dict segment = py::reinterpret_borrow<py::dict>(item);
      segment["pool_key"] = py::make_tuple(key.first, key.second);
      segment["plain"] = true;  // X's allocation, not mapped granules (snapshot_format.py)
      segments.append(segment);
    }
  }
  for (py::handle item : segments) {
    py::dict segment = py::reinterpret_borrow<py::dict>(item);
    if (segment.contains("pool_key")) continue;
    const auto pool = segment["pool"].cast<PoolId>();
    if (pool == 0) continue;  // the device pool: (0, 0)
    // a private pool torch's key is no longer known for shows as the default pool, as in the C++
    // snapshot (PrivatePoolNames::key_of), never as (0, core id), which may be a live MemPool's key
    const shim::MempoolKey key = names.key_of(pool);
    segment["pool_key"] = py::make_tuple(key.first, key.second);
    for (py::handle b : segment["blocks"].cast<py::list>()) {
      py::dict block = py::reinterpret_borrow<py::dict>(b);
      if (!names.parked.count(block["address"].cast<Addr>())) continue;
      block["state"] = "inactive";
      block["parked"] = true;
    }
  }
  return out;
}

void set_oom_callback(py::object callable) {
  if (callable.is_none()) {
    shim::set_oom_callback(nullptr);
    return;
  }
  if (!PyCallable_Check(callable.ptr())) throw py::type_error("runtime_set_oom_callback: expected a callable or None");
  auto held = share_callable(std::move(callable));
  shim::set_oom_callback([held](int device, std::size_t requested) -> bool {
    if (python_finalizing()) return false;
    py::gil_scoped_acquire gil;
    try {
      return py::bool_((*held)(device, requested));
    } catch (py::error_already_set& error) {
      warn_callback_error("OOM callback", error);
      return false;
    }
  });
}

void set_context_provider(py::object callable) {
  if (callable.is_none()) {
    shim::set_context_provider(nullptr);
    return;
  }
  if (!PyCallable_Check(callable.ptr())) {
    throw py::type_error("runtime_set_context_provider: expected a callable or None");
  }
  auto held = share_callable(std::move(callable));
  shim::set_context_provider([held]() -> std::uint64_t {
    if (python_finalizing()) return 0;
    py::gil_scoped_acquire gil;
    try {
      return (*held)().cast<std::uint64_t>();
    } catch (py::error_already_set& error) {
      warn_callback_error("context provider", error);
      return 0;
    } catch (const py::cast_error&) {
      return 0;
    }
  });
}

}  // namespace

void bind_runtime(py::module_& m) {
  m.def("runtime_allocator_initialized", &shim::torch_allocator_initialized,
        "Whether torch's current CUDA allocator is initialized (then it can no longer be swapped)");
  m.def(
      "runtime_install",
      [](const py::dict& config, const std::string& backend) { shim::install(runtime_config_from(config, backend)); },
      py::arg("config"), py::arg("backend") = "auto",
      "Swap torch's CUDA allocator for torchmem's. config: PoolConfig keys (minus limit_bytes) plus 'limit' "
      "(None | fraction | bytes) and 'oom_hook_retries'");
  m.def(
      "runtime_configure",
      [](const py::dict& config, const std::string& backend) { shim::configure(runtime_config_from(config, backend)); },
      py::arg("config"), py::arg("backend") = "auto",
      "Set the config of torchmem's device pools without swapping torch's allocator (torch.cuda.MemPool use)");
  m.def("runtime_is_configured", &shim::is_configured);
  m.def("runtime_is_installed", &shim::is_installed);
  m.def("runtime_devices", &shim::devices, "Devices that have a torchmem pool");
  m.def("runtime_compile_context", &shim::current_compile_context,
        "The torch.compile region this thread runs (dynamo's compile context), '' outside any");
  m.def(
      "runtime_push_compile_context", [](std::string name) { shim::push_compile_context(name); },
      "Enter a compile context on this thread, as dynamo does through the allocator (tests)");
  m.def("runtime_pop_compile_context", &shim::pop_compile_context, "Leave this thread's innermost compile context");
  m.def("runtime_set_compile_context_recording", &shim::set_compile_context_recording,
        "Follow torch.compile regions (a global RecordFunction callback) for allocation history");
  m.def("runtime_backend_name", &shim::backend_name, py::arg("device"));
  m.def("runtime_stats", &runtime_stats, py::arg("device"),
        "The device pool's stats (the shape of _C.Pool.stats()) plus device_total and device_free");
  m.def(
      "runtime_reset_peak_stats", [](int device) { shim::device_pool(device).reset_peak_stats(); },
      py::arg("device"));
  m.def(
      "runtime_reset_accumulated_stats", [](int device) { shim::device_pool(device).reset_accumulated_stats(); },
      py::arg("device"));
  m.def("runtime_snapshot", &runtime_snapshot, py::arg("device"));
  m.def("runtime_empty_cache", &shim::empty_cache, py::call_guard<py::gil_scoped_release>(),
        "Return every pool's cached memory to the device; the bytes returned");
  m.def(
      "runtime_release_cached_to",
      [](int device, std::size_t keep_bytes) { return shim::device_pool(device).release_cached_to(keep_bytes); },
      py::arg("device"), py::arg("keep_bytes"), py::call_guard<py::gil_scoped_release>(),
      "Return the device pool's cached memory down to keep_bytes held; the bytes returned");
  m.def(
      "runtime_set_limit", &shim::set_share_grant, py::arg("device"), py::arg("bytes"),
      "Set the budget in bytes (0 = the whole device): the sharing arbiter's grant (Note [Budget rule])");
  m.def("runtime_limit", &shim::budget_limit, py::arg("device"), "The limit in force in bytes (0 = none)");
  m.def("runtime_budget_state", &budget_state, py::arg("device"),
        "The device's Budget: each limit as set and the one in force (Note [Budget rule] in csrc/shim/budget.h)");
  m.def("runtime_set_trace_capacity", &shim::set_trace_capacity, py::arg("entries"),
        py::call_guard<py::gil_scoped_release>(),
        "Trace ring size for every pool, live ones included (they keep their newest entries)");
  m.def("runtime_clear_trace", &shim::clear_trace, py::call_guard<py::gil_scoped_release>(),
        "Drop every pool's trace entries");
  m.def("runtime_memory_fraction", &shim::memory_fraction, py::arg("device"),
        "The memory fraction in force (torch.cuda.get_per_process_memory_fraction)");
  m.def("runtime_set_memory_fraction", &shim::set_memory_fraction, py::arg("fraction"), py::arg("device"));
  m.def("runtime_set_oom_callback", &set_oom_callback, py::arg("callback"),
        "callable(device, requested_bytes) -> bool, run after a failed allocation; None removes it");
  m.def("runtime_set_free_context", &shim::set_free_context, py::arg("enabled"),
        "Frees and empty_cache record the provider's context too (torch's context='all')");
  m.def("runtime_sequence", &shim::pool_sequence, py::arg("device"),
        "The device pool's operation counter (0 before its first use)");
  m.def("runtime_record_torch_stacks", &shim::record_torch_stacks, py::arg("enabled"), py::arg("free_stacks"),
        py::arg("compile_contexts"), py::arg("cpp_frames") = true,
        "Gather each allocation's frames in C++ as torch does (Note [Torch's recorder]): Python and TorchScript "
        "frames, plus C++ ones with cpp_frames; off: the caller sets the provider");
  m.def(
      "runtime_symbolize_torch_contexts",
      [](const std::vector<std::uint64_t>& ids) {
        std::vector<std::vector<shim::StackFrame>> symbolized = shim::symbolize_torch_contexts(ids);
        py::list out;
        for (const auto& frames : symbolized) {
          py::list one;
          for (const auto& f : frames) {
            py::dict frame;
            frame["filename"] = f.filename;
            frame["line"] = f.line;
            frame["name"] = f.name;
            one.append(std::move(frame));
          }
          out.append(std::move(one));
        }
        return out;
      },
      py::arg("ids"), "Frames ({filename, line, name}, innermost first) of each gathered context id, in one batch");
  m.def("runtime_torch_context_compile_contexts", &shim::torch_context_compile_contexts, py::arg("ids"),
        "The compile region recorded with each gathered context id ('' if none), in one batch");
  m.def("runtime_torch_context_flag", []() { return shim::kTorchContextFlag; },
        "The bit set in every context id the C++ gatherer hands out");
  m.def("runtime_provider_context_now", &shim::provider_context_now,
        "What the context provider in force gives now (0 with none): tests of the providers");
  m.def("runtime_set_context_provider", &set_context_provider, py::arg("provider"),
        "callable() -> int, run before each allocation; its value is stored as the trace context");
  m.def(
      "runtime_check_invariants",
      [](int device) {
        std::string problem;
        {
          py::gil_scoped_release released;
          problem = shim::device_pool(device).check_invariants();
        }
        if (!problem.empty()) throw std::runtime_error("torchmem pool invariant violated: " + problem);
      },
      py::arg("device"));
  m.def(
      "runtime_probe_backend",
      [](int device, int repeats, std::size_t granules, std::size_t live_granules, std::size_t evict_bytes) {
        py::dict out;
        std::vector<std::pair<std::string, double>> costs;
        {
          py::gil_scoped_release released;
          costs = shim::probe_backend_costs(device, repeats, granules, live_granules, evict_bytes);
        }
        for (const auto& [name, micros] : costs) out[py::str(name)] = micros;
        return out;
      },
      py::arg("device"), py::arg("repeats") = 20, py::arg("granules") = 1, py::arg("live_granules") = 0,
      py::arg("evict_bytes") = 0,
      "Mean microseconds of each backend primitive on the device (torchmem.runtime.probe.driver_costs)");
  m.def("runtime_probe_pool_pair", &shim::probe_pool_pair_ns, py::arg("device"), py::arg("iterations") = 200000,
        py::call_guard<py::gil_scoped_release>(),
        "Nanoseconds per free + allocate pair through torchmem's allocation path, without torch's wrapper");
}

}  // namespace torchmem::bindings
