// exports.cpp: the extern "C" alloc/free pairs torch's CUDAPluggableAllocator
// loads by name from this module's .so, for users who build the allocator from
// Python and for torch.cuda.MemPool:
//   torchmem_alloc / torchmem_free            global swap: OOM throws
//   torchmem_pool_alloc / torchmem_pool_free  torch.cuda.MemPool: OOM -> nullptr
// torchmem.install() does not use them (install.cpp calls the runtime directly).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <exception>

#include "shim/allocation.h"

// Default visibility: the build hides everything else (-fvisibility=hidden).
#define TORCHMEM_EXPORT extern "C" __attribute__((visibility("default")))

TORCHMEM_EXPORT void* torchmem_alloc(size_t size, int device, cudaStream_t stream) {
  return torchmem::shim::allocate_or_throw(size, device, stream);
}

TORCHMEM_EXPORT void torchmem_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)stream;  // the pool remembers each block's stream itself
  torchmem::shim::deallocate(ptr, device);
}

TORCHMEM_EXPORT void* torchmem_pool_alloc(size_t size, int device, cudaStream_t stream) {
  try {
    return torchmem::shim::allocate_or_null(size, device, stream);
  } catch (const std::exception& error) {
    // torch's MemPool path expects nullptr, not an exception, when memory is short;
    // other failures are reported and surface as torch's own OOM error.
    std::fprintf(stderr, "torchmem_pool_alloc(%zu bytes, device %d): %s\n", size, device, error.what());
    return nullptr;
  }
}

TORCHMEM_EXPORT void torchmem_pool_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  torchmem_free(ptr, size, device, stream);
}
