// runs.cpp: run handles: growing a VMM heap by one driver handle per run of
// missing granules, and giving a wholly free run back.
//
// Note [Run handles]
// Rule: with no limit (limit_bytes == 0) and held under run_below x the
// device's memory (and under the creation ceiling, Note [When to stitch]),
// each hole of kMinRunGranules (2) or more missing granules a new block needs
// is filled by one handle (grow_by_runs; Note [Run length] cuts a long hole
// into several). Above that line, under a limit and
// in a private pool, growth is a handle per granule. A run granule is never
// reclaimable; a run wholly free goes back whole (release_free_runs) on
// empty_cache, release_cached_to, and when a request finds no room otherwise
// (behind the device barrier: Note [Device barrier]).
// Why: the driver's cost follows handles, not bytes (~30 us per granule
// handle; ~0.3 us a granule in a 256-granule run), but a handle maps only
// whole, so a run's granules cannot be stitched one by one. Under a limit
// packing matters more than calls; from 2 granules, so that empty_cache churn
// (PyTorch's test_allocator_fuzz) does not create thousands of single
// granules. Cost: free space inside a partly used run stays mapped.
// Benchmarks: BENCHMARKS.md, Growth and driver calls; Memory.
//
// Note [Huge holes] A request missing kHugeRunGranules (8 GiB) or more gets
// runs even above run_below, and under a limit one handle.
// Why: granule by granule, half an H200 is ~35,000 handles (seconds; PyTorch
// takes 0.05 s); natively such a block is one segment with the same stranded
// space. Under a limit the run is not stitched while part of it is live; once
// wholly free it goes back whole when another request needs its room.
// Benchmark: BENCHMARKS.md, Growth and driver calls (huge requests).
//
// Note [Run length] With no limit, a hole longer than kMaxRunGranules (256
// MiB) is filled by runs of at most that length, or of a kMaxRunsPerHole-th
// (16th) of the hole where that is longer, all of one length (give or take a
// granule), huge holes too.
// Why: a run goes back to the device only whole, so one live block anywhere
// in it keeps all of it mapped through empty_cache. Memory is handed between
// streams (Note [Cross-stream reuse]), so a small block that outlives the
// step (a cuBLAS workspace another stream asks for) can land in the free run
// a finished op left, where PyTorch, whose blocks stay with their stream,
// takes a new segment; one run for a 2 GiB tensor then holds 2 GiB for a 32
// MiB block. Cut, a live block holds at most its own runs: 256 MiB, or a
// 16th of a larger tensor's memory. Cost: a handle (~30 us) per run, at most
// 16 more per growth (a 2 GiB tensor: ~0.2 ms more, once).
//
// Note [Runs ahead] A large heap's run shorter than kRunAheadBytes (20 MiB)
// maps on past its block over the unmapped granules that follow (up to the
// first one mapped, pending an unmap or under a block), up to 20 MiB, so the
// next blocks land there with no driver call. Only where runs are taken, never
// in the small heap (its requests take one granule).
// Why: after an empty_cache, 2-10 MiB tensors would each take a handle, where
// PyTorch's 20 MiB segments serve several per cudaMalloc. Cost: up to 18 MiB
// mapped and unused per growth, like a native segment's free tail.
// Benchmark: BENCHMARKS.md, Growth and driver calls (test_allocator_fuzz).
//
// Note [Runs under a limit] Under a limit (memory fraction, share grant) the
// pool grows granule by granule so that every cached granule can be stitched.
// run_below_limit (default 0) takes runs while held stays under that fraction
// of the limit, never with runs ahead; torchmem/runtime/config.py sets 0.5 with share,
// 0 otherwise.
// Why: a fixed limit pays its granules once, in the warm-up; a sharing
// group's limits keep moving, so its growth recurs and 0.5 halves the
// granules created, for a min-cap up to 1.0166 x peak requested.
// limit_run_granules (default 0: off) caps such a run's length (a huge hole
// stays one handle, Note [Huge holes]): a short run
// goes back whole as soon as its few granules are free, so less memory is
// stranded in runs partly in use when the pool reaches the limit.
// Benchmarks: BENCHMARKS.md, Budget regime (growth under a limit; replay at
// the budget with shapes that vary); Sharing and monitoring.
#include <algorithm>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Granule;
using detail::Heap;

namespace {
// The smallest run: a hole of one granule is a plain granule handle (Note [Run handles]).
constexpr std::size_t kMinRunGranules = 2;
}  // namespace

void Pool::Impl::cut_hole(const Hole& h, std::size_t most, std::vector<Hole>* out) {
  for (std::size_t first = 0; first < h.count; first += most) {
    out->push_back(Hole{h.first + first, std::min(most, h.count - first)});
  }
}

std::vector<Pool::Impl::Hole> Pool::Impl::cut_holes(const std::vector<Hole>& holes, std::size_t most) {
  std::vector<Hole> cut;
  for (const Hole& h : holes) cut_hole(h, most, &cut);
  return cut;
}

std::vector<Pool::Impl::Hole> Pool::Impl::cut_runs(const std::vector<Hole>& holes) {
  std::vector<Hole> cut;
  for (const Hole& h : holes) {
    const std::size_t most = std::max(kMaxRunGranules, (h.count + kMaxRunsPerHole - 1) / kMaxRunsPerHole);
    // Runs of even length: no short last run for Note [Runs ahead] to stretch.
    const std::size_t runs = (h.count + most - 1) / most;
    cut_hole(h, (h.count + runs - 1) / runs, &cut);
  }
  return cut;
}

std::size_t Pool::Impl::run_ahead(const Heap& heap, const Hole& last, std::size_t block_end, std::size_t most) const {
  // Only a hole that reaches the block's last granule can go on past it.
  if (last.first + last.count != block_end) return 0;
  const std::size_t want = (kRunAheadBytes + gran - 1) / gran;
  if (last.count >= want) return 0;
  const std::size_t stop = std::min(heap.span / gran, block_end + std::min(most, want - last.count));
  std::size_t ahead = 0;
  for (std::size_t i = block_end; i < stop; ++i, ++ahead) {
    if (i < heap.granules.size()) {
      const Granule& g = heap.granules[i];
      // Mapped, pending an unmap or under a block: the run stops here.
      if (g.handle || g.stale || g.live) break;
    }
  }
  return ahead;
}

bool Pool::Impl::grow_by_runs(Heap& heap, const std::vector<Hole>& block_holes, std::size_t missing,
                              std::size_t ahead) {
  // A hole of kMinRunGranules or more gets one run handle; a single missing
  // granule gets a plain granule handle (a run is two granules or more).
  struct Grown {
    Hole hole;
    std::size_t ahead = 0;               // of hole.count, the granules past the block (Note [Runs ahead])
    std::vector<GranuleHandle> handles;  // one (a run) or hole.count
    bool run() const { return hole.count >= kMinRunGranules; }
  };
  std::vector<Grown> holes;
  for (const Hole& hole : block_holes) holes.push_back(Grown{hole, 0, {}});
  if (ahead > 0) {
    Grown& last = holes.back();
    last.hole.count += ahead;
    last.ahead = ahead;
    const std::size_t end = last.hole.first + last.hole.count;
    if (heap.granules.size() < end) heap.granules.resize(end);
  }
  auto release_created = [&] {
    for (const Grown& h : holes) {
      for (GranuleHandle made : h.handles) vmm_ops->release_granule(made);
    }
  };
  for (Grown& h : holes) {
    const std::size_t handles = h.run() ? 1 : h.hole.count;
    for (std::size_t k = 0; k < handles; ++k) {
      const GranuleHandle made = h.run() ? vmm_ops->create_run(h.hole.count) : vmm_ops->create_granule();
      if (!made) {
        // The device is full (memory outside the pool): give back what this
        // call created; the caller goes on granule by granule.
        release_created();
        return false;
      }
      h.handles.push_back(made);
    }
  }
  const std::uint32_t group = ++map_groups;  // Note [Map groups]
  ++stats_.num_growths;
  for (const Grown& h : holes) {
    const std::size_t first = h.hole.first, count = h.hole.count;
    clear_pending_places(heap, h.hole);
    const Addr at = heap.base + first * gran;
    if (h.run()) {
      vmm_ops->map_run(at, h.handles.front(), count);
    } else {
      vmm_ops->map(at, h.handles.data(), count);
    }
    for (std::size_t k = 0; k < count; ++k) {
      Granule& g = heap.granules[first + k];
      g.owner = 0;
      g.group = group;
      if (h.run()) {
        g.handle = h.handles.front();
        g.run_first = static_cast<std::uint32_t>(first);
        g.run_count = static_cast<std::uint32_t>(count);
      } else {
        g.handle = h.handles[k];
      }
    }
    // Every granule of the hole but those ahead lies under the block being carved: busy.
    if (h.run()) heap.granules[first].run_busy = static_cast<std::uint32_t>(count - h.ahead);
    trace(TraceAction::kSegmentMap, at, count * gran, 0, heap.pool, op_context);
  }
  held += (missing + ahead) * gran;
  heap.mapped += missing + ahead;
  memory_dirty = true;
  mapped_bytes[heap.small ? 0 : 1] += (missing + ahead) * gran;
  stats_.num_device_alloc += missing + ahead;
  return true;
}

std::size_t Pool::Impl::release_free_runs(std::size_t want_bytes, bool all_or_nothing) {
  // Nothing new is behind the barrier since the last pass found nothing.
  if (runs_checked_at == barrier_seq) return 0;
  struct Free {
    Heap* heap;
    std::size_t first, count;
  };
  std::vector<Free> found;
  std::size_t bytes = 0;
  bool skipped = false;
  for (auto& hp : heaps) {
    if (!hp || hp->frozen) continue;
    Heap& heap = *hp;
    for (std::size_t i = 0; i < heap.granules.size() && bytes < want_bytes;) {
      const Granule& head = heap.granules[i];
      const std::size_t n = head.run_count ? head.run_count : 1;
      if (head.run_count && head.run_busy == 0) {
        // Unmapping follows every stream: each granule's last free must lie
        // behind the last device barrier (Note [Device barrier]).
        bool behind = true;
        for (std::size_t k = i; k < i + n && behind; ++k) behind = behind_barrier(heap.granules[k].seq);
        if (behind) {
          found.push_back(Free{&heap, i, n});
          bytes += n * gran;
        } else {
          skipped = true;
        }
      }
      i += n;
    }
  }
  if (found.empty() && skipped) runs_checked_at = barrier_seq;
  // A request that these runs cannot serve in full keeps them: an OOM gives
  // no cache back only to create it again (Note [OOM ladder]).
  if (all_or_nothing && bytes < want_bytes) return 0;
  for (const Free& f : found) {
    Heap& heap = *f.heap;
    const Addr at = heap.base + f.first * gran;
    const GranuleHandle handle = heap.granules[f.first].handle;
    vmm_ops->unmap_run(at, f.count);
    vmm_ops->release_granule(handle);
    for (std::size_t k = f.first; k < f.first + f.count; ++k) {
      Granule& g = heap.granules[k];
      g.handle = 0;
      g.owner = 0;
      g.run_first = g.run_count = g.run_busy = 0;
    }
    heap.mapped -= f.count;
    mapped_bytes[heap.small ? 0 : 1] -= f.count * gran;
    held -= f.count * gran;
    --free_runs;
    stats_.num_device_free += f.count;
    memory_dirty = true;
    trace(TraceAction::kSegmentUnmap, at, f.count * gran, 0, heap.pool, op_context);
  }
  return bytes;
}

}  // namespace torchmem
