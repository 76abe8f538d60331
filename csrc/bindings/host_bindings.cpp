// host_bindings.cpp: torchmem._C.HostPool, the pinned host pool seen from
// Python (torchmem/host/pool.py), and the sysfs helpers it is tested through.
//
// A block leaves the pool as a uint8 CPU tensor whose storage owns it: the
// tensor's DataPtr deleter frees the block back to the pool, and it holds a
// reference to the pool, so a tensor may outlive every Python handle to the
// pool. Python views the bytes as the dtype and shape asked for.
//
// Allocation releases the GIL: a fresh chunk may take a few hundred
// milliseconds to pin, and other Python threads should run meanwhile.
#include <torch/extension.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings/bindings.h"
#include "bindings/host_pool_holder.h"
#include "host/host_pool.h"
#include "host/host_system.h"
#include "host/sim_host_backend.h"
#if TORCHMEM_WITH_CUDA
#include "host/host_backend_cuda.h"
#endif

namespace py = pybind11;

namespace torchmem::bindings {

namespace {

using host::HostPool;
using host::HostPoolConfig;

using Holder = HostPoolHolder;

HostPoolConfig pool_config(std::size_t chunk_bytes, std::size_t limit_bytes, bool require_pinned) {
  HostPoolConfig c;
  c.chunk_bytes = chunk_bytes;
  c.limit_bytes = limit_bytes;
  c.require_pinned = require_pinned;
  return c;
}

Holder make_sim(std::size_t chunk_bytes, std::size_t limit_bytes, bool require_pinned, const std::string& huge_pages,
                const std::string& sysfs_root, bool refuse_pinning, std::size_t memlock_bytes,
                std::size_t capacity_bytes, bool auto_complete) {
  host::SimHostConfig sc;
  sc.huge_pages = host::parse_huge_pages(huge_pages);
  sc.sysfs_root = sysfs_root;
  sc.refuse_pinning = refuse_pinning;
  sc.memlock_bytes = memlock_bytes;
  sc.capacity_bytes = capacity_bytes;
  sc.auto_complete = auto_complete;
  auto holder = std::make_shared<PyHostPool>();
  auto backend = std::make_unique<host::SimHostBackend>(sc);
  holder->sim = backend.get();
  holder->thp = backend->thp();
  holder->backend = std::move(backend);
  holder->pool = std::make_unique<HostPool>(*holder->backend, pool_config(chunk_bytes, limit_bytes, require_pinned));
  return holder;
}

#if TORCHMEM_WITH_CUDA
Holder make_cuda(int device, std::size_t chunk_bytes, std::size_t limit_bytes, bool require_pinned,
                 const std::string& huge_pages, bool numa, int touch_threads, const std::string& sysfs_root) {
  host::CudaHostConfig cc;
  cc.device = device;
  cc.huge_pages = host::parse_huge_pages(huge_pages);
  cc.numa = numa;
  cc.touch_threads = touch_threads;
  cc.sysfs_root = sysfs_root;
  auto holder = std::make_shared<PyHostPool>();
  auto backend = std::make_unique<host::CudaHostBackend>(cc);
  holder->device = device;
  holder->numa_node = backend->numa_node();
  holder->thp = backend->thp();
  holder->backend = std::move(backend);
  holder->pool = std::make_unique<HostPool>(*holder->backend, pool_config(chunk_bytes, limit_bytes, require_pinned));
  return holder;
}
#endif

at::Tensor empty_bytes(const Holder& holder, std::size_t nbytes, std::uint64_t stream) {
  void* ptr;
  {
    py::gil_scoped_release released;
    ptr = holder->pool->allocate(nbytes, static_cast<StreamId>(stream));
  }
  Holder keep = holder;
  auto deleter = [keep](void* p) {
    try {
      keep->pool->free(p);
    } catch (const std::exception&) {
      // A deleter must not throw; the pool only refuses pointers it never
      // handed out, which this one was.
    }
  };
  return torch::from_blob(ptr, {static_cast<std::int64_t>(nbytes)}, deleter,
                          at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

py::dict stats_dict(const host::HostPoolStats& s) {
  py::dict d;
#define TORCHMEM_HOST_STAT_ITEM(name) d[#name] = s.name;
  TORCHMEM_HOST_STATS(TORCHMEM_HOST_STAT_ITEM)
#undef TORCHMEM_HOST_STAT_ITEM
  return d;
}

HostPool& pool_of(const Holder& h) { return *h->pool; }

}  // namespace

void bind_host(py::module_& m) {
  py::register_exception<host::HostOutOfMemory>(m, "HostOutOfMemoryError", PyExc_MemoryError);
  py::register_exception<host::HostPoolError>(m, "HostPoolError", PyExc_ValueError);

  py::class_<PyHostPool, Holder>(m, "HostPool", "A pinned host pool (csrc/host/host_pool.h); use torchmem.host")
      .def_static("sim", &make_sim, py::arg("chunk_bytes"), py::arg("limit_bytes") = 0,
                  py::arg("require_pinned") = false, py::arg("huge_pages") = "thp", py::arg("sysfs_root") = "/sys",
                  py::arg("refuse_pinning") = false, py::arg("memlock_bytes") = 0, py::arg("capacity_bytes") = 0,
                  py::arg("auto_complete") = true)
#if TORCHMEM_WITH_CUDA
      .def_static("cuda", &make_cuda, py::arg("device"), py::arg("chunk_bytes"), py::arg("limit_bytes") = 0,
                  py::arg("require_pinned") = false, py::arg("huge_pages") = "thp", py::arg("numa") = true,
                  py::arg("touch_threads") = 8, py::arg("sysfs_root") = "/sys")
#endif
      .def("empty_bytes", &empty_bytes, py::arg("nbytes"), py::arg("stream") = 0)
      .def("record_stream", [](const Holder& h, std::uintptr_t ptr, std::uint64_t stream) {
        pool_of(h).record_stream(reinterpret_cast<void*>(ptr), static_cast<StreamId>(stream));
      })
      .def("process_events", [](const Holder& h) { return pool_of(h).process_events(); })
      .def("set_copies_reported", [](const Holder& h, bool reported) { pool_of(h).set_copies_reported(reported); },
           py::arg("reported"))
      .def("release_cached", [](const Holder& h) {
        py::gil_scoped_release released;
        return pool_of(h).release_cached();
      })
      .def("is_pinned", [](const Holder& h, std::uintptr_t ptr) { return pool_of(h).is_pinned(reinterpret_cast<void*>(ptr)); })
      .def("block_size", [](const Holder& h, std::uintptr_t ptr) { return pool_of(h).block_size(reinterpret_cast<void*>(ptr)); })
      .def("set_limit", [](const Holder& h, std::size_t bytes) { pool_of(h).set_limit(bytes); })
      .def("limit", [](const Holder& h) { return pool_of(h).limit(); })
      .def("stats", [](const Holder& h) { return stats_dict(pool_of(h).stats()); })
      .def("reset_peak_stats", [](const Holder& h) { pool_of(h).reset_peak_stats(); })
      .def("check_invariants", [](const Holder& h) { return pool_of(h).check_invariants(); })
      .def("take_notices", [](const Holder& h) { return h->backend->take_notices(); })
      .def_property_readonly("backend_name", [](const Holder& h) { return h->backend->name(); })
      .def_property_readonly("page_bytes", [](const Holder& h) { return h->backend->page_bytes(); })
      .def_property_readonly("numa_node", [](const Holder& h) { return h->numa_node; })
      .def_property_readonly("thp_mode", [](const Holder& h) { return h->thp; })
      .def("complete_events", [](const Holder& h, std::uint64_t stream) {
        if (h->sim == nullptr) throw py::value_error("complete_events: only the simulated host backend has it");
        h->sim->complete_events(static_cast<StreamId>(stream));
      }, py::arg("stream") = 0)
      .def("open_events", [](const Holder& h) {
        if (h->sim == nullptr) throw py::value_error("open_events: only the simulated host backend has it");
        return h->sim->open_events();
      });

  m.def("host_size_class", &host::host_size_class, "The size a host request is rounded to");
  m.def("host_numa_node_of_pci", &host::numa_node_of_pci, py::arg("sysfs_root"), py::arg("bus_id"));
  m.def("host_numa_node_count", &host::numa_node_count, py::arg("sysfs_root"));
  m.def("host_thp_mode", &host::thp_mode, py::arg("sysfs_root"));
}

}  // namespace torchmem::bindings
