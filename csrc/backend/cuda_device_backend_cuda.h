// cuda_device_backend_cuda.h: what the two CUDA backends (vmm, cuda_malloc)
// share: the device they serve, its memory figures and its stream fences.
//
// Both order work on streams the same way (pooled timing-free events, see
// cuda::FencePool), so the Backend's event primitives and mem_info live here
// once; each backend adds only how it obtains memory.
#pragma once

#include "backend/cuda_support_cuda.h"
#include "core/backend.h"

namespace torchmem {

class CudaDeviceBackend : public Backend {
 public:
  explicit CudaDeviceBackend(int device) : device_(device), fences_(device) {}

  MemInfo mem_info() override;
  EventHandle record_event(StreamId stream) override;
  bool event_completed(EventHandle event) override;
  void synchronize_event(EventHandle event) override;
  void destroy_event(EventHandle event) override;

  int device() const { return device_; }

 protected:
  const int device_;

 private:
  cuda::FencePool fences_;
};

}  // namespace torchmem
