// pool.h: the fragmentation-aware pool for one device: the public contract.
//
// The pool turns byte requests into addresses carved out of memory it obtains
// from a Backend (backend.h). It owns all policy: rounding, the small and large
// heaps, best fit with split and merge, caching, stitching granules (VMM
// backends), the budget, stream-safe reuse, private pools and the OOM ladder.
// It knows nothing of CUDA or Python; the same code runs under the simulated
// backend for tests and trace replay and under the CUDA backends in training.
//
// Thread safety: every public method is safe to call from any thread; each
// takes the pool's one (non-recursive) mutex. Backend calls happen under it.
// Nothing under the lock calls back into user code; OOM hooks run in the shim,
// outside the lock, after allocate() returned 0.
//
// Note [Policy]
// - Requests round up to kMinBlockSize (512 B). Requests <= small_threshold go
//   to the small heap (2 MiB pages of their own), the rest to the large heap,
//   so short-lived small tensors never pin granules that large blocks need.
// - VMM backends: each heap reserves one virtual range, large enough never to
//   run out. Blocks are carved at 512 B granularity, so neighbours share
//   granules. Free blocks stay mapped and cached. A request takes the best
//   fitting cached block (smallest size, then lowest address), splitting it.
//   Granules a new block needs come, in order, from: new granules while
//   held < (1 + reclaim_slack) * in use and under the budget; granules of
//   cached free space whose fences completed, least recently freed first
//   (stitching); with alias_reclaim, granules freed on the requesting stream
//   alone whose fences are pending (Note [Fences]); new granules under the
//   budget. No unmapped handle is kept:
//   one that is not mapped again at once is released (detail/granules.cpp).
// - cuda_malloc backend: blocks are carved out of segments (2 MiB for the small
//   heap, at least 20 MiB for the large one); no stitching.
//
// Note [Fences]
// Unmapping is a host operation, not ordered with streams: a granule whose
// last block was freed moments ago may still be read by queued kernels. When a
// block is freed, the pool notes its stream and a sequence number; a granule
// is reclaimable only after a fence (a backend event recorded on that stream
// after the free) completed. The pool records fences lazily, when it looks for
// reclaimable granules, and never waits for one except on the OOM ladder.
// Reusing a cached block on the stream that freed it needs no fence (stream
// order); on another stream it needs the fence too. With alias_reclaim, a
// granule freed on the requesting stream alone is stitched before its fence
// completes: its handle is mapped at the new address at once (CUDA allows two
// mappings of one handle; stream order puts the new block's kernels after the
// old ones) and the old address is unmapped lazily, once the fence completed
// (Note [Alias reclaim] in detail/aliases.cpp).
//
// Note [Record stream]
// record_stream(p, s) adds s to the block's uses. A free of a block with
// foreign uses records one event per used stream and defers the block; it
// becomes free when all those events completed (polled at each allocate,
// waited for on the OOM ladder).
//
// Note [OOM ladder] allocate() tries, cheapest first:
//   1. a cached block that fits;
//   2. completed deferred frees, then 1 again;
//   3. carve new space, getting granules as in Note [Policy];
//   4. wait for pending deferred frees and fences, then 1 and 3 again;
//   5. release every cached granule/segment (num_alloc_retries += 1), retry 3;
//   6. give up: num_ooms += 1, record an "oom" trace entry, return 0.
//
// Note [Stats apart] Counters in PoolStats are updated in one place after an
// operation succeeded, never inside split/merge code.
//
// Note [Private pools] A private pool (CUDA graph capture, torch.cuda.MemPool)
// has blocks of its own: its cached blocks serve only its own requests, so a
// captured graph's addresses stay valid across replays. Its granules come from
// and go back to the device's shared physical memory and count against the
// same budget. release_private_pool() marks it for release: its cached memory
// returns to the shared pool, and blocks still live return as they are freed.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/stats.h"
#include "core/types.h"

namespace torchmem {

struct PoolConfig {
  // Budget: bytes the pool may hold from the backend. 0 = the device's total
  // memory. set_limit() changes it later (memory fraction).
  std::size_t limit_bytes = 0;
  // Bytes mapped (VMM) or allocated (cuda_malloc) at construction and kept
  // even by release_cached(): pre-reservation, so the memory is ours up front.
  std::size_t reserve_bytes = 0;
  // Requests of at most this many bytes go to the small heap.
  std::size_t small_threshold = 1 * kMiB;
  // Page size of the small heap (a multiple of the backend's granularity).
  std::size_t small_page_bytes = 2 * kMiB;
  // Create new granules instead of stitching while held < (1 + slack) * in use.
  double reclaim_slack = 0.0;
  // Stitch granules freed on the requesting stream before their fences
  // complete, by mapping the handle at a second address (Note [Fences]).
  bool alias_reclaim = true;
  // Virtual address space reserved per heap; 0 = 2x the device's total memory.
  std::size_t virtual_bytes = 0;
  // Run check_invariants() after every operation and throw std::logic_error
  // naming the violation. Always on in DEBUG=1 builds.
  bool debug_checks = false;
  // Keep the last this-many trace entries (0 = no trace); see TraceEntry.
  std::size_t trace_capacity = 0;
};

enum class TraceAction : int {
  kAlloc = 0,
  kFreeRequested = 1,
  kFreeCompleted = 2,
  kSegmentMap = 3,    // granules mapped (VMM) or a segment allocated
  kSegmentUnmap = 4,  // granules unmapped (VMM) or a segment freed
  kOom = 5,
};

struct TraceEntry {
  TraceAction action;
  Addr addr;
  std::size_t size;       // requested size for allocs/frees; bytes for segment actions
  StreamId stream;
  PoolId pool;
  std::uint64_t context;  // opaque id from allocate() (e.g. a Python stack id)
  std::uint64_t sequence; // position in the pool's operation order
};

enum class BlockState : int { kAllocated = 0, kPendingFree = 1, kInactive = 2 };

struct BlockInfo {
  Addr addr;
  std::size_t size;       // rounded size
  std::size_t requested;  // requested size (0 for inactive blocks)
  BlockState state;
  StreamId stream;
  std::uint64_t context;
};

// A maximal run of mapped memory (VMM) or one segment (cuda_malloc); its
// blocks tile it exactly (free blocks are clipped at unmapped gaps).
struct SegmentInfo {
  Addr addr;
  std::size_t size;
  bool small_heap;
  PoolId pool;
  StreamId stream;
  std::vector<BlockInfo> blocks;
};

struct PoolSnapshot {
  std::vector<SegmentInfo> segments;
  std::vector<TraceEntry> trace;  // oldest first
};

// Thrown for caller errors (zero size, unknown or double free, bad config);
// the pool is unchanged when it is thrown.
class PoolError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class Pool {
 public:
  // Validates `config` against the backend (throws PoolError naming the field).
  Pool(Backend& backend, const PoolConfig& config);
  ~Pool();  // returns all memory to the backend
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Returns the address of a block of at least `size` bytes usable on `stream`,
  // or 0 when the OOM ladder found no memory. size == 0 throws PoolError.
  Addr allocate(std::size_t size, StreamId stream, PoolId pool = 0, std::uint64_t context = 0);
  // Frees a block returned by allocate(). Unknown or already freed addresses
  // throw PoolError and change nothing.
  void deallocate(Addr addr);
  // Marks the block at `addr` as used on `stream` too (Note [Record stream]).
  void record_stream(Addr addr, StreamId stream);

  // Private pools (Note [Private pools]).
  void create_private_pool(PoolId pool);
  void release_private_pool(PoolId pool);

  // empty_cache: return cached memory (beyond reserve_bytes) to the backend,
  // after waiting for pending frees. Returns the bytes returned.
  std::size_t release_cached();
  // Changes the budget; 0 = device capacity. Does not free live memory.
  void set_limit(std::size_t bytes);
  std::size_t limit() const;

  // Resizes the trace ring of a live pool, keeping its newest entries that
  // fit (0 = stop tracing and drop them); clear_trace() drops every entry.
  void set_trace_capacity(std::size_t entries);
  void clear_trace();

  PoolStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  PoolSnapshot snapshot() const;
  // Size of the live block at `addr` (its rounded size), or 0 if none.
  std::size_t block_size(Addr addr) const;

  // Returns "" when every invariant holds, else a description of the first
  // violation: blocks tile each range, no overlap, no two adjacent free blocks
  // left unmerged, counters equal sums, every mapped granule owned once.
  std::string check_invariants() const;

  const PoolConfig& config() const { return config_; }
  Backend& backend() const { return backend_; }

 private:
  Backend& backend_;
  PoolConfig config_;
  mutable std::mutex mutex_;
  // The implementation owns the rest (csrc/core/detail/pool_impl.h).
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace torchmem
