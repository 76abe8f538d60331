// native_model.h: a model of PyTorch's default CUDA caching allocator
// (c10/cuda/CUDACachingAllocator.cpp, "native" in PYTORCH_CUDA_ALLOC_CONF
// terms), so torchmem can be compared with it on recorded traces without a GPU.
//
// It keeps the native allocator's policy and nothing else: no CUDA, no
// threads, no events. Addresses are fake (see Note [Descending addresses] in
// the .cpp), and the only "device calls" are segment allocations and frees,
// which are counted and given a modeled cost. It reproduces the recorded
// segment_alloc sequence of both shared traces exactly (so their native peak
// reserved bytes too); the tests hold it to within 1% of the recorded peak.
//
// Note [Native policy] (what PyTorch does, as modeled here)
// - Every request rounds up to a multiple of 512 B (kMinBlockSize).
// - Requests <= 1 MiB use the small pool, the rest the large pool. Each pool
//   is a set of free blocks ordered by (stream, size, address); a request
//   takes the first block at or above its size on its own stream (best fit,
//   lowest address among equals). Free blocks are never shared across streams.
// - No fit: a new segment ("cudaMalloc") of 2 MiB for small requests, 20 MiB
//   for requests under 10 MiB, else the request rounded up to 2 MiB.
// - A found block is split when the remainder is >= 512 B in the small pool,
//   or when the request is below max_split_size and the remainder is > 1 MiB
//   in the large pool (so large blocks may carry up to 1 MiB of slack).
// - A freed block merges with its free neighbours inside its segment.
// - Blocks >= max_split_size are never split, serve no request below
//   max_split_size, and serve larger requests only within 20 MiB of their size.
//
// Note [Native OOM steps] When no cached block fits, in order:
//   1. allocate a segment if reserved + segment <= the limit (the limit is
//      set_per_process_memory_fraction's maximum, else the device capacity);
//   2. only when max_split_size is set: free oversize cached blocks (the
//      smallest one that is big enough, else the largest ones until enough
//      bytes were freed) and retry 1;
//   3. free every cached block that fills its whole segment (unsplit), in
//      both pools (num_alloc_retries += 1), and retry 1;
//   4. give up: num_ooms += 1 and allocate() returns 0.
// Blocks that share a segment with a live block are never freed: this is
// the fragmentation that expandable segments and torchmem remove.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/types.h"

namespace torchmem {

struct NativeConfig {
  // Device memory: a segment allocation fails once reserved bytes would pass it.
  std::size_t capacity_bytes = 80 * kGiB;
  // set_per_process_memory_fraction as bytes; 0 = no limit beyond capacity.
  std::size_t limit_bytes = 0;
  // PYTORCH_CUDA_ALLOC_CONF max_split_size_mb, in bytes; SIZE_MAX = unset
  // (PyTorch's default).
  std::size_t max_split_size = std::numeric_limits<std::size_t>::max();
  // Modeled cost of one cudaMalloc / cudaFree in microseconds (the sim
  // backend's defaults, measured on an H200).
  double segment_alloc_us = 60.0;
  double segment_free_us = 100.0;
};

// Counters kept as PyTorch's DeviceStats names them, where they mean the same.
struct NativeStats {
  std::size_t reserved_bytes = 0;        // bytes in live segments
  std::size_t peak_reserved_bytes = 0;
  std::size_t allocated_bytes = 0;       // live blocks, rounded sizes
  std::size_t peak_allocated_bytes = 0;
  std::size_t requested_bytes = 0;       // live blocks, requested sizes
  std::size_t peak_requested_bytes = 0;
  std::size_t segments = 0;              // live segments
  std::uint64_t num_device_alloc = 0;    // segments allocated ("cudaMalloc")
  std::uint64_t num_device_free = 0;     // segments freed ("cudaFree")
  std::uint64_t num_alloc_retries = 0;   // step 3 of Note [Native OOM steps] ran
  std::uint64_t num_ooms = 0;
  std::uint64_t num_allocs = 0;          // successful allocate() calls
  std::uint64_t num_frees = 0;
  double modeled_us = 0.0;               // modeled time of device calls
};

// One segment and the blocks tiling it, lowest address first (tests, reports).
struct NativeSegment {
  Addr addr = 0;
  std::size_t size = 0;
  bool small_pool = false;
  StreamId stream = 0;
  struct Block {
    Addr addr;
    std::size_t size;
    std::size_t requested;  // 0 for free blocks
    bool allocated;
  };
  std::vector<Block> blocks;
};

// Thrown for caller errors (zero size, unknown or double free, bad config);
// the model is unchanged when it is thrown.
class NativeModelError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class NativeModel {
 public:
  explicit NativeModel(const NativeConfig& config);
  ~NativeModel();
  NativeModel(const NativeModel&) = delete;
  NativeModel& operator=(const NativeModel&) = delete;

  // The address of a block of at least `size` bytes for `stream`, or 0 when
  // every step of Note [Native OOM steps] failed. size == 0 throws.
  Addr allocate(std::size_t size, StreamId stream);
  // Frees a block returned by allocate(); unknown addresses throw.
  void deallocate(Addr addr);
  // torch.cuda.empty_cache(): frees every unsplit cached block. Returns bytes freed.
  std::size_t release_cached();
  // Changes the limit (0 = capacity only); live memory is not touched.
  void set_limit(std::size_t bytes);

  // The allocator's own rules, exposed for tests.
  static std::size_t round_size(std::size_t size);
  static std::size_t segment_size(std::size_t rounded_size);
  bool should_split(bool small_pool, std::size_t block_size, std::size_t rounded_size) const;

  const NativeStats& stats() const;
  std::vector<NativeSegment> segments() const;
  // "" when every invariant holds, else the first violation found: blocks
  // tile each segment, no two adjacent free blocks, the free sets hold exactly
  // the free blocks, counters equal sums.
  std::string check_invariants() const;
  const NativeConfig& config() const { return config_; }

  static constexpr std::size_t kSmallSize = 1 * kMiB;      // largest small request
  static constexpr std::size_t kSmallBuffer = 2 * kMiB;    // small pool segment
  static constexpr std::size_t kMinLargeAlloc = 10 * kMiB; // below: a kLargeBuffer segment
  static constexpr std::size_t kLargeBuffer = 20 * kMiB;
  static constexpr std::size_t kRoundLarge = 2 * kMiB;

 private:
  NativeConfig config_;
  struct State;  // blocks, free sets, address map (native_model.cpp)
  std::unique_ptr<State> state_;
};

}  // namespace torchmem
