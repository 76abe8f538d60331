// host_backend_cuda.h: the real host backend: mmap'ed chunks placed on the
// GPU's NUMA node, on huge pages where the kernel allows, first-touched by
// several threads and registered with cudaHostRegister.
//
// Why not cudaHostAlloc: it faults and locks pages one thread at a time under
// a global driver lock (about 2 GB/s); touching the pages in parallel first and
// registering the range after reaches 10-20 GB/s (host_and_tenancy.md 1.3),
// and mmap lets us choose the node and the page size (host_system.h).
//
// Compiled only in CUDA builds (the *_cuda.cpp rule in setup.py).
#pragma once

#include <memory>
#include <string>

#include "backend/cuda_support_cuda.h"
#include "host/host_backend.h"
#include "host/host_system.h"

namespace torchmem::host {

struct CudaHostConfig {
  int device = 0;                 // events and NUMA placement follow this GPU
  HugePages huge_pages = HugePages::kTransparent;
  bool numa = true;               // bind chunks to the GPU's node (no-op with one node)
  int touch_threads = 8;          // threads for the first touch of a chunk
  std::string sysfs_root = "/sys";
};

class CudaHostBackend final : public HostBackend {
 public:
  explicit CudaHostBackend(const CudaHostConfig& config);
  ~CudaHostBackend() override = default;

  std::string name() const override { return "cuda"; }
  std::size_t page_bytes() const override;
  HostChunk map_chunk(std::size_t bytes) override;
  void unmap_chunk(const HostChunk& chunk) override;
  std::string describe_limits() const override;

  EventHandle record_event(StreamId stream) override { return fences_.record(stream); }
  bool event_completed(EventHandle event) override { return fences_.completed(event); }
  void synchronize_event(EventHandle event) override { fences_.synchronize(event); }
  void destroy_event(EventHandle event) override { fences_.destroy(event); }

  int numa_node() const { return node_; }        // -1: not bound
  const std::string& thp() const { return thp_; }

 private:
  CudaHostConfig config_;
  std::string thp_;
  int node_ = -1;
  std::size_t pinned_ = 0;
  cuda::FencePool fences_;
};

}  // namespace torchmem::host
