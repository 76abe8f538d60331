// vmm_backend_cuda.h: the `vmm` backend: physical granules from cuMemCreate,
// placed in reserved virtual ranges with cuMemMap, for one device.
//
// Why the driver API through the runtime: cuMem* live in libcuda.so, which the
// module must not link against (it would then fail to import on machines
// without a driver, e.g. CI). cudaGetDriverEntryPointByVersion hands out the
// driver's function pointers at run time; <cuda.h> is included for types only.
//
// Costs on an H200 (BENCHMARKS.md, Growth and driver calls): cuMemCreate ~10 us,
// cuMemMap ~1 us, cuMemSetAccess ~20-27 us per handle it covers,
// cuMemUnmap ~16 us: ~30 us per granule to grow with a handle per granule,
// ~0.3 us per granule with one handle for a run of 256 (create_run). So
// map() sets access once over the whole run it mapped, and the pool, not
// this file, decides how rarely granules move and when runs pay.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/cuda_device_backend_cuda.h"

namespace torchmem {

struct DriverApi;  // the cuMem* entry points, resolved once per process

class VmmBackend final : public CudaDeviceBackend, public VmmPrimitives {
 public:
  // Throws std::runtime_error if the driver lacks virtual memory management.
  explicit VmmBackend(int device);
  ~VmmBackend() override;

  // True when `device` supports cuMem* virtual memory management (probes
  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; false, not an
  // error, when the driver entry points are missing).
  static bool device_supports_vmm(int device);

  std::string name() const override { return "vmm"; }
  std::size_t granularity() const override { return granularity_; }

  Addr reserve(std::size_t bytes) override;
  void unreserve(Addr base, std::size_t bytes) override;
  GranuleHandle create_granule() override;
  void release_granule(GranuleHandle handle) override;
  void map(Addr at, const GranuleHandle* handles, std::size_t count) override;
  void unmap(Addr at, std::size_t count) override;
  GranuleHandle create_run(std::size_t granules) override;
  void map_run(Addr at, GranuleHandle handle, std::size_t granules) override;
  void unmap_run(Addr at, std::size_t granules) override;

  // ---- sharing with other processes (Note [Shareable handles], the .cpp) ----
  // A handle's file descriptor in this process (open until the handle goes
  // back to the device) and a number no other export of this process has.
  // Throws std::runtime_error, naming the fix, when the handle cannot be exported.
  struct SharedHandle {
    int fd;
    std::uint64_t id;
  };
  SharedHandle export_handle(GranuleHandle handle);
  // Maps another process's exported handles (`fd`: a descriptor of this
  // process) into a fresh range of `span` bytes on `device`, each piece at its
  // offset. The result points at the range; dropping it waits for the device,
  // then unmaps and releases everything. Descriptors stay the caller's.
  struct ImportPiece {
    int fd;
    std::size_t offset;
    std::size_t bytes;
  };
  static std::shared_ptr<void> import_shared(int device, std::size_t span, const std::vector<ImportPiece>& pieces);

 private:
  GranuleHandle create_handle(std::size_t granules);  // 0 when the device is full
  void forget_export(GranuleHandle handle);           // closes its descriptor, if exported

  const DriverApi& api_;
  std::size_t granularity_ = 0;
  bool shareable_ = false;  // handles get the POSIX file-descriptor type

  std::mutex export_mutex_;  // guards exported_
  std::unordered_map<GranuleHandle, SharedHandle> exported_;
  std::atomic<std::size_t> exported_count_{0};  // release_granule's lock-free check
};

}  // namespace torchmem
