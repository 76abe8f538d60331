// vmm_backend_cuda.h: the `vmm` backend: physical granules from cuMemCreate,
// placed in reserved virtual ranges with cuMemMap, for one device.
//
// Why the driver API through the runtime: cuMem* live in libcuda.so, which the
// module must not link against (it would then fail to import on machines
// without a driver, e.g. CI). cudaGetDriverEntryPointByVersion hands out the
// driver's function pointers at run time; <cuda.h> is included for types only.
//
// Costs on an H200 (BENCHMARKS.md sections 5 and 9): cuMemCreate ~10 us,
// cuMemMap ~1 us, cuMemSetAccess ~20-27 us per handle it covers,
// cuMemUnmap ~16 us: ~30 us per granule to grow with a handle per granule,
// ~0.3 us per granule with one handle for a run of 256 (create_run). So
// map() sets access once over the whole run it mapped, and the pool, not
// this file, decides how rarely granules move and when runs pay.
#pragma once

#include <memory>
#include <string>

#include "backend/cuda_device_backend_cuda.h"

namespace torchmem {

struct DriverApi;  // the cuMem* entry points, resolved once per process

class VmmBackend final : public CudaDeviceBackend {
 public:
  // Throws std::runtime_error if the driver lacks virtual memory management.
  explicit VmmBackend(int device);
  ~VmmBackend() override;

  // True when `device` supports cuMem* virtual memory management (probes
  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; false, not an
  // error, when the driver entry points are missing).
  static bool device_supports_vmm(int device);

  std::string name() const override { return "vmm"; }
  bool supports_vmm() const override { return true; }
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

  Addr allocate_segment(std::size_t bytes) override;
  void free_segment(Addr base, std::size_t bytes) override;

 private:
  GranuleHandle create_handle(std::size_t granules);  // 0 when the device is full

  const DriverApi& api_;
  std::size_t granularity_ = 0;
};

}  // namespace torchmem
