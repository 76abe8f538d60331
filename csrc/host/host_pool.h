// host_pool.h: the pinned host memory pool: the public contract.
//
// Hands out page-locked host blocks for non_blocking copies, carved from large
// chunks a HostBackend obtains (host_backend.h: placed on the GPU's NUMA node,
// on huge pages, registered with the driver). It knows nothing of CUDA or
// Python; the simulated backend runs the same policy in tests.
//
// Thread safety: every public method takes the pool's one mutex; backend calls
// happen under it (so a fresh chunk being pinned delays other requests).
//
// Note [Host size classes]
// Requests round up to a class with four steps per power of two (512 B
// minimum): 5 MiB -> 5 MiB, 5.1 MiB -> 6 MiB, so at most 25% is lost to
// rounding (PyTorch's pinned cache rounds to the next power of two: up to
// 100%, a 4 GiB tensor costing 8 GiB). Classes up to chunk_bytes / 4 are carved
// one after another from shared chunks; larger ones get a chunk of their own,
// rounded to the backend's page. Blocks are never split or merged: host
// requests repeat (DataLoader batches, offloaded activations of one step), so
// a freed block is reused whole by a request of its class, or of a class up
// to 2x smaller.
//
// Note [Host stream-safe reuse]
// A pinned block may still be read or written by a copy queued on a stream
// when its tensor is freed (tensor.to(dev, non_blocking=True); del tensor).
// Each block remembers the streams it was used on: the stream current at
// allocation plus every record_stream(). Its free records one event per stream
// and parks the block; it is reusable only once all those events completed
// (polled at each allocate; waited for before the pool gives up with an
// out-of-memory error). Unlike device memory, reuse on the "same stream" is not
// safe: the host writes to the block directly, unordered with the stream.
// Once the pool is torch's host allocator, torch reports every non_blocking
// copy from or to its blocks (record_event, the contract of torch's own pinned
// cache), so the pool stops guessing: allocation no longer counts the current
// stream, and a block no copy was reported on is reusable at its free, with no
// event (set_copies_reported; this is what makes a cached request as cheap as
// torch's).
//
// Note [Host out of memory]
// A request the limit or the system cannot serve first returns chunks with no
// live block (after waiting for parked frees), then fails with HostOutOfMemory
// naming the request, what the pool holds and pins, the limit and the system's
// limits. Nothing held is lost: live blocks stay valid and the pool unchanged.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "host/host_backend.h"

namespace torchmem::host {

struct HostPoolConfig {
  // Size of the shared chunks small classes are carved from (a multiple of the
  // backend's page, at least 2 MiB).
  std::size_t chunk_bytes = std::size_t{64} << 20;
  // Most bytes the pool may hold from the backend; 0 = no limit of its own
  // (the system's memlock and memory limits still apply).
  std::size_t limit_bytes = 0;
  // Throw instead of falling back to pageable memory when pinning is refused.
  bool require_pinned = false;
};

// Counters, declared once (an X-macro) for the struct and the Python dict.
// Names follow torch.cuda.host_memory_stats() where one exists.
#define TORCHMEM_HOST_STATS(X)                                                          \
  X(allocations_current)    /* live blocks */                                          \
  X(allocations_peak)                                                                  \
  X(allocations_allocated)  /* blocks handed out, ever */                              \
  X(allocations_freed)                                                                 \
  X(allocated_bytes_current) /* live blocks, rounded size */                           \
  X(allocated_bytes_peak)                                                              \
  X(requested_bytes_current) /* live blocks, requested size */                         \
  X(held_bytes)              /* chunks obtained from the backend */                    \
  X(held_bytes_peak)                                                                   \
  X(pinned_bytes)            /* of held_bytes, page-locked */                          \
  X(huge_page_bytes)         /* of held_bytes, on huge pages */                        \
  X(cached_bytes)            /* free blocks ready for reuse */                         \
  X(pending_bytes)           /* freed blocks waiting for their streams' events */      \
  X(chunks)                                                                            \
  X(num_host_alloc)          /* chunks obtained, ever */                               \
  X(num_host_free)                                                                     \
  X(host_alloc_time_us_total)                                                          \
  X(host_alloc_time_us_max)                                                            \
  X(host_free_time_us_total)                                                           \
  X(cache_hits)              /* requests served by a cached block */                   \
  X(cache_misses)                                                                      \
  X(num_ooms)

struct HostPoolStats {
#define TORCHMEM_DECLARE_HOST_STAT(name) std::uint64_t name = 0;
  TORCHMEM_HOST_STATS(TORCHMEM_DECLARE_HOST_STAT)
#undef TORCHMEM_DECLARE_HOST_STAT
};

// Caller errors (zero size, unknown or double free, bad config); the pool is
// unchanged when it is thrown.
class HostPoolError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The limit or the system cannot serve a request (Note [Host out of memory]).
class HostOutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The size a request of `bytes` is rounded to (Note [Host size classes]).
std::size_t host_size_class(std::size_t bytes);

class HostPool {
 public:
  HostPool(HostBackend& backend, const HostPoolConfig& config);
  ~HostPool();  // gives every chunk back; waits for parked frees first
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A block of at least `bytes`, first used on `stream`. Throws HostPoolError
  // for bytes == 0 and HostOutOfMemory when it cannot be served.
  void* allocate(std::size_t bytes, StreamId stream);
  // Frees a block (Note [Host stream-safe reuse]). Unknown or already freed
  // pointers throw HostPoolError and change nothing.
  void free(void* ptr);
  // The block at `ptr` is used on `stream` too.
  void record_stream(void* ptr, StreamId stream);
  // True once every copy using the pool's blocks is reported through
  // record_stream (Note [Host stream-safe reuse]): blocks allocated from then
  // on start with no stream.
  void set_copies_reported(bool reported);
  bool copies_reported() const { return copies_reported_.load(std::memory_order_relaxed); }

  // Polls parked frees; returns how many became reusable.
  std::size_t process_events();
  // Returns chunks that hold no live block (after waiting for parked frees).
  // Returns the bytes given back.
  std::size_t release_cached();

  bool is_pinned(const void* ptr) const;  // the block's chunk is page-locked
  std::size_t block_size(const void* ptr) const;  // rounded size of a live block, 0 if none
  void set_limit(std::size_t bytes);
  std::size_t limit() const;
  HostPoolStats stats() const;
  void reset_peak_stats();
  // "" when the bookkeeping is consistent, else the first violation.
  std::string check_invariants() const;
  const HostBackend& backend() const { return backend_; }

 private:
  struct Chunk;
  struct Block {
    char* ptr;
    std::size_t size;       // rounded (class) size
    std::size_t requested;  // 0 when not live
    bool live = false;      // handed out and not freed
    Chunk* chunk;
    std::vector<StreamId> streams;
    std::vector<EventHandle> events;  // while parked
  };
  struct Chunk {
    HostChunk memory;
    std::size_t carved = 0;  // bump offset: bytes handed to blocks so far
    std::size_t live = 0;    // live or parked blocks
    bool dedicated = false;  // one large block of its own
    std::vector<std::unique_ptr<Block>> blocks;  // in address order
  };

  Block* take_cached(std::size_t size);
  Block* carve(std::size_t size);
  Chunk* new_chunk(std::size_t bytes, bool dedicated);
  std::size_t release_idle_chunks();
  std::size_t poll_parked();
  void wait_parked();
  bool poll_block(Block* block);
  Block* live_block(const void* ptr) const;  // nullptr unless a live block starts at ptr
  void make_free(Block* block);
  [[noreturn]] void throw_oom(std::size_t bytes, std::size_t size, const std::string& why);

  HostBackend& backend_;
  HostPoolConfig config_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  Chunk* current_ = nullptr;  // the shared chunk carving continues in
  // Free blocks by size class; the vectors keep their capacity, so a cached
  // allocate + free moves pointers without allocating (Note [Host size classes]:
  // a handful of classes per request, so the scan in take_cached is short).
  std::map<std::size_t, std::vector<Block*>> free_;
  std::vector<Block*> parked_;
  // Every block ever carved, live or not, by address: blocks are never split
  // or merged, so an entry lives as long as its chunk (no insert per request).
  std::unordered_map<const void*, Block*> by_ptr_;
  HostPoolStats stats_;
  std::string refusal_;  // why the last new_chunk() returned nullptr
  std::atomic<bool> copies_reported_{false};
};

}  // namespace torchmem::host
