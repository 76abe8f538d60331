// granules.cpp: physical memory of VMM heaps: pinning, acquiring granules
// (create / reclaim + stitch / map), fences and the reclaimable lists.
//
// Note [Lazy reclaim]
// Free blocks keep their granules mapped: reusing cached memory in place
// costs nothing. A granule is only moved where a new block needs it
// (stitching) or given back by release_cached(). Stitching moves a handle
// without unmapping its old place at once (Note [Pending unmaps] in
// aliases.cpp). All map/unmap calls are batched over consecutive granules.
//
// Note [When to stitch]
// Stitching keeps held memory at the live high-water mark (plus edge
// rounding), but every moved granule costs ~20-45 us of driver calls, and a
// workload that repeats forever (a periodic churn of mixed sizes) pays them
// forever: measured on an H200, 0.12 map + 0.12 unmap per torch.empty, 3x
// native's time per allocation, on a device that was nearly empty. Tightness
// only matters when memory is the limit, so a missing granule comes, in order:
//   1. created, while held stays under max((1 + reclaim_slack) x in use,
//      line x budget): with room to spare the pool grows like expandable
//      segments and, once the working set is stable, makes no driver calls;
//   2. stitched from cached free space whose fence completed, least recently
//      emptied first, then (alias_reclaim) from free space of the requesting
//      stream whose fence is pending;
//   3. created under the budget.
// Creation failing because the device is full (another process, memory
// outside the pool) also sends the pool to stitching.
// The line: with no limit, stitch_above (0.95) x the device's memory, so that
// the pool packs before the device refuses it (a failed creation costs a call
// per request). Under a limit (memory fraction, the batch controller's
// ceiling, a share), stitch_above_limit (1.0) x the limit: the pool grows to
// the limit before it moves anything, and with backed_fit (Note [Backed
// placement]) it then places where cached granules already back a request.
// Why 1.0 under a limit: with shapes that vary, stitching in the top 5%
// moved whole gigabytes of granules whenever a new shape fit none of the
// holes the last ones left (about 3,000 calls at one step, on an H100, where
// expandable_segments made 0-6 after warm-up); growing to the limit first and
// placing on backed memory made 0-3, with the same min-cap on the bundled
// traces (BENCHMARKS.md, Budget regime: backed placement with stitching only
// at the limit). 0.95 with no limit: replays under budgets of 1.02-1.2x the
// peak give the same min-cap at 0.8, 0.95 and 0.98 (BENCHMARKS.md, Memory: why
// stitching starts at 95% of the budget).
#include <algorithm>
#include <stdexcept>

#include "core/detail/pool_impl.h"

namespace torchmem {

using detail::Granule;
using detail::GranuleRef;
using detail::Heap;
using detail::StreamSlot;

Granule& Pool::Impl::granule(GranuleRef ref) { return heaps[ref.heap]->granules[ref.index]; }

// ---- reclaimable lists ------------------------------------------------------

void Pool::Impl::list_push(std::uint32_t slot, GranuleRef ref, bool front) {
  Granule& g = granule(ref);
  g.slot = slot;
  // A frozen heap's free granules stay where they are, off every list
  // (Note [Private pools]); release_private_pool() lists them.
  if (heaps[ref.heap]->frozen) return;
  StreamSlot& s = slots[slot];
  g.on_list = true;
  g.prev = g.next = GranuleRef{};
  if (s.head.empty()) {
    s.head = s.tail = ref;
  } else if (front) {
    granule(s.head).prev = ref;
    g.next = s.head;
    s.head = ref;
  } else {
    granule(s.tail).next = ref;
    g.prev = s.tail;
    s.tail = ref;
  }
  ++s.listed;
}

void Pool::Impl::thaw(Heap& heap) {
  settle_lazy_pins(heap);
  heap.frozen = false;
  for (std::size_t i = 0; i < heap.granules.size(); ++i) {
    const Granule& g = heap.granules[i];
    if (g.handle && g.live == 0 && !g.on_list && !g.run_count) {
      list_push(g.slot, GranuleRef{heap.id, static_cast<std::uint32_t>(i)}, /*front=*/false);
    }
  }
}

void Pool::Impl::refreeze(Heap& heap) {
  heap.frozen = true;
  for (std::size_t i = 0; i < heap.granules.size(); ++i) {
    if (heap.granules[i].on_list) list_remove(GranuleRef{heap.id, static_cast<std::uint32_t>(i)});
  }
}

void Pool::Impl::list_remove(GranuleRef ref) {
  Granule& g = granule(ref);
  StreamSlot& s = slots[g.slot];
  if (g.prev.empty()) {
    s.head = g.next;
  } else {
    granule(g.prev).next = g.next;
  }
  if (g.next.empty()) {
    s.tail = g.prev;
  } else {
    granule(g.next).prev = g.prev;
  }
  g.prev = g.next = GranuleRef{};
  g.on_list = false;
  --s.listed;
}

std::uint32_t Pool::Impl::slot_for_slow(StreamId stream) {
  auto it = slot_index.find(stream);
  std::uint32_t slot;
  if (it == slot_index.end()) {
    slot = static_cast<std::uint32_t>(slots.size());
    slots.emplace_back();
    slots.back().stream = stream;
    slot_index.emplace(stream, slot);
  } else {
    slot = it->second;
  }
  cached_stream = stream;
  cached_slot = slot;
  cached_valid = true;
  return slot;
}

// ---- fences (Note [Fences] in pool.h) --------------------------------------

bool Pool::Impl::fence_done(std::uint32_t slot, std::uint64_t q, bool may_record) {
  StreamSlot& s = slots[slot];
  if (s.completed_seq >= q) return true;
  while (!s.fences.empty() && backend.event_completed(s.fences.front().event)) {
    s.completed_seq = std::max(s.completed_seq, s.fences.front().seq);
    backend.destroy_event(s.fences.front().event);
    s.fences.pop_front();
  }
  if (s.completed_seq >= q) return true;
  if (may_record && (s.fences.empty() || s.fences.back().seq < q)) {
    // One event covers every free on this stream so far.
    s.fences.push_back(detail::Fence{backend.record_event(s.stream), seq});
    if (backend.event_completed(s.fences.back().event)) {
      // Stream order: every older fence of this stream completed too.
      s.completed_seq = std::max(s.completed_seq, s.fences.back().seq);
      for (const detail::Fence& f : s.fences) backend.destroy_event(f.event);
      s.fences.clear();
    }
  }
  return s.completed_seq >= q;
}

void Pool::Impl::sync_all_fences() {
  for (std::uint32_t i = 1; i < slots.size(); ++i) {
    StreamSlot& s = slots[i];
    if (s.last_free_seq > s.completed_seq &&
        (s.fences.empty() || s.fences.back().seq < s.last_free_seq)) {
      s.fences.push_back(detail::Fence{backend.record_event(s.stream), seq});
    }
    for (const detail::Fence& f : s.fences) {
      backend.synchronize_event(f.event);
      s.completed_seq = std::max(s.completed_seq, f.seq);
      backend.destroy_event(f.event);
    }
    s.fences.clear();
  }
}

// ---- pinning ------------------------------------------------------------------

std::size_t Pool::Impl::pin(Heap& heap, Addr addr, std::size_t size) {
  if (addr + size <= heap.pins_lazy_below) return 0;  // Note [Lazy pins]: every granule there is mapped
  const std::size_t g0 = first_granule(heap, addr), g1 = end_granule(heap, addr + size);
  if (g1 > heap.granules.size()) {
    // Grow geometrically, but never past the range.
    std::size_t want = std::max(g1, heap.granules.size() * 2);
    heap.granules.resize(std::min(want, heap.span / gran));
  }
  std::size_t missing = 0;
  for (std::size_t i = g0; i < g1; ++i) {
    Granule& g = heap.granules[i];
    if (g.live++ != 0) continue;
    if (g.run_count) {  // Note [Run handles] (runs.cpp)
      if (heap.granules[g.run_first].run_busy++ == 0) --free_runs;
      continue;
    }
    if (g.handle) {
      if (g.on_list) list_remove(GranuleRef{heap.id, static_cast<std::uint32_t>(i)});
    } else {
      ++missing;
    }
  }
  return missing;
}

void Pool::Impl::unpin(Heap& heap, Addr addr, std::size_t size, StreamId stream, std::uint64_t at_seq,
                       bool restore) {
  if (addr + size <= heap.pins_lazy_below) {  // Note [Lazy pins]
    if (!restore) note_lazy_free(heap, slot_for(stream), at_seq);
    return;
  }
  const std::size_t g0 = first_granule(heap, addr), g1 = end_granule(heap, addr + size);
  std::uint32_t slot = 0;
  bool have_slot = false;
  if (!restore) {
    slot = slot_for(stream);
    have_slot = true;
  }
  for (std::size_t i = g0; i < g1; ++i) {
    Granule& g = heap.granules[i];
    // Note [Alias reclaim]: a granule freed on two streams is never aliased.
    if (have_slot) g.owner = Granule::merged_owner(g.owner, slot);
    if (--g.live != 0 || !g.handle) continue;
    if (g.run_count) {  // Note [Run handles]: never listed; the run goes back whole
      if (!restore) g.seq = at_seq;
      if (--heap.granules[g.run_first].run_busy == 0) ++free_runs;
      continue;
    }
    if (restore) {
      list_push(g.slot, GranuleRef{heap.id, static_cast<std::uint32_t>(i)}, /*front=*/true);
      continue;
    }
    g.seq = at_seq;
    list_push(slot, GranuleRef{heap.id, static_cast<std::uint32_t>(i)}, /*front=*/false);
  }
}

// ---- acquiring granules ------------------------------------------------------

std::vector<GranuleRef> Pool::Impl::pop_reclaimable(std::size_t count, std::uint32_t requester) {
  std::vector<GranuleRef> out;
  while (out.size() < count) {
    std::uint32_t best = 0;
    std::uint64_t best_seq = 0;
    bool found = false;
    for (std::uint32_t i = 0; i < slots.size(); ++i) {
      if (slots[i].listed == 0) continue;
      const Granule& head = granule(slots[i].head);
      if (found && head.seq >= best_seq) continue;
      // Note [Cross-stream reuse]: never-used memory (slot 0) is free to take;
      // memory only the requester's stream freed (owner) once its fence
      // completed (alias reclaim takes it earlier); anything another stream
      // freed, on this granule too, only behind a device barrier.
      const bool ready = i == 0 || behind_barrier(head.seq) ||
                         (i == requester && head.owner == requester &&
                          fence_done(i, head.seq, /*may_record=*/true));
      if (!ready) continue;
      best = i;
      best_seq = head.seq;
      found = true;
    }
    if (!found) break;
    GranuleRef ref = slots[best].head;
    list_remove(ref);
    out.push_back(ref);
  }
  return out;
}

void Pool::Impl::unmap_granules(std::vector<GranuleRef>& refs, std::vector<GranuleHandle>* handles) {
  std::sort(refs.begin(), refs.end(), [](const GranuleRef& a, const GranuleRef& b) {
    return a.heap != b.heap ? a.heap < b.heap : a.index < b.index;
  });
  for (std::size_t i = 0; i < refs.size();) {
    std::size_t j = i + 1;
    while (j < refs.size() && refs[j].heap == refs[i].heap && refs[j].index == refs[j - 1].index + 1) ++j;
    Heap& heap = *heaps[refs[i].heap];
    const Addr at = heap.base + std::size_t{refs[i].index} * gran;
    vmm_ops->unmap(at, j - i);
    for (std::size_t k = i; k < j; ++k) {
      Granule& g = heap.granules[refs[k].index];
      handles->push_back(g.handle);
      g.handle = 0;
    }
    heap.mapped -= j - i;
    memory_dirty = true;
    mapped_bytes[heap.small ? 0 : 1] -= (j - i) * gran;
    trace(TraceAction::kSegmentUnmap, at, (j - i) * gran, 0, heap.pool, op_context);
    i = j;
  }
}

// Note [Device room] A request that misses many granules asks the device how
// much it can still give (one cuMemGetInfo, against the creation of 32+
// handles). Without it, a request the device cannot back (the pool holds 70
// GB of an H200 and asks for 70 GB more; a batch-size probe that does not
// fit) created every granule the device had left, ~35,000, only to release
// them all: 3.5 s for the OOM where PyTorch's allocator answers in 0.07 s
// (PyTorch's test_out_of_memory_retry; BENCHMARKS.md, Growth and driver calls:
// huge requests). The device's free
// memory then bounds creation like the budget does, so the request stitches
// what it must or fails before creating anything. Smaller requests find out
// by trying: each failed creation costs one call.
double Pool::Impl::create_ceiling(std::size_t request) const {
  const double slack_cap = (1.0 + config.reclaim_slack) * double(active_total + request);
  // Note [When to stitch]: the line is a fraction of the limit under one, of the device without.
  const double line = config.limit_bytes != 0 ? config.stitch_above_limit : config.stitch_above;
  const double roomy_cap = line * double(budget());
  return std::max(slack_cap, roomy_cap);
}

bool Pool::Impl::acquire(Heap& heap, Addr addr, std::size_t size, std::size_t missing,
                         std::size_t request, StreamId stream) {
  // Places behind the last barrier are unmapped where a mapping needs them
  // (Note [Pending unmaps]); all of them only while a released pool waits
  // for its heap to empty before it is dropped.
  if (released_pools && !pending_unmaps.empty()) process_pending_unmaps(/*wait=*/false);
  // Mapping over a pending place needs the whole device to have caught up
  // (Note [Pending unmaps]); the caller looked for a fit that avoids it first.
  if (heap.stale && pending_blocks(heap, addr, size) && !device_barrier()) return false;
  const std::size_t limit = budget();
  // Note [Device room]: granules the budget and, for a large request, the device can still give.
  auto creatable = [&]() {
    std::size_t granules = held < limit ? (limit - held) / gran : 0;
    if (missing >= kDeviceRoomProbe) {
      try {
        granules = std::min(granules, backend.mem_info().free_bytes / gran);
      } catch (const std::exception&) {
        // the device would not say: creating finds out, granule by granule, as before
      }
    }
    return granules;
  };
  std::size_t room = creatable();
  // Note [Run handles] (runs.cpp): far from the device's capacity, one handle per hole
  // (Note [Run length]: per piece of a long one); Note [Huge holes]: runs for a huge hole
  // anywhere, one handle under a budget.
  if (heap.pool == 0 && room >= missing && config.run_below > 0.0) {
    // Under a limit, runs only below run_below_limit x the budget (Note [Runs under a limit]).
    const bool limited = config.limit_bytes != 0;
    const double run_line = limited ? config.run_below_limit : config.run_below;
    auto roomy = [&](std::size_t granules) {
      const double after = double(held + granules * gran);
      return after <= run_line * double(limit) && after <= create_ceiling(request);
    };
    // A huge hole the budget can back is created whatever is cached: stitching
    // it granule by granule is the 35,000-handle cost the run avoids, and the
    // cached granules stay reclaimable for the requests after it.
    const bool huge = missing >= kHugeRunGranules;
    if (huge || roomy(missing)) {
      std::vector<Hole> holes = unmapped_holes(heap, addr, size);
      // Note [Runs under a limit]: the cap is for growth near the limit; a huge
      // hole stays one handle (Note [Huge holes]). Note [Run length]: with no
      // limit, runs of kMaxRunGranules, or a kMaxRunsPerHole-th of a longer hole.
      if (!limited) {
        holes = cut_runs(holes);
      } else if (!huge && config.limit_run_granules > 0) {
        holes = cut_holes(holes, config.limit_run_granules);
      }
      // Note [Runs ahead]: far from every limit, a large heap's run maps on past the block.
      std::size_t ahead = 0;
      if (!huge && !limited && !heap.small) {
        ahead = run_ahead(heap, holes.back(), end_granule(heap, addr + size), room - missing);
        if (!roomy(missing + ahead)) ahead = 0;
      }
      if (grow_by_runs(heap, holes, missing, ahead)) return true;
    }
  }
  std::vector<GranuleRef> victims, aliases;
  if (room < missing) {
    // Creating alone cannot cover the request (the budget or the device is
    // short), so at least missing - room granules are stitched whatever is
    // created: take them first, and give up before creating anything if they
    // are not there (Note [OOM ladder], Note [Device room]).
    victims = pop_reclaimable(missing - room, slot_for(stream));
    if (config.alias_reclaim && room + victims.size() < missing) {
      aliases = pop_aliasable(slot_for(stream), missing - room - victims.size());
    }
    const std::size_t found = victims.size() + aliases.size();
    if (free_runs && room + found < missing &&
        release_free_runs((missing - room - found) * gran, /*all_or_nothing=*/true) > 0) {
      // Whole free runs behind the barrier went back (Note [Run handles]);
      // their room is created again granule by granule below.
      room = creatable();
    }
    if (room + victims.size() + aliases.size() < missing) {
      unpop_granules(aliases);
      unpop_granules(victims);
      return false;
    }
  }
  std::vector<GranuleHandle> handles;
  handles.reserve(missing);
  std::size_t created = 0;
  bool device_full = false;
  auto append = [](std::vector<GranuleRef>& to, std::vector<GranuleRef> more) {
    to.insert(to.end(), more.begin(), more.end());
  };
  auto short_by = [&]() { return missing - std::min(missing, handles.size() + victims.size() + aliases.size()); };
  auto create_while_below = [&](double cap) {
    while (!device_full && short_by() > 0 && held + gran <= limit && double(held + gran) <= cap) {
      GranuleHandle h = vmm_ops->create_granule();
      if (!h) {
        device_full = true;
        break;
      }
      held += gran;
      ++created;
      handles.push_back(h);
    }
  };
  // Note [When to stitch]
  create_while_below(create_ceiling(request));
  if (short_by() > 0) append(victims, pop_reclaimable(short_by(), slot_for(stream)));
  if (short_by() > 0 && config.alias_reclaim) append(aliases, pop_aliasable(slot_for(stream), short_by()));
  create_while_below(double(limit));
  if (short_by() > 0 && free_runs && release_free_runs(short_by() * gran, /*all_or_nothing=*/true) > 0) {
    // The device said no (other processes, memory outside the pool): whole
    // free runs behind the barrier go back to it (Note [Run handles]), and
    // their room is created again granule by granule.
    device_full = false;
    create_while_below(double(limit));
  }
  if (short_by() > 0) {
    // Not enough: give everything back rather than hold unmapped handles.
    unpop_granules(aliases);
    unpop_granules(victims);
    release_handles(handles);
    held -= handles.size() * gran;
    stats_.num_device_alloc += created;
    stats_.num_device_free += handles.size();
    return false;
  }
  const std::size_t reclaimed = victims.size() + aliases.size();
  retire_places(victims, &handles);
  retire_places(aliases, &handles);
  // Map the holes of [addr, addr + size) in runs of consecutive granules.
  std::size_t next = 0;
  const std::uint32_t group = ++map_groups;  // Note [Map groups]
  ++stats_.num_growths;
  for (const Hole& hole : unmapped_holes(heap, addr, size)) {
    clear_pending_places(heap, hole);
    const Addr at = heap.base + hole.first * gran;
    vmm_ops->map(at, handles.data() + next, hole.count);
    for (std::size_t k = hole.first; k < hole.first + hole.count; ++k) {
      heap.granules[k].handle = handles[next++];
      heap.granules[k].owner = 0;
      heap.granules[k].group = group;
    }
    trace(TraceAction::kSegmentMap, at, hole.count * gran, 0, heap.pool, op_context);
  }
  heap.mapped += missing;
  memory_dirty = true;
  mapped_bytes[heap.small ? 0 : 1] += missing * gran;
  stats_.num_device_alloc += created;
  stats_.num_reclaims += reclaimed;
  if (reclaimed && heap.pool == 0 && !heap.arena) plan_note_pressure();  // Note [Step plan]
  return true;
}

std::vector<Pool::Impl::Hole> Pool::Impl::unmapped_holes(const Heap& heap, Addr addr, std::size_t size) const {
  const std::size_t g0 = first_granule(heap, addr), g1 = end_granule(heap, addr + size);
  std::vector<Hole> holes;
  for (std::size_t i = g0; i < g1;) {
    if (heap.granules[i].handle) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < g1 && !heap.granules[j].handle) ++j;
    holes.push_back(Hole{i, j - i});
    i = j;
  }
  return holes;
}

void Pool::Impl::clear_pending_places(Heap& heap, const Hole& hole) {
  for (std::size_t k = hole.first; k < hole.first + hole.count; ++k) {
    // A pending place is unmapped before anything maps there (acquire took
    // the barrier if one was in the way, so this never waits).
    if (heap.granules[k].stale) resolve_stale(GranuleRef{heap.id, static_cast<std::uint32_t>(k)}, /*wait=*/true);
  }
}

void Pool::Impl::retire_places(std::vector<GranuleRef>& refs, std::vector<GranuleHandle>* handles) {
  std::vector<GranuleRef> now;
  for (GranuleRef ref : refs) {
    if (behind_barrier(granule(ref).seq)) {
      now.push_back(ref);
    } else {
      handles->push_back(make_stale(ref));
    }
  }
  if (!now.empty()) unmap_granules(now, handles);
}

std::size_t Pool::Impl::release_reclaimable(std::size_t keep_bytes) {
  if (held <= keep_bytes) return 0;
  // Their handles go back to the device: every place they were mapped at must
  // be unmapped, so the whole device must have caught up first. Refused (a
  // graph capture), only granules behind the last barrier go.
  // Nothing cached, nothing to wait for (PyTorch's empty_cache syncs only
  // when it frees something, too).
  const bool any_listed = std::any_of(slots.begin(), slots.end(), [](const detail::StreamSlot& s) { return s.listed > 0; });
  if (!any_listed && free_runs == 0) return 0;
  if (barrier_seq < seq) device_barrier();
  const std::size_t before = held;
  std::vector<GranuleRef> victims = pop_reclaimable((held - keep_bytes) / gran, kNoRequester);
  release_granules(victims);
  if (held > keep_bytes && free_runs) release_free_runs(held - keep_bytes, /*all_or_nothing=*/false);
  return before - held;
}

void Pool::Impl::release_pool_reclaimable(const PoolHeaps& heaps_of) {
  if (!vmm) {
    for (Heap* h : {heaps_of.small, heaps_of.large}) release_empty_segments_of(*h, false);
    return;
  }
  std::vector<GranuleRef> victims;
  for (const Heap* h : {heaps_of.small, heaps_of.large}) {
    for (std::size_t i = 0; i < h->granules.size(); ++i) {
      if (h->granules[i].on_list) victims.push_back(GranuleRef{h->id, static_cast<std::uint32_t>(i)});
    }
  }
  // Their handles leave the device: every stream must have caught up (Note [Device barrier]).
  if (victims.empty() || (barrier_seq < seq && !device_barrier())) return;
  for (const GranuleRef& ref : victims) list_remove(ref);
  release_granules(victims);
}

void Pool::Impl::release_granules(std::vector<GranuleRef>& victims) {
  if (victims.empty()) return;
  std::vector<GranuleHandle> handles;
  unmap_granules(victims, &handles);
  release_handles(handles);
  held -= handles.size() * gran;
  stats_.num_device_free += handles.size();
}

void Pool::Impl::release_handles(const std::vector<GranuleHandle>& handles) {
  for (GranuleHandle h : handles) {
    // Retire every pending place of the handle first (Note [Pending unmaps]).
    for (auto it = stale_at.find(h); it != stale_at.end(); it = stale_at.find(h)) {
      if (!resolve_stale(it->second, /*wait=*/true)) {
        throw std::logic_error("torchmem: a granule with a pending unmap was released while device barriers "
                               "are refused (a CUDA graph capture): this is a bug in torchmem");
      }
    }
    vmm_ops->release_granule(h);
  }
}

void Pool::Impl::premap_reserve() {
  Heap& heap = *default_large;
  std::size_t n = (config.reserve_bytes + gran - 1) / gran;
  n = std::min(n, budget() / gran);
  heap.granules.resize(std::max(heap.granules.size(), n));
  std::vector<GranuleHandle> handles;
  for (std::size_t i = 0; i < n; ++i) {
    GranuleHandle h = vmm_ops->create_granule();
    if (!h) {
      for (GranuleHandle x : handles) vmm_ops->release_granule(x);
      throw PoolError("PoolConfig.reserve_bytes: the device could not provide " +
                      std::to_string(n * gran) + " bytes");
    }
    handles.push_back(h);
  }
  if (n == 0) return;
  vmm_ops->map(heap.base, handles.data(), n);
  const std::uint32_t group = ++map_groups;  // Note [Map groups]
  ++stats_.num_growths;
  for (std::size_t i = 0; i < n; ++i) {
    heap.granules[i].handle = handles[i];
    heap.granules[i].group = group;
    heap.granules[i].seq = 0;
    list_push(0, GranuleRef{heap.id, static_cast<std::uint32_t>(i)}, /*front=*/false);
  }
  heap.mapped += n;
  memory_dirty = true;
  mapped_bytes[1] += n * gran;
  held += n * gran;
  reserve_held = n * gran;
  stats_.num_device_alloc += n;
  trace(TraceAction::kSegmentMap, heap.base, n * gran, 0, 0, op_context);
}

}  // namespace torchmem
