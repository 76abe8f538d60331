// cuda_support_cuda.cpp: error checks, guards and the fence pool shared by the
// two CUDA backends (see the header for why each exists).
#include "backend/cuda_support_cuda.h"

#include <stdexcept>

namespace torchmem::cuda {

void throw_cuda_error(const char* call, cudaError_t status) {
  (void)cudaGetLastError();  // clear the sticky copy so later calls are not poisoned
  throw std::runtime_error(std::string("torchmem: ") + call + " failed: " + cudaGetErrorName(status) +
                           " (" + cudaGetErrorString(status) + ")");
}

DeviceGuard::DeviceGuard(int device) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  // Set even when current: on a thread that never made a runtime call that
  // binds a context, cudaSetDevice makes the primary context current, which
  // the driver calls (cuMem*) need. It is cheap next to any backend call.
  check(cudaSetDevice(device), "cudaSetDevice");
  switched_ = previous_ != device;
}

DeviceGuard::~DeviceGuard() {
  if (switched_) cudaSetDevice(previous_);
}

FencePool::~FencePool() {
  // Only reached when a pool is torn down explicitly; at process exit the
  // runtime may be gone already, so errors are ignored.
  for (Fence* fence : all_) {
    if (fence->event) cudaEventDestroy(fence->event);
    delete fence;
  }
}

FencePool::Fence* FencePool::as_fence(EventHandle handle) {
  return reinterpret_cast<Fence*>(static_cast<std::uintptr_t>(handle));
}

namespace {
// True while `stream` captures, or is the legacy stream while a blocking
// stream captures (as good as capturing).
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t query = cudaStreamIsCapturing(stream, &status);
  if (query == cudaErrorStreamCaptureImplicit || query == cudaErrorStreamCaptureUnsupported) {
    (void)cudaGetLastError();
    return true;
  }
  check(query, "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}
}  // namespace

bool FencePool::try_record(Fence& fence) {
  if (capturing(fence.stream)) return false;  // Note [Fences during capture]
  check(cudaEventRecord(fence.event, fence.stream), "cudaEventRecord");
  fence.recorded = true;
  return true;
}

EventHandle FencePool::record(StreamId stream) {
  RelaxedCaptureGuard relaxed;
  DeviceGuard on_device(device_);
  Fence* fence = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      fence = free_.back();
      free_.pop_back();
    }
  }
  if (fence == nullptr) {
    auto fresh = new Fence();
    cudaError_t status = cudaEventCreateWithFlags(&fresh->event, cudaEventDisableTiming);
    if (status != cudaSuccess) {
      delete fresh;
      throw_cuda_error("cudaEventCreateWithFlags", status);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    all_.push_back(fresh);
    fence = fresh;
  }
  fence->stream = reinterpret_cast<cudaStream_t>(stream);
  fence->recorded = false;
  try {
    try_record(*fence);
  } catch (...) {
    destroy(reinterpret_cast<EventHandle>(fence));
    throw;
  }
  return reinterpret_cast<EventHandle>(fence);
}

bool FencePool::completed(EventHandle handle) {
  Fence& fence = *as_fence(handle);
  RelaxedCaptureGuard relaxed;
  if (!fence.recorded) {
    DeviceGuard on_device(device_);
    if (!try_record(fence)) return false;
  }
  cudaError_t status = cudaEventQuery(fence.event);
  if (status == cudaSuccess) return true;
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  throw_cuda_error("cudaEventQuery", status);
}

void FencePool::synchronize(EventHandle handle) {
  Fence& fence = *as_fence(handle);
  RelaxedCaptureGuard relaxed;
  if (!fence.recorded) {
    DeviceGuard on_device(device_);
    if (!try_record(fence)) {
      // The stream still captures: its captured work does not run until a
      // replay, and work queued before the capture cannot be waited for from
      // the host now. torch.cuda.graph synchronizes the device before capture
      // begins, so there is none; returning (rather than throwing) keeps the
      // pool's OOM ladder, which waits on every fence, exception-free.
      return;
    }
  }
  check(cudaEventSynchronize(fence.event), "cudaEventSynchronize");
}

bool FencePool::order(StreamId waiter, StreamId signaler) {
  RelaxedCaptureGuard relaxed;
  DeviceGuard on_device(device_);
  const auto wait_on = reinterpret_cast<cudaStream_t>(waiter);
  if (capturing(wait_on)) return false;
  const EventHandle handle = record(signaler);
  Fence& fence = *as_fence(handle);
  if (!fence.recorded) {  // the signaler captures
    destroy(handle);
    return false;
  }
  // The wait takes the event's state now: the event may be recorded again at once.
  const cudaError_t status = cudaStreamWaitEvent(wait_on, fence.event, 0);
  destroy(handle);
  check(status, "cudaStreamWaitEvent");
  return true;
}

void FencePool::destroy(EventHandle handle) {
  Fence* fence = as_fence(handle);
  fence->recorded = false;
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(fence);
}

}  // namespace torchmem::cuda
