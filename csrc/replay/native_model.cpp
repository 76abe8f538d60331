// native_model.cpp: the model of PyTorch's native caching allocator (see
// native_model.h for the policy it reproduces and why it exists).
//
// The structure follows the real allocator where that decides behaviour: free
// blocks live in one std::set per pool ordered by (stream, size, address), so
// lower_bound gives PyTorch's exact best fit including its tie-break; blocks
// of one segment form a doubly linked list in address order for split and
// merge. Everything else (stats, events, graphs, IPC) is left out or reduced
// to counters.
#include "replay/native_model.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

namespace torchmem {

namespace {

struct Block {
  Addr addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // requested size while allocated
  StreamId stream = 0;
  bool allocated = false;
  bool small_pool = false;
  Block* prev = nullptr;  // address neighbours inside the segment
  Block* next = nullptr;

  bool is_split() const { return prev != nullptr || next != nullptr; }
};

struct BySizeThenAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};

using FreeSet = std::set<Block*, BySizeThenAddress>;

struct SegmentRecord {
  std::size_t size;
  bool small_pool;
  StreamId stream;
};

// Note [Descending addresses]
// Fake device addresses: each new segment goes just below the previous one,
// 2 MiB aligned, never reused. Only their order matters, through best fit's
// tie-break between free blocks of equal size (lowest address wins). On the
// H200 the driver handed out successive cudaMalloc segments at descending
// addresses; with ascending fake addresses the model picked other blocks and
// drifted from the recorded segment sequence (-0.05% peak on gpt2), with
// descending ones it reproduces both shared traces' segment_alloc sequences
// exactly.
constexpr Addr kAddressBase = Addr{1} << 47;

}  // namespace

struct NativeModel::State {
  FreeSet small_free;
  FreeSet large_free;
  std::unordered_map<Addr, Block*> allocated;  // live blocks by address
  std::map<Addr, SegmentRecord> segments;      // live segments by base address
  Addr next_address = kAddressBase;
  NativeStats stats;

  FreeSet& pool(bool small) { return small ? small_free : large_free; }

  ~State() {
    for (Block* b : small_free) delete b;
    for (Block* b : large_free) delete b;
    for (auto& entry : allocated) delete entry.second;
  }
};

NativeModel::NativeModel(const NativeConfig& config) : config_(config), state_(new State) {
  if (config.capacity_bytes < kSmallBuffer) {
    throw NativeModelError("native model: capacity_bytes must be at least 2 MiB (one segment), got " +
                           std::to_string(config.capacity_bytes));
  }
  if (config.max_split_size < kLargeBuffer) {
    // PyTorch refuses max_split_size_mb below 20 MiB too.
    throw NativeModelError("native model: max_split_size must be at least 20 MiB (or unset), got " +
                           std::to_string(config.max_split_size));
  }
}

NativeModel::~NativeModel() = default;

std::size_t NativeModel::round_size(std::size_t size) {
  if (size < kMinBlockSize) return kMinBlockSize;
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

std::size_t NativeModel::segment_size(std::size_t rounded_size) {
  if (rounded_size <= kSmallSize) return kSmallBuffer;
  if (rounded_size < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((rounded_size + kRoundLarge - 1) / kRoundLarge);
}

bool NativeModel::should_split(bool small_pool, std::size_t block_size, std::size_t rounded_size) const {
  const std::size_t remaining = block_size - rounded_size;
  if (small_pool) return remaining >= kMinBlockSize;
  return rounded_size < config_.max_split_size && remaining > kSmallSize;
}

void NativeModel::set_limit(std::size_t bytes) { config_.limit_bytes = bytes; }

const NativeStats& NativeModel::stats() const { return state_->stats; }

namespace {

// Best fit on `stream` as get_free_block() does it, oversize rules included.
Block* find_free_block(FreeSet& pool, StreamId stream, std::size_t size, std::size_t max_split_size) {
  Block key;
  key.stream = stream;
  key.size = size;
  key.addr = 0;
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* block = *it;
  if (size < max_split_size && block->size >= max_split_size) return nullptr;
  if (size >= max_split_size && block->size >= size + NativeModel::kLargeBuffer) return nullptr;
  pool.erase(it);
  return block;
}

}  // namespace

Addr NativeModel::allocate(std::size_t size, StreamId stream) {
  if (size == 0) {
    throw NativeModelError("native model: allocate(0): a request must be at least 1 byte");
  }
  State& s = *state_;
  const std::size_t rounded = round_size(size);
  const bool small = rounded <= kSmallSize;
  FreeSet& pool = s.pool(small);
  const std::size_t alloc_size = segment_size(rounded);
  const std::size_t maximum =
      config_.limit_bytes ? std::min(config_.limit_bytes, config_.capacity_bytes) : config_.capacity_bytes;

  // A new segment, unless it would pass the limit (alloc_block()).
  auto allocate_segment = [&]() -> Block* {
    if (s.stats.reserved_bytes + alloc_size > maximum) return nullptr;
    Block* block = new Block;
    s.next_address -= kRoundLarge * ((alloc_size + kRoundLarge - 1) / kRoundLarge);
    block->addr = s.next_address;
    block->size = alloc_size;
    block->stream = stream;
    block->small_pool = small;
    s.segments[block->addr] = SegmentRecord{alloc_size, small, stream};
    s.stats.reserved_bytes += alloc_size;
    s.stats.peak_reserved_bytes = std::max(s.stats.peak_reserved_bytes, s.stats.reserved_bytes);
    s.stats.segments += 1;
    s.stats.num_device_alloc += 1;
    s.stats.modeled_us += config_.segment_alloc_us;
    return block;
  };

  // Frees one cached, unsplit block's segment (release_block()).
  auto release_segment = [&](FreeSet& from, FreeSet::iterator it) {
    Block* block = *it;
    from.erase(it);
    s.segments.erase(block->addr);
    s.stats.reserved_bytes -= block->size;
    s.stats.segments -= 1;
    s.stats.num_device_free += 1;
    s.stats.modeled_us += config_.segment_free_us;
    delete block;
  };

  // Step 2: release_available_cached_blocks(): oversize blocks only.
  auto release_oversize = [&]() -> bool {
    if (config_.max_split_size == std::numeric_limits<std::size_t>::max()) return false;
    Block key;
    key.stream = stream;
    key.size = std::max(rounded, config_.max_split_size);
    key.addr = 0;
    auto it = pool.lower_bound(&key);
    if (it != pool.end() && (*it)->stream == stream) {
      release_segment(pool, it);
      return true;
    }
    // No single block is large enough: free the largest oversize blocks of
    // this stream until enough bytes went back.
    if (it == pool.begin()) return false;
    std::size_t released = 0;
    --it;
    while (released < key.size && (*it)->size >= config_.max_split_size && (*it)->stream == stream) {
      auto current = it;
      released += (*it)->size;
      const bool at_begin = it == pool.begin();
      if (!at_begin) --it;
      release_segment(pool, current);
      if (at_begin) break;
    }
    return released >= key.size;
  };

  // Step 3: release_cached_blocks(): every unsplit cached block of both pools.
  auto release_unsplit = [&]() {
    for (FreeSet* set : {&s.large_free, &s.small_free}) {
      for (auto it = set->begin(); it != set->end();) {
        auto current = it++;
        if (!(*current)->is_split()) release_segment(*set, current);
      }
    }
  };

  Block* block = find_free_block(pool, stream, rounded, config_.max_split_size);
  if (block == nullptr) {
    block = allocate_segment();
    if (block == nullptr && release_oversize()) block = allocate_segment();
    if (block == nullptr) {
      release_unsplit();
      s.stats.num_alloc_retries += 1;
      block = allocate_segment();
    }
  }
  if (block == nullptr) {
    s.stats.num_ooms += 1;
    return 0;
  }

  if (should_split(small, block->size, rounded)) {
    // The front part serves the request; the rest goes back to the pool.
    Block* remaining = new Block;
    remaining->addr = block->addr + rounded;
    remaining->size = block->size - rounded;
    remaining->stream = block->stream;
    remaining->small_pool = small;
    remaining->prev = block;
    remaining->next = block->next;
    if (remaining->next) remaining->next->prev = remaining;
    block->next = remaining;
    block->size = rounded;
    pool.insert(remaining);
  }
  block->allocated = true;
  block->requested = size;
  s.allocated[block->addr] = block;

  NativeStats& st = s.stats;
  st.allocated_bytes += block->size;
  st.peak_allocated_bytes = std::max(st.peak_allocated_bytes, st.allocated_bytes);
  st.requested_bytes += size;
  st.peak_requested_bytes = std::max(st.peak_requested_bytes, st.requested_bytes);
  st.num_allocs += 1;
  return block->addr;
}

void NativeModel::deallocate(Addr addr) {
  State& s = *state_;
  auto found = s.allocated.find(addr);
  if (found == s.allocated.end()) {
    std::ostringstream msg;
    msg << "native model: free of address 0x" << std::hex << addr
        << " that is not a live allocation (never allocated, or already freed)";
    throw NativeModelError(msg.str());
  }
  Block* block = found->second;
  s.allocated.erase(found);
  s.stats.allocated_bytes -= block->size;
  s.stats.requested_bytes -= block->requested;
  s.stats.num_frees += 1;
  block->allocated = false;
  block->requested = 0;

  // free_block(): merge with free neighbours of the same segment.
  FreeSet& pool = s.pool(block->small_pool);
  if (Block* prev = block->prev; prev && !prev->allocated) {
    pool.erase(prev);
    block->addr = prev->addr;
    block->size += prev->size;
    block->prev = prev->prev;
    if (block->prev) block->prev->next = block;
    delete prev;
  }
  if (Block* next = block->next; next && !next->allocated) {
    pool.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (block->next) block->next->prev = block;
    delete next;
  }
  pool.insert(block);
}

std::size_t NativeModel::release_cached() {
  State& s = *state_;
  std::size_t freed = 0;
  for (FreeSet* set : {&s.large_free, &s.small_free}) {
    for (auto it = set->begin(); it != set->end();) {
      Block* block = *it;
      if (block->is_split()) {
        ++it;
        continue;
      }
      it = set->erase(it);
      s.segments.erase(block->addr);
      s.stats.reserved_bytes -= block->size;
      s.stats.segments -= 1;
      s.stats.num_device_free += 1;
      s.stats.modeled_us += config_.segment_free_us;
      freed += block->size;
      delete block;
    }
  }
  return freed;
}

namespace {

std::vector<const Block*> all_blocks_by_address(const FreeSet& small, const FreeSet& large,
                                                const std::unordered_map<Addr, Block*>& allocated) {
  std::vector<const Block*> blocks(small.begin(), small.end());
  blocks.insert(blocks.end(), large.begin(), large.end());
  for (const auto& entry : allocated) blocks.push_back(entry.second);
  std::sort(blocks.begin(), blocks.end(), [](const Block* a, const Block* b) { return a->addr < b->addr; });
  return blocks;
}

}  // namespace

std::vector<NativeSegment> NativeModel::segments() const {
  const State& s = *state_;
  std::vector<NativeSegment> result;
  const auto blocks = all_blocks_by_address(s.small_free, s.large_free, s.allocated);
  std::size_t i = 0;
  for (const auto& [base, record] : s.segments) {
    NativeSegment segment;
    segment.addr = base;
    segment.size = record.size;
    segment.small_pool = record.small_pool;
    segment.stream = record.stream;
    while (i < blocks.size() && blocks[i]->addr < base + record.size) {
      segment.blocks.push_back({blocks[i]->addr, blocks[i]->size, blocks[i]->requested, blocks[i]->allocated});
      ++i;
    }
    result.push_back(std::move(segment));
  }
  return result;
}

std::string NativeModel::check_invariants() const {
  const State& s = *state_;
  std::ostringstream err;
  const auto blocks = all_blocks_by_address(s.small_free, s.large_free, s.allocated);
  std::size_t i = 0, reserved = 0, allocated_bytes = 0, requested_bytes = 0;
  for (const auto& [base, record] : s.segments) {
    reserved += record.size;
    Addr cursor = base;
    const Block* previous = nullptr;
    while (i < blocks.size() && blocks[i]->addr < base + record.size) {
      const Block* b = blocks[i];
      if (b->addr != cursor) {
        err << "segment 0x" << std::hex << base << ": gap or overlap at 0x" << b->addr;
        return err.str();
      }
      if (b->prev != previous || (previous && previous->next != b)) {
        err << "segment 0x" << std::hex << base << ": broken neighbour links at 0x" << b->addr;
        return err.str();
      }
      if (previous && !previous->allocated && !b->allocated) {
        err << "segment 0x" << std::hex << base << ": adjacent free blocks left unmerged at 0x" << b->addr;
        return err.str();
      }
      if (b->small_pool != record.small_pool || b->stream != record.stream) {
        err << "block 0x" << std::hex << b->addr << ": pool or stream differs from its segment";
        return err.str();
      }
      if (b->allocated) {
        allocated_bytes += b->size;
        requested_bytes += b->requested;
      }
      cursor += b->size;
      previous = b;
      ++i;
    }
    if (cursor != base + record.size || (previous && previous->next != nullptr)) {
      err << "segment 0x" << std::hex << base << ": blocks do not end at the segment end";
      return err.str();
    }
  }
  if (i != blocks.size()) return "a block lies outside every segment";
  for (const FreeSet* set : {&s.small_free, &s.large_free}) {
    for (const Block* b : *set) {
      if (b->allocated) return "an allocated block sits in a free set";
      if (b->small_pool != (set == &s.small_free)) return "a free block sits in the other pool's set";
    }
  }
  if (reserved != s.stats.reserved_bytes) return "reserved_bytes differs from the sum of segments";
  if (allocated_bytes != s.stats.allocated_bytes) return "allocated_bytes differs from the sum of live blocks";
  if (requested_bytes != s.stats.requested_bytes) return "requested_bytes differs from the sum of live requests";
  if (s.segments.size() != s.stats.segments) return "segment count differs from the live segments";
  return "";
}

}  // namespace torchmem
