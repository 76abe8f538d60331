// runs.cpp: run handles: growing a VMM heap by one driver handle per run of
// missing granules, and giving a wholly free run back.
//
// Note [Run handles]
// The driver's cost of growing follows handles, not bytes: a handle per
// 2 MiB granule costs ~30 us to create, map and give access, however the
// calls are batched; one handle for a run of N granules costs 28.6 us at
// N = 1 and 82 us at N = 256 (0.32 us per granule, what cudaMalloc pays)
// (H200, BENCHMARKS.md section 9). Growing GPT-2's varied shapes by 13,000
// single granules made its steps 15-25% slower than native's. But a bigger
// handle can only be mapped whole (the driver refuses slices), so its
// granules can never be stitched one by one. Hence: while the pool has no
// budget of its own (limit_bytes == 0: the device is the budget) and held
// stays under run_below x the device's memory (and under the creation
// ceiling of Note [When to stitch], where nothing would be stitched
// anyway), each hole of 2 or more missing granules that a new block needs
// is filled by ONE handle (grow_by_runs). Growth above that line or under a
// budget gets a handle per granule.
// A run granule is never listed as reclaimable; a run whose granules are all
// free goes back whole (release_free_runs): on empty_cache and
// release_cached_to, and when a request finds no room otherwise, under the
// budget or on a device that other processes filled (behind the
// device barrier, Note [Device barrier]: on the OOM ladder's step 4 at the
// latest); the room it leaves is then filled granule by granule.
// Why not under a budget: free space inside a partly used run stays where
// it is, and under a budget packing is what the pool is for. Replays
// (2026-12-01) with runs in the bottom half of the budget raised the bundled
// traces' min-cap from 1.0015-1.0027 to up to 1.0152 x peak requested, and
// on the H200 a Llama step under a 660 MiB limit (offload="auto") failed
// with 50 MiB cached in partly used runs where stitching had fitted it. So
// under a limit, a memory fraction or a share, the pool packs exactly as
// before. Without one, the bundled traces' growth costs 6-51 ms of modeled
// driver time instead of 45-381 ms. Why every hole, not only those of 8
// granules and more (the rule until 2026-12-02): PyTorch's
// test_allocator_fuzz (2-20 MiB tensors, empty_cache every ~20 actions)
// ran 1.5x native's time on the H200 (0.75 s against 0.49,
// bench/empty_cache_fuzz.py, BENCHMARKS.md section 14), creating and
// releasing ~6,000 single granules where native's 20 MiB segments took one
// call each. Runs from 2 granules cut that replay's driver calls 3.6x (4,839
// handles to 1,342) and the bundled traces' modeled growth 1.8-2.8x, and
// the smallest DEVICE the traces fit on (no limit) moved from 1.0014-1.0152
// to 1.0014-1.0170 x peak requested. (The 8 came from runs made under a
// limit, where small runs made synthetic patterns OOM under 1.1x; under a
// limit there are no runs.) Private pools (graph capture,
// MemPool) keep a handle per granule: they are never stitched while in use,
// and a released one gives back what it holds granule by granule.
//
// Note [Huge holes] One request that misses 8 GiB or more (kHugeRunGranules)
// gets one handle even above run_below. Granule by granule, a 70 GB tensor
// (half an H200: PyTorch's test_out_of_memory_retry; an inference engine's
// KV-cache arena is bigger) created ~35,000 handles and released as many at
// empty_cache: 2.69 s where PyTorch's allocator took 0.05 s (BENCHMARKS.md
// section 13). Such a block is one segment natively too, and stranding
// free space inside it is what a native segment does: the price is the
// same, the 2.6 s is not paid. Holes under 8 GiB cost at most ~0.15 s.
// Under a budget too (limit, memory fraction, share): PyTorch's
// test_set_per_process_memory_fraction asks for 0.499 of the card under a
// fraction of 0.5 and took 2.63 s against native's 0.06 (BENCHMARKS.md
// section 14). What a run cannot do there is be stitched granule by granule
// while part of it is live; a hole of 8 GiB is at least 8 GiB of the budget
// that one request needed at once, and once wholly free the run goes back
// whole when another request needs its room (release_free_runs).
// Note [Runs ahead] A large heap's run shorter than 20 MiB (kRunAheadBytes)
// maps on past its block, over the unmapped granules that follow (up to the
// first one mapped, pending an unmap or under a block), until it reaches 20
// MiB; the blocks carved after it land there with no driver call. Only where
// runs are taken at all (no limit, under run_below), never in the small heap
// (its requests take one granule, as PyTorch's 2 MiB small segments).
// Why: after every empty_cache, test_allocator_fuzz's 2-20 MiB tensors each
// took a handle of their own (2,186 in all, 1.48x native's time on the H200,
// BENCHMARKS.md section 15), where PyTorch's 20 MiB segments serve several
// 1-10 MiB tensors per cudaMalloc (1,539 calls in the native model), and
// expandable segments map the large pool 20 MiB at a time for the same
// reason. Replays (2026-12-02): that fuzz (with its checks' temporaries)
// takes 1,210 handles instead of 2,186, the bundled traces gpt2 /
// kv_generate / llama_ckpt / vision 238 / 37 / 274 / 127 instead of 314 / 69
// / 555 / 156 (modeled growth 9.6 / 1.4 / 9.9 / 4.3 ms instead of 11.8 /
// 2.4 / 18.1 / 5.2), unconstrained peak reserved unchanged (1.078 / 1.057 /
// 1.147 / 1.006 x requested). What it trades: up to 18 MiB mapped and unused
// per growth until a block lands there, like a native segment's free tail,
// and a partly used run goes back only whole. The smallest device a trace
// fits on with no limit moved from 1.0028 / 1.0165 / 1.0166 / 1.0011 to
// 1.0021 / 1.0207 / 1.0181 / 1.0011 x peak requested; under a budget
// nothing changes (no runs there).
// Note [Runs under a limit] Under a limit (memory fraction, share, the batch
// controller's ceiling) the pool grows granule by granule, ~30 us a granule
// on the H200, so that every cached granule can be stitched: replays under
// budgets of 1.05-1.2x peak requested spend 45-413 ms of modeled driver time
// (gpt2 at 1.1x: 12,646 handles, 412.6 ms) where the same traces with no
// limit spend 1.4-9.9 ms. run_below_limit (0 by default) takes runs while
// held stays under that fraction of the limit, never with runs ahead.
// Replays (2026-12-02) at 0.5: handles and modeled time halved (gpt2 at
// 1.1x 6,807 handles, 240.6 ms; llama_ckpt at 1.2x 9,483 -> 5,269; kv at
// 1.1x 1,513 -> 853; vision at 1.05x 2,942 -> 1,467), no OOM, while min-cap
// rises from 1.0016 / 1.0027 / 1.0015 / 1.0011 to 1.0028 / 1.0165 / 1.0166 /
// 1.0011 x peak requested (gpt2 / kv / llama / vision); at 0.8 llama's
// min-cap is 1.131. Free space inside a partly used run cannot be stitched,
// and #11 asks that a budget packs as tightly as it can: hence 0 in the core.
// On the H200 (BENCHMARKS.md section 17) a fixed loose limit (memory
// fraction 0.5) left the timed steps as fast as with no limit and cost the
// warm-up ~0.4 s for gpt2's 10,714 granules; in the sharing scenario, whose
// limits keep moving, 0.5 halved the granules created (37,948 -> 19,713 for
// the first borrower) and raised throughput 2%. So the Python layer's auto
// value (torchmem/config.py) is 0.5 with share and 0 otherwise.
#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Granule;
using detail::Heap;

namespace {
// The smallest run: a hole of one granule is a plain granule handle (Note [Run handles]).
constexpr std::size_t kMinRunGranules = 2;
}  // namespace

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
      for (GranuleHandle made : h.handles) backend.release_granule(made);
    }
  };
  for (Grown& h : holes) {
    const std::size_t handles = h.run() ? 1 : h.hole.count;
    for (std::size_t k = 0; k < handles; ++k) {
      const GranuleHandle made = h.run() ? backend.create_run(h.hole.count) : backend.create_granule();
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
  for (const Grown& h : holes) {
    const std::size_t first = h.hole.first, count = h.hole.count;
    clear_pending_places(heap, h.hole);
    const Addr at = heap.base + first * gran;
    if (h.run()) {
      backend.map_run(at, h.handles.front(), count);
    } else {
      backend.map(at, h.handles.data(), count);
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
    backend.unmap_run(at, f.count);
    backend.release_granule(handle);
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
