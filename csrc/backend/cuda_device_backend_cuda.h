// cuda_device_backend_cuda.h: what the two CUDA backends (vmm, cuda_malloc)
// share: the device they serve, its memory figures and its stream fences.
//
// Both order work on streams the same way (pooled timing-free events, see
// cuda::FencePool), so the Backend's event primitives and mem_info live here
// once; each backend adds only how it obtains memory.
#pragma once

#include <atomic>

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
  // cudaDeviceSynchronize, refused while *active_captures > 0 (a graph
  // capture would be invalidated by a device-wide wait).
  bool synchronize_device() override;
  // Refused like synchronize_device, and while either stream captures.
  bool order_streams(StreamId waiter, StreamId signaler) override;

  // The owner's count of captures (and MemPool scopes) in progress on this
  // device; synchronize_device() refuses while it is non-zero.
  void refuse_device_sync_while(const std::atomic<int>* active_captures) { active_captures_ = active_captures; }

  int device() const { return device_; }

 protected:
  const int device_;

 private:
  cuda::FencePool fences_;
  const std::atomic<int>* active_captures_ = nullptr;
};

}  // namespace torchmem
