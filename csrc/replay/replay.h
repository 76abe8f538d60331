// replay.h: replays a recorded allocator trace under an allocation policy and
// measures what that policy would have held.
//
// A trace (torchmem/analysis/trace.py) is a list of (action, addr, size, stream) rows
// recorded from a real program under PyTorch's native allocator. Replay feeds
// its allocs (action 0) and frees (action 1) in order to a target, maps each
// trace address to the address the target returned, and records the peak of
// live requested bytes, the peak of bytes the target held from its backend,
// OOMs and backend calls. Targets:
//   - kTorchmem: torchmem's Pool (pool.h) over the simulated backend, i.e.
//     the exact policy code that runs on the GPU;
//   - kNative: NativeModel (native_model.h), PyTorch's default allocator;
//   - kExpandable: ExpandableModel (expandable_model.h), PyTorch's allocator
//     with expandable_segments:True.
// Other actions (free_completed, segment events) describe the recording
// allocator, not the program, and are skipped.
//
// Note [Replay under OOM] A trace is always replayed to the end. An alloc the
// target cannot satisfy counts as an OOM and its later free is skipped; the
// rest of the program's events go on as recorded, so the OOM count says how
// many allocations would have failed, not where the program would have died.
//
// Note [Min-cap] The smallest budget under which a trace replays with no OOM,
// found by bisection at a given precision (one 2 MiB granule by default)
// between the largest budget below peak requested (which must fail: held
// bytes never fall below live bytes) and the unlimited run's peak held bytes
// (which must pass: the budget never binds). Bisection assumes a budget that
// passes keeps passing when raised; allocator policies need not be monotonic,
// so the answer is "a budget that was replayed and passed, with the one just
// below it failing", each end verified by a replay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/sim_backend.h"
#include "core/backend.h"
#include "replay/expandable_model.h"
#include "replay/native_model.h"
#include "core/pool.h"

namespace torchmem {

// One trace row; an (N, 4) int64 array is an array of these.
struct TraceEvent {
  std::int64_t action;
  std::int64_t addr;
  std::int64_t size;
  std::int64_t stream;
};

enum class ReplayPolicy : int { kTorchmem = 0, kNative = 1, kExpandable = 2 };

// Default device size for replays: an H200 (the traces' device) reports
// ~140 GiB. Only matters when a trace needs more than the budget allows.
constexpr std::size_t kReplayCapacity = 140 * kGiB;

struct ReplayOptions {
  ReplayPolicy policy = ReplayPolicy::kTorchmem;
  PoolConfig pool;      // torchmem's configuration (its limit_bytes is the budget)
  NativeConfig native;  // the native model's (its limit_bytes is the budget)
  ExpandableConfig expandable;  // the expandable model's (its limit_bytes is the budget)
  SimConfig sim;        // the simulated device for torchmem (capacity, costs)
  // Budget in bytes for any policy; 0 keeps the policy config's own limit.
  std::size_t limit_bytes = 0;
  // Device memory for both policies; 0 keeps sim.capacity_bytes and
  // native.capacity_bytes as they are.
  std::size_t capacity_bytes = kReplayCapacity;
  // Stop after the event with this index (inclusive), e.g. at the peak to
  // look at the layout there; -1 = replay everything.
  std::int64_t stop_at = -1;
  // Called every progress_every events with (events done, events total).
  std::function<void(std::size_t, std::size_t)> progress;
  std::size_t progress_every = std::size_t{1} << 16;
  // Note [Cold caches] After every alloc and free, walk this many bytes of a
  // scratch buffer (one write per cache line) before the next event. In a
  // training step the host runs ~30 us of Python, autograd and CUDA launches
  // between two allocations, which evicts the pool's data from the CPU's
  // nearer caches; a replay's tight loop keeps it all hot and so hides the
  // cost of a path that touches more cache lines. Host-time measurements
  // only (bench/replay_steps.py --evict-kib): it changes no decision.
  std::size_t cache_evict_bytes = 0;
  // When set, receives the held bytes after every event walked (one entry
  // per trace row, up to stop_at), for plots of the reserved curve.
  std::vector<std::int64_t>* timeline = nullptr;
};

struct ReplayResult {
  std::size_t events = 0;           // trace rows walked (up to stop_at)
  std::size_t allocs = 0;           // allocs replayed successfully
  std::size_t frees = 0;            // frees replayed
  std::size_t skipped_frees = 0;    // frees of failed allocs (Note [Replay under OOM])
  std::size_t unmatched_frees = 0;  // frees of addresses the trace never allocated
  std::size_t lost_frees = 0;       // allocs at a live address: the earlier block is freed first
  std::size_t peak_requested = 0;   // peak of live requested bytes
  std::size_t peak_reserved = 0;    // peak bytes held from the backend
  std::int64_t peak_reserved_event = -1;  // first event index at which peak_reserved was reached
  std::size_t final_reserved = 0;
  std::uint64_t ooms = 0;
  std::uint64_t alloc_retries = 0;  // allocations that released cached memory and retried
  std::uint64_t reclaims = 0;       // torchmem: granules stitched from cached free space
  // torchmem: device barriers (backend_calls.device_sync_calls, counted by the
  // pool) and step plans (Note [Step plan]): put in force, allocations placed
  // by one, allocations one could not place.
  std::uint64_t device_barriers = 0, plans = 0, plan_drops = 0, plan_hits = 0, plan_misses = 0;
  // torchmem: planning passes run (adopted or not) and their host time on this
  // machine (Note [Planning pass cost]).
  std::uint64_t plan_passes = 0, plan_pass_us = 0;
  // The pool's own host time (config time_host_ops only, Note [Host time]).
  std::uint64_t host_alloc_ns = 0, host_free_ns = 0, host_plan_ns = 0;
  std::uint64_t steady_barriers = 0;  // device barriers in the second half of the walk
  BackendCounters backend_calls;    // native: segment_alloc/free calls only; expandable: a create and a
                                    // map per page mapped, an unmap and a release per page unmapped
  double modeled_backend_us = 0.0;
  // Note [Steady state] The same over the second half of the walk only (after
  // warm-up): what a long run keeps paying. Driver calls: create, release,
  // map, unmap, device barriers (torchmem); cudaMalloc/cudaFree (native).
  double steady_backend_us = 0.0;
  std::uint64_t steady_driver_calls = 0;
  // Note [Call bursts] Growths: mappings of new or moved memory, each a burst
  // of driver calls that follow one another (torchmem: num_growths, Note [Map
  // groups]; expandable: each mapping of contiguous pages; native: none, a
  // cudaMalloc is one call). The first call of each kind in a burst finds the
  // host's caches evicted by the framework's work since the last one, so a
  // time model prices it higher (torchmem/analysis/call_costs.py). With the
  // second half's calls by kind, for the same model after warm-up.
  std::uint64_t growths = 0, steady_growths = 0;
  BackendCounters steady_backend_calls;
};

// Owns one target, so a caller can look at it after run() (e.g. a snapshot
// at stop_at). One Replayer runs one trace once.
class Replayer {
 public:
  explicit Replayer(const ReplayOptions& options);
  ~Replayer();
  Replayer(const Replayer&) = delete;
  Replayer& operator=(const Replayer&) = delete;

  ReplayResult run(const TraceEvent* events, std::size_t count);

  // The target, for inspection after run(); null for the other policies.
  const Pool* pool() const { return pool_.get(); }
  const SimBackend* backend() const { return backend_.get(); }
  const NativeModel* native() const { return native_.get(); }
  const ExpandableModel* expandable() const { return expandable_.get(); }

 private:
  ReplayOptions options_;
  std::unique_ptr<SimBackend> backend_;
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<NativeModel> native_;
  std::unique_ptr<ExpandableModel> expandable_;
  bool ran_ = false;
};

ReplayResult replay(const TraceEvent* events, std::size_t count, const ReplayOptions& options);

struct MinCapResult {
  std::size_t min_cap = 0;          // smallest budget found with no OOM
  std::size_t peak_requested = 0;   // of the unlimited run
  std::size_t unlimited_peak_reserved = 0;
  int replays = 0;                  // replays the search ran
};

// Note [Min-cap]. options.limit_bytes is ignored; options.progress, when set,
// is called once per replay with (replays done, an estimate of the total).
MinCapResult find_min_cap(const TraceEvent* events, std::size_t count, const ReplayOptions& options,
                          std::size_t precision = 2 * kMiB);

const char* policy_name(ReplayPolicy policy);
// "torchmem" | "native" | "expandable"; anything else throws std::invalid_argument naming the choices.
ReplayPolicy parse_policy(const std::string& name);

}  // namespace torchmem
