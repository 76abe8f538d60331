// diagnostics.h: measurement and test hooks, not part of the allocator:
// timing probes for bench/gpu_probe.py and bench/empty_cache_fuzz.py
// (diagnostics.cpp), and a look at the context provider for tests/test_stacks.py
// (runtime.cpp). Nothing in the allocation path calls them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torchmem::shim {

// Times each backend primitive `repeats` times on `device` outside any pool and
// returns (name, mean microseconds) pairs; with `live_granules` granules mapped
// meanwhile and `evict_bytes` of host memory walked before each timed call
// (Note [Probe conditions] in diagnostics.cpp).
std::vector<std::pair<std::string, double>> probe_backend_costs(int device, int repeats, std::size_t granules,
                                                                std::size_t live_granules = 0,
                                                                std::size_t evict_bytes = 0);
// Nanoseconds per free + allocate pair through the shim's allocation path (the
// device's torchmem pool, legacy stream), 64 live blocks of mixed sizes.
double probe_pool_pair_ns(int device, int iterations);
// What the context provider in force gives now (0 with none).
std::uint64_t provider_context_now();

}  // namespace torchmem::shim
