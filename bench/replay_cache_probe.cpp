// replay_cache_probe.cpp: one replay of a raw event file under torchmem's pool,
// for measuring the pool's host work per allocation under callgrind's cache
// simulator, with the caches hot or evicted between events (Note [Cold caches]
// in csrc/replay/replay.h). Plain g++, no torch: `make bench-cache-probe`.
//
//   replay_cache_probe EVENTS.bin BUDGET EVICT_BYTES PEAK_REQUEST
//
// EVENTS.bin: the (N, 4) int64 rows of a trace (numpy's tofile); BUDGET: a
// multiple of PEAK_REQUEST (bytes), 0 for no limit; EVICT_BYTES: the scratch
// walk after every alloc and free. Run it on a trace and on the same trace
// with more copies of its step (torchmem.analysis.patterns.repeat_last_step):
// the difference of the two runs' counts over the added allocations is one
// steady allocation's (BENCHMARKS.md, Lockstep under a budget, says how).
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "replay/replay.h"

using torchmem::ReplayOptions;
using torchmem::Replayer;
using torchmem::ReplayResult;
using torchmem::TraceEvent;

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s EVENTS.bin BUDGET EVICT_BYTES PEAK_REQUEST\n", argv[0]);
    return 2;
  }
  std::FILE* f = std::fopen(argv[1], "rb");
  if (!f) {
    std::fprintf(stderr, "replay_cache_probe: cannot open %s\n", argv[1]);
    return 2;
  }
  std::fseek(f, 0, SEEK_END);
  const long bytes = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<TraceEvent> events(static_cast<std::size_t>(bytes) / sizeof(TraceEvent));
  const std::size_t read = std::fread(events.data(), sizeof(TraceEvent), events.size(), f);
  std::fclose(f);
  if (read != events.size()) {
    std::fprintf(stderr, "replay_cache_probe: short read of %s\n", argv[1]);
    return 2;
  }
  const double budget = std::atof(argv[2]);
  const std::size_t peak = std::strtoull(argv[4], nullptr, 10);
  ReplayOptions options;
  options.sim.event_delay = 10;  // a GPU that runs behind the host, as the tests model it
  options.limit_bytes = budget > 0 ? static_cast<std::size_t>(static_cast<double>(peak) * budget) : 0;
  options.cache_evict_bytes = std::strtoull(argv[3], nullptr, 10);
  Replayer replayer(options);
  const ReplayResult r = replayer.run(events.data(), events.size());
  std::printf("allocs %zu peak_requested %zu plans %llu plan_hits %llu ooms %llu\n", r.allocs, r.peak_requested,
              static_cast<unsigned long long>(r.plans), static_cast<unsigned long long>(r.plan_hits),
              static_cast<unsigned long long>(r.ooms));
  return 0;
}
