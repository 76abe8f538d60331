// vmm_backend_cuda.cpp: cuMem* virtual memory for one device (see the header).
//
// Note [Driver ABI version]
// Entry points are requested for the CUDA 12.0 ABI: every cuMem* call used here
// has had the same signature since CUDA 10.2, and a 12.0 request is served by
// any driver a CUDA 12 or 13 build of torch runs on.
#include "backend/vmm_backend_cuda.h"

#include <cuda.h>

#include <stdexcept>
#include <string>

namespace torchmem {

struct DriverApi {
  bool loaded = false;
  std::string load_error;
  decltype(&cuGetErrorString) get_error_string = nullptr;
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) get_granularity = nullptr;
};

namespace {

constexpr unsigned kDriverAbiVersion = 12000;  // Note [Driver ABI version]

template <typename Fn>
bool resolve(const char* symbol, Fn& out, std::string& error) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t status = cudaGetDriverEntryPointByVersion(symbol, &fn, kDriverAbiVersion, cudaEnableDefault, &found);
  if (status != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();
    if (error.empty()) {
      error = std::string("the CUDA driver has no entry point ") + symbol + " (" + cudaGetErrorString(status) + ")";
    }
    return false;
  }
  out = reinterpret_cast<Fn>(fn);
  return true;
}

const DriverApi& driver_api() {
  static const DriverApi api = [] {
    DriverApi a;
    std::string& e = a.load_error;
    bool ok = resolve("cuGetErrorString", a.get_error_string, e);
    ok = resolve("cuDeviceGet", a.device_get, e) && ok;
    ok = resolve("cuDeviceGetAttribute", a.device_get_attribute, e) && ok;
    ok = resolve("cuMemAddressReserve", a.address_reserve, e) && ok;
    ok = resolve("cuMemAddressFree", a.address_free, e) && ok;
    ok = resolve("cuMemCreate", a.create, e) && ok;
    ok = resolve("cuMemRelease", a.release, e) && ok;
    ok = resolve("cuMemMap", a.map, e) && ok;
    ok = resolve("cuMemUnmap", a.unmap, e) && ok;
    ok = resolve("cuMemSetAccess", a.set_access, e) && ok;
    ok = resolve("cuMemGetAllocationGranularity", a.get_granularity, e) && ok;
    a.loaded = ok;
    return a;
  }();
  return api;
}

const DriverApi& loaded_driver_api() {
  const DriverApi& api = driver_api();
  if (!api.loaded) {
    throw std::runtime_error("torchmem: the vmm backend needs the CUDA driver's virtual memory API: " +
                             api.load_error + ". Use backend='cuda_malloc'.");
  }
  return api;
}

[[noreturn]] void throw_driver_error(const DriverApi& api, const char* call, CUresult status) {
  const char* text = nullptr;
  if (api.get_error_string == nullptr || api.get_error_string(status, &text) != CUDA_SUCCESS || text == nullptr) {
    text = "unknown error";
  }
  throw std::runtime_error(std::string("torchmem: ") + call + " failed: CUresult " + std::to_string(status) + " (" +
                           text + ")");
}

void check_driver(const DriverApi& api, CUresult status, const char* call) {
  if (status != CUDA_SUCCESS) throw_driver_error(api, call, status);
}

CUmemAllocationProp granule_properties(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

bool is_out_of_memory(CUresult status) { return status == CUDA_ERROR_OUT_OF_MEMORY; }

// Read and write access for `device` over [at, at + bytes), one call however
// many handles the range covers.
CUresult grant_access(const DriverApi& api, int device, Addr at, std::size_t bytes) {
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return api.set_access(static_cast<CUdeviceptr>(at), bytes, &access, 1);
}

}  // namespace

bool VmmBackend::device_supports_vmm(int device) {
  const DriverApi& api = driver_api();
  if (!api.loaded) return false;
  CUdevice handle = 0;
  if (api.device_get(&handle, device) != CUDA_SUCCESS) return false;
  int supported = 0;
  if (api.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, handle) !=
      CUDA_SUCCESS) {
    return false;
  }
  return supported != 0;
}

VmmBackend::VmmBackend(int device) : CudaDeviceBackend(device), api_(loaded_driver_api()) {
  if (!device_supports_vmm(device)) {
    throw std::runtime_error("torchmem: device " + std::to_string(device) +
                             " does not support CUDA virtual memory management; use backend='cuda_malloc'");
  }
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  CUmemAllocationProp prop = granule_properties(device_);
  // The minimum granularity is the real constraint (2 MiB on H200) and wastes
  // the least at range edges.
  check_driver(api_, api_.get_granularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity");
  if (granularity_ == 0 || (granularity_ & (granularity_ - 1)) != 0 || granularity_ % kMinBlockSize != 0) {
    throw std::runtime_error("torchmem: unexpected CUDA allocation granularity " + std::to_string(granularity_));
  }
}

VmmBackend::~VmmBackend() = default;

Addr VmmBackend::reserve(std::size_t bytes) {
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  CUdeviceptr base = 0;
  CUresult status = api_.address_reserve(&base, bytes, granularity_, 0, 0);
  if (status == CUDA_ERROR_OUT_OF_MEMORY || status == CUDA_ERROR_INVALID_VALUE) return 0;
  check_driver(api_, status, "cuMemAddressReserve");
  counters_.reserve_calls += 1;
  return static_cast<Addr>(base);
}

void VmmBackend::unreserve(Addr base, std::size_t bytes) {
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  check_driver(api_, api_.address_free(static_cast<CUdeviceptr>(base), bytes), "cuMemAddressFree");
}

GranuleHandle VmmBackend::create_granule() { return create_handle(1); }

GranuleHandle VmmBackend::create_run(std::size_t granules) {
  if (granules < 2) throw std::invalid_argument("torchmem: create_run needs at least 2 granules");
  return create_handle(granules);
}

GranuleHandle VmmBackend::create_handle(std::size_t granules) {
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  CUmemAllocationProp prop = granule_properties(device_);
  CUmemGenericAllocationHandle handle = 0;
  CUresult status = api_.create(&handle, granules * granularity_, &prop, 0);
  if (is_out_of_memory(status)) {
    (void)cudaGetLastError();
    return 0;
  }
  check_driver(api_, status, "cuMemCreate");
  counters_.create_calls += 1;
  return static_cast<GranuleHandle>(handle);
}

void VmmBackend::release_granule(GranuleHandle handle) {
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  check_driver(api_, api_.release(static_cast<CUmemGenericAllocationHandle>(handle)), "cuMemRelease");
  counters_.release_calls += 1;
}

void VmmBackend::map(Addr at, const GranuleHandle* handles, std::size_t count) {
  if (count == 0) return;
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  std::size_t mapped = 0;
  auto undo = [&] {
    for (std::size_t i = 0; i < mapped; ++i) api_.unmap(static_cast<CUdeviceptr>(at + i * granularity_), granularity_);
  };
  for (; mapped < count; ++mapped) {
    CUresult status = api_.map(static_cast<CUdeviceptr>(at + mapped * granularity_), granularity_, 0,
                               static_cast<CUmemGenericAllocationHandle>(handles[mapped]), 0);
    if (status != CUDA_SUCCESS) {
      undo();
      throw_driver_error(api_, "cuMemMap", status);
    }
  }
  // One access call over the whole run: its cost is per call plus per granule,
  // and a run set in one call is cheaper than granule by granule.
  CUresult status = grant_access(api_, device_, at, count * granularity_);
  if (status != CUDA_SUCCESS) {
    undo();
    throw_driver_error(api_, "cuMemSetAccess", status);
  }
  counters_.map_calls += count;
}

void VmmBackend::unmap(Addr at, std::size_t count) {
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  // Granule by granule: cuMemUnmap must cover exactly what one cuMemMap mapped.
  for (std::size_t i = 0; i < count; ++i) {
    check_driver(api_, api_.unmap(static_cast<CUdeviceptr>(at + i * granularity_), granularity_), "cuMemUnmap");
  }
  counters_.unmap_calls += count;
}

void VmmBackend::map_run(Addr at, GranuleHandle handle, std::size_t granules) {
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  const std::size_t bytes = granules * granularity_;
  CUresult status = api_.map(static_cast<CUdeviceptr>(at), bytes, 0, static_cast<CUmemGenericAllocationHandle>(handle), 0);
  if (status != CUDA_SUCCESS) throw_driver_error(api_, "cuMemMap", status);
  status = grant_access(api_, device_, at, bytes);
  if (status != CUDA_SUCCESS) {
    api_.unmap(static_cast<CUdeviceptr>(at), bytes);
    throw_driver_error(api_, "cuMemSetAccess", status);
  }
  counters_.map_calls += 1;
}

void VmmBackend::unmap_run(Addr at, std::size_t granules) {
  cuda::RelaxedCaptureGuard relaxed;
  cuda::DeviceGuard on_device(device_);
  check_driver(api_, api_.unmap(static_cast<CUdeviceptr>(at), granules * granularity_), "cuMemUnmap");
  counters_.unmap_calls += 1;
}

Addr VmmBackend::allocate_segment(std::size_t) {
  throw std::logic_error("torchmem: the vmm backend has no plain segments (allocate_segment called)");
}

void VmmBackend::free_segment(Addr, std::size_t) {
  throw std::logic_error("torchmem: the vmm backend has no plain segments (free_segment called)");
}

}  // namespace torchmem
