// inspect.cpp: read-only views of the pool: check_invariants(), snapshot(),
// the largest free block and what backs a live block (Note [Block backing]).
//
// check_invariants() recomputes everything the pool keeps incrementally
// (tiling, merges, granule use counts, reclaimable lists, held bytes, stats)
// from the blocks themselves and reports the first disagreement. It is O(size
// of the pool) and meant for tests and debug builds.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <unordered_set>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Block;
using detail::Granule;
using detail::GranuleRef;
using detail::Heap;

namespace {

std::string where(const Heap& h) {
  return std::string(h.small ? "small" : "large") + " heap of pool " + std::to_string(h.pool);
}

}  // namespace

std::string Pool::Impl::check_invariants() const {
  std::ostringstream err;
  std::size_t live_count = 0, pending_count = 0, free_count[2] = {0, 0};
  std::size_t alloc_bytes[2] = {0, 0}, active_bytes[2] = {0, 0}, requested_bytes[2] = {0, 0};
  std::size_t active_blocks[2] = {0, 0};
  std::size_t held_seen = 0;
  std::unordered_set<GranuleHandle> handles, stale_handles;
  std::size_t free_runs_seen = 0;
  std::size_t stale_places = 0;
  std::unordered_set<const Block*> pending;
  for (const Deferred& d : deferred) pending.insert(d.block);

  // Walks one tiled range [lo, hi) starting at `first`; returns false on error.
  auto walk = [&](const Heap& h, const Block* first, Addr lo, Addr hi,
                  std::vector<std::uint32_t>* counts) -> bool {
    const int kind = h.small ? 0 : 1;
    Addr at = lo;
    const Block* prev = nullptr;
    for (const Block* b = first; b; prev = b, b = b->next) {
      if (b->prev != prev) { err << where(h) << ": block " << hex(b->addr) << " has a wrong prev link"; return false; }
      if (b->addr != at) { err << where(h) << ": gap or overlap at " << hex(at) << " (next block at " << hex(b->addr) << ")"; return false; }
      if (b->size == 0 || b->size % kMinBlockSize) { err << where(h) << ": block " << hex(b->addr) << " has size " << b->size; return false; }
      if (b->heap != &h) { err << where(h) << ": block " << hex(b->addr) << " names another heap"; return false; }
      const bool in_set = h.holds_free(b);
      if (b->is_free()) {
        if (prev && prev->is_free()) { err << where(h) << ": adjacent free blocks at " << hex(prev->addr) << " and " << hex(b->addr) << " were not merged"; return false; }
        if (!in_set) { err << where(h) << ": free block " << hex(b->addr) << " is missing from the free set"; return false; }
        ++free_count[kind];
      } else {
        if (in_set) { err << where(h) << ": live block " << hex(b->addr) << " is in the free set"; return false; }
        if (b->state == BlockState::kAllocated) {
          if (live.find(b->addr) != b) { err << where(h) << ": allocated block " << hex(b->addr) << " is not in the live map"; return false; }
          ++live_count;
          alloc_bytes[kind] += b->size;
          requested_bytes[kind] += b->requested;
        } else {
          if (!pending.count(b)) { err << where(h) << ": pending block " << hex(b->addr) << " is not on the deferred list"; return false; }
          ++pending_count;
        }
        active_bytes[kind] += b->size;
        ++active_blocks[kind];
        if (counts) {
          for (std::size_t i = first_granule(h, b->addr); i < end_granule(h, b->end()); ++i) {
            if (i >= counts->size() || !h.granules[i].handle) { err << where(h) << ": live block " << hex(b->addr) << " covers unmapped granule " << i; return false; }
            ++(*counts)[i];
          }
        }
      }
      at = b->end();
    }
    if (at != hi) { err << where(h) << ": blocks end at " << hex(at) << ", not at the range end " << hex(hi); return false; }
    return true;
  };

  for (const auto& hp : heaps) {
    if (!hp) continue;
    const Heap& h = *hp;
    const std::size_t before = free_count[h.small ? 0 : 1];
    if (vmm) {
      std::vector<std::uint32_t> counts(h.granules.size(), 0);
      if (!walk(h, h.first, h.base, h.base + h.span, &counts)) return err.str();
      std::size_t mapped = 0, stale = 0;
      for (std::size_t i = 0; i < h.granules.size(); ++i) {
        const Granule& g = h.granules[i];
        if (g.stale) {
          // Note [Pending unmaps]: a pending place holds a handle that is
          // live at exactly one other place (and maybe pending at others).
          ++stale;
          ++stale_places;
          if (g.handle) { err << where(h) << ": granule " << i << " is mapped and pending unmap at once"; return err.str(); }
          stale_handles.insert(g.stale);
          const GranuleRef here{h.id, static_cast<std::uint32_t>(i)};
          auto [first, last] = stale_at.equal_range(g.stale);
          if (std::none_of(first, last, [&](const auto& e) { return e.second == here; })) { err << where(h) << ": pending-unmap granule " << i << " is missing from the handle index"; return err.str(); }
        }
        if (h.base + (i + 1) * gran <= h.pins_lazy_below) {
          // Note [Lazy pins]: no counts below the line, which only a wholly mapped footprint has.
          if (!g.handle || g.run_count) { err << where(h) << ": granule " << i << " lies below the lazy-pins line but is " << (g.handle ? "part of a run" : "unmapped"); return err.str(); }
        } else if (g.live != counts[i]) { err << where(h) << ": granule " << i << " counts " << g.live << " live blocks, found " << counts[i]; return err.str(); }
        if (g.handle) {
          ++mapped;
          const bool run_head = g.run_count && g.run_first == i;
          if ((!g.run_count || run_head) && !handles.insert(g.handle).second) { err << "granule handle " << g.handle << " is mapped twice"; return err.str(); }
        }
        if (g.run_count) {
          // Note [Run handles]: the run's granules share its handle, lie
          // inside it, and its first granule counts the busy ones.
          const Granule& head = g.run_first < h.granules.size() ? h.granules[g.run_first] : g;
          if (!g.handle || g.run_first > i || i >= std::size_t{g.run_first} + g.run_count || head.handle != g.handle || head.run_count != g.run_count) { err << where(h) << ": granule " << i << " is not a consistent part of its run"; return err.str(); }
          if (g.run_first == i) {
            std::uint32_t busy = 0;
            for (std::size_t k = i; k < i + g.run_count && k < h.granules.size(); ++k) busy += h.granules[k].live > 0;
            if (busy != g.run_busy) { err << where(h) << ": run at granule " << i << " counts " << g.run_busy << " busy granules, found " << busy; return err.str(); }
            if (busy == 0) ++free_runs_seen;
          }
        }
        const bool reclaimable = g.handle && g.live == 0 && !h.frozen && !g.run_count;
        if (g.on_list != reclaimable) { err << where(h) << ": granule " << i << (reclaimable ? " is reclaimable but not listed" : " is listed but not reclaimable"); return err.str(); }
      }
      if (mapped != h.mapped) { err << where(h) << ": " << mapped << " granules mapped, tally says " << h.mapped; return err.str(); }
      if (stale != h.stale) { err << where(h) << ": " << stale << " granules pending unmap, tally says " << h.stale; return err.str(); }
      held_seen += mapped * gran;
    } else {
      std::size_t bytes = 0;
      for (const auto& s : h.segments) {
        if (!walk(h, s->first, s->addr, s->addr + s->size, nullptr)) return err.str();
        for (const Block* b = s->first; b; b = b->next) {
          if (b->segment != s.get()) { err << where(h) << ": block " << hex(b->addr) << " names another segment"; return err.str(); }
        }
        bytes += s->size;
      }
      if (bytes != h.segment_bytes) { err << where(h) << ": segments hold " << bytes << " bytes, tally says " << h.segment_bytes; return err.str(); }
      held_seen += bytes;
    }
    if (h.arena) {
      // Note [Step plan arena]: its address index holds exactly its free blocks.
      std::size_t indexed = 0;
      for (const Block* b = h.first; b; b = b->next) {
        if (!b->is_free()) continue;
        if (!h.free_by_addr.holds(b)) { err << where(h) << ": arena free block " << hex(b->addr) << " is missing from its address index"; return err.str(); }
        ++indexed;
      }
      if (indexed != h.free_by_addr.size()) { err << where(h) << ": arena address index has " << h.free_by_addr.size() << " entries for " << indexed << " free blocks"; return err.str(); }
    }
    if (free_count[h.small ? 0 : 1] - before != h.free_count()) {
      err << where(h) << ": free set has " << h.free_count() << " blocks, the range has " << free_count[h.small ? 0 : 1] - before;
      return err.str();
    }
  }
  // Reclaimable lists.
  for (std::uint32_t s = 0; s < slots.size(); ++s) {
    std::size_t n = 0;
    GranuleRef prev;
    for (GranuleRef r = slots[s].head; !r.empty();) {
      const Granule& g = heaps[r.heap]->granules[r.index];
      if (!g.on_list || g.slot != s || !(g.prev == prev)) { err << "reclaimable list of stream slot " << s << " is corrupt at granule " << r.index; return err.str(); }
      prev = r;
      r = g.next;
      if (++n > slots[s].listed) break;
    }
    if (n != slots[s].listed) { err << "reclaimable list of stream slot " << s << " has " << n << " granules, tally says " << slots[s].listed; return err.str(); }
  }
  if (stale_places != stale_at.size()) { err << stale_at.size() << " places indexed as pending unmap, " << stale_places << " found"; return err.str(); }
  for (GranuleHandle sh : stale_handles) {
    if (!handles.count(sh)) { err << "granule handle " << sh << " is pending unmap but mapped at no live place"; return err.str(); }
  }
  std::size_t pending_live = 0;
  for (const PendingUnmap& e : pending_unmaps) pending_live += still_pending(e);
  if (pending_live != stale_places) { err << pending_live << " pending unmaps queued, " << stale_places << " places pending"; return err.str(); }
  if (pending_unmaps.size() > pending_compact_at) { err << pending_unmaps.size() << " pending unmaps queued, more than the " << pending_compact_at << " that compact the queue"; return err.str(); }
  if (free_runs_seen != free_runs) { err << free_runs_seen << " free runs found, tally says " << free_runs; return err.str(); }
  if (held_seen != held) { err << "the pool holds " << held_seen << " bytes, tally says " << held; return err.str(); }
  if (live_count != live.size()) { err << live.size() << " blocks in the live map, " << live_count << " in the heaps"; return err.str(); }
  if (pending_count != deferred.size()) { err << deferred.size() << " deferred frees, " << pending_count << " pending blocks"; return err.str(); }
  if (active_bytes[0] + active_bytes[1] != active_total) { err << "active bytes " << active_bytes[0] + active_bytes[1] << ", tally says " << active_total; return err.str(); }
  for (int k = 0; k < 2; ++k) {
    if (free_count[k] != free_blocks[k]) { err << "free block tally of kind " << k << " is " << free_blocks[k] << ", found " << free_count[k]; return err.str(); }
  }
  // Stats equal sums.
  const int kinds[2] = {kStatSmallPool, kStatLargePool};
  // A copy with the hot gauges in it (Note [Hot gauges]): stats_'s own are stale.
  PoolStats now = stats_;
  hot_into(now);
  auto expect = [&](const char* name, const Stat* stat, const std::size_t* per_kind) -> bool {
    for (int j = 0; j < 2; ++j) {
      if (stat[kinds[j]].current != static_cast<std::int64_t>(per_kind[j])) {
        err << "stat " << name << "[" << (j ? "large_pool" : "small_pool") << "].current = " << stat[kinds[j]].current << ", expected " << per_kind[j];
        return false;
      }
    }
    if (stat[kStatAll].current != static_cast<std::int64_t>(per_kind[0] + per_kind[1])) {
      err << "stat " << name << "[all].current = " << stat[kStatAll].current << ", expected " << per_kind[0] + per_kind[1];
      return false;
    }
    return true;
  };
  std::size_t alloc_blocks[2] = {0, 0};
  live.for_each([&](Addr, const Block* b) { ++alloc_blocks[b->heap->small ? 0 : 1]; });
  if (!expect("allocation", now.allocation, alloc_blocks)) return err.str();
  if (!expect("allocated_bytes", now.allocated_bytes, alloc_bytes)) return err.str();
  if (!expect("requested_bytes", now.requested_bytes, requested_bytes)) return err.str();
  if (!expect("active", now.active, active_blocks)) return err.str();
  if (!expect("active_bytes", now.active_bytes, active_bytes)) return err.str();
  if (!expect("reserved_bytes", now.reserved_bytes, mapped_bytes)) return err.str();
  return "";
}

// Note [Map groups] PyTorch's allocator shows one segment per cudaMalloc, and
// its tools and tests count segments (a CUDA graph's pool holds one per large
// allocation it grew by). A mapped run of granules is one stretch of address
// space, but it was mapped by several growths. Each growth (one request's
// holes, a reservation) tags the granules it maps with a group, and a
// snapshot shows a run as one segment per group, split at every group
// boundary that no live block crosses (a free block there is shown in two
// pieces). A block served across a boundary (the tail of one growth and the
// next) holds its groups together, as an expandable segment would.
std::vector<std::pair<Addr, Addr>> Pool::Impl::map_group_pieces(const Heap& h, std::size_t first, std::size_t end,
                                                                const Block* b) const {
  std::vector<std::pair<Addr, Addr>> pieces;
  Addr lo = h.base + first * gran;
  for (std::size_t k = first + 1; k < end; ++k) {
    if (h.granules[k].group == h.granules[k - 1].group) continue;
    const Addr cut = h.base + k * gran;
    while (b && b->end() <= cut) b = b->next;
    const bool crossed = b && b->addr < cut && !b->is_free();  // a live block spans the cut
    if (crossed) continue;
    pieces.emplace_back(lo, cut);
    lo = cut;
  }
  pieces.emplace_back(lo, h.base + end * gran);
  return pieces;
}

PoolSnapshot Pool::Impl::snapshot() const {
  PoolSnapshot snap;
  auto info = [](const Block* b, Addr lo, Addr hi) {
    BlockInfo bi;
    bi.addr = lo;
    bi.size = hi - lo;
    bi.state = b->state;
    const bool is_live = !b->is_free();
    bi.requested = b->requested;  // a free block's is its last request, as in PyTorch's snapshots
    bi.stream = is_live ? b->stream : 0;
    bi.context = is_live ? b->context : 0;
    return bi;
  };
  for (const auto& hp : heaps) {
    if (!hp) continue;
    const Heap& h = *hp;
    if (vmm) {
      const Block* b = h.first;
      for (std::size_t i = 0; i < h.granules.size();) {
        if (!h.granules[i].handle) {
          ++i;
          continue;
        }
        std::size_t j = i;
        while (j < h.granules.size() && h.granules[j].handle) ++j;
        while (b && b->end() <= h.base + i * gran) b = b->next;
        for (const auto& [lo, hi] : map_group_pieces(h, i, j, b)) {
          SegmentInfo seg{lo, hi - lo, h.small, h.pool, 0, {}};
          while (b && b->end() <= lo) b = b->next;
          for (const Block* c = b; c && c->addr < hi; c = c->next) {
            seg.blocks.push_back(info(c, std::max(c->addr, lo), std::min(c->end(), hi)));
            if (!c->is_free() && seg.stream == 0) seg.stream = c->stream;
          }
          snap.segments.push_back(std::move(seg));
        }
        i = j;
      }
    } else {
      for (const auto& s : h.segments) {
        SegmentInfo seg{s->addr, s->size, h.small, h.pool, 0, {}};
        for (const Block* c = s->first; c; c = c->next) {
          seg.blocks.push_back(info(c, c->addr, c->end()));
          if (!c->is_free() && seg.stream == 0) seg.stream = c->stream;
        }
        snap.segments.push_back(std::move(seg));
      }
    }
  }
  std::sort(snap.segments.begin(), snap.segments.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.addr < b.addr; });
  snap.trace = ring.entries();
  return snap;
}

std::size_t Pool::Impl::largest_free_block() const {
  std::size_t best = 0;
  for (const auto& hp : heaps) {
    if (!hp) continue;
    const Heap& h = *hp;
    auto visit = [&](const Block* b) {
      if (b->size <= best) return false;
      if (!vmm) {
        best = b->size;
        return false;
      }
      // The longest mapped stretch inside the block.
      const std::size_t g0 = first_granule(h, b->addr);
      const std::size_t g1 = std::min(end_granule(h, b->end()), h.granules.size());
      for (std::size_t i = g0; i < g1;) {
        if (!h.granules[i].handle) {
          ++i;
          continue;
        }
        std::size_t j = i;
        while (j < g1 && h.granules[j].handle) ++j;
        const Addr lo = std::max(b->addr, h.base + i * gran);
        const Addr hi = std::min(b->end(), h.base + j * gran);
        best = std::max(best, static_cast<std::size_t>(hi - lo));
        i = j;
      }
      return true;
    };
    if (h.arena) {  // Note [Arena free set]: by address, so every block is seen
      h.free_by_addr.for_each(visit);
    } else {
      h.free.for_each_descending(visit);
    }
  }
  return best;
}

BlockBacking Pool::Impl::backing_of(Addr addr) const {
  const Block* b = live.find(addr);
  if (b == nullptr) {
    throw PoolError("torchmem: " + hex(addr) + " is not the start of a live block of this pool (was it freed, "
                    "or allocated by another allocator?)");
  }
  BlockBacking out{b->addr, b->size, {}};
  if (!vmm) {
    out.pieces.push_back(BackingPiece{b->segment->addr, b->segment->size, 0});
    return out;
  }
  const Heap& h = *b->heap;
  const std::size_t end = end_granule(h, b->end());
  for (std::size_t g = first_granule(h, b->addr); g < end;) {
    const Granule& granule = h.granules[g];
    // A run maps whole: its piece starts at its first granule, which may lie before the block.
    const std::size_t first = granule.run_count > 0 ? granule.run_first : g;
    const std::size_t count = granule.run_count > 0 ? granule.run_count : 1;
    out.pieces.push_back(BackingPiece{h.base + (first << gran_shift), count << gran_shift, granule.handle});
    g = first + count;
  }
  return out;
}

BlockBacking Pool::backing_of(Addr addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return impl_->backing_of(addr);
}

}  // namespace torchmem
