// vmm_backend_cuda.cpp: cuMem* virtual memory for one device (see the header).
//
// Note [Driver ABI version]
// Entry points are requested for the CUDA 12.0 ABI: every cuMem* call used here
// has had the same signature since CUDA 10.2, and a 12.0 request is served by
// any driver a CUDA 12 or 13 build of torch runs on.
#include "backend/vmm_backend_cuda.h"

#include <cuda.h>
#include <unistd.h>

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
  // Optional (Note [Shareable handles]): absent, handles are simply not shareable.
  decltype(&cuMemExportToShareableHandle) export_shareable = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_shareable = nullptr;
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
    std::string optional_error;
    if (!resolve("cuMemExportToShareableHandle", a.export_shareable, optional_error) ||
        !resolve("cuMemImportFromShareableHandle", a.import_shareable, optional_error)) {
      a.export_shareable = nullptr;
      a.import_shareable = nullptr;
    }
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

std::string driver_error_text(const DriverApi& api, CUresult status) {
  const char* text = nullptr;
  if (api.get_error_string == nullptr || api.get_error_string(status, &text) != CUDA_SUCCESS || text == nullptr) {
    text = "unknown error";
  }
  return "CUresult " + std::to_string(status) + " (" + text + ")";
}

[[noreturn]] void throw_driver_error(const DriverApi& api, const char* call, CUresult status) {
  throw std::runtime_error(std::string("torchmem: ") + call + " failed: " + driver_error_text(api, status));
}

void check_driver(const DriverApi& api, CUresult status, const char* call) {
  if (status != CUDA_SUCCESS) throw_driver_error(api, call, status);
}

CUmemAllocationProp granule_properties(int device, bool shareable = false) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

// Statuses with which a driver or a container refuses exportable handles (the
// handle type is unsupported or not permitted), as opposed to a real failure.
bool refuses_shareable(CUresult status) {
  return status == CUDA_ERROR_NOT_SUPPORTED || status == CUDA_ERROR_INVALID_VALUE ||
         status == CUDA_ERROR_NOT_PERMITTED;
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
  serve(static_cast<VmmPrimitives*>(this));
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
  CUdevice cu_device = 0;
  int fd_handles = 0;
  shareable_ = api_.export_shareable != nullptr && api_.device_get(&cu_device, device_) == CUDA_SUCCESS &&
               api_.device_get_attribute(&fd_handles, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                         cu_device) == CUDA_SUCCESS &&
               fd_handles != 0;
}

VmmBackend::~VmmBackend() {
  std::lock_guard<std::mutex> lock(export_mutex_);
  for (const auto& [handle, exported] : exported_) ::close(exported.fd);
}

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
  CUmemAllocationProp prop = granule_properties(device_, shareable_);
  CUmemGenericAllocationHandle handle = 0;
  CUresult status = api_.create(&handle, granules * granularity_, &prop, 0);
  if (shareable_ && refuses_shareable(status)) {
    // Note [Shareable handles]: a driver that advertises file descriptors
    // but refuses them here (a container's policy) gets plain handles from
    // now on; only sharing with another process is lost.
    (void)cudaGetLastError();
    shareable_ = false;
    prop = granule_properties(device_, false);
    status = api_.create(&handle, granules * granularity_, &prop, 0);
  }
  if (is_out_of_memory(status)) {
    (void)cudaGetLastError();
    return 0;
  }
  check_driver(api_, status, "cuMemCreate");
  counters_.create_calls += 1;
  return static_cast<GranuleHandle>(handle);
}

void VmmBackend::release_granule(GranuleHandle handle) {
  if (exported_count_.load(std::memory_order_relaxed) != 0) forget_export(handle);
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

// ---- Note [Shareable handles] ---------------------------------------------------
// CUDA IPC of VMM memory (csrc/shim/ipc.cpp): a handle created with the POSIX
// file-descriptor handle type can be exported as a file descriptor, which
// another process duplicates (pidfd_getfd) and imports. Handles are created
// so whenever the device supports it, as PyTorch's expandable segments do:
// the type costs nothing until a handle is exported. A handle is exported
// at most once; its descriptor stays open for receivers to duplicate until
// the handle goes back to the device.

VmmBackend::SharedHandle VmmBackend::export_handle(GranuleHandle handle) {
  std::lock_guard<std::mutex> lock(export_mutex_);
  auto found = exported_.find(handle);
  if (found != exported_.end()) return found->second;
  if (api_.export_shareable == nullptr) {
    throw std::runtime_error("torchmem: this CUDA driver cannot export memory handles "
                             "(cuMemExportToShareableHandle is missing); use backend='cuda_malloc' to share CUDA "
                             "tensors between processes");
  }
  int fd = -1;
  CUresult status = api_.export_shareable(&fd, static_cast<CUmemGenericAllocationHandle>(handle),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (status != CUDA_SUCCESS) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("torchmem: cannot share this CUDA tensor with another process: ") +
                             "cuMemExportToShareableHandle failed: " + driver_error_text(api_, status) + ", with " +
                             std::to_string(exported_.size()) +
                             " handles of this device exported and open. Either the process ran out of file "
                             "descriptors (raise `ulimit -n`), or the memory was created without a shareable "
                             "handle type (the driver or container refused POSIX file descriptors: " +
                             (shareable_ ? "not so far" : "it did") +
                             "). backend='cuda_malloc' shares through cudaIpc handles instead");
  }
  static std::atomic<std::uint64_t> exports_made{0};  // across devices: ids name one export per process
  SharedHandle shared{fd, ++exports_made};
  exported_.emplace(handle, shared);
  exported_count_.store(exported_.size(), std::memory_order_relaxed);
  return shared;
}

void VmmBackend::forget_export(GranuleHandle handle) {
  std::lock_guard<std::mutex> lock(export_mutex_);
  auto found = exported_.find(handle);
  if (found == exported_.end()) return;
  ::close(found->second.fd);
  exported_.erase(found);
  exported_count_.store(exported_.size(), std::memory_order_relaxed);
}

std::shared_ptr<void> VmmBackend::import_shared(int device, std::size_t span, const std::vector<ImportPiece>& pieces) {
  const DriverApi& api = loaded_driver_api();
  if (api.import_shareable == nullptr) {
    throw std::runtime_error("torchmem: this CUDA driver cannot import memory handles "
                             "(cuMemImportFromShareableHandle is missing)");
  }
  cuda::DeviceGuard on_device(device);
  struct Imported {
    int device = 0;
    CUdeviceptr base = 0;
    std::size_t span = 0;
    std::vector<std::pair<std::size_t, std::size_t>> mapped;  // (offset, bytes)
    std::vector<CUmemGenericAllocationHandle> handles;
  };
  auto undo = [&api](Imported& m, bool wait) {
    cuda::DeviceGuard guard(m.device);
    // The receiver's streams may still read the memory: unmap only behind a
    // device barrier (Note [Device barrier] in core/pool.h).
    if (wait && cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
    for (const auto& [offset, bytes] : m.mapped) api.unmap(m.base + offset, bytes);
    for (CUmemGenericAllocationHandle h : m.handles) api.release(h);
    if (m.base != 0) api.address_free(m.base, m.span);
  };
  auto made = std::make_unique<Imported>();
  made->device = device;
  made->span = span;
  try {
    CUresult status = api.address_reserve(&made->base, span, 0, 0, 0);
    check_driver(api, status, "cuMemAddressReserve");
    for (const ImportPiece& piece : pieces) {
      CUmemGenericAllocationHandle handle = 0;
      status = api.import_shareable(&handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(piece.fd)),
                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      check_driver(api, status, "cuMemImportFromShareableHandle");
      made->handles.push_back(handle);
      check_driver(api, api.map(made->base + piece.offset, piece.bytes, 0, handle, 0), "cuMemMap");
      made->mapped.emplace_back(piece.offset, piece.bytes);
    }
    check_driver(api, grant_access(api, device, static_cast<Addr>(made->base), span), "cuMemSetAccess");
  } catch (...) {
    (void)cudaGetLastError();
    undo(*made, false);
    throw;
  }
  Imported* raw = made.release();
  return std::shared_ptr<void>(reinterpret_cast<void*>(raw->base), [raw, undo](void*) mutable {
    undo(*raw, true);
    delete raw;
  });
}

}  // namespace torchmem
