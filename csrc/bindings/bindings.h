// bindings.h: the pieces of the torchmem._C module, one function per concern.
//
// module.cpp owns the module and calls each binder; each binder lives in its own
// file so a change to one recompiles only that file. Binders include pybind11
// only (not torch/extension.h), which keeps each file quick to compile.
#pragma once

#include <pybind11/pybind11.h>

namespace torchmem::bindings {

void bind_core(pybind11::module_& m);     // core_bindings.cpp: SimBackend, Pool, stats, snapshots
void bind_replay(pybind11::module_& m);   // replay_bindings.cpp: trace replay, native allocator model
void bind_host(pybind11::module_& m);     // host_bindings.cpp: the pinned host pool
#if TORCHMEM_WITH_CUDA
void bind_runtime(pybind11::module_& m);  // runtime_bindings_cuda.cpp: the installed allocator
void bind_host_torch(pybind11::module_& m);  // host_torch_bindings_cuda.cpp: torch's host allocator hook
void bind_offload_copies(pybind11::module_& m);  // offload_copies_cuda.cpp: activation offload's copies
#endif

}  // namespace torchmem::bindings
