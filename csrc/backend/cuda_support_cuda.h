// cuda_support_cuda.h: what both CUDA backends need: error checks that name the
// call, a device guard, the relaxed capture-mode guard, and a pool of fences.
//
// No torch headers here (backends must build without them); CUDA runtime only.
//
// Note [Relaxed capture mode]
// While any stream of the process captures a CUDA graph in the default (global)
// mode, "unsafe" calls such as cudaMalloc, cudaEventQuery or cuMemMap from ANY
// thread invalidate the capture. An allocator must still serve allocations
// made during capture, so every backend call runs under
// cudaThreadExchangeStreamCaptureMode(relaxed), as PyTorch's own allocator does.
// The swap is thread-local and costs a few nanoseconds.
//
// Note [Fences during capture]
// An event recorded on a capturing stream becomes a node of the graph, not a
// marker of the stream's progress, and querying it is illegal. So a fence asked
// for on a capturing stream is left unrecorded; it is recorded for real the
// first time it is polled after the capture ended (it then still covers every
// piece of work queued on that stream before the free). Until then it reads as
// not completed, so the pool keeps the memory and creates new granules rather
// than reusing memory that pre-capture kernels may still read. Waiting on such
// a fence (the OOM ladder) returns at once: torch.cuda.graph synchronizes the
// device before a capture begins, so no pre-capture work is left to wait for.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "core/types.h"

namespace torchmem::cuda {

// Throws std::runtime_error "torchmem: <call> failed: <CUDA error string>"
// after clearing the sticky error state.
[[noreturn]] void throw_cuda_error(const char* call, cudaError_t status);

inline void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) throw_cuda_error(call, status);
}

// Runs the enclosing scope in relaxed stream-capture mode (Note [Relaxed capture mode]).
class RelaxedCaptureGuard {
 public:
  RelaxedCaptureGuard() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureGuard() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureGuard(const RelaxedCaptureGuard&) = delete;
  RelaxedCaptureGuard& operator=(const RelaxedCaptureGuard&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Makes `device` (and its primary context) current for the enclosing scope and
// restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

// Fences for one device: reusable timing-free events (creating one costs a
// driver call; a training step records hundreds). EventHandle values handed
// to the pool are pointers to Fence records owned here.
class FencePool {
 public:
  explicit FencePool(int device) : device_(device) {}
  ~FencePool();
  FencePool(const FencePool&) = delete;
  FencePool& operator=(const FencePool&) = delete;

  EventHandle record(StreamId stream);
  bool completed(EventHandle handle);
  void synchronize(EventHandle handle);
  void destroy(EventHandle handle);
  // An event recorded on `signaler` and waited for by `waiter` (cudaStreamWaitEvent);
  // false, doing nothing, while either stream captures.
  bool order(StreamId waiter, StreamId signaler);

 private:
  struct Fence {
    cudaEvent_t event = nullptr;
    cudaStream_t stream = nullptr;
    bool recorded = false;  // false: asked for during capture (Note [Fences during capture])
  };
  static Fence* as_fence(EventHandle handle);
  bool try_record(Fence& fence);

  int device_;
  std::mutex mutex_;  // guards free_ only: pools of different heaps may share it
  std::vector<Fence*> free_;
  std::vector<Fence*> all_;
};

}  // namespace torchmem::cuda
