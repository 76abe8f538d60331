// host_backend_cuda.cpp: mmap + NUMA binding + huge pages + parallel first
// touch + cudaHostRegister (see host_backend_cuda.h).
#include "host/host_backend_cuda.h"

#include <cuda_runtime_api.h>

namespace torchmem::host {

CudaHostBackend::CudaHostBackend(const CudaHostConfig& config)
    : config_(config), thp_(thp_mode(config.sysfs_root)), fences_(config.device) {
  if (config.numa && numa_node_count(config.sysfs_root) > 1) {
    char bus_id[64] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), config.device) == cudaSuccess) {
      node_ = numa_node_of_pci(config.sysfs_root, bus_id);
    } else {
      cudaGetLastError();
    }
    if (node_ < 0) {
      notice_once("numa", "torchmem.host: this machine has several NUMA nodes but GPU " +
                              std::to_string(config.device) + "'s node is unknown (sysfs numa_node is -1 or "
                              "missing): pinned chunks are not bound and may sit on the far node");
    }
  }
}

std::size_t CudaHostBackend::page_bytes() const {
  return config_.huge_pages == HugePages::kOff ? kSmallPageBytes : kHugePageBytes;
}

HostChunk CudaHostBackend::map_chunk(std::size_t bytes) {
  HostChunk chunk;
  Mapping m = map_anonymous(bytes, config_.huge_pages, thp_);
  if (m.ptr == nullptr) return chunk;
  if (!m.refused.empty()) notice_once("huge_pages", "torchmem.host: " + m.refused);
  if (node_ >= 0) {
    std::string error = bind_to_node(m.ptr, bytes, node_);
    if (error.empty()) {
      chunk.numa_node = node_;
    } else {
      notice_once("numa", "torchmem.host: binding pinned chunks to NUMA node " + std::to_string(node_) +
                              " failed (" + error + "); they are placed by the kernel's default policy");
    }
  }
  // Every 4 KiB page, even on huge pages: where the kernel gave small pages
  // after all, each must exist before registration; where it gave huge pages,
  // the extra writes hit present pages and cost next to nothing.
  touch_pages(m.ptr, bytes, kSmallPageBytes, config_.touch_threads);
  chunk.ptr = m.ptr;
  chunk.bytes = bytes;
  chunk.huge_pages = m.huge_pages;
  cudaError_t status;
  {
    cuda::RelaxedCaptureGuard relaxed;
    // Portable: the range counts as pinned for every device, not just the current one.
    status = cudaHostRegister(m.ptr, bytes, cudaHostRegisterPortable);
  }
  if (status == cudaSuccess) {
    chunk.pinned = true;
    pinned_ += bytes;
  } else {
    cudaGetLastError();  // clear the error so later calls do not report it
    notice_once("pinning", "torchmem.host: cudaHostRegister of " + format_bytes(bytes) + " failed (" +
                               cudaGetErrorString(status) + "; " + format_bytes(pinned_) + " pinned by this pool, " +
                               describe_host_limits() +
                               "): using pageable memory, so copies from it are synchronous and several times "
                               "slower; raise the memlock limit (ulimit -l) or lower the pool's use");
  }
  return chunk;
}

void CudaHostBackend::unmap_chunk(const HostChunk& chunk) {
  if (chunk.pinned) {
    cuda::RelaxedCaptureGuard relaxed;
    if (cudaHostUnregister(chunk.ptr) != cudaSuccess) cudaGetLastError();
    pinned_ -= chunk.bytes;
  }
  unmap_anonymous(chunk.ptr, chunk.bytes);
}

std::string CudaHostBackend::describe_limits() const {
  std::string out = describe_host_limits();
  out += node_ >= 0 ? ", NUMA node " + std::to_string(node_) : std::string(", NUMA binding off (one node or unknown)");
  out += ", THP mode " + (thp_.empty() ? std::string("unknown") : thp_);
  return out;
}

}  // namespace torchmem::host
