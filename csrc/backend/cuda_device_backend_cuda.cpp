// cuda_device_backend_cuda.cpp: device memory figures and stream fences shared
// by the CUDA backends (see the header).
#include "backend/cuda_device_backend_cuda.h"

namespace torchmem {

MemInfo CudaDeviceBackend::mem_info() {
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  MemInfo info;
  cuda::check(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo");
  return info;
}

EventHandle CudaDeviceBackend::record_event(StreamId stream) {
  EventHandle event = fences_.record(stream);
  counters_.event_record_calls += 1;
  return event;
}

bool CudaDeviceBackend::event_completed(EventHandle event) { return fences_.completed(event); }

void CudaDeviceBackend::synchronize_event(EventHandle event) {
  fences_.synchronize(event);
  counters_.event_sync_calls += 1;
}

void CudaDeviceBackend::destroy_event(EventHandle event) { fences_.destroy(event); }

bool CudaDeviceBackend::synchronize_device() {
  if (active_captures_ != nullptr && active_captures_->load(std::memory_order_acquire) > 0) return false;
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  counters_.device_sync_calls += 1;
  return true;
}

bool CudaDeviceBackend::order_streams(StreamId waiter, StreamId signaler) {
  if (waiter == signaler) return true;
  if (active_captures_ != nullptr && active_captures_->load(std::memory_order_acquire) > 0) return false;
  if (!fences_.order(waiter, signaler)) return false;
  counters_.event_record_calls += 1;
  counters_.stream_wait_calls += 1;
  return true;
}

}  // namespace torchmem
