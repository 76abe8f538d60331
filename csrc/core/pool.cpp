// pool.cpp: Pool's public methods, construction and the OOM ladder (the
// stats bookkeeping is in detail/stats.cpp).
//
// Every public method validates its input, takes the one mutex and calls into
// Pool::Impl (detail/pool_impl.h), whose parts live in csrc/core/detail/.
// Caller errors throw PoolError before anything changes, so the pool is
// unchanged after one. Lock order: Pool::mutex_, then the backend's own
// lock if it has one; nothing under the lock calls user code.
#include "core/pool.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Block;
using detail::Heap;

namespace {

inline std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

}  // namespace

// ============================================================================
// Impl: construction and teardown
// ============================================================================

Pool::Impl::Impl(Backend& backend_in, PoolConfig& config_in)
    : backend(backend_in),
      vmm_ops(backend_in.vmm()),
      segment_ops(backend_in.segments()),
      config(config_in),
      vmm(vmm_ops != nullptr),
      gran(backend_in.granularity()),
      gran_shift(static_cast<unsigned>(__builtin_ctzll(gran))),
      ring(config_in.trace_capacity) {
  if ((vmm_ops == nullptr) == (segment_ops == nullptr)) {
    throw PoolError("backend '" + backend.name() + "' must serve exactly one of vmm() and segments()");
  }
  capacity = backend.mem_info().total_bytes;
  time_host_ops = config.time_host_ops;
  virtual_span = round_up(config.virtual_bytes ? config.virtual_bytes : 2 * capacity, gran);
#if TORCHMEM_DEBUG
  checks = true;
#else
  checks = config.debug_checks;
#endif
  slots.emplace_back();  // slot 0: never-used memory, no fence needed
  slots[0].completed_seq = detail::StreamSlot::kAlwaysComplete;
  try {
    PoolHeaps& heaps0 = pools[0];
    heaps0.small = default_small = make_heap(0, true);
    heaps0.large = default_large = make_heap(0, false);
    if (config.reserve_bytes) {
      if (vmm) {
        premap_reserve();
      } else {
        // One pinned segment in the large heap, kept by release_cached.
        if (!grow_segments(*default_large, round_up(config.reserve_bytes, 2 * kMiB))) {
          throw PoolError("PoolConfig.reserve_bytes = " + mib(config.reserve_bytes) +
                          ": the device could not provide it");
        }
        default_large->segments.back()->pinned = true;
        reserve_held = held;
      }
    }
  } catch (...) {
    teardown();
    throw;
  }
  sync_memory_stats();
}

Pool::Impl::~Impl() { teardown(); }

void Pool::Impl::teardown() {
  // Return everything, live or not: the owner is going away. Every address is
  // unmapped below, so the whole device must have caught up first (Note
  // [Device barrier]); pending places go with the rest.
  if (vmm) {
    try {
      device_barrier();
    } catch (...) {
      // A device that fails here is going away too: unmap regardless.
    }
    for (auto& heap : heaps) {
      if (!heap) continue;
      for (std::size_t i = 0; i < heap->granules.size(); ++i) {
        if (!heap->granules[i].stale) continue;
        vmm_ops->unmap(heap->base + i * gran, 1);
        heap->granules[i].stale = 0;
      }
    }
  }
  for (Deferred& d : deferred) {
    for (EventHandle e : d.events) {
      if (e) backend.destroy_event(e);
    }
  }
  for (detail::StreamSlot& slot : slots) {
    for (detail::Fence& f : slot.fences) backend.destroy_event(f.event);
  }
  for (auto& heap : heaps) {
    if (!heap) continue;
    if (vmm) {
      for (std::size_t i = 0; i < heap->granules.size();) {
        detail::Granule& gr = heap->granules[i];
        if (!gr.handle) {
          ++i;
          continue;
        }
        const std::size_t n = gr.run_count ? gr.run_count : 1;  // Note [Run handles]
        if (gr.run_count) {
          vmm_ops->unmap_run(heap->base + i * gran, n);
        } else {
          vmm_ops->unmap(heap->base + i * gran, 1);
        }
        vmm_ops->release_granule(gr.handle);
        for (std::size_t k = i; k < i + n; ++k) heap->granules[k].handle = 0;
        i += n;
      }
      vmm_ops->unreserve(heap->base, heap->span);
    } else {
      for (auto& seg : heap->segments) segment_ops->free_segment(seg->addr, seg->size);
      heap->segments.clear();
    }
  }
  heaps.clear();
  deferred.clear();
  slots.clear();
  pending_unmaps.clear();
  stale_at.clear();
}

Heap* Pool::Impl::make_heap(PoolId pool, bool small, bool is_arena) {
  auto heap = std::make_unique<Heap>();
  heap->id = static_cast<std::uint32_t>(heaps.size());
  heap->pool = pool;
  heap->small = small;
  heap->frozen = pool != 0 || is_arena;  // Note [Private pools], Note [Step plan arena]
  heap->arena = is_arena;
  if (vmm) {
    heap->base = vmm_ops->reserve(virtual_span);
    if (!heap->base) {
      throw std::runtime_error("torchmem: could not reserve " + mib(virtual_span) +
                               " of virtual address space; set PoolConfig.virtual_bytes lower");
    }
    heap->span = virtual_span;
    // The whole range starts as one free block: the unlimited tail.
    Block* tail = arena.make();
    tail->addr = heap->base;
    tail->size = heap->span;
    tail->heap = heap.get();
    heap->first = tail;
    heap->insert_free(tail);
    ++free_blocks[small ? 0 : 1];
  }
  ++heap_count[small ? 0 : 1];
  heaps.push_back(std::move(heap));
  return heaps.back().get();
}

void Pool::Impl::drop_heap(Heap* heap) {
  // Only called for empty heaps: no live block, nothing mapped, no segment.
  for (Block* b = heap->first; b;) {
    Block* next = b->next;
    arena.recycle(b);
    b = next;
  }
  free_blocks[heap->small ? 0 : 1] -= heap->free_count();
  if (vmm) vmm_ops->unreserve(heap->base, heap->span);
  --heap_count[heap->small ? 0 : 1];
  heaps[heap->id].reset();
}

Heap* Pool::Impl::private_heap_for(PoolId pool, std::size_t rounded) {
  const bool small = rounded <= config.small_threshold;
  auto it = pools.find(pool);
  if (it == pools.end()) {
    throw PoolError("private pool " + std::to_string(pool) +
                    " does not exist; call create_private_pool first");
  }
  if (it->second.released) {
    throw PoolError("private pool " + std::to_string(pool) +
                    " was released; create a new one to allocate from it");
  }
  return small ? it->second.small : it->second.large;
}

bool Pool::Impl::pool_empty(const PoolHeaps& ph) const {
  for (const Heap* h : {ph.small, ph.large}) {
    if (h->live_blocks || h->mapped || h->stale || !h->segments.empty()) return false;
  }
  return true;
}

void Pool::Impl::maybe_drop_released_pools() {
  if (released_pools == 0) return;
  for (auto it = pools.begin(); it != pools.end();) {
    if (it->second.released && !vmm) {
      // cuda_malloc: a released pool's empty segments go back at once.
      for (Heap* h : {it->second.small, it->second.large}) {
        for (std::size_t i = h->segments.size(); i-- > 0;) {
          detail::Segment* s = h->segments[i].get();
          if (s->first->is_free() && s->first->next == nullptr) free_segment(*h, s);
        }
      }
    }
    if (it->second.released && pool_empty(it->second)) {
      drop_heap(it->second.small);
      drop_heap(it->second.large);
      --released_pools;
      it = pools.erase(it);
    } else {
      ++it;
    }
  }
}

bool Pool::Impl::could_fit(std::size_t rounded) const {
  std::size_t pending = 0;  // deferred frees may complete in step 4
  for (const Deferred& d : deferred) pending += d.block->size;
  const std::size_t live_bytes = active_total - pending;
  const std::size_t shared = vmm ? 2 * gran : 0;  // granules the new block may share with live ones
  return live_bytes + rounded <= budget() + shared;
}

std::size_t Pool::Impl::budget() const {
  if (config.limit_bytes == 0) return capacity;  // the device decides: foreign bytes are in its free memory
  const std::size_t foreign = foreign_bytes.load(std::memory_order_relaxed);  // Note [Foreign bytes]
  return config.limit_bytes > foreign ? config.limit_bytes - foreign : 0;
}

// ============================================================================
// Impl: the allocation ladder (Note [OOM ladder] in pool.h)
// ============================================================================

Addr Pool::Impl::allocate(std::size_t size, StreamId stream, PoolId pool, std::uint64_t context, bool cached_only) {
  if (size == 0) throw PoolError("allocate: size 0; request at least one byte");
  const std::size_t limit = budget();
  const std::size_t rounded = size > limit ? size : round_up(size, kMinBlockSize);
  Heap* heap = heap_for(pool, rounded);  // may throw: nothing changed yet
  ++seq;
  if (rounded > limit) {
    // More than the whole budget: no ladder step can help, and releasing the
    // cache for it would only slow down what comes next.
    if (cached_only) return 0;
    ++stats_.num_ooms;
    trace(TraceAction::kOom, 0, size, stream, pool, context);
    return 0;
  }
  if (!deferred.empty()) poll_deferred(false);

  Block* b = nullptr;
  // Tries steps 1 and 3: a cached fit, then carving with new granules/segments.
  auto attempt = [&](bool ordered = false) -> Block* {
    Block* fit = ordered ? find_fit_ordered(*heap, rounded, stream) : find_fit(*heap, rounded, stream);
    if (vmm) {
      if (!fit) return nullptr;  // the range is exhausted (or fenced off)
      std::size_t missing = pin(*heap, fit->addr, rounded);
      // Where in `fit` the block goes: its start, unless the fit misses
      // granules and a better place is found (out of line: the slow path).
      Addr at = fit->addr;
      if (missing) at = place_missing(*heap, &fit, rounded, stream, &missing);
      if (missing && (cached_only || !acquire(*heap, at, rounded, missing, rounded, stream))) {
        unpin(*heap, at, rounded, 0, 0, /*restore=*/true);
        return nullptr;
      }
      return carve(at == fit->addr ? fit : split_free_at(fit, at), rounded);
    }
    if (!fit) {
      if (cached_only || !grow_segments(*heap, rounded)) return nullptr;
      fit = find_fit(*heap, rounded, stream);
      if (!fit) return nullptr;
    }
    return carve(fit, rounded);
  };

  // Note [Step plan]: named (and placed, while a plan is in force) first.
  std::uint32_t item = detail::StepPlan::kNoItem;
  if (__builtin_expect(plan.naming(), 0) && pool == 0 && !cached_only) {
    detail::HostClock clock(time_host_ops, stats_.host_plan_ns);  // Note [Host time]
    b = plan_allocate(rounded, stream, &item);
  }
  if (!b) b = attempt();
  if (!b && cached_only) return 0;  // a cached fit or nothing: no ladder, no OOM counted
  if (!b && !could_fit(rounded)) {  // Note [OOM ladder]: no step can help
    plan.on_free(item);
    ++stats_.num_ooms;
    trace(TraceAction::kOom, 0, size, stream, pool, context);
    sync_memory_stats();
    return 0;
  }
  // Step 3b: a fit that only other streams' frees fence is taken behind a
  // device-side wait on those streams (Note [Cross-stream reuse]), not a barrier.
  if (!b && config.stream_order && fenced_fit(*heap, rounded, stream)) b = attempt(/*ordered=*/true);
  if (!b) {
    // Step 4: wait for deferred frees and fences, then try again.
    bool waited = !deferred.empty() || slots.size() > 1;
    bool barrier_refused = false;
    if (waited) {
      // Note [Cross-stream reuse]: what other streams freed becomes reusable
      // behind a barrier (refused during a capture: the fences still help).
      if (pool == 0) plan_note_pressure();
      barrier_refused = !device_barrier();
      poll_deferred(true);
      sync_all_fences();
      ++stats_.num_sync_all_streams;
      b = attempt();
      if (!b && plan_arena) b = plan_place_after_barrier(item, rounded, stream);
    }
    if (!b && !vmm) {
      // Step 5 (cuda_malloc segments only): return every cached segment and retry.
      ++stats_.num_alloc_retries;
      release_cached();
      b = attempt();
    }
    if (!b && plan_arena && plan_may_lend(item)) {
      // Note [Lent arena cache]: its free granules first, the plan kept.
      plan_lend_cache(true);
      b = plan_place_after_barrier(item, rounded, stream);
      if (!b) b = attempt();
      plan_lend_cache(false);
    }
    if (!b && plan_arena) {
      // A plan in force keeps its arena's cache to itself: let it go first
      // (Note [Step plan arena]).
      plan_drop(/*rearm=*/true);
      b = attempt();
    }
    if (!b && vmm && barrier_refused) b = take_unmapped_tail(*heap, rounded, stream);  // Note [Unmapped tail]
    if (!b) {
      plan.on_free(item);
      ++stats_.num_ooms;
      trace(TraceAction::kOom, 0, size, stream, pool, context);
      sync_memory_stats();
      return 0;
    }
  }
  // Success: the block is live.
  heap = b->heap;  // a planned block lives in the plan's arena
  b->plan_item = item;
  b->requested = size;
  b->stream = stream;
  b->context = context;
  live.insert(b->addr, b);
  ++heap->live_blocks;
  active_total += b->size;
  note_alloc(heap->small, b->size, size);
  if (memory_dirty) sync_memory_stats();
  trace(TraceAction::kAlloc, b->addr, size, stream, pool, context);
  return b->addr;
}

void Pool::Impl::deallocate(Addr addr, std::uint64_t free_context, StreamId current_stream) {
  Block* b = live.erase(addr);
  if (!b) {
    throw PoolError("free: " + hex(addr) +
                    " is not a live block of this pool (never allocated here, or already freed)");
  }
  ++seq;
  Heap* heap = b->heap;
  const bool small = heap->small;
  const std::size_t size = b->size, requested = b->requested;
  const StreamId stream = b->stream;
  const PoolId pool = heap->pool;
  const std::uint64_t context = free_context != 0 ? free_context : b->context;
  --heap->live_blocks;
  trace(TraceAction::kFreeRequested, addr, requested, stream, pool, context);
  // Note [Freed under another stream]
  const StreamId reader = current_stream != stream ? current_stream : kNoStream;
  if (!b->uses.empty()) {
    // Note [Record stream]: wait for every foreign stream before reuse.
    if (reader != kNoStream && std::find(b->uses.begin(), b->uses.end(), reader) == b->uses.end()) b->uses.push_back(reader);
    Deferred d{b, {}};
    d.events.reserve(b->uses.size());
    for (StreamId s : b->uses) d.events.push_back(backend.record_event(s));
    b->state = BlockState::kPendingFree;
    deferred.push_back(std::move(d));
    ++stats_.num_deferred_frees;
    note_free_requested(small, size, requested, /*deferred=*/true);
    return;
  }
  release_block(b, stream, reader);
  active_total -= size;
  note_free_requested(small, size, requested, /*deferred=*/false);
  note_free_completed(small, size);
  trace(TraceAction::kFreeCompleted, addr, requested, stream, pool, context);
  if (released_pools) maybe_drop_released_pools();
  if (memory_dirty) sync_memory_stats();
}

void Pool::Impl::record_stream(Addr addr, StreamId stream) {
  Block* b = live.find(addr);
  if (!b) throw PoolError("record_stream: " + hex(addr) + " is not a live block of this pool");
  if (stream == b->stream) return;
  if (std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) b->uses.push_back(stream);
}

void Pool::Impl::create_private_pool(PoolId pool) {
  if (pool == 0) throw PoolError("create_private_pool: id 0 is the default pool; use a non-zero id");
  if (pools.count(pool)) {
    throw PoolError("create_private_pool: pool " + std::to_string(pool) + " already exists" +
                    (pools[pool].released ? " (released, with blocks still live)" : ""));
  }
  PoolHeaps ph;
  ph.small = make_heap(pool, true);
  ph.large = make_heap(pool, false);
  pools[pool] = ph;
}

void Pool::Impl::release_private_pool(PoolId pool) {
  if (pool == 0) throw PoolError("release_private_pool: the default pool (id 0) cannot be released");
  auto it = pools.find(pool);
  if (it == pools.end() || it->second.released) {
    throw PoolError("release_private_pool: no private pool " + std::to_string(pool) +
                    (it == pools.end() ? "" : " (already released)"));
  }
  it->second.released = true;
  ++released_pools;
  // Thawed (Note [Private pools]). cuda_malloc: its empty segments go back
  // now; VMM: its cached granules become reclaimable like any others and go
  // when stitched or released.
  for (Heap* h : {it->second.small, it->second.large}) thaw(*h);
  maybe_drop_released_pools();
  sync_memory_stats();
}

std::size_t Pool::Impl::release_cached(std::size_t keep_bytes, PoolId only) {
  const PoolHeaps* heaps_of = nullptr;
  if (only != kAllPools) {
    auto it = pools.find(only);
    if (only == 0 || it == pools.end()) return 0;
    heaps_of = &it->second;
  }
  poll_deferred(true);
  sync_all_fences();
  process_pending_unmaps(/*wait=*/true);
  // Memory back to the device: a plan's arena too (Note [Step plan arena]);
  // a plan given up with no limit may be learnt again.
  if (only == kAllPools) {
    plan_reset();
    if (plan_quiet_until == kPlanNever) plan_quiet_until = 0;
  }
  const std::size_t before = held;
  if (heaps_of != nullptr) {
    release_pool_reclaimable(*heaps_of);
  } else if (vmm) {
    release_reclaimable(std::max(reserve_held, keep_bytes));
  } else {
    release_empty_segments(false);
  }
  maybe_drop_released_pools();
  drop_retired_arenas();
  sync_memory_stats();
  return before - held;
}

void Pool::Impl::after_op(const char* what) {
  if (!checks) return;
  std::string problem = check_invariants();
  if (!problem.empty()) {
    throw std::logic_error(std::string("torchmem pool invariant violated after ") + what + ": " + problem);
  }
}

// ============================================================================
// Pool: the public surface
// ============================================================================

Pool::Pool(Backend& backend, const PoolConfig& config) : backend_(backend), config_(config) {
  validate_config(config_, backend_, backend_.mem_info().total_bytes);
  impl_ = std::make_unique<Impl>(backend_, config_);
}

Pool::~Pool() = default;

namespace {

// Sets Impl::op_context for one public operation (also when it throws).
class OpContext {
 public:
  OpContext(std::uint64_t& slot, std::uint64_t context) : slot_(slot) { slot_ = context; }
  ~OpContext() { slot_ = 0; }
  OpContext(const OpContext&) = delete;
  OpContext& operator=(const OpContext&) = delete;

 private:
  std::uint64_t& slot_;
};

}  // namespace

Addr Pool::allocate(std::size_t size, StreamId stream, PoolId pool, std::uint64_t context) {
  return allocate_locked(size, stream, pool, context, /*cached_only=*/false);
}

Addr Pool::allocate_cached(std::size_t size, StreamId stream, PoolId pool, std::uint64_t context) {
  return allocate_locked(size, stream, pool, context, /*cached_only=*/true);
}

Addr Pool::allocate_locked(std::size_t size, StreamId stream, PoolId pool, std::uint64_t context, bool cached_only) {
  std::lock_guard<std::mutex> lock(mutex_);
  detail::HostClock clock(impl_->time_host_ops, impl_->stats_.host_alloc_ns);  // Note [Host time]
  OpContext op(impl_->op_context, context);
  Addr a = impl_->allocate(size, stream, pool, context, cached_only);
  impl_->after_op(cached_only ? "allocate_cached" : "allocate");
  return a;
}

void Pool::deallocate(Addr addr, std::uint64_t free_context, StreamId current_stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  detail::HostClock clock(impl_->time_host_ops, impl_->stats_.host_free_ns);  // Note [Host time]
  OpContext op(impl_->op_context, free_context);
  impl_->deallocate(addr, free_context, current_stream);
  impl_->after_op("free");
}

std::uint64_t Pool::sequence() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return impl_->seq;
}

void Pool::record_stream(Addr addr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  impl_->record_stream(addr, stream);
}

void Pool::create_private_pool(PoolId pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  impl_->create_private_pool(pool);
  impl_->after_op("create_private_pool");
}

void Pool::release_private_pool(PoolId pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  impl_->release_private_pool(pool);
  impl_->after_op("release_private_pool");
}

std::size_t Pool::release_cached(std::uint64_t context) {
  std::lock_guard<std::mutex> lock(mutex_);
  OpContext op(impl_->op_context, context);
  ++impl_->stats_.num_cache_releases;
  std::size_t freed = impl_->release_cached();
  impl_->after_op("release_cached");
  return freed;
}

std::size_t Pool::release_pool_cache(PoolId pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++impl_->stats_.num_cache_releases;
  std::size_t freed = impl_->release_cached(0, pool);
  impl_->after_op("release_pool_cache");
  return freed;
}

std::size_t Pool::release_cached_to(std::size_t keep_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (impl_->held <= keep_bytes) return 0;  // nothing above the mark: no barrier, no stats
  ++impl_->stats_.num_cache_releases;
  std::size_t freed = impl_->release_cached(keep_bytes);
  impl_->after_op("release_cached_to");
  return freed;
}

void Pool::set_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t g = backend_.granularity();
  if (bytes != 0 && bytes < g) {
    throw PoolError("set_limit: " + mib(bytes) + " is below one granule (" + mib(g) +
                    "); give at least one granule or 0 for no limit");
  }
  // A plan learnt under a larger budget may not fit the new one (Note [Step plan arena]).
  if (bytes != 0 && (config_.limit_bytes == 0 || bytes < config_.limit_bytes)) impl_->plan_reset();
  if (bytes != 0 && impl_->plan_quiet_until == Impl::kPlanNever) impl_->plan_quiet_until = 0;  // given up with no limit
  config_.limit_bytes = bytes;
}

void Pool::set_foreign_bytes(std::size_t bytes) {
  impl_->foreign_bytes.store(bytes, std::memory_order_relaxed);  // no lock: read once per allocation
}

std::size_t Pool::limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return config_.limit_bytes;
}

void Pool::set_trace_capacity(std::size_t entries) {
  std::lock_guard<std::mutex> lock(mutex_);
  impl_->ring.set_capacity(entries);
  config_.trace_capacity = entries;
}

void Pool::clear_trace() {
  std::lock_guard<std::mutex> lock(mutex_);
  impl_->ring.clear();
}

PoolSnapshot Pool::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return impl_->snapshot();
}

std::size_t Pool::block_size(Addr addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Block* b = impl_->live.find(addr);
  return b ? b->size : 0;
}

Pool::Usage Pool::usage() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::int64_t allocated = impl_->hot_[kStatAll].allocated_bytes.current();  // Note [Hot gauges]
  return Usage{static_cast<std::size_t>(std::max<std::int64_t>(0, allocated)),
               impl_->mapped_bytes[0] + impl_->mapped_bytes[1]};
}

std::string Pool::check_invariants() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return impl_->check_invariants();
}

}  // namespace torchmem
