// aliases.cpp: same-stream alias reclaim and lazy (pending) unmaps.
//
// Note [Alias reclaim]
// On a GPU the host runs far ahead of the device: a granule freed moments ago
// almost never has a completed fence when the pool looks for one to stitch,
// so without this the pool creates a new granule and held memory grows to
// the virtual high-water mark (measured on an H200: 1.07 / 1.15 of peak
// requested, against 1.002 in a replay whose events complete at once).
// A granule freed on stream S, and touched by frees of no other stream since
// its handle was mapped there (Granule::owner), may serve a request on S at
// once: its handle is mapped at the new address too (CUDA allows one physical
// allocation at two virtual addresses), and stream order runs the new block's
// kernels after the old ones. The old address becomes "pending unmap": for
// the pool it is unmapped (not reclaimable, not counted in reserved bytes,
// its handle counted once at the new place), but the backend mapping stays
// until the fence of the granule's last free completed, because unmapping is
// a host operation that queued kernels would not survive.
//   - Pending unmaps are finished lazily: in the slow path of allocate (when
//     granules are acquired) and by release_cached, which waits for all of
//     them; the destructor waits too. Never on the cached fast path.
//   - Mapping at a pending address (or releasing its handle) first finishes
//     its unmap, waiting for the fence if needed. To keep that rare, a best
//     fit that would map over a pending place whose fence is still running
//     gives way to the next best fit that would not (slow path only: a fit
//     with every granule mapped never looks at pending places).
//   - A handle has at most one pending place: a granule whose handle is
//     still pending elsewhere is aliased only once that place is unmapped.
//   - Small-heap granules are never aliased: small blocks come and go so
//     fast that their pages were needed again before the device caught up,
//     making the pool wait (replays under lag: most forced waits, for a
//     ratio gain of under 0.5%).
//   - Requests on another stream keep the old rule (completed fence needed):
//     their kernels are not ordered after the old ones.
#include <algorithm>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Granule;
using detail::GranuleRef;
using detail::Heap;

namespace {
// How many ineligible granules (small heap, touched by another stream, or
// whose handle is still pending elsewhere) pop_aliasable looks past before
// giving up.
constexpr std::size_t kMaxAliasSkips = 64;
// How many best-fit candidates a refit away from pending places looks at.
constexpr std::size_t kMaxRefitCandidates = 32;
}  // namespace

std::vector<GranuleRef> Pool::Impl::pop_aliasable(std::uint32_t slot, std::size_t count) {
  std::vector<GranuleRef> out;
  std::size_t skipped = 0;
  for (GranuleRef r = slots[slot].head; !r.empty() && out.size() < count;) {
    Granule& g = granule(r);
    const GranuleRef next = g.next;
    bool ok = g.owner == slot && !heaps[r.heap]->small;
    if (ok) {
      auto it = stale_at.find(g.handle);
      // Its handle is still pending at another place: unmap that one first
      // if it may go now, else leave this granule alone.
      if (it != stale_at.end()) ok = resolve_stale(it->second, /*wait=*/false);
    }
    if (ok) {
      list_remove(r);
      out.push_back(r);
    } else if (++skipped > kMaxAliasSkips) {
      break;
    }
    r = next;
  }
  return out;
}

void Pool::Impl::unpop_aliasable(const std::vector<GranuleRef>& refs) {
  // Back at the front, in their old order (they were the oldest of the list).
  for (std::size_t i = refs.size(); i-- > 0;) list_push(granule(refs[i]).slot, refs[i], /*front=*/true);
}

GranuleHandle Pool::Impl::make_stale(GranuleRef ref) {
  Heap& heap = *heaps[ref.heap];
  Granule& g = heap.granules[ref.index];
  // Make sure a fence covering the free is recorded, so that the pending
  // unmap can be finished by polling it later.
  fence_done(g.slot, g.seq, /*may_record=*/true);
  const GranuleHandle h = g.handle;
  g.stale = h;
  g.stale_slot = g.slot;
  g.stale_seq = g.seq;
  g.handle = 0;
  g.owner = 0;
  --heap.mapped;
  ++heap.stale;
  memory_dirty = true;
  mapped_bytes[heap.small ? 0 : 1] -= gran;
  stale_at[h] = ref;
  pending_unmaps.push_back(PendingUnmap{ref, h, g.seq});
  // For the pool the granule is unmapped now; the backend call comes later.
  trace(TraceAction::kSegmentUnmap, heap.base + std::size_t{ref.index} * gran, gran, 0, heap.pool, 0);
  return h;
}

bool Pool::Impl::pending_blocks(const Heap& heap, Addr addr, std::size_t size) {
  const std::size_t g0 = first_granule(heap, addr);
  const std::size_t g1 = std::min(end_granule(heap, addr + size), heap.granules.size());
  for (std::size_t i = g0; i < g1; ++i) {
    const Granule& g = heap.granules[i];
    if (g.stale && !fence_done(g.stale_slot, g.stale_seq, /*may_record=*/false)) return true;
  }
  return false;
}

detail::Block* Pool::Impl::find_fit_unblocked(Heap& heap, std::size_t size, StreamId stream) {
  std::size_t looked = 0;
  bool found = false;
  detail::Block* b = heap.free.best_fit(size, [&](detail::Block* c) {
    found = reusable(*c, stream) && !pending_blocks(heap, c->addr, size);
    return found || ++looked > kMaxRefitCandidates;
  });
  return found ? b : nullptr;
}

void Pool::Impl::wait_fence(std::uint32_t slot, std::uint64_t q) {
  if (fence_done(slot, q, /*may_record=*/true)) return;
  detail::StreamSlot& s = slots[slot];
  // fence_done recorded a fence covering q if none did; wait for the oldest
  // fences in order until one covers q.
  while (!s.fences.empty() && s.completed_seq < q) {
    const detail::Fence f = s.fences.front();
    s.fences.pop_front();
    backend.synchronize_event(f.event);
    s.completed_seq = std::max(s.completed_seq, f.seq);
    backend.destroy_event(f.event);
  }
}

bool Pool::Impl::resolve_stale(GranuleRef ref, bool wait) {
  Heap& heap = *heaps[ref.heap];
  Granule& g = heap.granules[ref.index];
  if (!g.stale) return true;
  if (wait) {
    wait_fence(g.stale_slot, g.stale_seq);
  } else if (!fence_done(g.stale_slot, g.stale_seq, /*may_record=*/false)) {
    return false;
  }
  backend.unmap(heap.base + std::size_t{ref.index} * gran, 1);
  stale_at.erase(g.stale);
  g.stale = 0;
  --heap.stale;
  return true;
}

void Pool::Impl::process_pending_unmaps(bool wait) {
  if (pending_unmaps.empty()) return;
  // Finished entries whose fences completed, in runs of consecutive granules
  // (one backend call per run); the rest stays in order.
  std::vector<GranuleRef> done;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending_unmaps.size(); ++i) {
    const PendingUnmap& e = pending_unmaps[i];
    if (!heaps[e.ref.heap]) continue;  // cannot happen: a heap with pending places is not dropped
    Granule& g = granule(e.ref);
    if (g.stale != e.handle || g.stale_seq != e.seq) continue;  // resolved already
    bool ready;
    if (wait) {
      wait_fence(g.stale_slot, g.stale_seq);
      ready = true;
    } else {
      ready = fence_done(g.stale_slot, g.stale_seq, /*may_record=*/false);
    }
    if (ready) {
      done.push_back(e.ref);
    } else {
      pending_unmaps[kept++] = e;
    }
  }
  pending_unmaps.resize(kept);
  if (done.empty()) return;
  std::sort(done.begin(), done.end(), [](const GranuleRef& a, const GranuleRef& b) {
    return a.heap != b.heap ? a.heap < b.heap : a.index < b.index;
  });
  for (std::size_t i = 0; i < done.size();) {
    std::size_t j = i + 1;
    while (j < done.size() && done[j].heap == done[i].heap && done[j].index == done[j - 1].index + 1) ++j;
    Heap& heap = *heaps[done[i].heap];
    backend.unmap(heap.base + std::size_t{done[i].index} * gran, j - i);
    for (std::size_t k = i; k < j; ++k) {
      Granule& g = heap.granules[done[k].index];
      stale_at.erase(g.stale);
      g.stale = 0;
    }
    heap.stale -= j - i;
    i = j;
  }
  if (released_pools) maybe_drop_released_pools();
}

}  // namespace torchmem
