// placement.cpp: where a block goes when its best fit misses granules: the
// allocation's slow-path choices between fits (stream order, pending places)
// and, with backed_fit, windows inside them (Note [Backed placement]).
//
// Kept apart from granules.cpp (how granules are pinned, found and mapped)
// and from carve.cpp (the fast path): nothing here runs on a cached hit.
#include <algorithm>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Granule;
using detail::Heap;

Addr Pool::Impl::place_missing(Heap& heap, detail::Block** fit, std::size_t size, StreamId stream,
                               std::size_t* missing) {
  // Note [Cross-stream reuse]: with no limit, the fit's missing granules
  // would be new memory; memory another stream cached comes first.
  if (config.stream_order && config.limit_bytes == 0) {
    if (detail::Block* other = find_backed_fit_ordered(heap, size, stream)) {
      *fit = refit(heap, (*fit)->addr, other, size, missing);
    }
  }
  // Note [Backed placement]: a window inside a fit, found before anything is
  // split (a request that then fails leaves the free blocks as it found them).
  Addr at = (*fit)->addr;
  if (*missing && config.backed_fit && config.limit_bytes && !heap.small) {
    at = place_on_backing(heap, fit, size, stream, missing);
  }
  if (*missing && heap.stale && pending_blocks(heap, at, size)) {
    // Note [Alias reclaim]: mapping there would wait for the device; take
    // another fit that needs no wait if there is one.
    if (detail::Block* other = find_fit_unblocked(heap, size, stream)) {
      *fit = refit(heap, at, other, size, missing);
      at = (*fit)->addr;
    }
  }
  return at;
}

detail::Block* Pool::Impl::refit(Heap& heap, Addr from, detail::Block* to, std::size_t size, std::size_t* missing) {
  unpin(heap, from, size, 0, 0, /*restore=*/true);
  *missing = pin(heap, to->addr, size);
  return to;
}

// Note [Backed placement]
// Rule: with backed_fit, under a limit, a best fit in the large heap that
// misses granules looks at the next kMaxBackedCandidates usable fits and,
// inside each, at both ends and every granule-aligned start between them;
// the window missing the fewest granules wins (ties: the smaller candidate,
// then its start, its top, then the lower aligned start). Windows over a
// pending place (Note [Pending unmaps]) are skipped: mapping there waits for
// the device.
// Why: at its limit the pool's free memory is mostly virtual; a best fit by
// size lands where nothing is mapped and stitches every granule (two driver
// calls each), while cached granules back another free range that would
// serve: replays of the bundled traces at 1.03-1.12x their peak make 2-5x
// fewer driver calls after warm-up, and no barrier.
// Cost: blocks placed where memory is mapped stay in islands, where
// stitching packs them end to end at the frontier; each island's end
// granules are partly free and cannot move, so churn of mixed sizes needs
// more memory (min-cap of the periodic pattern 1.04 -> 1.09x with
// stitch_above_limit 1.0, still under the expandable model's 1.19x; the
// bundled traces stay at or under 1.02x). On by default since, with shapes
// that vary, it is what keeps a pool at its limit from moving memory every
// time a new shape arrives (Note [When to stitch]).
Addr Pool::Impl::place_on_backing(Heap& heap, detail::Block** fit_in_out, std::size_t size, StreamId stream,
                                  std::size_t* missing) {
  detail::Block* fit = *fit_in_out;
  // This runs in front of driver calls (~20 us each): a scan of a few
  // thousand granule entries pays, an unbounded one would not.
  constexpr int kMaxBackedCandidates = 17;
  constexpr std::size_t kMaxScannedGranules = std::size_t{1} << 14;
  const std::size_t table = heap.granules.size();  // granules past it were never mapped
  auto unmapped = [&](std::size_t i) { return i >= table || !heap.granules[i].backed(); };
  auto blocks = [&](std::size_t i) { return i < table && pending_place(heap.granules[i]); };
  struct Count {
    std::size_t missing = 0, pending = 0;
  };
  auto count = [&](Addr at) {
    Count n;
    for (std::size_t i = first_granule(heap, at), end = end_granule(heap, at + size); i < end; ++i) {
      n.missing += unmapped(i);
      n.pending += blocks(i);
    }
    return n;
  };
  struct Place {
    detail::Block* block;
    Addr at;
    std::size_t missing;
  } best{fit, fit->addr, *missing};
  auto consider = [&](detail::Block* c, Addr at, const Count& n) {
    if (n.pending == 0 && n.missing < best.missing) best = Place{c, at, n.missing};
  };
  std::size_t scanned = 0;
  int seen = 0;
  heap.free.best_fit(size, [&](detail::Block* c) {
    if (reusable(*c, stream)) {
      const Addr top = c->end() - size;
      if (c != fit) consider(c, c->addr, count(c->addr));
      if (top != c->addr) consider(c, top, count(top));
      // Granule-aligned starts strictly inside, slid one granule at a time;
      // a window wholly past the table misses every granule (no better).
      const std::size_t w = end_granule(heap, heap.base + size);
      const std::size_t lo = first_granule(heap, c->addr) + 1;
      const std::size_t stop = std::min(first_granule(heap, top), table);
      if (lo <= stop && best.missing > 0) {
        Count n = count(heap.base + lo * gran);  // the window at lo: granules [lo, lo + w)
        for (std::size_t g0 = lo;; ++g0) {
          const Addr at = heap.base + g0 * gran;
          if (at < top) consider(c, at, n);
          if (g0 == stop || best.missing == 0) break;
          n.missing += unmapped(g0 + w);
          n.missing -= unmapped(g0);
          n.pending += blocks(g0 + w);
          n.pending -= blocks(g0);
        }
        scanned += stop - lo + w;
      }
    }
    return best.missing == 0 || ++seen >= kMaxBackedCandidates || scanned >= kMaxScannedGranules;
  });
  if (best.block == fit && best.at == fit->addr) return fit->addr;
  ++stats_.num_backed_moves;
  unpin(heap, fit->addr, size, 0, 0, /*restore=*/true);
  *missing = pin(heap, best.at, size);
  *fit_in_out = best.block;
  return best.at;
}

}  // namespace torchmem
