// install.cpp: swaps torch's CUDA allocator for torchmem's, in C++.
//
// Why C++ and not torch.cuda.memory.CUDAPluggableAllocator from Python: the pool
// hooks (begin/end allocate to pool, release pool) take std::function and
// std::pair by value, which a plain C function address from ctypes cannot
// provide; from here every hook is a lambda built with torch's own ABI. This is
// the only file that includes torch's allocator headers (each costs ~1 minute
// to compile).
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <memory>
#include <mutex>
#include <stdexcept>

#include "shim/runtime.h"

namespace torchmem::shim {

namespace {

using torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

std::mutex install_mutex;

}  // namespace

bool torch_allocator_initialized() {
  auto* current = c10::cuda::CUDACachingAllocator::allocator.load();
  return current != nullptr && current->initialized();
}

void install(const RuntimeConfig& config) {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (is_installed()) {
    configure(config);  // throws if the config differs from the one in force
    return;
  }
  if (torch_allocator_initialized()) {
    throw std::runtime_error(
        "torchmem.install(): PyTorch's CUDA allocator is already initialized, and an initialized allocator "
        "cannot be swapped. It initializes on the first CUDA tensor or torch.cuda call; call "
        "torchmem.install() right after `import torch`, before anything touches CUDA.");
  }
  configure(config);
  auto created = torch::cuda::CUDAPluggableAllocator::createCustomAllocator(
      [](size_t size, int device, cudaStream_t stream) { return allocate_or_throw(size, device, stream); },
      [](void* ptr, size_t, int device, cudaStream_t) { deallocate(ptr, device); });
  // createCustomAllocator always builds a CUDAPluggableAllocator; static_cast
  // avoids relying on RTTI across shared-library boundaries.
  auto* allocator = static_cast<CUDAPluggableAllocator*>(created.get());
  // Pools are made lazily per device at first use, so init has nothing to do;
  // it is still set so torch's lazy CUDA init has a hook to call.
  allocator->set_init_fn([](int) {});
  allocator->set_reset_fn([] { empty_cache(); });
  allocator->set_memory_fraction_fn([](double fraction, int device) { set_memory_fraction(fraction, device); });
  allocator->set_base_alloc_fn([](void* ptr, size_t* size) { return base_allocation(ptr, size); });
  allocator->set_record_stream_fn([](void* ptr, cudaStream_t stream) { record_stream(ptr, stream); });
  allocator->set_begin_allocate_to_pool(
      [](int device, c10::cuda::MempoolId_t id, std::function<bool(cudaStream_t)> filter) {
        begin_allocate_to_pool(device, MempoolKey(id.first, id.second), std::move(filter));
      });
  allocator->set_end_allocate_to_pool_fn(
      [](int device, c10::cuda::MempoolId_t id) { end_allocate_to_pool(device, MempoolKey(id.first, id.second)); });
  allocator->set_release_pool(
      [](int device, c10::cuda::MempoolId_t id) { release_pool(device, MempoolKey(id.first, id.second)); });
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(created);
  mark_installed();
}

}  // namespace torchmem::shim
