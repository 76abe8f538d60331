// host_torch_bindings_cuda.cpp: torchmem._C.host_install_torch_allocator:
// makes a torchmem host pool torch's pinned-memory allocator for CUDA.
//
// torch (2.8 and later, including 2.11 and 2.14) routes every pinned
// allocation through at::getHostAllocator(kCUDA): torch.empty(...,
// pin_memory=True), tensor.pin_memory(), DataLoader(pin_memory=True). Its copy
// kernels call record_event(ptr, ctx, stream) on that allocator after each
// non_blocking copy from or to pinned memory, which is exactly the pool's
// record_stream. So once installed, existing code gets the pool's chunks, NUMA
// placement, huge pages and 25%-bounded rounding without a change.
//
// Note [Host allocator swap]
// at::setHostAllocator only swaps a pointer. Blocks torch pinned before the
// swap keep their own deleter and free into torch's cache; but torch's copy
// kernels now report their copies to torchmem's allocator, which does not know
// those blocks (record_event returns false), so such a block could be reused
// by torch's cache while a copy from it still runs. Install before anything is
// pinned (torchmem.host.install_torch_host_allocator checks
// torch.cuda.host_memory_stats() and refuses otherwise). The swap is for the
// life of the process: the DataPtr deleter is a plain function bound to the
// one installed pool.
//
// Stats: only the HostStats fields that exist in every torch since the hook
// appeared are filled (allocated_bytes, host_alloc_time, host_free_time,
// num_host_alloc, num_host_free); torchmem.host.stats() has the rest.
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <pybind11/pybind11.h>

#include <cstring>
#include <memory>
#include <mutex>

#include "bindings/bindings.h"
#include "bindings/host_pool_holder.h"

namespace py = pybind11;

namespace torchmem::bindings {

namespace {

HostPoolHolder g_installed;  // set once, never reset (Note [Host allocator swap])

void delete_block(void* ctx) {
  try {
    g_installed->pool->free(ctx);
  } catch (const std::exception&) {
    // A deleter must not throw; the pool refuses only pointers it never gave out.
  }
}

void delete_nothing(void*) {}

struct TorchmemHostAllocator final : public at::HostAllocator {
  at::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) return {nullptr, nullptr, &delete_nothing, at::DeviceType::CPU};
    // Copies are reported (Note [Host stream-safe reuse]): the current stream
    // matters only if someone turned that off.
    StreamId stream = 0;
    if (!g_installed->pool->copies_reported()) {
      stream = reinterpret_cast<StreamId>(
          c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(g_installed->device)).stream());
    }
    void* ptr;
    try {
      ptr = g_installed->pool->allocate(bytes, stream);
    } catch (const host::HostOutOfMemory& e) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
    }
    return {ptr, ptr, &delete_block, at::DeviceType::CPU};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    if (stream.device_type() != c10::DeviceType::CUDA) return false;
    c10::cuda::CUDAStream cuda_stream(c10::cuda::CUDAStream::UNCHECKED, stream);
    try {
      g_installed->pool->record_stream(ctx != nullptr ? ctx : ptr, reinterpret_cast<StreamId>(cuda_stream.stream()));
      return true;
    } catch (const host::HostPoolError&) {
      return false;  // not one of ours (pinned before the swap, or a view's inner pointer)
    }
  }

  void empty_cache() override { g_installed->pool->release_cached(); }

  at::HostStats get_stats() override {
    const host::HostPoolStats s = g_installed->pool->stats();
    at::HostStats out;
    out.allocated_bytes.current = static_cast<int64_t>(s.allocated_bytes_current);
    out.allocated_bytes.peak = static_cast<int64_t>(s.allocated_bytes_peak);
    out.host_alloc_time.total = static_cast<int64_t>(s.host_alloc_time_us_total);
    out.host_alloc_time.max = static_cast<int64_t>(s.host_alloc_time_us_max);
    out.host_alloc_time.count = static_cast<int64_t>(s.num_host_alloc);
    out.host_free_time.total = static_cast<int64_t>(s.host_free_time_us_total);
    out.host_free_time.count = static_cast<int64_t>(s.num_host_free);
    out.num_host_alloc = static_cast<int64_t>(s.num_host_alloc);
    out.num_host_free = static_cast<int64_t>(s.num_host_free);
    return out;
  }

  void reset_accumulated_stats() override {}
  void reset_peak_stats() override { g_installed->pool->reset_peak_stats(); }
};

void install(const HostPoolHolder& holder) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (g_installed) {
    if (g_installed == holder) return;
    throw py::value_error("torchmem.host: another pool is already torch's host allocator; it stays for the "
                          "life of the process");
  }
  if (holder->device < 0) {
    throw py::value_error("torchmem.host: only a CUDA pool (backend='cuda') can be torch's host allocator");
  }
  g_installed = holder;
  // torch's copy kernels report every copy to the installed allocator from now on.
  holder->pool->set_copies_reported(true);
  static auto* allocator = new TorchmemHostAllocator();  // torch keeps the pointer: never destroyed
  at::setHostAllocator(at::kCUDA, allocator);
}

}  // namespace

void bind_host_torch(py::module_& m) {
  m.def("host_install_torch_allocator", &install, py::arg("pool"),
        "Makes `pool` torch's pinned host allocator for CUDA (once per process)");
  m.def("host_torch_allocator_installed", [] { return static_cast<bool>(g_installed); });
}

}  // namespace torchmem::bindings
