// plan_pool.cpp: the pool's side of the step plan: when to learn one, its
// arena, placing blocks there, and when to let it go.
//
// Note [Step plan arena]
// A plan in force owns an arena: a heap of its own (a virtual range of the
// default pool) where block i of the plan lives at base + offset(i). The arena
// is frozen like a private pool (Note [Private pools] in pool.h): its cached
// granules stay mapped where they are, so once every planned range has been
// backed the step makes no driver call and takes no device barrier. Its
// granules are obtained the usual way (created under the budget, or stitched
// from the online heaps' cache) the first time a range is used, which is the
// plan's one-time warm-up; the online heaps shrink as their blocks are freed.
//
// Lifecycle (Note [Step plan] in step_plan.h for naming and planning):
//   - off: the default pool never stitched nor waited for the device: its
//     layout already holds, and naming costs nothing because nothing is named;
//   - armed by the first stitch or step-4 barrier (plan_note_pressure): names
//     every default-pool request and records lifetimes;
//   - when the window closes: adopted if the window saw pressure (otherwise
//     the online layout held by itself) and the plan fits the budget next to
//     the memory it does not cover; otherwise off again, for a while;
//   - in force: planned requests go to their ranges; anything else (a new
//     shape, a range still taken) is served online, as before;
//   - dropped when more than 1 in 50 requests of a window (after the first
//     window since adoption, the warm-up) missed and the
//     pool stitched or waited in that window, or when the window needed the
//     OOM ladder's device barrier at all, since a plan in force takes none and
//     a few misses a step served online behind a barrier would otherwise hold
//     for good (the step changed: a new window
//     is recorded at once; after three such drops in a row the plan stays off
//     for a while; with no limit set, until a limit is set or the cache is
//     emptied: nothing but a full device would reclaim the dropped arenas'
//     cache), before an OOM is declared (its cache may back the request;
//     a planned request first tries its range again behind the ladder's
//     barrier, which the cache's pending fences may have kept it from being
//     backed before, then, for a plan and request Note [When the arena lends]
//     names, the arena lends its free granules for one more try:
//     Note [Lent arena cache]), and at empty_cache or a lower budget.
// A dropped arena thaws: its cached granules become reclaimable, its live
// blocks are freed as usual, and the heap goes once it holds nothing.
//
// Note [Lent arena cache]
// Right after adoption the arena backs each planned range the first time it
// is used, while blocks placed online before the plan still hold their
// memory until the step frees them: for a step or so both layouts are
// backed. Under a tight budget their sum can pass it, and the OOM ladder
// finds the online heaps empty while the arena caches granules for ranges
// the step has not reached yet. Dropping the plan there gives its cache back
// but also the plan: the next one is learnt over a window, meets the same
// overlap, and is dropped again, each time with barriers and thousands of
// calls. So before the plan is given up, the ladder lends the arena's free
// granules: the arena thaws for one more try (the planned range first, then
// the online heaps), and freezes again. The ranges whose granules were lent
// are backed again when their requests come, by then from the memory the
// online layout frees. A plan that keeps needing the ladder is still
// learnt again: its window took a barrier (above). Only some plans and
// requests are lent to: Note [When the arena lends].
//
// Note [When the arena lends]
// The ladder lends the arena's cache only while all of these hold, and
// otherwise gives the plan up at once, as it did before lending:
//   - the plan is in its first window since adoption (plan_settling): the
//     overlap of the two layouts lasts until the blocks placed online before
//     adoption are freed, which a repeating step does within that window;
//     later, a plan that needs the ladder does not fit its step;
//   - the request has a place in the plan (an offset): the overlap shows as
//     a planned range the budget cannot back yet. A request the plan never
//     saw says the window missed part of the cycle, and that plan is better
//     learnt again now than kept through ladder barriers until a window
//     check ends it;
//   - no plan failed a window check since the last one that held
//     (plan_failures == 0): after such a failure the pool is still finding
//     the cycle's length (the window was stretched to the part the last plan
//     missed, a guess), and a plan that then needs the ladder is more often
//     short of the cycle again than caught in the overlap; given up at the
//     first ladder barrier, the next window starts that much sooner.
// Lending to every plan kept plans learnt over too short a window through
// dozens of ladder barriers (gradient accumulation under FSDP warmed up
// steps later); under these conditions the plans that lend are the ones
// whose only trouble is the overlap at adoption.
//
// Note [Arena free set]
// No request searches an arena by size: a planned one goes to its offset,
// found through free_by_addr. So an arena's free set is that address index
// alone, and its FreeIndex stays empty: a planned request and its free pay
// for one index, not two (Note [Naming on the host] says why a line counts).
// Heap::insert_free, free_count and holds_free read whichever is the set.
//
// Note [Lazy pins]
// Every block's allocation and free moves the live count of each granule it
// covers (pin / unpin): the counts say which granules a free empties, to be
// listed as reclaimable. A plan's arena is frozen, so its emptied granules
// are never listed, and once every granule under the plan's footprint is
// mapped no planned request can miss one: while the plan is in force the
// counts there say nothing the pool acts on. So from the first window that
// finds the footprint wholly mapped, blocks below it move no counts, and
// the arena keeps only the latest free's sequence and stream and whether
// frees came from more than one stream (note_lazy_free). When the arena
// thaws the counts are made again from its live blocks, and every granule
// below the footprint takes the lazy frees' fence as its own: the latest
// free's, owned by its stream, or by several (Note [Alias reclaim]). A later
// fence than a granule's own only waits longer, so reuse stays safe. A run
// handle's granules (Note [Run handles]) keep their counts: runs count
// their busy granules from them, so an arena holding one stays counted.
#include <algorithm>
#include <chrono>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Block;
using detail::FreeByAddr;
using detail::Granule;
using detail::Heap;
using detail::StepPlan;

namespace {
// A window of a plan in force holds if at most 1 in this many requests missed.
constexpr std::uint64_t kMissDivisor = 50;
// Plans dropped in a row before the pool stops planning for a while.
constexpr std::uint32_t kMaxPlanFailures = 3;
}  // namespace

void Pool::Impl::plan_note_pressure() {
  ++pressure;
  if (!vmm || !config.step_plan || plan.naming() || stats_.num_allocs < plan_quiet_until) return;
  plan.arm();
  pressure_at_arm = pressure;
}

Block* Pool::Impl::plan_allocate(std::size_t rounded, StreamId stream, std::uint32_t* item) {
  if (plan.state() == StepPlan::State::kRecording) {
    if (plan.window_closed()) {
      plan_adopt();
    } else if (plan.window_hopeless()) {
      plan_reset();  // shapes that do not repeat: nothing to plan
      plan_quiet_until = stats_.num_allocs + StepPlan::kMaxRecordAllocs;
    }
  } else if (plan.active()) {
    plan_check_window();
  }
  bool by_lookup = false;
  *item = plan.on_alloc(rounded, stream, rounded <= config.small_threshold, &by_lookup);
  stats_.num_plan_lookups += by_lookup;
  if (!plan.active()) return nullptr;
  ++plan_window_allocs;
  Block* b = plan_place(*item, rounded, stream);
  if (b) {
    ++stats_.num_plan_hits;
  } else {
    ++stats_.num_plan_misses;
    ++plan_window_misses;
  }
  return b;
}

Block* Pool::Impl::plan_place(std::uint32_t item, std::size_t rounded, StreamId stream) {
  Block* b = nullptr;
  const std::uint64_t offset = plan.offset_of(item);
  if (offset != StepPlan::kNoOffset && offset + rounded <= plan_arena->span) {
    const Addr at = plan_arena->base + offset;
    FreeByAddr& index = plan_arena->free_by_addr;
    const std::size_t above = index.upper_bound(at);
    Block* f = above == 0 ? nullptr : index.block_at(above - 1);
    if (f && f->end() >= at + rounded && reusable_ordered(*f, stream)) {  // the range is free
      const std::size_t missing = pin(*plan_arena, at, rounded);
      if (missing == 0 || acquire(*plan_arena, at, rounded, missing, rounded, stream)) {
        // What is left above the block taken joins the index just below
        // `above`, in the entry of f when f is the block taken.
        const bool whole = at == f->addr;
        b = carve(split_free_at(f, at, /*index_upper=*/false), rounded);
        Block* rest = b->next && b->next->is_free() ? b->next : nullptr;
        if (whole && rest) {
          index.replace_at(above - 1, rest);
        } else if (whole) {
          index.erase_at(above - 1);
        } else if (rest) {
          index.insert_at(above, rest);
        }
      } else {
        unpin(*plan_arena, at, rounded, 0, 0, /*restore=*/true);
      }
    }
  }
  return b;
}

Block* Pool::Impl::plan_place_after_barrier(std::uint32_t item, std::size_t rounded, StreamId stream) {
  if (item == StepPlan::kNoItem) return nullptr;
  Block* b = plan_place(item, rounded, stream);
  if (b) {
    ++stats_.num_plan_hits;
    --stats_.num_plan_misses;
    --plan_window_misses;
  }
  return b;
}

void Pool::Impl::plan_lend_cache(bool lend) {
  if (lend) {
    thaw(*plan_arena);  // lists its free granules; its lazy pins are counted again
  } else {
    refreeze(*plan_arena);  // the lazy pins start again at the next window check
  }
}

bool Pool::Impl::plan_may_lend(std::uint32_t item) const {
  // Note [When the arena lends]
  return plan_settling && plan_failures == 0 && plan.offset_of(item) != StepPlan::kNoOffset;
}

void Pool::Impl::plan_adopt() {
  if (pressure == pressure_at_arm) {  // the online layout held through a whole window
    plan_reset();
    return;
  }
  const std::uint64_t window = plan.allocs_recorded();
  // Note [Planning pass cost] The pass runs on the host inside one allocation
  // and grows with the square of the window; a pass whose plan does not fit
  // the budget is thrown away and leaves no other trace. Both counters let a
  // step's host time be told apart from its driver calls and barriers.
  const auto pass_start = std::chrono::steady_clock::now();
  const std::size_t footprint = plan.plan(gran);
  ++stats_.num_plan_passes;
  stats_.plan_pass_us += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - pass_start).count());
  // What the plan does not cover stays where it is: the granules live blocks
  // hold now, less the planned ones, which move into the arena as they recur
  // (a named block live since before the last cycle has no place: it stays).
  std::size_t pinned = 0;
  for (const auto& hp : heaps) {
    if (!hp) continue;
    for (const detail::Granule& g : hp->granules) pinned += g.live ? gran : 0;
  }
  const std::size_t uncovered = pinned - std::min(pinned, plan.planned_live_bytes());
  if (footprint == 0 || footprint + uncovered > budget()) {
    plan_reset();
    plan_quiet_until = stats_.num_allocs + 4 * window;
    return;
  }
  drop_retired_arenas();
  plan_arena = make_heap(0, /*small=*/false, /*arena=*/true);
  plan_footprint = footprint;
  plan.activate();
  plan_window = std::max<std::uint64_t>(window, StepPlan::kMinQuiet);
  plan_window_allocs = plan_window_misses = 0;
  plan_window_pressure = pressure;
  plan_window_barriers = stats_.num_sync_all_streams;
  plan_settling = true;
  ++stats_.num_plans;
}

void Pool::Impl::plan_check_window() {
  if (plan_window_allocs < plan_window) return;
  if (plan_arena->pins_lazy_below == 0) start_lazy_pins(*plan_arena, plan_footprint);
  // Misses served from cached memory cost nothing: a plan is learnt again only
  // when they also made the pool stitch or wait (a timing-dependent free, a
  // rare shape, does not make every window pay for a new plan).
  // The first window after adoption is the plan's warm-up: blocks placed online
  // before it still hold planned ranges until they are freed, so its requests
  // miss and stitch by design; only the windows after it say whether the plan holds.
  // A plan in force takes no device barrier (the OOM ladder's): one whose window needed one does
  // not hold, however few its misses.
  const bool barrier = stats_.num_sync_all_streams != plan_window_barriers;
  const bool held = plan_settling || (plan_window_misses * kMissDivisor <= plan_window_allocs && !barrier) ||
                    pressure == plan_window_pressure;
  plan_settling = false;
  plan_window_allocs = plan_window_misses = 0;
  plan_window_pressure = pressure;
  plan_window_barriers = stats_.num_sync_all_streams;
  if (held) {
    plan_failures = 0;
    return;
  }
  // With no limit, only a full device makes the pool stitch a dropped arena's
  // cache away: a plan learnt again after each drop would strand an arena's
  // worth of memory every time, so one failure is the last until a limit is
  // set or the cache is emptied.
  const bool no_limit = config.limit_bytes == 0;
  if (!no_limit && ++plan_failures < kMaxPlanFailures) {
    plan.cycle_outgrew_window();
    plan_drop(/*rearm=*/true);
    return;
  }
  plan_failures = 0;
  plan_reset();
  plan_quiet_until = no_limit ? kPlanNever : stats_.num_allocs + 16 * plan_window;
}

void Pool::Impl::plan_drop(bool rearm) {
  if (plan_arena) {
    thaw(*plan_arena);  // its cached granules may serve anyone now
    retired_arenas.push_back(plan_arena);
    plan_arena = nullptr;
    ++stats_.num_plan_drops;
  }
  if (rearm) {
    plan.rerecord();
    pressure_at_arm = pressure;
  } else {
    plan.reset();
  }
}

void Pool::Impl::plan_reset() { plan_drop(/*rearm=*/false); }

void Pool::Impl::drop_retired_arenas() {
  for (std::size_t i = 0; i < retired_arenas.size();) {
    Heap* h = retired_arenas[i];
    if (h->live_blocks == 0 && h->mapped == 0 && h->stale == 0) {
      drop_heap(h);
      retired_arenas.erase(retired_arenas.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

void Pool::Impl::start_lazy_pins(Heap& heap, std::size_t footprint) {
  const std::size_t n = end_granule(heap, heap.base + footprint);
  if (n == 0 || n > heap.granules.size()) return;
  for (std::size_t i = 0; i < n; ++i) {
    const Granule& g = heap.granules[i];
    if (!g.handle || g.run_count) return;  // not wholly mapped yet, or a run
  }
  heap.pins_lazy_below = heap.base + n * gran;
  ++stats_.num_lazy_pins;  // lazy_free_* are 0: they start so, and settle_lazy_pins clears them
}

void Pool::Impl::settle_lazy_pins(Heap& heap) {
  if (heap.pins_lazy_below == 0) return;
  const std::size_t lazy_end = first_granule(heap, heap.pins_lazy_below);
  heap.pins_lazy_below = 0;
  // Counted again from the live blocks; above lazy_end the counts were kept,
  // so recounting leaves them (and the runs' busy counts) as they are.
  for (Granule& g : heap.granules) g.live = 0;
  for (const Block* b = heap.first; b; b = b->next) {
    if (b->is_free()) continue;
    for (std::size_t i = first_granule(heap, b->addr), end = end_granule(heap, b->end()); i < end; ++i) {
      ++heap.granules[i].live;
    }
  }
  if (heap.lazy_free_seq == 0) return;  // nothing below lazy_end was freed
  for (std::size_t i = 0; i < lazy_end; ++i) {
    Granule& g = heap.granules[i];
    g.owner = Granule::merged_owner(g.owner, heap.lazy_free_owner);
    if (g.live == 0) {
      g.seq = std::max(g.seq, heap.lazy_free_seq);
      g.slot = heap.lazy_free_slot;
    }
  }
  heap.lazy_free_seq = 0;
  heap.lazy_free_slot = heap.lazy_free_owner = 0;
}

Block* Pool::Impl::split_free_at(Block* f, Addr at, bool index_upper) {
  if (at == f->addr) return f;
  Heap& heap = *f->heap;
  // The free space below `at` stays a free block; both parts keep the fence tag.
  Block* upper = split_off(f, at);
  const std::size_t old_size = f->size;
  f->size = at - f->addr;
  if (heap.arena) {  // Note [Arena free set]: f keeps its entry
    if (index_upper) heap.free_by_addr.insert(upper);
  } else {
    heap.free.replace(old_size, f->addr, f);
    heap.free.insert(upper);
  }
  ++free_blocks[heap.small ? 0 : 1];
  return upper;
}

void Pool::Impl::arena_note_free(Heap& heap, Block* b) {
  // b has an entry already when it absorbed into a free block below; a free
  // block above that b absorbed is the one entry inside b now.
  FreeByAddr& index = heap.free_by_addr;
  const std::size_t pos = index.lower_bound(b->addr);
  if (pos < index.size() && index.addr_at(pos) == b->addr) {
    index.replace_at(pos, b);
  } else {
    index.insert_at(pos, b);
  }
  if (pos + 1 < index.size() && index.addr_at(pos + 1) < b->end()) index.erase_at(pos + 1);
}

}  // namespace torchmem
