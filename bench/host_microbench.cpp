// host_microbench.cpp: nanoseconds per cached allocate+free pair of the pinned
// host pool (csrc/host), over the simulated host backend: the pool's own
// bookkeeping, which is what a cached torch.empty(pin_memory=True) pays on top
// of torch once the pool is torch's host allocator (bench/host_bench.py
// measures the whole call on a GPU machine).
//
// Built with plain g++ (no torch, no CUDA): `make bench-host-micro`.
// Loops, over a background of `live` live blocks of seeded sizes (4 KiB..16 MiB):
//   reported  copies reported (torch's contract once installed): no events
//   guessing  the standalone pool: every free records an event on the
//             allocation stream (the sim's events complete at once)
//
// Usage: host_microbench [iterations=2000000] [live=64] [seed=1]
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "host/host_pool.h"
#include "host/sim_host_backend.h"

using namespace torchmem::host;

namespace {

double now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

double pair_ns(bool reported, std::size_t iterations, std::size_t live, std::uint64_t seed) {
  SimHostConfig sim;
  sim.huge_pages = HugePages::kOff;
  sim.sysfs_root = "/nonexistent";
  SimHostBackend backend(sim);
  HostPoolConfig config;
  HostPool pool(backend, config);
  pool.set_copies_reported(reported);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(12.0, 24.0);
  std::vector<void*> background;
  for (std::size_t i = 0; i < live; ++i) background.push_back(pool.allocate(std::size_t(std::exp2(u(rng))), 1));
  std::vector<std::size_t> sizes(1024);
  for (auto& s : sizes) s = std::size_t(std::exp2(u(rng)));
  for (std::size_t s : sizes) pool.free(pool.allocate(s, 1));  // every size cached once
  double best = 1e300;
  const std::size_t rounds = 10, per_round = iterations / rounds;
  for (std::size_t r = 0; r < rounds; ++r) {
    const double t0 = now_ns();
    for (std::size_t i = 0; i < per_round; ++i) pool.free(pool.allocate(sizes[i & 1023], 1));
    best = std::min(best, (now_ns() - t0) / double(per_round));
  }
  for (void* p : background) pool.free(p);
  const HostPoolStats s = pool.stats();
  std::printf("  %-9s chunks %llu, cache misses %llu\n", reported ? "reported" : "guessing",
              (unsigned long long)s.chunks, (unsigned long long)s.cache_misses);
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t iterations = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 2000000;
  const std::size_t live = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 64;
  const std::uint64_t seed = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1;
  const double reported = pair_ns(true, iterations, live, seed);
  const double guessing = pair_ns(false, iterations, live, seed);
  std::printf("host pool cached allocate+free pair: %.1f ns (copies reported), %.1f ns (an event per free, sim)\n",
              reported, guessing);
  return 0;
}
