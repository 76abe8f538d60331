// pool_impl.h: the pool's state and the internal operations behind pool.h.
//
// Pool (pool.cpp) validates input, takes the lock and calls into Impl; Impl
// never locks. The implementation is split by concern:
//   pool.cpp          construction, the public methods, the OOM ladder, stats
//   detail/carve.cpp  best fit, split, merge, free, deferred frees (blocks)
//   detail/stream_reuse.cpp  which stream may reuse a free block: waits on others
//   detail/granules.cpp  pin/unpin granules, acquire (create / reclaim / map),
//                     fences and reclaimable lists, releasing cached granules
//   detail/runs.cpp      run handles: one driver handle per run of missing granules
//   detail/aliases.cpp   alias reclaim, pending unmaps, the device barrier
//   detail/segments.cpp  cuda_malloc mode: segments
//   detail/inspect.cpp   check_invariants, snapshot, largest free block
#pragma once

#include <algorithm>
#include <atomic>

#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/detail/addr_map.h"
#include "core/detail/block.h"
#include "core/detail/heap.h"
#include "core/detail/host_clock.h"
#include "core/detail/hot_gauges.h"
#include "core/detail/step_plan.h"
#include "core/detail/streams.h"
#include "core/detail/trace_ring.h"
#include "core/format.h"
#include "core/pool.h"

namespace torchmem {

// Validates `c` against `backend` (capacity: the device's total bytes); throws
// PoolError naming the field. Defined in config_check.cpp.
void validate_config(const PoolConfig& c, Backend& backend, std::size_t capacity);

// Note [Device room] (granules.cpp): requests missing this many granules or
// more ask the device for its free memory before creating any.
constexpr std::size_t kDeviceRoomProbe = 32;

// Note [Huge holes] (runs.cpp): a hole of this many granules (8 GiB) or more
// takes runs above run_below, and one run handle under a budget.
constexpr std::size_t kHugeRunGranules = 4096;

// Note [Run length] (runs.cpp): with no limit, a run handle covers at most
// this many granules (256 MiB), or this fraction of a longer hole.
constexpr std::size_t kMaxRunGranules = 128;
constexpr std::size_t kMaxRunsPerHole = 16;

// Note [Runs ahead] (runs.cpp): a large heap's run reaches at least this far.
constexpr std::size_t kRunAheadBytes = std::size_t{20} << 20;

struct Pool::Impl {
  Impl(Backend& backend, PoolConfig& config);
  ~Impl();
  void teardown();  // returns every granule, range and segment to the backend

  // ---- the two heaps of a pool id ------------------------------------------
  struct PoolHeaps {
    detail::Heap* small = nullptr;
    detail::Heap* large = nullptr;
    bool released = false;
  };

  // ---- pool.cpp ----------------------------------------------------------------
  // cached_only: a cached block that fits, or 0 (no new memory, no ladder, no OOM counted).
  Addr allocate(std::size_t size, StreamId stream, PoolId pool, std::uint64_t context, bool cached_only);
  void deallocate(Addr addr, std::uint64_t free_context = 0, StreamId current_stream = kNoStream);
  void record_stream(Addr addr, StreamId stream);
  void create_private_pool(PoolId pool);
  void release_private_pool(PoolId pool);
  // Also the OOM ladder's step 5. `only`: one private pool's cache alone
  // (Pool::release_pool_cache; keep_bytes is then unused).
  static constexpr PoolId kAllPools = ~PoolId{0};
  std::size_t release_cached(std::size_t keep_bytes = 0, PoolId only = kAllPools);
  PoolStats stats();  // refreshes the derived gauges first
  std::size_t budget() const;    // limit in bytes (device capacity if 0)
  void after_op(const char* what);  // debug checks

  // Stats, updated once per successful operation (Note [Stats apart]).
  // Defined inline below: they run on every cached malloc and free.
  // Note [Lazy current]: they leave the `current` of the five gauges they
  // move stale; sync_current() brings it up to date before stats_ is read.
  void note_alloc(bool small, std::size_t size, std::size_t requested);
  void note_free_requested(bool small, std::size_t size, std::size_t requested, bool deferred);
  void note_free_completed(bool small, std::size_t size);
  void sync_current();      // Note [Lazy current]: hot_ into stats_
  void hot_into(PoolStats& s) const;  // the five hot gauges into `s` (Note [Hot gauges])
  void load_hot();          // stats_'s five gauges back into hot_, after a reset
  void sync_memory_stats();  // sync_current(), then segment / reserved / inactive gauges from tallies
  // Inline: with tracing off (the usual case) a call is one branch.
  void trace(TraceAction action, Addr addr, std::size_t size, StreamId stream, PoolId pool,
             std::uint64_t context) {
    if (ring.enabled()) ring.push(TraceEntry{action, addr, size, stream, pool, context, seq});
  }

  // ---- heaps ---------------------------------------------------------------------
  // is_arena: a step plan's arena (Note [Step plan arena]): frozen, its free set the address index.
  detail::Heap* make_heap(PoolId pool, bool small, bool is_arena = false);
  void drop_heap(detail::Heap* heap);
  // The default pool's heaps inline (every allocate asks); a private pool
  // takes private_heap_for(), which also throws for an unknown or released id.
  detail::Heap* heap_for(PoolId pool, std::size_t rounded) {
    if (pool != 0) return private_heap_for(pool, rounded);
    return rounded <= config.small_threshold ? default_small : default_large;
  }
  detail::Heap* private_heap_for(PoolId pool, std::size_t rounded);
  void maybe_drop_released_pools();
  // False when no ladder step can make room for a block of `rounded` bytes
  // (Note [OOM ladder]).
  bool could_fit(std::size_t rounded) const;
  bool pool_empty(const PoolHeaps& heaps) const;

  // ---- detail/carve.cpp -----------------------------------------------------
  // Best fitting free block of `heap` usable on `stream`, or null.
  detail::Block* find_fit(detail::Heap& heap, std::size_t size, StreamId stream);
  // Best-fit candidates looked at before a search gives up on cached blocks
  // (the OOM ladder's wait or barrier makes the fenced ones usable).
  static constexpr int kMaxFitCandidates = 17;
  // The best fit among the first `max_candidates` for which `usable` holds,
  // or null; *passed_over (if given): how many it looked at and passed over.
  template <class Usable>
  detail::Block* best_fit_where(detail::Heap& heap, std::size_t size, Usable&& usable, int* passed_over = nullptr,
                                int max_candidates = kMaxFitCandidates) {
    int passed = 0;
    bool found = false;
    detail::Block* b = heap.free.best_fit(size, [&](detail::Block* c) {
      found = usable(*c);
      return found || ++passed >= max_candidates;
    });
    if (passed_over) *passed_over = passed;
    return found ? b : nullptr;
  }
  // Note [Cross-stream reuse] (pool.h): the freeing stream may reuse a free
  // block at once; any other stream only behind a device barrier (or a wait:
  // reusable_ordered, stream_reuse.cpp). Inline: find_fit asks it per candidate.
  bool reusable(const detail::Block& b, StreamId stream) const {
    return b.free_seq == 0 || b.free_stream == stream || behind_barrier(b.free_seq);
  }
  // A new block for [at, f->end()), linked in after f with f's fence tag;
  // f's size is the caller's to shrink, and neither is indexed here.
  detail::Block* split_off(detail::Block* f, Addr at) {
    detail::Block* upper = arena.make();
    upper->addr = at;
    upper->size = f->end() - at;
    upper->heap = f->heap;
    upper->segment = f->segment;
    upper->free_stream = f->free_stream;
    upper->reader_slot = f->reader_slot;
    upper->free_seq = f->free_seq;
    upper->prev = f;
    upper->next = f->next;
    if (f->next) f->next->prev = upper;
    f->next = upper;
    return upper;
  }
  // Turns the first `size` bytes of free block `b` into a live block; the rest
  // stays free. Granules must already be mapped (VMM).
  detail::Block* carve(detail::Block* b, std::size_t size);
  // Makes a live or pending block free again and merges it with free neighbours;
  // `reader` (kNoStream: none) is Note [Freed under another stream]'s stream.
  detail::Block* release_block(detail::Block* b, StreamId free_stream, StreamId reader = kNoStream);
  void merge_tags(detail::Block& into, const detail::Block& other);
  // Note [Freed under another stream]: `b`, just freed, takes `reader` as its
  // reader (out of line: the free's fast path has none).
  [[gnu::noinline]] void tag_reader(detail::Block& b, StreamId reader);
  bool poll_deferred(bool wait);  // true if some deferred free completed

  // ---- detail/placement.cpp -------------------------------------------------
  // The allocation's slow path when the pinned fit *fit misses granules:
  // another fit (stream order, pending places) or a window inside one
  // (backed placement) may serve with fewer. Returns where the block goes,
  // pinned, with *fit the free block that holds it (not split yet) and
  // *missing its unmapped granules.
  [[gnu::noinline]] Addr place_missing(detail::Heap& heap, detail::Block** fit, std::size_t size, StreamId stream,
                                       std::size_t* missing);
  // A pinned fit at `from` given up for `to`: unpins one, pins the other and
  // returns `to`, with *missing its unmapped granules. Out of line: the
  // allocation fast path stays small.
  [[gnu::noinline]] detail::Block* refit(detail::Heap& heap, Addr from, detail::Block* to,
                                         std::size_t size, std::size_t* missing);
  // Note [Backed placement]: a pinned fit *fit that misses
  // granules under a limit may move to where cached granules already back
  // the request, inside it or in another candidate. Returns the address of
  // the (pinned) window, with *fit the free block that holds it and
  // *missing its unmapped granules; nothing is split yet.
  [[gnu::noinline]] Addr place_on_backing(detail::Heap& heap, detail::Block** fit, std::size_t size,
                                          StreamId stream, std::size_t* missing);

  // ---- detail/granules.cpp --------------------------------------------------
  // Granule indices of an address range. Shifts, not divisions: every
  // malloc and free maps its block to granules, and a 64-bit divide costs
  // tens of cycles (the granularity is a power of two, config_check.cpp).
  std::size_t first_granule(const detail::Heap& heap, Addr addr) const {
    return (addr - heap.base) >> gran_shift;
  }
  std::size_t end_granule(const detail::Heap& heap, Addr end) const {
    return (end - heap.base + gran - 1) >> gran_shift;
  }
  detail::Granule& granule(detail::GranuleRef ref);
  // Marks the granules of [addr, addr+size) as used by one more live block and
  // returns how many of them are unmapped.
  std::size_t pin(detail::Heap& heap, Addr addr, std::size_t size);
  // Undoes pin(); granules left with no live block become reclaimable under
  // the fence of (`stream`, `seq`), or keep their previous fence if `restore`.
  void unpin(detail::Heap& heap, Addr addr, std::size_t size, StreamId stream, std::uint64_t seq,
             bool restore);
  // Maps the unmapped granules of the (pinned) range, getting handles as in
  // Note [Policy]. False (nothing changed) when the budget or device says no.
  // Held bytes under which a missing granule is created rather than stitched
  // (Note [When to stitch] in granules.cpp).
  double create_ceiling(std::size_t request) const;
  bool acquire(detail::Heap& heap, Addr addr, std::size_t size, std::size_t missing,
               std::size_t request, StreamId stream);
  // Up to `count` reclaimable granules that a request on stream slot
  // `requester` may take (Note [Cross-stream reuse]), least recently emptied
  // first; kNoRequester: only those behind the device barrier.
  static constexpr std::uint32_t kNoRequester = ~std::uint32_t{0};
  std::vector<detail::GranuleRef> pop_reclaimable(std::size_t count, std::uint32_t requester);
  // Takes granules popped by pop_reclaimable / pop_aliasable off the backend
  // mapping of their place (Note [Pending unmaps]): a place behind the device
  // barrier is unmapped now, the others become pending unmap. Appends their
  // handles to `handles`.
  void retire_places(std::vector<detail::GranuleRef>& refs, std::vector<GranuleHandle>* handles);
  void unmap_granules(std::vector<detail::GranuleRef>& refs, std::vector<GranuleHandle>* handles);
  void list_push(std::uint32_t slot, detail::GranuleRef ref, bool front);
  // A frozen heap (private pool, plan arena) lets go: its cached granules
  // become reclaimable like any others.
  void thaw(detail::Heap& heap);
  // Freezes a thawed heap again: its free granules leave the reclaimable lists.
  void refreeze(detail::Heap& heap);
  // Note [Lazy pins] (plan_pool.cpp): a plan's arena wholly mapped up to its
  // footprint stops counting per granule, and counts again when it thaws.
  void start_lazy_pins(detail::Heap& heap, std::size_t footprint);
  void note_lazy_free(detail::Heap& heap, std::uint32_t slot, std::uint64_t at_seq) {
    heap.lazy_free_seq = std::max(heap.lazy_free_seq, at_seq);
    heap.lazy_free_slot = slot;
    heap.lazy_free_owner = detail::Granule::merged_owner(heap.lazy_free_owner, slot);
  }
  void settle_lazy_pins(detail::Heap& heap);
  void list_remove(detail::GranuleRef ref);
  // The stream's slot, created on first use. Inline for the repeated stream
  // (every free looks its slot up); a new stream takes slot_for_slow().
  std::uint32_t slot_for(StreamId stream) {
    return cached_valid && cached_stream == stream ? cached_slot : slot_for_slow(stream);
  }
  std::uint32_t slot_for_slow(StreamId stream);
  bool fence_done(std::uint32_t slot, std::uint64_t seq, bool may_record);
  void sync_all_fences();
  std::size_t release_reclaimable(std::size_t keep_bytes);  // unmap + release, oldest first
  // Pool::release_pool_cache: the reclaimable granules of one private pool's
  // heaps, or their empty segments (cuda_malloc), go back to the backend.
  void release_pool_reclaimable(const PoolHeaps& heaps_of);
  // A maximal stretch of unmapped granules: `count` from index `first`.
  struct Hole {
    std::size_t first, count;
  };
  std::vector<Hole> unmapped_holes(const detail::Heap& heap, Addr addr, std::size_t size) const;
  // Appends `h` cut into pieces of at most `most` granules.
  static void cut_hole(const Hole& h, std::size_t most, std::vector<Hole>* out);
  // Holes cut into pieces of at most `most` granules (PoolConfig.limit_run_granules).
  static std::vector<Hole> cut_holes(const std::vector<Hole>& holes, std::size_t most);
  // Holes cut into the runs of Note [Run length] (no limit).
  static std::vector<Hole> cut_runs(const std::vector<Hole>& holes);
  // Unmaps the pending places (Note [Pending unmaps]) inside `hole` before
  // anything is mapped there.
  void clear_pending_places(detail::Heap& heap, const Hole& hole);
  // ---- detail/runs.cpp (Note [Run handles]) ------------------------------------
  // Fills each hole of missing granules under the (pinned)
  // range with one handle; false, with nothing changed, when the device is full.
  // Maps `holes` (a block's unmapped_holes, `missing` granules in all) by runs,
  // the last one `ahead` granules longer (Note [Runs ahead]).
  bool grow_by_runs(detail::Heap& heap, const std::vector<Hole>& holes, std::size_t missing, std::size_t ahead);
  // Note [Runs ahead] (runs.cpp): unmapped granules past a block ending at
  // granule `block_end`, whose last hole is `last`, that its growth may map
  // as well, at most `most`.
  std::size_t run_ahead(const detail::Heap& heap, const Hole& last, std::size_t block_end, std::size_t most) const;
  // Gives back whole free runs whose frees lie behind the device barrier
  // until `want_bytes` went (none at all, if `all_or_nothing` and they do
  // not add up to it); returns the bytes given back.
  std::size_t release_free_runs(std::size_t want_bytes, bool all_or_nothing);
  void premap_reserve();
  // Unmaps `victims` (granules already off their lists) and gives their handles back.
  void release_granules(std::vector<detail::GranuleRef>& victims);
  // Gives handles back to the device, first unmapping any pending-unmap
  // place they still have (waiting for its fence).
  void release_handles(const std::vector<GranuleHandle>& handles);

  // ---- detail/aliases.cpp (Notes [Alias reclaim], [Pending unmaps]) -----------
  // Up to `count` reclaimable granules whose fences are still pending but that
  // only `slot`'s stream used, oldest first, taken off their list.
  std::vector<detail::GranuleRef> pop_aliasable(std::uint32_t slot, std::size_t count);
  // Puts popped granules back where they were.
  void unpop_granules(const std::vector<detail::GranuleRef>& refs);
  // The granule gives its handle to a new place: it becomes pending unmap.
  GranuleHandle make_stale(detail::GranuleRef ref);
  // Note [Device barrier]: waits for the whole device; false if refused.
  bool device_barrier();
  bool behind_barrier(std::uint64_t free_seq) const { return free_seq <= barrier_seq; }
  // Unmaps the pending place of `ref` if it is behind the barrier (or after
  // taking one when `wait`); true when the place is unmapped now.
  bool resolve_stale(detail::GranuleRef ref, bool wait);
  void forget_stale(detail::GranuleRef ref, GranuleHandle handle);
  // Unmaps every pending place behind the barrier (all, after one, if `wait`).
  void process_pending_unmaps(bool wait);
  void compact_pending_unmaps();  // drops entries already resolved (Note [Pending unmaps])
  // A pending place (Note [Pending unmaps]) that mapping over would wait for the device.
  bool pending_place(const detail::Granule& g) const { return g.stale && !behind_barrier(g.stale_seq); }
  // True if [addr, addr + size) covers a pending place not yet behind the
  // barrier (mapping there now would wait for the whole device).
  bool pending_blocks(const detail::Heap& heap, Addr addr, std::size_t size);
  // Like find_fit, skipping blocks whose first `size` bytes pending_blocks().
  detail::Block* find_fit_unblocked(detail::Heap& heap, std::size_t size, StreamId stream);

  // ---- detail/plan_pool.cpp (Notes [Step plan], [Step plan arena]) ----------
  // The default pool met memory pressure (a stitch or a device barrier):
  // arms the plan if it is off.
  void plan_note_pressure();
  // Names a default-pool request (Note [Step plan]); while a plan is in
  // force, places it where the plan says. Returns the block or null, and the
  // request's name in *item.
  detail::Block* plan_allocate(std::size_t rounded, StreamId stream, std::uint32_t* item);
  // The block for a named request at its planned range, if that range is
  // free and can be backed now; null otherwise (counts nothing).
  detail::Block* plan_place(std::uint32_t item, std::size_t rounded, StreamId stream);
  // The OOM ladder, behind its barrier, before the plan is given up: the
  // planned range of a request that missed it, tried again (the cache's
  // pending fences may have kept it from being backed); a hit now counts as
  // one instead of the miss.
  detail::Block* plan_place_after_barrier(std::uint32_t item, std::size_t rounded, StreamId stream);
  // Note [Lent arena cache]: lend=true makes the arena's free granules
  // reclaimable for one more try of the OOM ladder; lend=false freezes the
  // arena again.
  void plan_lend_cache(bool lend);
  // Note [When the arena lends]: whether the ladder lends the arena's cache
  // for this request (`item`: its name) before it gives the plan up.
  bool plan_may_lend(std::uint32_t item) const;
  // Ends the plan in force: its arena thaws (its cached granules become
  // reclaimable) and retires. rearm: record a new window at once.
  void plan_drop(bool rearm);
  // Forgets the plan and every name (empty_cache, a lower budget).
  void plan_reset();
  // Splits free block `f` at `at` (inside it); returns the upper part, or f if
  // at == f->addr. index_upper=false: the caller takes the upper part at once,
  // so an arena's address index does not get its entry.
  detail::Block* split_free_at(detail::Block* f, Addr at, bool index_upper = true);
  // release_block() made `b` free, merged with its free neighbours: an
  // arena's address index follows.
  void arena_note_free(detail::Heap& heap, detail::Block* b);
  void plan_adopt();
  void plan_check_window();
  void drop_retired_arenas();

  // ---- detail/stream_reuse.cpp (Note [Reuse behind a stream wait]) ------------
  // Note [Reuse behind a stream wait]: may free block `f` be handed to
  // `stream` now? Orders `stream` after the streams that freed it if needed.
  bool reusable_ordered(const detail::Block& f, StreamId stream);
  // find_fit, taking a block other streams fence behind a wait on them.
  detail::Block* find_fit_ordered(detail::Heap& heap, std::size_t size, StreamId stream);
  // Some fit among find_fit's candidates is fenced by other streams' frees.
  bool fenced_fit(detail::Heap& heap, std::size_t size, StreamId stream);
  // Note [Unmapped tail]: a live block of `size` at the start of the VMM
  // heap's unmapped tail, backed as allocate() backs any fit; null if the
  // tail is too short or cannot be backed.
  [[gnu::noinline]] detail::Block* take_unmapped_tail(detail::Heap& heap, std::size_t size, StreamId stream);
  // The best fit that other streams fence but whose memory is all mapped, taken
  // behind a wait on them (reusable_ordered); null if none among the first few.
  detail::Block* find_backed_fit_ordered(detail::Heap& heap, std::size_t size, StreamId stream);
  // Every granule of [addr, addr + size) holds memory.
  bool backed(const detail::Heap& heap, Addr addr, std::size_t size) const;
  // `waiter` runs after every free on `signaler` up to `free_seq` (a device-side
  // wait, taken once per pair for all frees before it); false during a capture.
  bool order_after(StreamId waiter, StreamId signaler, std::uint64_t free_seq);

  // ---- detail/checkpoint.cpp (Note [Pool checkpoints]) -------------------
  PoolCheckpoint checkpoint_private_pool(PoolId pool);
  RestoreDelta restore_private_pool(const PoolCheckpoint& checkpoint);
  PoolHeaps& checkpointable_pool(PoolId pool, const char* what);
  // Allocates exactly [c.addr, c.addr + c.size) of `heap`, which must be free.
  void allocate_at(detail::Heap& heap, const CheckpointBlock& c);

  // ---- detail/segments.cpp --------------------------------------------------
  bool grow_segments(detail::Heap& heap, std::size_t size);
  std::size_t release_empty_segments(bool include_pinned);
  std::size_t release_empty_segments_of(detail::Heap& heap, bool include_pinned);
  void free_segment(detail::Heap& heap, detail::Segment* segment);

  // ---- detail/inspect.cpp --------------------------------------------------
  std::string check_invariants() const;
  PoolSnapshot snapshot() const;
  // Note [Map groups]: [lo, hi) of each segment a snapshot shows for the mapped
  // granules [first, end) of `h`; `from` is the block at or after the first
  // granule's start.
  std::vector<std::pair<Addr, Addr>> map_group_pieces(const detail::Heap& h, std::size_t first, std::size_t end,
                                                      const detail::Block* from) const;
  std::size_t largest_free_block() const;
  BlockBacking backing_of(Addr addr) const;  // Note [Block backing] (pool.h)

  // ---- state ----------------------------------------------------------------
  Backend& backend;
  // The backend's one kind of memory (core/backend.h), read once: exactly one
  // is non-null, and `vmm` says which.
  VmmPrimitives* const vmm_ops;
  SegmentPrimitives* const segment_ops;
  PoolConfig& config;
  const bool vmm;
  const std::size_t gran;
  const unsigned gran_shift;  // log2(gran)
  std::size_t capacity = 0;      // device total at construction
  // Note [Foreign bytes] (pool.h): held outside this pool, counted in its budget.
  std::atomic<std::size_t> foreign_bytes{0};
  std::size_t virtual_span = 0;  // per heap (VMM)
  bool checks = false;

  detail::BlockArena arena;
  std::vector<std::unique_ptr<detail::Heap>> heaps;  // by id; null once dropped
  std::unordered_map<PoolId, PoolHeaps> pools;       // pool 0 included
  detail::Heap* default_small = nullptr;
  detail::Heap* default_large = nullptr;
  std::size_t released_pools = 0;  // released, not yet dropped

  detail::AddrMap live;  // allocated blocks by address

  std::vector<detail::StreamSlot> slots;  // slot 0: memory never used
  std::unordered_map<StreamId, std::uint32_t> slot_index;
  StreamId cached_stream = 0;
  std::uint32_t cached_slot = 0;
  bool cached_valid = false;

  struct Deferred {
    detail::Block* block;
    std::vector<EventHandle> events;  // one per foreign stream; 0 once completed
  };
  std::vector<Deferred> deferred;

  // Pending unmaps, oldest first; an entry is stale (already resolved) when
  // its granule's stale handle or seq differ (Note [Pending unmaps]).
  struct PendingUnmap {
    detail::GranuleRef ref;
    GranuleHandle handle;
    std::uint64_t seq;
  };
  std::vector<PendingUnmap> pending_unmaps;
  // False once the entry's place was unmapped on demand or mapped again (the
  // queue keeps such entries until a pass or compact_pending_unmaps drops them).
  bool still_pending(const PendingUnmap& e) const {
    if (!heaps[e.ref.heap]) return false;
    const detail::Granule& g = heaps[e.ref.heap]->granules[e.ref.index];
    return g.stale == e.handle && g.stale_seq == e.seq;
  }
  std::unordered_multimap<GranuleHandle, detail::GranuleRef> stale_at;  // handle -> its pending places
  // Frees with a sequence up to this one happened before the last device
  // barrier began: no stream still touches what they freed.
  std::uint64_t barrier_seq = 0;
  std::uint64_t pending_checked_at = ~std::uint64_t{0};  // barrier_seq at the last pending-unmap pass
  // pending_unmaps' length that triggers compact_pending_unmaps; never below the minimum.
  static constexpr std::size_t kMinPendingCompact = 1024;
  std::size_t pending_compact_at = kMinPendingCompact;

  std::size_t held = 0;         // bytes held from the backend
  std::size_t free_runs = 0;    // run handles with no live block (Note [Run handles])
  // barrier_seq when release_free_runs last found free runs but none behind
  // the barrier: until the next barrier another pass would find none either.
  std::uint64_t runs_checked_at = ~std::uint64_t{0};
  std::size_t active_total = 0; // bytes of live + pending blocks, all heaps
  std::size_t reserve_held = 0; // bytes release_cached() keeps
  std::uint64_t seq = 0;        // operation sequence
  std::uint32_t map_groups = 0; // growths so far (Note [Map groups], inspect.cpp)
  // The context of the public operation running now (allocate's, a free's, a
  // release's): segment map/unmap history entries carry it.
  std::uint64_t op_context = 0;
  // Per kind (0 small, 1 large) tallies behind the memory gauges.
  std::size_t mapped_bytes[2] = {0, 0};
  std::size_t segment_count[2] = {0, 0};
  std::size_t free_blocks[2] = {0, 0};
  std::size_t heap_count[2] = {0, 0};
  bool memory_dirty = false;  // tallies above moved since the last sync_memory_stats()
  // config.time_host_ops (Note [Host time]), beside memory_dirty: read on every
  // operation, from a line the operation touches anyway.
  bool time_host_ops = false;

  // Note [Step plan]
  detail::StepPlan plan;
  detail::Heap* plan_arena = nullptr;         // the arena of the plan in force
  std::size_t plan_footprint = 0;             // its planned bytes, from its base
  std::vector<detail::Heap*> retired_arenas;  // thawed, dropped once empty
  std::uint64_t pressure = 0;                 // stitches and barriers of the default pool
  std::uint64_t pressure_at_arm = 0;
  std::uint64_t plan_window = 0;              // allocations the plan in force was learnt from
  std::uint64_t plan_window_allocs = 0;       // allocations of the plan in force's current window
  std::uint64_t plan_window_misses = 0;
  std::uint64_t plan_window_pressure = 0;     // `pressure` when the window began
  std::uint64_t plan_window_barriers = 0;     // stats_.num_sync_all_streams then
  std::uint32_t plan_failures = 0;            // plans dropped since the last one that held
  bool plan_settling = false;                 // the window since adoption is not judged
  std::uint64_t plan_quiet_until = 0;         // num_allocs before which the plan stays off
  static constexpr std::uint64_t kPlanNever = ~std::uint64_t{0};
  struct StreamOrder {
    StreamId waiter, signaler;
    std::uint64_t seq;  // frees on signaler up to this seq are ordered before waiter's work
  };
  std::vector<StreamOrder> stream_orders;     // Note [Reuse behind a stream wait]

  PoolStats stats_;
  // Note [Hot gauges]: the five gauges every operation moves, per stat kind.
  detail::HotGauges hot_[kStatKinds];
  detail::TraceRing ring;
};

// ---- the per-operation stats (Note [Stats apart]) -----------------------------
// Here rather than in stats.cpp so the fast path inlines them.
//
// Note [Lazy current]
// A cached malloc+free pair moves five gauges (allocation, active and the
// allocated, active and requested bytes), each for all and for its heap's
// kind. Stat::increase and decrease store `current`, a running total and
// the peak each time: 52 of the pair's ~225 stores. current == allocated -
// freed always holds, so the fast path stores only the running total,
// computes current to check the peak (stored only when exceeded), and
// sync_current() writes them to stats_ before anything reads it
// (sync_memory_stats, usage, the resets, check_invariants). The figures are
// the same at every read; the pair makes 30 stores and ~50 instructions
// fewer (pool_microbench: ~2 ns of ~98).
//
// Note [Hot gauges]
// Those five gauges live apart from stats_, in hot_: a kind's five running
// totals and peaks side by side (two cache lines), where in PoolStats each
// gauge is an array of its own over the three kinds, so that an operation
// touched about ten lines for them. Between two allocations the framework's
// own host work evicts the pool's data from the CPU caches, and a host-bound
// step pays for every line (Note [Naming on the host]). hot_ is the truth for
// the five; stats_ holds a copy from sync_current() on, and the resets, which
// work on stats_, write theirs back (load_hot).

inline void Pool::Impl::note_alloc(bool small, std::size_t size, std::size_t requested) {
  const int k = small ? kStatSmallPool : kStatLargePool;
  for (int i : {int(kStatAll), k}) {
    detail::HotGauges& g = hot_[i];
    g.allocation.increase(1);
    g.active.increase(1);
    g.allocated_bytes.increase(size);
    g.active_bytes.increase(size);
    g.requested_bytes.increase(requested);
  }
  ++stats_.num_allocs;
}

inline void Pool::Impl::note_free_requested(bool small, std::size_t size, std::size_t requested, bool) {
  const int k = small ? kStatSmallPool : kStatLargePool;
  for (int i : {int(kStatAll), k}) {
    detail::HotGauges& g = hot_[i];
    g.allocation.decrease(1);
    g.allocated_bytes.decrease(size);
    g.requested_bytes.decrease(requested);
  }
  ++stats_.num_frees;
}

inline void Pool::Impl::note_free_completed(bool small, std::size_t size) {
  const int k = small ? kStatSmallPool : kStatLargePool;
  for (int i : {int(kStatAll), k}) {
    detail::HotGauges& g = hot_[i];
    g.active.decrease(1);
    g.active_bytes.decrease(size);
  }
}

}  // namespace torchmem
