// random_ops.h: a seeded random workload against the pool, checked against a
// reference model of live blocks and against check_invariants().
//
// Used by tests/test_pool_random.py through _C._random_ops: running the loop
// in C++ makes millions of operations per CI run affordable. It drives a
// SimBackend (plain C++, no CUDA), the one place csrc/core reaches into
// csrc/backend, because the driver is a test harness, not allocator code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace torchmem::replay {

struct RandomOpsOptions {
  bool vmm = true;
  std::size_t capacity = 512ull << 20;  // sim device memory
  std::size_t limit = 0;                // PoolConfig.limit_bytes (0 = capacity)
  std::size_t check_every = 1000;       // check_invariants() period (ops)
  std::uint64_t event_delay = 0;        // SimConfig.event_delay
  unsigned streams = 2;                 // distinct streams used
  double reclaim_slack = 0.0;
  double stitch_above = 0.0;            // PoolConfig.stitch_above (0: stitch as often as possible)
  double run_below = 0.5;               // PoolConfig.run_below (Note [Run handles])
  double run_below_limit = 0.0;         // PoolConfig.run_below_limit (Note [Runs under a limit])
  // Before one free in `foreign_readers`, a kernel on another stream keeps
  // reading the block (a free without record_stream); any unmap under it
  // fails the run (Note [Device barrier] in pool.h). 0 = never.
  unsigned foreign_readers = 4;
  // Before one free in `declared_readers`, a kernel on another allocating
  // stream reads the block and the free names that stream as current (Note
  // [Freed under another stream]); memory handed to a third stream under it
  // without a wait fails the run. 0 = never.
  unsigned declared_readers = 4;
  // One op in `scopes` opens or closes a scope in which the sim refuses device
  // barriers and stream waits, as a CUDA graph capture or a MemPool scope does
  // (Note [Unmapped tail] in core/detail/stream_reuse.cpp); the checks above
  // hold inside it as outside. 0 = never.
  unsigned scopes = 0;
  bool alias_reclaim = true;            // PoolConfig.alias_reclaim
  bool private_pools = true;            // create/use/release private pools
  std::size_t max_live = 400;           // free when this many blocks are live
};

struct RandomOpsSummary {
  std::uint64_t ops = 0, allocs = 0, frees = 0, ooms = 0, checks = 0, reclaims = 0;
  std::uint64_t scope_allocs = 0;  // allocations served inside a scope
  std::uint64_t peak_live = 0, peak_held = 0;
};

// Returns "" on success, else "seed S, op N (what): problem".
std::string run_random_ops(std::uint64_t seed, std::size_t ops, const RandomOpsOptions& options,
                           RandomOpsSummary* summary);

}  // namespace torchmem::replay
