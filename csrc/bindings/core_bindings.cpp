// core_bindings.cpp: torchmem._C.SimBackend, torchmem._C.Pool and the
// randomized checker _C._random_ops, for tests, replay and the Python layer.
//
// Pool calls release the GIL, so Python threads in stress tests really run
// concurrently (the pool has its own lock). Dicts come from convert.h so a
// simulated pool answers stats() and snapshot() exactly like the installed one.
// PoolError becomes torchmem._C.PoolError, a subclass of ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/sim_backend.h"
#include "bindings/bindings.h"
#include "bindings/convert.h"
#include "replay/random_ops.h"
#include "core/pool.h"

namespace py = pybind11;

namespace torchmem::bindings {

namespace {

py::dict pool_stats(const Pool& pool) {
  PoolStats s;
  BackendCounters counters;
  {
    py::gil_scoped_release release;
    s = pool.stats();
    counters = pool.backend().counters();
  }
  py::dict d = stats_to_dict(s);
  d["backend"] = backend_counters_to_dict(counters);
  d["backend_name"] = pool.backend().name();
  return d;
}

// Checkpoints as plain dicts, so tests can inspect and edit them.
py::dict checkpoint_to_dict(const Pool& pool, PoolId id) {
  PoolCheckpoint c;
  {
    py::gil_scoped_release release;
    c = pool.checkpoint_private_pool(id);
  }
  py::list blocks;
  for (const CheckpointBlock& b : c.blocks) {
    py::dict d;
    d["addr"] = b.addr;
    d["size"] = b.size;
    d["requested"] = b.requested;
    d["stream"] = b.stream;
    d["context"] = b.context;
    blocks.append(d);
  }
  py::dict out;
  out["pool"] = c.pool;
  out["blocks"] = blocks;
  return out;
}

py::dict restore_from_dict(Pool& pool, const py::dict& checkpoint) {
  PoolCheckpoint c;
  try {
    c.pool = checkpoint["pool"].cast<PoolId>();
    for (const auto& item : checkpoint["blocks"].cast<py::list>()) {
      const py::dict b = item.cast<py::dict>();
      c.blocks.push_back(CheckpointBlock{b["addr"].cast<Addr>(), b["size"].cast<std::size_t>(),
                                         b["requested"].cast<std::size_t>(), b["stream"].cast<StreamId>(),
                                         b["context"].cast<std::uint64_t>()});
    }
  } catch (const py::error_already_set&) {
    throw py::value_error("restore_private_pool: expected the dict checkpoint_private_pool returned "
                          "({'pool', 'blocks': [{'addr', 'size', 'requested', 'stream', 'context'}]})");
  } catch (const py::cast_error&) {
    throw py::value_error("restore_private_pool: a checkpoint field has the wrong type; expected the dict "
                          "checkpoint_private_pool returned");
  }
  RestoreDelta delta;
  {
    py::gil_scoped_release release;
    delta = pool.restore_private_pool(c);
  }
  py::dict out;
  out["freed"] = delta.freed;
  out["allocated"] = delta.allocated;
  return out;
}

}  // namespace

void bind_core(py::module_& m) {
  py::register_exception<PoolError>(m, "PoolError", PyExc_ValueError);

  py::class_<Backend>(m, "Backend", "A source of device memory (see csrc/core/backend.h)")
      .def_property_readonly("name", &Backend::name)
      .def_property_readonly("granularity", &Backend::granularity)
      .def_property_readonly("supports_vmm", &Backend::supports_vmm)
      .def("counters", [](const Backend& b) { return backend_counters_to_dict(b.counters()); },
           "How many times each primitive was called");

  m.def(
      "sim_costs",
      [] {
        py::dict costs;
        const SimCosts defaults;
#define TORCHMEM_SIM_COST_ITEM(name, default_value) costs[#name] = defaults.name;
        TORCHMEM_SIM_COSTS(TORCHMEM_SIM_COST_ITEM)
#undef TORCHMEM_SIM_COST_ITEM
        return costs;
      },
      "The simulated backend's price of each call in microseconds (csrc/backend/sim_backend.h: "
      "measured in isolation on an H200), the keys SimBackend's and replay's costs= take");

  py::class_<SimBackend, Backend>(m, "SimBackend",
                                  "A simulated device: fake addresses, a capacity, per-call costs")
      .def(py::init([](std::size_t capacity, std::size_t granularity, bool vmm, bool host_memory,
                       std::uint64_t event_delay, py::object costs) {
             SimConfig c;
             c.capacity_bytes = capacity;
             c.granularity = granularity;
             c.vmm = vmm;
             c.host_memory = host_memory;
             c.event_delay = event_delay;
             c.costs = sim_costs_from_dict(costs, "SimBackend");
             try {
               return std::make_unique<SimBackend>(c);
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           py::arg("capacity") = 80 * kGiB, py::arg("granularity") = 2 * kMiB, py::arg("vmm") = true,
           py::arg("host_memory") = false, py::arg("event_delay") = 0, py::arg("costs") = py::none())
      .def("modeled_us", &SimBackend::modeled_us, "Modeled microseconds of every backend call so far")
      .def("device_used", &SimBackend::device_used, "Bytes of granules or segments created now")
      .def("write_pattern", &SimBackend::write_pattern, py::arg("addr"), py::arg("size"), py::arg("seed"),
           py::call_guard<py::gil_scoped_release>())
      .def("check_pattern", &SimBackend::check_pattern, py::arg("addr"), py::arg("size"), py::arg("seed"),
           py::call_guard<py::gil_scoped_release>())
      // The raw primitives, for tests of the backend itself (a pool owns them
      // otherwise: never call these on a backend a Pool uses).
      .def("reserve", &SimBackend::reserve, py::arg("bytes"))
      .def("unreserve", &SimBackend::unreserve, py::arg("base"), py::arg("bytes"))
      .def("create_granule", &SimBackend::create_granule)
      .def("release_granule", &SimBackend::release_granule, py::arg("handle"))
      .def("map",
           [](SimBackend& b, Addr at, const std::vector<GranuleHandle>& handles) {
             b.map(at, handles.data(), handles.size());
           },
           py::arg("at"), py::arg("handles"))
      .def("unmap", &SimBackend::unmap, py::arg("at"), py::arg("count"))
      .def("create_run", &SimBackend::create_run, py::arg("granules"))
      .def("map_run", &SimBackend::map_run, py::arg("at"), py::arg("handle"), py::arg("granules"))
      .def("unmap_run", &SimBackend::unmap_run, py::arg("at"), py::arg("granules"))
      .def("allocate_segment", &SimBackend::allocate_segment, py::arg("bytes"))
      .def("free_segment", &SimBackend::free_segment, py::arg("base"), py::arg("bytes"))
      .def("record_event", &SimBackend::record_event, py::arg("stream"))
      .def("event_completed", &SimBackend::event_completed, py::arg("event"))
      .def("synchronize_event", &SimBackend::synchronize_event, py::arg("event"))
      .def("destroy_event", &SimBackend::destroy_event, py::arg("event"))
      .def("synchronize_device", &SimBackend::synchronize_device)
      .def("launch", &SimBackend::launch, py::arg("stream"), py::arg("addr"), py::arg("size"), py::arg("polls"),
           "A kernel on `stream` touching [addr, addr+size) for `polls` event polls; unmapping memory it "
           "touches raises (an illegal address on a GPU)")
      .def("kernels_in_flight", &SimBackend::kernels_in_flight)
      .def("allow_device_sync", &SimBackend::allow_device_sync, py::arg("allowed"),
           "False: synchronize_device() refuses, as during a CUDA graph capture")
      .def("allow_stream_order", &SimBackend::allow_stream_order, py::arg("allowed"),
           "False: order_streams() refuses, as while one of its streams captures")
      .def("mem_info", [](SimBackend& b) {
        MemInfo m = b.mem_info();
        return py::make_tuple(m.free_bytes, m.total_bytes);
      });

  py::class_<Pool>(m, "Pool", "torchmem's pool over a backend (csrc/core/pool.h)")
      .def(py::init([](Backend& backend, py::object config) {
             PoolConfig c;
             if (!config.is_none()) c = config_from_dict(config.cast<py::dict>());
             return std::make_unique<Pool>(backend, c);
           }),
           py::arg("backend"), py::arg("config") = py::none(), py::keep_alive<1, 2>())
      .def("allocate", &Pool::allocate, py::arg("size"), py::arg("stream") = 0, py::arg("pool") = 0,
           py::arg("context") = 0, py::call_guard<py::gil_scoped_release>(),
           "Address of a block of at least size bytes, or 0 when out of memory")
      .def("allocate_cached", &Pool::allocate_cached, py::arg("size"), py::arg("stream") = 0, py::arg("pool") = 0,
           py::arg("context") = 0, py::call_guard<py::gil_scoped_release>(),
           "A cached block that fits, or 0: no new memory, no OOM ladder, no OOM counted (use_on_oom lenders)")
      .def("free", &Pool::deallocate, py::arg("addr"), py::arg("free_context") = 0, py::arg("current_stream") = kNoStream,
           py::call_guard<py::gil_scoped_release>(),
           "current_stream: the caller's current stream at the free, if known (Note [Freed under another stream])")
      .def("sequence", &Pool::sequence)
      .def("record_stream", &Pool::record_stream, py::arg("addr"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>())
      .def("create_private_pool", &Pool::create_private_pool, py::arg("id"),
           py::call_guard<py::gil_scoped_release>())
      .def("release_private_pool", &Pool::release_private_pool, py::arg("id"),
           py::call_guard<py::gil_scoped_release>())
      .def("release_cached_to", &Pool::release_cached_to, py::arg("keep_bytes"),
           py::call_guard<py::gil_scoped_release>(),
           "Return cached memory only down to keep_bytes held; the bytes returned")
      .def("release_pool_cache", &Pool::release_pool_cache, py::arg("id"),
           py::call_guard<py::gil_scoped_release>(),
           "torch's emptyCache(mempool_id): return private pool `id`'s cached memory alone; bytes returned")
      .def("release_cached", &Pool::release_cached, py::arg("context") = 0,
           py::call_guard<py::gil_scoped_release>(),
           "empty_cache: returns the bytes given back to the backend (segment-unmap history entries carry context)")
      .def("set_limit", &Pool::set_limit, py::arg("bytes"), py::call_guard<py::gil_scoped_release>())
      .def("set_foreign_bytes", &Pool::set_foreign_bytes, py::arg("bytes"),
           "Bytes held outside this pool that count against its limit (Note [Foreign bytes])")
      .def("limit", &Pool::limit)
      .def("set_trace_capacity", &Pool::set_trace_capacity, py::arg("entries"),
           py::call_guard<py::gil_scoped_release>(), "Resize the trace ring, keeping its newest entries")
      .def("clear_trace", &Pool::clear_trace, py::call_guard<py::gil_scoped_release>())
      .def("stats", &pool_stats)
      .def("reset_peak_stats", &Pool::reset_peak_stats, py::call_guard<py::gil_scoped_release>())
      .def("reset_accumulated_stats", &Pool::reset_accumulated_stats,
           py::call_guard<py::gil_scoped_release>())
      .def("snapshot",
           [](const Pool& p) {
             PoolSnapshot s;
             {
               py::gil_scoped_release release;
               s = p.snapshot();
             }
             return snapshot_to_dict(s);
           })
      .def("check_invariants",
           [](const Pool& p) {
             std::string problem;
             {
               py::gil_scoped_release release;
               problem = p.check_invariants();
             }
             if (!problem.empty()) throw std::runtime_error("torchmem pool invariant violated: " + problem);
           })
      .def("block_size", &Pool::block_size, py::arg("addr"))
      .def(
          "backing_of",
          [](const Pool& p, Addr addr) {
            const BlockBacking backing = p.backing_of(addr);
            py::list pieces;
            for (const BackingPiece& piece : backing.pieces) {
              py::dict d;
              d["at"] = piece.at;
              d["bytes"] = piece.bytes;
              d["handle"] = piece.handle;
              pieces.append(d);
            }
            py::dict out;
            out["block"] = backing.block;
            out["size"] = backing.size;
            out["pieces"] = pieces;
            return out;
          },
          py::arg("addr"),
          "What backs the live block at `addr`: {'block', 'size', 'pieces': [{'at', 'bytes', 'handle'}]} "
          "(Note [Block backing]); PoolError if `addr` is not a live block's start")
      .def("checkpoint_private_pool", &checkpoint_to_dict, py::arg("id"),
           "The live blocks of private pool `id`: {'pool', 'blocks': [{'addr', 'size', 'requested', "
           "'stream', 'context'}]} (Note [Pool checkpoints])")
      .def("restore_private_pool", &restore_from_dict, py::arg("checkpoint"),
           "Makes the pool's live set that of `checkpoint` at the same addresses; returns "
           "{'freed': [addr], 'allocated': [addr]}")
      .def_property_readonly("backend", &Pool::backend, py::return_value_policy::reference_internal);

  m.def("pool_config_fields", &pool_config_fields,
        "[(name, kind, default, doc)] for every field of the core's PoolConfig (csrc/core/pool.h)");

  m.def(
      "_random_ops",
      [](std::uint64_t seed, std::size_t ops, py::object options) {
        replay::RandomOpsOptions o;
        if (!options.is_none()) {
          for (const auto& item : options.cast<py::dict>()) {
            const std::string key = py::str(item.first);
            if (key == "vmm") o.vmm = item.second.cast<bool>();
            else if (key == "capacity") o.capacity = item.second.cast<std::size_t>();
            else if (key == "limit") o.limit = item.second.cast<std::size_t>();
            else if (key == "check_every") o.check_every = item.second.cast<std::size_t>();
            else if (key == "event_delay") o.event_delay = item.second.cast<std::uint64_t>();
            else if (key == "streams") o.streams = item.second.cast<unsigned>();
            else if (key == "reclaim_slack") o.reclaim_slack = item.second.cast<double>();
            else if (key == "stitch_above") o.stitch_above = item.second.cast<double>();
            else if (key == "run_below") o.run_below = item.second.cast<double>();
            else if (key == "run_below_limit") o.run_below_limit = item.second.cast<double>();
            else if (key == "foreign_readers") o.foreign_readers = item.second.cast<unsigned>();
            else if (key == "declared_readers") o.declared_readers = item.second.cast<unsigned>();
            else if (key == "scopes") o.scopes = item.second.cast<unsigned>();
            else if (key == "alias_reclaim") o.alias_reclaim = item.second.cast<bool>();
            else if (key == "private_pools") o.private_pools = item.second.cast<bool>();
            else if (key == "max_live") o.max_live = item.second.cast<std::size_t>();
            else throw py::value_error("_random_ops: unknown option '" + key + "'");
          }
        }
        replay::RandomOpsSummary s;
        std::string problem;
        {
          py::gil_scoped_release release;
          problem = replay::run_random_ops(seed, ops, o, &s);
        }
        if (!problem.empty()) throw std::runtime_error(problem);
        py::dict d;
        d["ops"] = s.ops;
        d["allocs"] = s.allocs;
        d["frees"] = s.frees;
        d["ooms"] = s.ooms;
        d["checks"] = s.checks;
        d["reclaims"] = s.reclaims;
        d["peak_live"] = s.peak_live;
        d["peak_held"] = s.peak_held;
        d["scope_allocs"] = s.scope_allocs;
        return d;
      },
      py::arg("seed"), py::arg("ops"), py::arg("options") = py::none(),
      "Runs `ops` seeded random pool operations on a sim backend against a reference model and "
      "check_invariants(); raises RuntimeError naming the seed and step of the first violation");
}

}  // namespace torchmem::bindings
