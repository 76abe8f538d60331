// cuda_malloc_backend_cuda.h: the `cuda_malloc` backend: plain cudaMalloc /
// cudaFree segments for one device.
//
// For drivers or devices without virtual memory management, and as a baseline:
// the pool carves blocks out of segments and frees whole empty ones, but cannot
// stitch (it serves SegmentPrimitives only: Backend::vmm() is null).
//
// A SegmentSource replaces cudaMalloc / cudaFree with someone else's pair: the
// pool behind torch.cuda.MemPool(allocator=X) caches X's segments this way
// (Note [External pool allocators], csrc/shim/private_pools.h).
#pragma once

#include <functional>
#include <string>

#include "backend/cuda_device_backend_cuda.h"

namespace torchmem {

// Where segments come from when not from cudaMalloc. allocate returns nullptr
// when it has no memory (the pool then climbs its OOM ladder).
struct SegmentSource {
  std::string name;
  std::function<void*(std::size_t bytes)> allocate;
  std::function<void(void* ptr, std::size_t bytes)> free;
};

class CudaMallocBackend final : public CudaDeviceBackend, public SegmentPrimitives {
 public:
  explicit CudaMallocBackend(int device, SegmentSource source = {});
  ~CudaMallocBackend() override;

  std::string name() const override { return source_.allocate ? source_.name : "cuda_malloc"; }
  // Not a hardware granule: the unit the pool rounds segments to, as PyTorch does.
  std::size_t granularity() const override { return 2 * kMiB; }

  Addr allocate_segment(std::size_t bytes) override;
  void free_segment(Addr base, std::size_t bytes) override;

 private:
  SegmentSource source_;
};

}  // namespace torchmem
