// expandable_model.h: a model of PyTorch's caching allocator with
// expandable_segments:True (c10/cuda/CUDACachingAllocator.cpp), so a trace
// can be replayed under the allocator that torchmem's unconstrained growth is
// measured against (peak reserved at or under expandable_segments') without a
// GPU.
//
// Like NativeModel it keeps the policy and nothing else: no CUDA, no events,
// fake addresses. Its "device calls" are page maps and unmaps, counted and
// given the simulated backend's costs.
//
// Note [Expandable policy] (what PyTorch does, as modeled here)
// - Requests round up to 512 B; <= 1 MiB goes to the small pool, the rest to
//   the large pool, as in Note [Native policy].
// - Each (stream, pool) owns one segment: a virtual range larger than the
//   device, mapped page by page (2 MiB pages in the small pool, 20 MiB in the
//   large), lowest address first. Its unmapped stretches are blocks too.
// - Best fit among mapped free blocks of the stream, ordered (size, address),
//   except that a free block touching an unmapped stretch counts as that much
//   bigger ("expandable size"): from the first fit, the search steps to the
//   next block while that one's expandable size is smaller. So the segment's
//   free tail serves a request only when no other free block fits.
// - No fit: the lowest-addressed run of free and unmapped blocks with room
//   (a free block just before an unmapped stretch included) is mapped,
//   page-rounded, only as far as the request needs, merged, and carved.
// - A found block is always split when 512 B or more remain.
// - A freed block merges with its mapped free neighbours.
// - OOM (a budget or the device would be passed): unmap every whole page
//   inside a free block, in both pools, then try once more.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/types.h"
#include "replay/native_model.h"

namespace torchmem {

struct ExpandableConfig {
  std::size_t capacity_bytes = 80 * kGiB;  // mapped pages never pass it
  std::size_t limit_bytes = 0;             // set_per_process_memory_fraction; 0 = none
  double map_page_us = 29.2;               // cuMemCreate + cuMemMap + cuMemSetAccess, one page
  double unmap_page_us = 24.0;             // cuMemUnmap + cuMemRelease, one page
};

struct ExpandableStats {
  std::size_t reserved_bytes = 0;  // mapped pages
  std::size_t peak_reserved_bytes = 0;
  std::size_t allocated_bytes = 0;  // live blocks, rounded sizes
  std::size_t requested_bytes = 0;
  std::size_t peak_requested_bytes = 0;
  std::uint64_t pages_mapped = 0;
  std::uint64_t pages_unmapped = 0;
  std::uint64_t map_bursts = 0;  // mappings of one or more contiguous pages (a growth)
  std::uint64_t num_alloc_retries = 0;
  std::uint64_t num_ooms = 0;
  double modeled_us = 0.0;
};

class ExpandableModelError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class ExpandableModel {
 public:
  explicit ExpandableModel(const ExpandableConfig& config);
  ~ExpandableModel();
  ExpandableModel(const ExpandableModel&) = delete;
  ExpandableModel& operator=(const ExpandableModel&) = delete;

  // A block of at least `size` bytes, or 0 on OOM; size == 0 throws.
  Addr allocate(std::size_t size, StreamId stream);
  // Frees a block allocate() returned; unknown addresses throw.
  void deallocate(Addr addr);
  // torch.cuda.empty_cache(): unmaps every whole page of free blocks; returns bytes unmapped.
  std::size_t release_cached();

  const ExpandableStats& stats() const;
  const ExpandableConfig& config() const { return config_; }
  // "" when every invariant holds: blocks tile each segment's mapped prefix
  // and holes, no two adjacent free mapped blocks, sets hold exactly the free
  // blocks, counters equal sums, unmapped stretches are page-aligned.
  std::string check_invariants() const;

  // PyTorch's own constants: the pools split alike, and a page is a native segment's size.
  static constexpr std::size_t kSmallSize = NativeModel::kSmallSize;
  static constexpr std::size_t kSmallPage = NativeModel::kSmallBuffer;
  static constexpr std::size_t kLargePage = NativeModel::kLargeBuffer;

 private:
  ExpandableConfig config_;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace torchmem
