// host_pool_holder.h: what a torchmem._C.HostPool Python object holds: a host
// backend and the pool over it, shared by every tensor carved from it (so the
// pool outlives its last tensor). Shared by host_bindings.cpp and, in CUDA
// builds, host_torch_bindings_cuda.cpp (torch's host allocator hook).
#pragma once

#include <memory>
#include <string>

#include "host/host_backend.h"
#include "host/host_pool.h"
#include "host/sim_host_backend.h"

namespace torchmem::bindings {

struct PyHostPool {
  std::unique_ptr<host::HostBackend> backend;
  std::unique_ptr<host::HostPool> pool;
  host::SimHostBackend* sim = nullptr;  // set for the simulated backend
  int device = -1;                      // the CUDA device served; -1 for the simulated backend
  int numa_node = -1;
  std::string thp;
};
using HostPoolHolder = std::shared_ptr<PyHostPool>;

}  // namespace torchmem::bindings
