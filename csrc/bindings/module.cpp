// module.cpp: the torchmem._C extension module and its build facts.
//
// build_info() tells Python what this binary was built against, so a module
// built for another torch fails at import with a clear message (see
// torchmem/_loader.py) instead of an undefined-symbol error later.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"

#ifndef TORCHMEM_TORCH_VERSION
#define TORCHMEM_TORCH_VERSION "unknown"
#endif
#ifndef TORCHMEM_CUDA_VERSION
#define TORCHMEM_CUDA_VERSION ""
#endif

namespace py = pybind11;

namespace {

py::dict build_info() {
  py::dict info;
  info["torch_version"] = TORCHMEM_TORCH_VERSION;
  const char* cuda = TORCHMEM_CUDA_VERSION;
  info["cuda_version"] = cuda[0] ? py::object(py::str(cuda)) : py::object(py::none());
  info["cuda_backends"] = static_cast<bool>(TORCHMEM_WITH_CUDA);
  info["debug"] = static_cast<bool>(TORCHMEM_DEBUG);
  info["compiler"] = __VERSION__;
  info["cplusplus"] = static_cast<long>(__cplusplus);
#ifdef __OPTIMIZE__
  info["optimized"] = true;
#else
  info["optimized"] = false;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchmem's compiled core: the pool, its backends and the allocator shim";
  m.def("build_info", &build_info, "What this extension was built against");
  torchmem::bindings::bind_core(m);
  torchmem::bindings::bind_replay(m);
  torchmem::bindings::bind_host(m);
#if TORCHMEM_WITH_CUDA
  torchmem::bindings::bind_runtime(m);
  torchmem::bindings::bind_host_torch(m);
  torchmem::bindings::bind_offload_copies(m);
#endif
}
