// aliases.cpp: stitching without unmapping: alias reclaim, pending unmaps
// and the device barrier that finally retires them.
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
// kernels after the old ones. Requests on another stream keep the rule of
// reclaimable granules (the free's fence completed): their kernels are not
// ordered after the old ones. Small-heap granules are never aliased: small
// blocks come and go so fast that their pages were needed again before the
// device caught up (replays under lag: most forced waits, for a ratio gain
// of under 0.5%).
//
// Note [Pending unmaps]
// Every stitch, aliased or not, leaves the old address "pending unmap": for
// the pool it is unmapped (not reclaimable, not counted in reserved bytes,
// the handle counted once, at its new place), but the backend mapping stays
// until a device barrier (Note [Device barrier] in pool.h) began after the
// granule's last free. A fence on the free's own stream is not enough: a
// kernel on another stream may still read the old address (a tensor freed
// without record_stream), and unmapping under it is an illegal-address fault
// that kills the process, where PyTorch's allocator would at worst give a
// stale read. With the old mapping kept, such a kernel reads the same
// physical bytes the new block now owns: PyTorch's stale read, no fault.
//   - A barrier is taken only when needed: release_cached (empty_cache, the
//     OOM ladder), the destructor, and mapping at a pending address. To keep
//     the last one rare, a best fit that would map over a pending place gives
//     way to the next best fit that would not (slow path only: a fit with
//     every granule mapped never looks at pending places).
//   - A place behind a barrier does not block a fit, and is unmapped when a
//     mapping needs its address, not before: the old mapping costs no
//     memory (its handle is counted at its new place), and unmapping every
//     place after the one barrier a request needed would cost a call per
//     granule stitched so far (a whole warm-up's stitching, once its growth
//     ended), most of them for addresses nothing maps again. release_cached
//     and the destructor retire them all; so does the slow path while a
//     released pool waits for its heap to empty.
//   - The list of places drops entries resolved on demand once it has grown
//     to twice its size after the last such pass (compact_pending_unmaps),
//     so it stays proportional to the places still pending.
//   - One handle may be pending at several places (CUDA allows any number of
//     mappings); releasing a handle retires all of them first.
//   - While a CUDA graph captures, the backend refuses barriers: pending
//     places stay, and the pool creates or fails rather than unmap.
#include <algorithm>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Granule;
using detail::GranuleRef;
using detail::Heap;

namespace {
// How many ineligible granules (small heap, touched by another stream)
// pop_aliasable looks past before giving up.
constexpr std::size_t kMaxAliasSkips = 64;
// How many best-fit candidates a refit away from pending places looks at.
constexpr int kMaxRefitCandidates = 33;
}  // namespace

std::vector<GranuleRef> Pool::Impl::pop_aliasable(std::uint32_t slot, std::size_t count) {
  std::vector<GranuleRef> out;
  std::size_t skipped = 0;
  for (GranuleRef r = slots[slot].head; !r.empty() && out.size() < count;) {
    Granule& g = granule(r);
    const GranuleRef next = g.next;
    if (g.owner == slot && !heaps[r.heap]->small) {
      list_remove(r);
      out.push_back(r);
    } else if (++skipped > kMaxAliasSkips) {
      break;
    }
    r = next;
  }
  return out;
}

void Pool::Impl::unpop_granules(const std::vector<GranuleRef>& refs) {
  // Back at the front, in their old order (they were the oldest of the list).
  for (std::size_t i = refs.size(); i-- > 0;) list_push(granule(refs[i]).slot, refs[i], /*front=*/true);
}

GranuleHandle Pool::Impl::make_stale(GranuleRef ref) {
  Heap& heap = *heaps[ref.heap];
  Granule& g = heap.granules[ref.index];
  const GranuleHandle h = g.handle;
  g.stale = h;
  g.stale_seq = g.seq;
  g.handle = 0;
  g.owner = 0;
  --heap.mapped;
  ++heap.stale;
  memory_dirty = true;
  mapped_bytes[heap.small ? 0 : 1] -= gran;
  stale_at.emplace(h, ref);
  if (pending_unmaps.size() >= pending_compact_at) compact_pending_unmaps();
  pending_unmaps.push_back(PendingUnmap{ref, h, g.seq});
  // For the pool the granule is unmapped now; the backend call comes later.
  trace(TraceAction::kSegmentUnmap, heap.base + std::size_t{ref.index} * gran, gran, 0, heap.pool, op_context);
  return h;
}

bool Pool::Impl::pending_blocks(const Heap& heap, Addr addr, std::size_t size) {
  const std::size_t g0 = first_granule(heap, addr);
  const std::size_t g1 = std::min(end_granule(heap, addr + size), heap.granules.size());
  for (std::size_t i = g0; i < g1; ++i) {
    const Granule& g = heap.granules[i];
    if (pending_place(g)) return true;
  }
  return false;
}

detail::Block* Pool::Impl::find_fit_unblocked(Heap& heap, std::size_t size, StreamId stream) {
  return best_fit_where(
      heap, size, [&](const detail::Block& c) { return reusable(c, stream) && !pending_blocks(heap, c.addr, size); },
      nullptr, kMaxRefitCandidates);
}

bool Pool::Impl::device_barrier() {
  if (!backend.synchronize_device()) return false;
  ++stats_.num_device_barriers;
  barrier_seq = seq;
  // Every stream finished everything queued so far: every fence is done.
  for (detail::StreamSlot& s : slots) {
    for (const detail::Fence& f : s.fences) backend.destroy_event(f.event);
    s.fences.clear();
    s.completed_seq = seq;
  }
  return true;
}

void Pool::Impl::forget_stale(GranuleRef ref, GranuleHandle handle) {
  auto [first, last] = stale_at.equal_range(handle);
  for (auto it = first; it != last; ++it) {
    if (it->second == ref) {
      stale_at.erase(it);
      return;
    }
  }
}

bool Pool::Impl::resolve_stale(GranuleRef ref, bool wait) {
  Heap& heap = *heaps[ref.heap];
  Granule& g = heap.granules[ref.index];
  if (!g.stale) return true;
  if (!behind_barrier(g.stale_seq) && !(wait && device_barrier())) return false;
  vmm_ops->unmap(heap.base + std::size_t{ref.index} * gran, 1);
  forget_stale(ref, g.stale);
  g.stale = 0;
  --heap.stale;
  return true;
}

void Pool::Impl::compact_pending_unmaps() {
  // Resolved entries go; order and the rest stay.
  pending_unmaps.erase(std::remove_if(pending_unmaps.begin(), pending_unmaps.end(),
                                      [&](const PendingUnmap& e) { return !still_pending(e); }),
                       pending_unmaps.end());
  pending_compact_at = std::max(kMinPendingCompact, 2 * pending_unmaps.size());
}

void Pool::Impl::process_pending_unmaps(bool wait) {
  if (pending_unmaps.empty()) return;
  if (wait && pending_unmaps.back().seq > barrier_seq) device_barrier();
  // Every entry was made after the barrier in force then (retire_places
  // unmaps at once what is behind it), so with no barrier since the last
  // pass nothing can go: skip the walk (the slow path calls this often, and
  // the list grows between barriers).
  if (barrier_seq == pending_checked_at) return;
  pending_checked_at = barrier_seq;
  // Entries behind the barrier go now, in runs of consecutive granules (one
  // backend call per run); the rest stays in order.
  std::vector<GranuleRef> done;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending_unmaps.size(); ++i) {
    const PendingUnmap& e = pending_unmaps[i];
    if (!still_pending(e)) continue;
    if (behind_barrier(e.seq)) {
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
    vmm_ops->unmap(heap.base + std::size_t{done[i].index} * gran, j - i);
    for (std::size_t k = i; k < j; ++k) {
      Granule& g = heap.granules[done[k].index];
      forget_stale(done[k], g.stale);
      g.stale = 0;
    }
    heap.stale -= j - i;
    i = j;
  }
  if (released_pools) maybe_drop_released_pools();
}

}  // namespace torchmem
