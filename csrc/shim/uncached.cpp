// uncached.cpp: allocations while caching is off (Note [Caching off]).
//
// Note [Caching off] torch.cuda.caching_allocator_enable(False) is PyTorch's
// switch for debugging memory errors: from then on every allocation is its own
// cudaMalloc and every free a cudaFree, so a stale pointer faults instead of
// reading memory someone else now owns. PyTorch's allocator then keeps such
// blocks out of its pools and its statistics, and so does torchmem: they are
// not in memory_stats, snapshots or the budget. Blocks allocated before the
// switch go back to the pool as usual; a block allocated while caching was
// off goes back to cudaFree whenever it is freed.
#include <cuda_runtime_api.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <unordered_set>

#include "backend/cuda_support_cuda.h"
#include "shim/runtime.h"

namespace torchmem::shim {

namespace {

std::atomic<bool> caching{true};
std::mutex uncached_mutex;
std::atomic<std::size_t> uncached_count{0};  // fast-path check for frees
std::unordered_set<void*> uncached_blocks;   // guarded by uncached_mutex

}  // namespace

void set_caching_enabled(bool enabled) { caching.store(enabled, std::memory_order_relaxed); }

bool caching_enabled() { return caching.load(std::memory_order_relaxed); }

void* allocate_uncached(std::size_t size, int device) {
  cuda::DeviceGuard guard(device);
  void* ptr = nullptr;
  const cudaError_t status = cudaMalloc(&ptr, size == 0 ? 1 : size);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear the sticky error
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                "CUDA out of memory. Tried to allocate " + std::to_string(size) +
                                    " bytes with caching off (torch.cuda.caching_allocator_enable(False)): "
                                    "cudaMalloc failed.");
  }
  cuda::check(status, "cudaMalloc (caching off)");
  std::lock_guard<std::mutex> lock(uncached_mutex);
  uncached_blocks.insert(ptr);
  uncached_count.store(uncached_blocks.size(), std::memory_order_release);
  return ptr;
}

bool free_if_uncached(void* ptr) {
  if (uncached_count.load(std::memory_order_acquire) == 0) return false;
  {
    std::lock_guard<std::mutex> lock(uncached_mutex);
    if (uncached_blocks.erase(ptr) == 0) return false;
    uncached_count.store(uncached_blocks.size(), std::memory_order_release);
  }
  // cudaFree waits for the device, as PyTorch's uncached free does.
  const cudaError_t status = cudaFree(ptr);
  if (status != cudaSuccess) {
    std::fprintf(stderr, "torchmem: cudaFree of an uncached block failed: %s\n", cudaGetErrorString(status));
  }
  return true;
}

void delete_uncached_block(void* ptr) noexcept {
  if (!free_if_uncached(ptr)) {
    std::fprintf(stderr, "torchmem: free of %p, which is not an uncached block (reported, not raised)\n", ptr);
  }
}

}  // namespace torchmem::shim
