// host_backend.h: the contract between the pinned host pool and whatever
// provides host memory.
//
// A HostBackend obtains and gives back large chunks of host memory (placed,
// backed by huge pages and page-locked as well as the system allows) and
// orders work on streams with events. The pool (host_pool.h) holds all policy:
// size classes, carving, caching, stream-safe reuse and the budget. Two
// implementations: `cuda` (host_backend_cuda.cpp: mmap + NUMA + THP +
// cudaHostRegister) and `sim` (sim_host_backend.cpp: the same mmap path, with
// registration and events simulated), so the policy is tested without a GPU.
//
// Note [Fallback notices]
// Refused pinning (memlock limits) or refused huge pages (THP disabled, no
// hugetlbfs pages) are not errors: the chunk is returned pageable or with 4 KiB
// pages, and the backend queues a notice saying what was refused, why and how
// to fix it. The Python layer turns every notice into a warning, so a fallback
// is never silent. Each kind of notice is queued once per backend, so a
// training loop does not print the same warning for every chunk.
//
// Threading: the pool calls a backend under its own lock; notices have a lock
// of their own because Python drains them from any thread.
#pragma once

#include <cstddef>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/types.h"

namespace torchmem::host {

// One chunk of host memory as the backend obtained it.
struct HostChunk {
  void* ptr = nullptr;      // nullptr: the system is out of host memory
  std::size_t bytes = 0;    // a multiple of the backend's page_bytes()
  bool pinned = false;      // page-locked and registered with the driver
  bool huge_pages = false;  // backed by transparent or hugetlbfs huge pages
  int numa_node = -1;       // the node it was bound to; -1 = not bound
};

class HostBackend {
 public:
  virtual ~HostBackend() = default;

  virtual std::string name() const = 0;  // "cuda", "sim"
  // Chunk sizes are multiples of this (2 MiB when huge pages are in use).
  virtual std::size_t page_bytes() const = 0;
  // Obtain `bytes` (a multiple of page_bytes()), touched so the pages exist.
  // Returns a chunk with ptr == nullptr when the system has no memory left;
  // refused pinning or huge pages give a usable chunk and a notice.
  virtual HostChunk map_chunk(std::size_t bytes) = 0;
  virtual void unmap_chunk(const HostChunk& chunk) = 0;
  // One line on the system's limits, for out-of-memory messages: memlock
  // limit, available memory, the NUMA node used.
  virtual std::string describe_limits() const = 0;

  // Record an event on `stream` that completes once the work queued on it so
  // far completes. Never returns 0.
  virtual EventHandle record_event(StreamId stream) = 0;
  virtual bool event_completed(EventHandle event) = 0;
  virtual void synchronize_event(EventHandle event) = 0;
  virtual void destroy_event(EventHandle event) = 0;

  // Notices queued since the last call (Note [Fallback notices]).
  std::vector<std::string> take_notices() {
    std::lock_guard<std::mutex> lock(notice_mutex_);
    std::vector<std::string> out;
    out.swap(notices_);
    return out;
  }

 protected:
  // Queues `text` unless a notice of this `kind` was queued before.
  void notice_once(const std::string& kind, const std::string& text) {
    std::lock_guard<std::mutex> lock(notice_mutex_);
    if (notice_kinds_.insert(kind).second) notices_.push_back(text);
  }

 private:
  std::mutex notice_mutex_;
  std::set<std::string> notice_kinds_;
  std::vector<std::string> notices_;
};

}  // namespace torchmem::host
