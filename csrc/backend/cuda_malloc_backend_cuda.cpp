// cuda_malloc_backend_cuda.cpp: cudaMalloc / cudaFree segments (see the header).
#include "backend/cuda_malloc_backend_cuda.h"

#include <stdexcept>
#include <utility>

namespace torchmem {

CudaMallocBackend::CudaMallocBackend(int device, SegmentSource source)
    : CudaDeviceBackend(device), source_(std::move(source)) {
  serve(static_cast<SegmentPrimitives*>(this));
}

CudaMallocBackend::~CudaMallocBackend() = default;

Addr CudaMallocBackend::allocate_segment(std::size_t bytes) {
  if (source_.allocate) {
    void* ptr = source_.allocate(bytes);
    if (ptr != nullptr) counters_.segment_alloc_calls += 1;
    return reinterpret_cast<Addr>(ptr);
  }
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // out of memory is not an error here: the pool climbs its ladder
    return 0;
  }
  cuda::check(status, "cudaMalloc");
  counters_.segment_alloc_calls += 1;
  return reinterpret_cast<Addr>(ptr);
}

void CudaMallocBackend::free_segment(Addr base, std::size_t bytes) {
  if (source_.free) {
    source_.free(reinterpret_cast<void*>(base), bytes);
    counters_.segment_free_calls += 1;
    return;
  }
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  cuda::check(cudaFree(reinterpret_cast<void*>(base)), "cudaFree");
  counters_.segment_free_calls += 1;
}

}  // namespace torchmem
