// runtime.h: the installed allocator's lifecycle: the config device pools are
// built from, the swap of torch's allocator, and the per-device pools.
//
// The shim's declarations are split by concern, one header each; none
// includes torch or CUDA headers, so the pybind11 bindings
// (csrc/bindings/runtime_bindings_cuda.cpp) stay quick to compile:
//   runtime.h        config, install, per-device pools (this file)
//   budget.h         the limit: install limit, memory fraction, share grant
//   allocation.h     what torch calls: allocate, free, record_stream; caching off
//   private_pools.h  torch.cuda.MemPool / graph pools, external allocators
//   callbacks.h      OOM callback and observers, context providers, stacks
//   device_stats.h   stats, peaks, trace ring, external pools' snapshots
//   diagnostics.h    timing probes for bench/gpu_probe.py
// The torch-facing parts live in runtime.cpp (the allocation path, the OOM
// error), install.cpp (CUDAPluggableAllocator and its hooks) and exports.cpp
// (the extern "C" alloc/free torch can load by name).
//
// Note [Lock order] Each device's Pool has one mutex (pool.h). The runtime adds
// a registry mutex (taken only to create a device's state), and per device a
// capture mutex (private pools and the active filters), a parked-blocks mutex
// and the Budget's mutex (budget.h). A pool's mutex may be taken while the
// capture mutex or the Budget's mutex is held, never the other way round; the
// parked-blocks mutex and the external-blocks mutex (Note [External pool
// allocators]) are leaves. No lock is held while user code runs (the OOM
// callback, torch's OOM observers, the context provider), except a MemPool's
// own allocator X: its pool (Note [External pool allocators]) calls X under
// that pool's mutex, and asks the device pool's usage there (external pool ->
// device pool, never the reverse), as PyTorch calls a pool's allocator under
// its own lock. An X that allocates through torchmem is routed to the device
// pool, never to itself.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "core/pool.h"
#include "shim/budget.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*: named here without CUDA headers

namespace torchmem::shim {

using CudaStream = CUstream_st*;
using MempoolKey = std::pair<unsigned long long, unsigned long long>;  // torch's MempoolId_t

struct RuntimeConfig {
  // Every PoolConfig field but limit_bytes, which stays 0 here: the limit is
  // `limit`, resolved per device by its Budget (budget.h).
  PoolConfig pool;
  LimitSpec limit;
  int oom_hook_retries = 3;
  // Note [Parked private blocks]: true parks frees of an in-use private pool
  // until its release; false (the default) frees them into the pool, whose own
  // later allocations reuse them (as PyTorch does; the core keeps the pool's
  // memory frozen while it is in use: Note [Private pools] in core/pool.h).
  bool park_private_frees = false;
  // Note [Memory fraction] (budget.h): a fraction every device's pool starts
  // with, as if set_memory_fraction() had been called at its creation (torch's
  // PYTORCH_CUDA_ALLOC_CONF per_process_memory_fraction); < 0: none.
  double initial_fraction = -1.0;
  std::string backend = "auto";  // "auto" (vmm where supported), "vmm", "cuda_malloc"
};

// ---- configuration and install ----------------------------------------------
// The one check of a RuntimeConfig's values (backend, limit, starting
// fraction): throws std::invalid_argument naming the bad value and the fix.
// configure() and install() run it first, before anything else can fail.
void check_config(const RuntimeConfig& config);

// Sets the config for pools made from now on. Throws std::invalid_argument if a
// pool exists already and `config` differs from the one in force (pools are
// never rebuilt: they own live memory).
void configure(const RuntimeConfig& config);
bool is_configured();
// Whether torch's current CUDA allocator has initialized (then it cannot be
// swapped). Defined in install.cpp.
bool torch_allocator_initialized();
// configure(), then swap torch's allocator for torchmem's (install.cpp). Throws
// std::runtime_error if torch's allocator initialized already.
void install(const RuntimeConfig& config);
bool is_installed();
void mark_installed();

// ---- per-device pools ---------------------------------------------------------
// The pool of `device`, made at first use with the configured (or default) config.
Pool& device_pool(int device);
std::vector<int> devices();        // devices that have a pool, ascending
std::string backend_name(int device);
MemInfo device_mem_info(int device);
std::size_t empty_cache();         // release_cached() on every pool; bytes returned

}  // namespace torchmem::shim
