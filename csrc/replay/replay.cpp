// replay.cpp: the trace replay driver and the min-cap search (see replay.h).
//
// The loop is deliberately plain: one hash map from trace address to target
// address, and a read of the target's held bytes after every event to find
// the peak and where it happened. Held bytes are what the target took from
// the device: for torchmem the simulated backend's created granules (mapped
// or spare: both count against a budget), for the native model its live
// segments.
#include "replay/replay.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

namespace torchmem {

const char* policy_name(ReplayPolicy policy) {
  switch (policy) {
    case ReplayPolicy::kNative: return "native";
    case ReplayPolicy::kExpandable: return "expandable";
    default: return "torchmem";
  }
}

ReplayPolicy parse_policy(const std::string& name) {
  if (name == "torchmem") return ReplayPolicy::kTorchmem;
  if (name == "native") return ReplayPolicy::kNative;
  if (name == "expandable") return ReplayPolicy::kExpandable;
  throw std::invalid_argument("unknown replay policy '" + name + "': expected 'torchmem', 'native' or 'expandable'");
}

Replayer::Replayer(const ReplayOptions& options) : options_(options) {
  if (options_.capacity_bytes) {
    options_.sim.capacity_bytes = options_.capacity_bytes;
    options_.native.capacity_bytes = options_.capacity_bytes;
    options_.expandable.capacity_bytes = options_.capacity_bytes;
  }
  if (options_.policy == ReplayPolicy::kNative) {
    if (options_.limit_bytes) options_.native.limit_bytes = options_.limit_bytes;
    // One cost table for both policies: the native model's device calls
    // cost what the simulated backend charges for cudaMalloc / cudaFree.
    options_.native.segment_alloc_us = options_.sim.costs.segment_alloc_us;
    options_.native.segment_free_us = options_.sim.costs.segment_free_us;
    native_ = std::make_unique<NativeModel>(options_.native);
  } else if (options_.policy == ReplayPolicy::kExpandable) {
    if (options_.limit_bytes) options_.expandable.limit_bytes = options_.limit_bytes;
    // A page costs what the simulated backend charges for a granule's handle.
    const SimCosts& c = options_.sim.costs;
    options_.expandable.map_page_us = c.create_us + c.map_us + c.set_access_us;
    options_.expandable.unmap_page_us = c.unmap_us + c.release_us;
    expandable_ = std::make_unique<ExpandableModel>(options_.expandable);
  } else {
    if (options_.limit_bytes) options_.pool.limit_bytes = options_.limit_bytes;
    backend_ = std::make_unique<SimBackend>(options_.sim);
    pool_ = std::make_unique<Pool>(*backend_, options_.pool);
  }
}

Replayer::~Replayer() {
  // The pool returns its memory to the backend, so it goes first.
  pool_.reset();
  backend_.reset();
}

namespace {

// The three targets (the native and expandable models, the pool) behind one
// small interface, resolved at compile time.
struct NativeTarget {
  NativeModel& model;
  Addr allocate(std::size_t size, StreamId stream) { return model.allocate(size, stream); }
  void free(Addr addr) { model.deallocate(addr); }
  std::size_t held() const { return model.stats().reserved_bytes; }
  double modeled_us() const { return model.stats().modeled_us; }
  // Releasing cached segments to retry synchronizes the device (cudaFree).
  std::uint64_t barriers() const { return model.stats().num_alloc_retries; }
  // cudaMalloc and cudaFree: each its own call, no burst (ReplayResult::growths).
  std::uint64_t growths() const { return 0; }
  BackendCounters calls() const {
    BackendCounters c;
    c.segment_alloc_calls = model.stats().num_device_alloc;
    c.segment_free_calls = model.stats().num_device_free;
    return c;
  }
};

struct ExpandableTarget {
  ExpandableModel& model;
  Addr allocate(std::size_t size, StreamId stream) { return model.allocate(size, stream); }
  void free(Addr addr) { model.deallocate(addr); }
  std::size_t held() const { return model.stats().reserved_bytes; }
  double modeled_us() const { return model.stats().modeled_us; }
  std::uint64_t barriers() const { return model.stats().num_alloc_retries; }
  std::uint64_t growths() const { return model.stats().map_bursts; }
  BackendCounters calls() const {
    BackendCounters c;
    c.create_calls = c.map_calls = model.stats().pages_mapped;
    c.unmap_calls = c.release_calls = model.stats().pages_unmapped;
    return c;
  }
};

struct PoolTarget {
  Pool& pool;
  SimBackend& backend;
  Addr allocate(std::size_t size, StreamId stream) { return pool.allocate(size, stream); }
  void free(Addr addr) { pool.deallocate(addr); }
  std::size_t held() const { return backend.device_used(); }
  double modeled_us() const { return backend.modeled_us(); }
  std::uint64_t barriers() const { return backend.counters().device_sync_calls; }
  std::uint64_t growths() const { return pool.stats().num_growths; }
  BackendCounters calls() const { return backend.counters(); }
};

// Note [Steady state]'s driver calls: create, release, map, unmap, a segment's
// cudaMalloc and cudaFree, device barriers.
std::uint64_t driver_calls(const BackendCounters& c) {
  return c.create_calls + c.release_calls + c.map_calls + c.unmap_calls + c.segment_alloc_calls +
         c.segment_free_calls + c.device_sync_calls;
}

BackendCounters minus(const BackendCounters& a, const BackendCounters& b) {
  BackendCounters d;
#define TORCHMEM_SUBTRACT_BACKEND_COUNTER(name) d.name = a.name - b.name;
  TORCHMEM_BACKEND_COUNTERS(TORCHMEM_SUBTRACT_BACKEND_COUNTER)
#undef TORCHMEM_SUBTRACT_BACKEND_COUNTER
  return d;
}

struct LiveBlock {
  Addr target_addr;  // 0: the alloc failed (an OOM); its free is skipped
  std::size_t requested;
};

template <typename Target>
void replay_events(Target target, const TraceEvent* events, std::size_t count, const ReplayOptions& options,
                   ReplayResult& result) {
  std::unordered_map<std::int64_t, LiveBlock> live;
  live.reserve(4096);
  // Note [Cold caches]: a scratch buffer written a cache line at a time.
  std::vector<unsigned char> scratch(options.cache_evict_bytes);
  unsigned char evict_sum = 0;
  auto evict_caches = [&] {
    for (std::size_t at = 0; at < scratch.size(); at += 64) {
      evict_sum = scratch[at] = static_cast<unsigned char>(scratch[at] + evict_sum + 1);
    }
  };
  std::size_t requested = 0;

  std::size_t end = count;
  if (options.stop_at >= 0) end = std::min(count, static_cast<std::size_t>(options.stop_at) + 1);

  if (options.timeline) {
    options.timeline->clear();
    options.timeline->reserve(end);
  }
  std::size_t held = target.held();

  auto release = [&](const LiveBlock& block) {
    if (block.target_addr == 0) {
      result.skipped_frees += 1;
      return;
    }
    target.free(block.target_addr);
    requested -= block.requested;
    result.frees += 1;
  };

  // Note [Steady state]: the second half of the walk, after warm-up.
  const std::size_t half = end / 2;
  double half_us = 0.0;
  std::uint64_t half_barriers = 0, half_growths = 0;
  BackendCounters half_by_kind;
  for (std::size_t i = 0; i < end; ++i) {
    if (i == half) {
      half_us = target.modeled_us();
      half_barriers = target.barriers();
      half_growths = target.growths();
      half_by_kind = target.calls();
    }
    const TraceEvent& e = events[i];
    if (e.action == 0) {
      auto found = live.find(e.addr);
      if (found != live.end()) {  // the trace lost a free (a wrapped ring buffer)
        result.lost_frees += 1;
        release(found->second);
        live.erase(found);
      }
      if (e.size > 0) {  // torch never asks for 0 bytes; nothing to place
        const auto size = static_cast<std::size_t>(e.size);
        const Addr addr = target.allocate(size, static_cast<StreamId>(e.stream));
        live.emplace(e.addr, LiveBlock{addr, size});
        if (addr != 0) {
          result.allocs += 1;
          requested += size;
          result.peak_requested = std::max(result.peak_requested, requested);
        }
      }
    } else if (e.action == 1) {
      auto found = live.find(e.addr);
      if (found == live.end()) {
        result.unmatched_frees += 1;
      } else {
        release(found->second);
        live.erase(found);
      }
    }
    if (e.action == 0 || e.action == 1) {
      if (!scratch.empty()) evict_caches();
      held = target.held();
      if (held > result.peak_reserved) {
        result.peak_reserved = held;
        result.peak_reserved_event = static_cast<std::int64_t>(i);
      }
    }
    if (options.timeline) options.timeline->push_back(static_cast<std::int64_t>(held));
    if (options.progress && (i + 1) % options.progress_every == 0) options.progress(i + 1, end);
  }
  result.events = end;
  // A volatile store is observable, so the scratch walk that feeds it cannot be optimized away.
  [[maybe_unused]] volatile unsigned char evict_sink = evict_sum;
  result.final_reserved = target.held();
  result.backend_calls = target.calls();
  result.modeled_backend_us = target.modeled_us();
  result.steady_backend_us = result.modeled_backend_us - half_us;
  result.steady_backend_calls = minus(result.backend_calls, half_by_kind);
  result.steady_driver_calls = driver_calls(result.steady_backend_calls);
  result.steady_barriers = target.barriers() - half_barriers;
  result.growths = target.growths();
  result.steady_growths = result.growths - half_growths;
  if (options.progress) options.progress(end, end);
}

}  // namespace

ReplayResult Replayer::run(const TraceEvent* events, std::size_t count) {
  if (ran_) throw std::logic_error("Replayer::run: a Replayer replays one trace once; make a new one");
  ran_ = true;
  ReplayResult result;
  if (native_) {
    replay_events(NativeTarget{*native_}, events, count, options_, result);
    const NativeStats& stats = native_->stats();
    result.ooms = stats.num_ooms;
    result.alloc_retries = result.device_barriers = stats.num_alloc_retries;
  } else if (expandable_) {
    replay_events(ExpandableTarget{*expandable_}, events, count, options_, result);
    const ExpandableStats& stats = expandable_->stats();
    result.ooms = stats.num_ooms;
    result.alloc_retries = result.device_barriers = stats.num_alloc_retries;
  } else {
    replay_events(PoolTarget{*pool_, *backend_}, events, count, options_, result);
    const PoolStats stats = pool_->stats();
    result.ooms = stats.num_ooms;
    result.alloc_retries = stats.num_alloc_retries;
    result.reclaims = stats.num_reclaims;
    result.device_barriers = stats.num_device_barriers;
    result.plans = stats.num_plans;
    result.plan_hits = stats.num_plan_hits;
    result.plan_misses = stats.num_plan_misses;
    result.plan_drops = stats.num_plan_drops;
    result.plan_passes = stats.num_plan_passes;
    result.plan_pass_us = stats.plan_pass_us;
    result.host_alloc_ns = stats.host_alloc_ns;
    result.host_free_ns = stats.host_free_ns;
    result.host_plan_ns = stats.host_plan_ns;
  }
  return result;
}

ReplayResult replay(const TraceEvent* events, std::size_t count, const ReplayOptions& options) {
  Replayer replayer(options);
  return replayer.run(events, count);
}

MinCapResult find_min_cap(const TraceEvent* events, std::size_t count, const ReplayOptions& options,
                          std::size_t precision) {
  if (precision == 0) throw std::invalid_argument("find_min_cap: precision must be > 0 bytes");
  ReplayOptions quiet = options;
  quiet.progress = nullptr;
  quiet.stop_at = -1;
  quiet.limit_bytes = 0;
  quiet.pool.limit_bytes = 0;
  quiet.native.limit_bytes = 0;
  quiet.expandable.limit_bytes = 0;

  MinCapResult found;
  int expected = 16;
  auto run_with = [&](std::size_t budget) {
    ReplayOptions limited = quiet;
    limited.limit_bytes = budget;
    ReplayResult r = replay(events, count, limited);
    found.replays += 1;
    if (options.progress) options.progress(static_cast<std::size_t>(found.replays), static_cast<std::size_t>(expected));
    return r;
  };

  const ReplayResult unlimited = replay(events, count, quiet);
  found.replays = 1;
  found.peak_requested = unlimited.peak_requested;
  found.unlimited_peak_reserved = unlimited.peak_reserved;
  if (unlimited.ooms > 0) {
    throw std::invalid_argument("find_min_cap: the trace does not replay without OOM even with no budget (" +
                             std::to_string(unlimited.ooms) + " OOMs at the device capacity); raise the capacity");
  }
  if (unlimited.peak_requested == 0) return found;  // nothing to place

  // Budgets are whole multiples of `precision`. lo fails, hi passes.
  std::size_t lo = (unlimited.peak_requested - 1) / precision;
  std::size_t hi = (unlimited.peak_reserved + precision - 1) / precision;
  std::size_t steps = 1;
  for (std::size_t span = hi > lo ? hi - lo : 1; span > 1; span = (span + 1) / 2) ++steps;
  expected = static_cast<int>(steps) + 2;
  while (run_with(hi * precision).ooms > 0) {
    // Not monotonic after all (Note [Min-cap]): widen until it passes.
    const std::size_t capacity = options.capacity_bytes ? options.capacity_bytes : options.sim.capacity_bytes;
    if (hi * precision >= capacity) {
      throw std::invalid_argument("find_min_cap: no budget up to the device capacity replays without OOM");
    }
    lo = hi;
    hi = std::min(hi * 2, capacity / precision);
  }
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (run_with(mid * precision).ooms == 0) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  found.min_cap = hi * precision;
  return found;
}

}  // namespace torchmem
