// cuda_malloc_backend_cuda.cpp: cudaMalloc / cudaFree segments (see the header).
#include "backend/cuda_malloc_backend_cuda.h"

#include <stdexcept>
#include <utility>

namespace torchmem {

namespace {

[[noreturn]] void no_vmm(const char* call) {
  throw std::logic_error(std::string("torchmem: the cuda_malloc backend has no virtual memory (") + call +
                         " called)");
}

}  // namespace

CudaMallocBackend::CudaMallocBackend(int device, SegmentSource source)
    : CudaDeviceBackend(device), source_(std::move(source)) {}

CudaMallocBackend::~CudaMallocBackend() = default;

Addr CudaMallocBackend::reserve(std::size_t) { no_vmm("reserve"); }
void CudaMallocBackend::unreserve(Addr, std::size_t) { no_vmm("unreserve"); }
GranuleHandle CudaMallocBackend::create_granule() { no_vmm("create_granule"); }
void CudaMallocBackend::release_granule(GranuleHandle) { no_vmm("release_granule"); }
void CudaMallocBackend::map(Addr, const GranuleHandle*, std::size_t) { no_vmm("map"); }
void CudaMallocBackend::unmap(Addr, std::size_t) { no_vmm("unmap"); }
GranuleHandle CudaMallocBackend::create_run(std::size_t) { no_vmm("create_run"); }
void CudaMallocBackend::map_run(Addr, GranuleHandle, std::size_t) { no_vmm("map_run"); }
void CudaMallocBackend::unmap_run(Addr, std::size_t) { no_vmm("unmap_run"); }

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
