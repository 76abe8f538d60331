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
//   held < max((1 + reclaim_slack) * in use, stitch line * budget); granules
//   of cached free space whose fences completed, least recently freed first
//   (stitching); with alias_reclaim, granules freed on the requesting stream
//   alone whose fences are pending (Note [Fences]); new granules under the
//   budget (Note [When to stitch] in detail/granules.cpp). No unmapped handle
//   is kept: one that is not mapped again at once is released. With no limit
//   set and far from the device's capacity, a hole of 2+ missing granules is
//   filled by one handle per 256 MiB (or 16th) of the run (Note [Run
//   handles], Note [Run length]).
// - A repeating step that made the pool stitch or wait for the device gets a
//   layout of its own, learnt from its requests and kept in an arena heap:
//   once warm it makes no driver call and takes no barrier (Note [Step plan]
//   in detail/step_plan.h, Note [Step plan arena] in detail/plan_pool.cpp).
// - cuda_malloc backend: blocks are carved out of segments (2 MiB for the small
//   heap, at least 20 MiB for the large one); no stitching.
//
// Note [Fences]
// A granule whose last block was freed moments ago may still be read by
// queued kernels. When a block is freed, the pool notes its stream and a
// sequence number. Reusing its memory for a block on the stream that freed it
// needs nothing (stream order); on another stream it needs a device barrier
// (Note [Cross-stream reuse]). Stitching a granule freed on the requesting
// stream needs the free's fence (a backend event recorded on that stream
// after the free) to have completed. The pool records fences lazily, when it
// looks for reclaimable granules, and never waits for one except on the OOM
// ladder. With alias_reclaim, a granule
// freed on the requesting stream alone may be stitched before its fence
// completes (Note [Alias reclaim] in detail/aliases.cpp).
//
// Note [Cross-stream reuse]
// Memory freed on stream S (a tensor's allocation stream: PyTorch frees there)
// is reused by a request on S at once, as PyTorch's allocator does: stream
// order puts the new kernels after S's old ones. A request on another stream
// takes it only behind a device barrier (Note [Device barrier]): S's fence
// does not cover a stream that read the tensor without record_stream, and
// PyTorch's allocator never hands such memory to another stream either (its
// blocks belong to their stream; only cudaFree, which synchronizes the
// device, moves memory between streams). The OOM ladder takes the barrier
// (step 4), so another stream's cached memory is still used before an OOM.
// Before that barrier, the ladder takes the best fit that only other streams'
// frees fence, behind a device-side wait on those streams instead (step 3b,
// Note [Reuse behind a stream wait] in detail/stream_reuse.cpp): the host does not
// wait and the pipeline keeps running. With no limit set, a fit that needs new
// memory gives way the same way to one another stream cached whole (step 3):
// two streams would otherwise each grow a cache of their own, and free blocks
// merged from both streams' frees would stay out of either's reach. A step plan's arena hands ranges
// between streams the same way. The barrier stays for what a wait cannot
// give: deferred frees, fences of granules to stitch, and captures (no wait
// may be added to a capturing stream).
//
// Note [Freed under another stream]
// A tensor freed while the freeing thread's current stream U is not its
// allocation stream S was, most likely, just used on U, and PyTorch tells the
// allocator nothing of it without record_stream: a worker thread that reads a
// tensor made on the default stream on a stream of its own, then drops it
// (PyTorch's test_cusparse_multiple_threads_same_device). Natively that is
// safe as long as S allocates nothing more meanwhile: the block goes back to
// S's cache alone. Handed to a third stream T behind a wait on S only (Note
// [Reuse behind a stream wait]), T's kernels would write it under U's read.
// So the pool takes U as a reader of the freed block: S reuses it at once, as
// natively; U behind a wait on S, as before (stream order covers U's own
// read); any other stream only behind waits on S and on U (or a barrier). A
// read on a stream that is neither the allocation stream nor current at the
// free stays the program's to order (record_stream), as natively it is for
// S's own reuse. A deferred free (record_stream) also waits for U. Free
// neighbours that S freed merge keeping S, and the reader if one of them had
// one (two different readers: the mixed tag), so that S still reuses the
// merged block at once where waits and barriers are refused: the warm-up of
// torch.compile's cudagraph trees runs in a MemPool scope on a stream of its
// own, and the default stream frees its outputs.
//
// Note [Device barrier]
// Reuse follows the free's stream; unmapping must follow every stream. A
// tensor freed without record_stream may still be read by a kernel on a
// stream the pool never heard of (PyTorch's own tests do this; so does real
// code), and unmapping its address under that kernel is an illegal-address
// fault that kills the process. So the pool never unmaps an address until a
// device barrier (Backend::synchronize_device, which waits for every stream)
// began after the last free there. Stitching maps the handle at its new
// place at once and leaves the old place mapped, "pending unmap" (Note
// [Pending unmaps] in detail/aliases.cpp); pending places are retired in bulk
// after a barrier, which is taken only by release_cached(), the OOM ladder
// and a map that cannot avoid a pending place. cuda_malloc needs none of
// this: cudaFree synchronizes the device itself.
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
//   3b. if 1 passed over fits other streams' frees fence (stream_order): the
//      best of them behind a device-side wait on those streams, then 3;
//   4. a device barrier (Note [Cross-stream reuse]), wait for pending deferred
//      frees and fences, then 1 and 3 again;
//   5. cuda_malloc backend: release every cached segment (num_alloc_retries
//      += 1), retry 3. A VMM pool skips it: step 3 already stitches every
//      cached granule, so giving them back could only let the pool create the
//      same number again. On a device shared with other processes (the
//      elastic budgets of monitor/share.py) each such OOM released the whole
//      cache and mapped it again: 190,000 granules created and released in
//      30 s by one process of the H200 sharing scenario (bench/share_scenario.py);
//   6. a step plan in force gives its arena's cache back (Note [Step plan
//      arena]) and 3 is tried once more;
//   6b. VMM, when 4's barrier was refused (a capture, a MemPool scope): the
//      heap's unmapped tail, past every fenced fit (Note [Unmapped tail] in
//      detail/stream_reuse.cpp);
//   7. give up: num_ooms += 1, record an "oom" trace entry, return 0.
// A request that cannot fit whatever steps 4 and 5 do (the live blocks plus
// the request exceed the budget by more than the two granules it could share
// with neighbours) gives up after step 3: a batch-size controller probing
// sizes that do not fit would otherwise pay a barrier and the release and
// re-creation of the whole cache for each probe. Step 3 itself creates
// nothing unless budget room and reclaimable granules cover the whole request
// (it would give back what it created).
//
// Note [Stats apart] Counters in PoolStats are updated in one place after an
// operation succeeded, never inside split/merge code.
//
// Note [Private pools] A private pool (CUDA graph capture, torch.cuda.MemPool)
// has blocks of its own: its cached blocks serve only its own requests, so a
// captured graph's addresses stay valid across replays. Its granules come from
// the device's shared physical memory and count against the same budget, but
// while the pool is in use its free memory is frozen: never reclaimed by
// another pool, moved by stitching or returned by release_cached() (as
// PyTorch's allocator keeps the segments of a pool in use), because a graph
// may replay into any address the pool ever handed out. release_private_pool()
// marks it for release: its cached memory returns to the shared pool, and
// blocks still live return as they are freed.
//
// Note [Pool checkpoints] checkpoint_private_pool() records the live blocks of
// one private pool (address, size, requested size, stream, context);
// restore_private_pool() makes the pool's live set equal a checkpoint's at the
// same addresses: blocks live now but not in the checkpoint are freed, blocks
// of the checkpoint not live now are allocated again at their exact addresses,
// inside the pool's own memory (CUDA graph trees: torch's
// setCheckpointPoolState). A block live now at the same address and size is
// kept as it is. A restored block holds whatever the memory holds: its old
// bytes unless its granules were moved meanwhile (VMM) (detail/checkpoint.cpp).
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

// PoolConfig's fields, declared once: the struct, its equality, the bindings'
// dict parsing and torchmem._C.pool_config_fields() all come from this list
// (torchmem/runtime/config.py adds units and checks its options cover it).
//   X(type, name, default, doc)
#define TORCHMEM_POOL_CONFIG(X)                                                                      \
  X(std::size_t, limit_bytes, 0,                                                                     \
    "Budget: bytes the pool may hold from the backend; 0 = the device's total memory. "             \
    "set_limit() changes it later (memory fraction).")                                               \
  X(std::size_t, reserve_bytes, 0,                                                                   \
    "Bytes mapped (VMM) or allocated (cuda_malloc) at construction and kept even by "              \
    "release_cached(): pre-reservation, so the memory is ours up front.")                            \
  X(std::size_t, small_threshold, 1 * kMiB, "Requests of at most this many bytes go to the small heap.") \
  X(std::size_t, small_page_bytes, 2 * kMiB,                                                         \
    "Page size of the small heap (a multiple of the backend's granularity).")                       \
  X(double, reclaim_slack, 0.0,                                                                      \
    "Create new granules instead of stitching while held < (1 + slack) x in use.")                   \
  X(double, stitch_above, 0.95,                                                                      \
    "With no limit, ... and while held < stitch_above x the device's memory: the pool stitches only " \
    "in the top of it, where memory is the limit (Note [When to stitch]); 0 = stitch whenever a "   \
    "granule is missing.")                                                                           \
  X(double, stitch_above_limit, 1.0,                                                                 \
    "Under a limit, the same line as a fraction of the limit: 1 = grow to the limit before "        \
    "stitching (Note [When to stitch]); 0 = stitch whenever a granule is missing.")                 \
  X(double, run_below, 0.5,                                                                          \
    "Without a limit, grow by one handle per run of missing granules while held stays under "      \
    "run_below x the device's memory, a handle per granule above or under a limit "                \
    "(Note [Run handles]); 0 = a handle per granule always.")            \
  X(double, run_below_limit, 0.0,                                                                    \
    "Under a limit, grow by one handle per run of missing granules while held stays under "        \
    "run_below_limit x the budget (Note [Runs under a limit]); 0 = a handle per granule, "         \
    "packing as tightly as the pool can.")                                                           \
  X(std::size_t, limit_run_granules, 0,                                                              \
    "Under a limit, a run handle covers at most this many granules (Note [Runs under a limit]); "   \
    "0 = a run covers the whole hole.")                                                              \
  X(bool, backed_fit, true,                                                                          \
    "Under a limit, a fit that misses granules moves to where cached granules already back the "    \
    "request, inside the fit or in another candidate (Note [Backed placement]).")                    \
  X(bool, alias_reclaim, true,                                                                       \
    "Stitch granules freed on the requesting stream before their fences complete, by mapping the " \
    "handle at a second address (Note [Alias reclaim]).")                                            \
  X(bool, stream_order, true,                                                                        \
    "A fit that only other streams' frees fence is taken behind a device-side wait on those "       \
    "streams instead of a device barrier, or, with no limit, instead of new memory "                  \
    "(Note [Cross-stream reuse]).")                                                                   \
  X(bool, step_plan, true,                                                                           \
    "Learn a static layout for a repeating step once the pool stitches or waits for the device, "   \
    "and keep it (Note [Step plan] in detail/step_plan.h; VMM backends).")                            \
  X(std::size_t, virtual_bytes, 0, "Virtual address space reserved per heap; 0 = 2x the device's total memory.") \
  X(bool, time_host_ops, false,                                                                      \
    "Count the host time of every allocate and free (two clock reads each, more on the step "      \
    "plan's path) in host_alloc_ns, host_free_ns and host_plan_ns: the pool's share of a step's "    \
    "host time (Note [Host time]). Off: no clock is read.")                                          \
  X(bool, debug_checks, false,                                                                       \
    "Run check_invariants() after every operation and throw std::logic_error naming the "          \
    "violation. Always on in DEBUG=1 builds.")                                                       \
  X(std::size_t, trace_capacity, 0, "Keep the last this-many trace entries (0 = no trace); see TraceEntry.")

struct PoolConfig {
#define TORCHMEM_DECLARE_POOL_CONFIG(type, name, default_value, doc) type name = default_value;
  TORCHMEM_POOL_CONFIG(TORCHMEM_DECLARE_POOL_CONFIG)
#undef TORCHMEM_DECLARE_POOL_CONFIG

  bool operator==(const PoolConfig& o) const {
    bool same = true;
#define TORCHMEM_COMPARE_POOL_CONFIG(type, name, default_value, doc) same = same && name == o.name;
    TORCHMEM_POOL_CONFIG(TORCHMEM_COMPARE_POOL_CONFIG)
#undef TORCHMEM_COMPARE_POOL_CONFIG
    return same;
  }
  bool operator!=(const PoolConfig& o) const { return !(*this == o); }
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

enum class BlockState : std::uint8_t { kAllocated = 0, kPendingFree = 1, kInactive = 2 };

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

// Note [Block backing] What physically backs a live block, for sharing it
// with another process (CUDA IPC, csrc/shim/ipc.cpp): the pieces the other
// process must map, ascending and contiguous, covering the block. VMM: each
// driver handle under the block where it is mapped, a granule or a whole run
// (a run handle maps only whole, so its piece may reach past the block).
// cuda_malloc: the block's segment, handle 0. A live block's pieces cannot
// change: its granules are pinned, and a pinned granule never moves or goes
// back to the device (Note [Policy] in detail/granules.cpp).
struct BackingPiece {
  Addr at;
  std::size_t bytes;
  GranuleHandle handle;  // 0 for a cuda_malloc segment
};

struct BlockBacking {
  Addr block = 0;
  std::size_t size = 0;  // rounded size
  std::vector<BackingPiece> pieces;
};

// One live block of a checkpoint (Note [Pool checkpoints]).
struct CheckpointBlock {
  Addr addr;
  std::size_t size;       // rounded size
  std::size_t requested;  // what allocate() was told
  StreamId stream;
  std::uint64_t context;
};

struct PoolCheckpoint {
  PoolId pool = 0;
  std::vector<CheckpointBlock> blocks;  // ascending addresses
};

// What restore_private_pool() changed: addresses freed and allocated, ascending.
struct RestoreDelta {
  std::vector<Addr> freed;
  std::vector<Addr> allocated;
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
  // Like allocate(), from cached free memory only: no new memory, no OOM
  // ladder, no OOM counted; 0 when no cached block fits (torch's use_on_oom
  // pools lend so: Note [External pool allocators] in csrc/shim/runtime.h).
  Addr allocate_cached(std::size_t size, StreamId stream, PoolId pool = 0, std::uint64_t context = 0);
  // Frees a block returned by allocate(). Unknown or already freed addresses
  // throw PoolError and change nothing.
  // `free_context` (0 = none) is the caller's context for this free: history
  // entries of the free and of any segment it unmaps carry it instead of the
  // allocation's (torch's _record_memory_history(context="all")).
  // `current_stream` (kNoStream: unknown) is the caller's current stream at the
  // free (Note [Freed under another stream]).
  void deallocate(Addr addr, std::uint64_t free_context = 0, StreamId current_stream = kNoStream);
  // Marks the block at `addr` as used on `stream` too (Note [Record stream]).
  void record_stream(Addr addr, StreamId stream);

  // Private pools (Note [Private pools]).
  void create_private_pool(PoolId pool);
  void release_private_pool(PoolId pool);
  // Checkpoints (Note [Pool checkpoints]). Both throw PoolError for a pool id
  // that is 0, unknown or released. restore throws PoolError, changing nothing,
  // when a checkpoint block is malformed or lies outside the pool's memory (its
  // segment was released since); it throws std::runtime_error when the device
  // or budget cannot back a block again: the blocks freed and allocated before
  // that stay so (invariants hold; the live set is part way to the checkpoint).
  PoolCheckpoint checkpoint_private_pool(PoolId pool) const;
  RestoreDelta restore_private_pool(const PoolCheckpoint& checkpoint);

  // empty_cache: return cached memory (beyond reserve_bytes) to the backend,
  // after waiting for pending frees. Returns the bytes returned. Its
  // segment-unmap history entries carry `context` (0 = none).
  std::size_t release_cached(std::uint64_t context = 0);
  // Returns only enough cached memory to bring what the pool holds down to
  // keep_bytes (never below reserve_bytes), oldest cache first: a sharing
  // member above a lowered limit gives back the excess and keeps its working
  // cache. The cuda_malloc backend cannot split a segment's worth and returns
  // every empty segment, like release_cached().
  std::size_t release_cached_to(std::size_t keep_bytes);
  // torch's emptyCache(mempool_id) (a torch.cuda.MemPool's destructor calls it):
  // returns the cached memory of private pool `pool` alone, as release_cached()
  // would; other pools keep theirs. An in-use pool's cache is frozen and stays
  // (Note [Private pools]); an unknown pool returns nothing. Returns the bytes.
  std::size_t release_pool_cache(PoolId pool);
  // Changes the budget; 0 = device capacity. Does not free live memory.
  void set_limit(std::size_t bytes);
  std::size_t limit() const;
  // Note [Foreign bytes] Memory the same process holds outside this pool but
  // charged to the same budget (a torch.cuda.MemPool whose own allocator
  // serves it through a pool of its own, as PyTorch counts such segments in
  // its per-process fraction). Under a limit the pool grows only into
  // limit - foreign; without one the device's free memory already tells.
  void set_foreign_bytes(std::size_t bytes);
  // The pool's operation counter: history entries recorded from now on carry
  // a larger `sequence` (a mark for annotations such as torch's user metadata).
  std::uint64_t sequence() const;

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
  // Note [Block backing]. Throws PoolError when `addr` is not the start of a
  // live block.
  BlockBacking backing_of(Addr addr) const;
  // Bytes of live blocks and bytes reserved, the two totals torch's profiler
  // takes with each memory event: cheaper than stats() (no free-block scan).
  struct Usage {
    std::size_t allocated;
    std::size_t reserved;
  };
  Usage usage() const;

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
  Addr allocate_locked(std::size_t size, StreamId stream, PoolId pool, std::uint64_t context, bool cached_only);
  // The implementation owns the rest (csrc/core/detail/pool_impl.h).
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace torchmem
