// expandable_model.cpp: the model of PyTorch's expandable segments (see
// expandable_model.h for the policy and why it exists).
//
// The structure follows the real allocator where it decides behaviour: mapped
// free blocks live in one set per pool ordered by (stream, size, address), so
// lower_bound and the expandable-size walk give PyTorch's choice; unmapped
// stretches live in a set ordered by (stream, address), so the growth search
// visits them lowest address first; the blocks of a segment, mapped or not,
// form a doubly linked list in address order for split, map and merge.
#include "replay/expandable_model.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <unordered_map>
#include <vector>

namespace torchmem {

namespace {

struct Block {
  Addr addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // while allocated
  StreamId stream = 0;
  bool allocated = false;
  bool mapped = false;
  bool small_pool = false;
  Block* prev = nullptr;  // address neighbours inside the segment
  Block* next = nullptr;

  bool free_mapped() const { return mapped && !allocated; }
  Addr end() const { return addr + size; }
};

struct BySizeThenAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};

struct ByAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->addr < b->addr;
  }
};

struct Pool {
  std::set<Block*, BySizeThenAddress> free_blocks;  // mapped, not allocated
  std::set<Block*, ByAddress> unmapped;
};

struct Segment {
  Addr base;
  std::size_t size;
  bool small_pool;
  StreamId stream;
};

// Segment bases are multiples of the large page (and so of the small one), so
// page rounding can work on absolute addresses.
constexpr Addr kSegmentBase = Addr{20} << 40;  // 20 TiB: a multiple of both page sizes

std::size_t round_up(std::size_t value, std::size_t unit) { return (value + unit - 1) / unit * unit; }
std::size_t round_down(std::size_t value, std::size_t unit) { return value / unit * unit; }

std::size_t page_of(bool small_pool) {
  return small_pool ? ExpandableModel::kSmallPage : ExpandableModel::kLargePage;
}

// Puts `fresh` into the neighbour list right after `before` (or first when before is null).
void link_after(Block* before, Block* fresh, Block* after) {
  fresh->prev = before;
  fresh->next = after;
  if (before) before->next = fresh;
  if (after) after->prev = fresh;
}

}  // namespace

struct ExpandableModel::State {
  Pool small_pool;
  Pool large_pool;
  std::unordered_map<Addr, Block*> allocated;
  std::vector<Segment> segments;
  Addr next_base = kSegmentBase;
  ExpandableStats stats;

  Pool& pool(bool small) { return small ? small_pool : large_pool; }

  ~State() {
    for (Pool* p : {&small_pool, &large_pool}) {
      for (Block* b : p->free_blocks) delete b;
      for (Block* b : p->unmapped) delete b;
    }
    for (auto& entry : allocated) delete entry.second;
  }

  // try_merge_blocks(): folds `src` into `dst` when both are free and both
  // mapped or both unmapped. `dst` must be in no set (its key changes).
  void try_merge(Block* dst, Block* src) {
    if (!src || src->allocated || src->mapped != dst->mapped) return;
    Pool& p = pool(dst->small_pool);
    if (src->mapped) {
      p.free_blocks.erase(src);
    } else {
      p.unmapped.erase(src);
    }
    if (dst->prev == src) {
      dst->addr = src->addr;
      dst->prev = src->prev;
      if (dst->prev) dst->prev->next = dst;
    } else {
      dst->next = src->next;
      if (dst->next) dst->next->prev = dst;
    }
    dst->size += src->size;
    delete src;
  }
};

ExpandableModel::ExpandableModel(const ExpandableConfig& config) : config_(config), state_(new State) {
  if (config.capacity_bytes < kLargePage) {
    throw ExpandableModelError("expandable model: capacity_bytes must be at least 20 MiB (one large page), got " +
                               std::to_string(config.capacity_bytes));
  }
}

ExpandableModel::~ExpandableModel() = default;

const ExpandableStats& ExpandableModel::stats() const { return state_->stats; }

namespace {

// get_free_block(): best fit by (size, address), stepping past blocks whose
// unmapped neighbour makes them "bigger" than the next candidate.
Block* take_free_block(Pool& pool, StreamId stream, std::size_t size) {
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = pool.free_blocks.lower_bound(&key);
  if (it == pool.free_blocks.end() || (*it)->stream != stream) return nullptr;
  auto expandable_size = [](const Block* b) {
    return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
  };
  for (auto next = std::next(it); next != pool.free_blocks.end() && (*next)->stream == stream &&
                                  expandable_size(*next) < expandable_size(*it);
       ++next) {
    it = next;
  }
  Block* block = *it;
  pool.free_blocks.erase(it);
  return block;
}

}  // namespace

Addr ExpandableModel::allocate(std::size_t size, StreamId stream) {
  if (size == 0) {
    throw ExpandableModelError("expandable model: allocate(0): a request must be at least 1 byte");
  }
  State& s = *state_;
  const std::size_t rounded = NativeModel::round_size(size);
  const bool small = rounded <= kSmallSize;
  Pool& pool = s.pool(small);
  const std::size_t page = page_of(small);

  // map_block(): maps `bytes` (page-rounded) at the front of unmapped block `b`.
  auto map_front = [&](Block* b, std::size_t bytes) -> Block* {
    bytes = round_up(bytes, page);
    if (s.stats.reserved_bytes + bytes > config_.capacity_bytes) return nullptr;
    pool.unmapped.erase(b);
    b->mapped = true;
    if (bytes < b->size) {
      Block* rest = new Block;
      rest->addr = b->addr + bytes;
      rest->size = b->size - bytes;
      rest->stream = b->stream;
      rest->small_pool = b->small_pool;
      link_after(b, rest, b->next);
      pool.unmapped.insert(rest);
      b->size = bytes;
    }
    s.try_merge(b, b->prev);
    s.try_merge(b, b->next);
    pool.free_blocks.insert(b);
    s.stats.reserved_bytes += bytes;
    s.stats.peak_reserved_bytes = std::max(s.stats.peak_reserved_bytes, s.stats.reserved_bytes);
    s.stats.pages_mapped += bytes / page;
    ++s.stats.map_bursts;
    s.stats.modeled_us += static_cast<double>(bytes / page) * config_.map_page_us;
    return b;
  };

  // find_expandable_block(): the lowest unmapped stretch of this stream's
  // segment which, with a free block just before it and whatever free or
  // unmapped blocks follow, holds `rounded`; else a new segment.
  auto find_room = [&]() -> Block* {
    Block key;
    key.stream = stream;
    for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
      Block* start = *it;
      if (start->prev && !start->prev->allocated) start = start->prev;
      std::size_t room = 0;
      for (const Block* b = start; b && !b->allocated && room < rounded; b = b->next) room += b->size;
      if (room >= rounded) return start;
    }
    // PyTorch reserves 1.125x the device's memory of address space per segment.
    const std::size_t span = round_up(config_.capacity_bytes + config_.capacity_bytes / 8, kLargePage);
    Block* whole = new Block;
    whole->addr = s.next_base;
    whole->size = span;
    whole->stream = stream;
    whole->small_pool = small;
    s.segments.push_back(Segment{s.next_base, span, small, stream});
    s.next_base += span;
    pool.unmapped.insert(whole);
    return whole;
  };

  // alloc_block() then try_allocate_expandable_block().
  auto grow = [&]() -> Block* {
    // PyTorch checks a budget against the native segment size of the request, not the pages it maps.
    const std::size_t step = NativeModel::segment_size(rounded);
    if (config_.limit_bytes && s.stats.reserved_bytes + step > config_.limit_bytes) return nullptr;
    Block* candidate = find_room();
    if (!candidate->mapped && !(candidate = map_front(candidate, std::min(candidate->size, rounded)))) {
      return nullptr;
    }
    while (candidate->size < rounded) {
      // A free block followed by an unmapped stretch: map what is missing.
      Block* next = candidate->next;
      candidate = map_front(next, std::min(rounded - candidate->size, next->size));
      if (!candidate) return nullptr;
    }
    pool.free_blocks.erase(candidate);
    return candidate;
  };

  Block* block = take_free_block(pool, stream, rounded);
  if (!block) block = grow();
  if (!block) {
    release_cached();
    s.stats.num_alloc_retries += 1;
    block = grow();
  }
  if (!block) {
    s.stats.num_ooms += 1;
    return 0;
  }

  if (block->size - rounded >= kMinBlockSize) {
    Block* rest = new Block;
    rest->addr = block->addr + rounded;
    rest->size = block->size - rounded;
    rest->stream = block->stream;
    rest->small_pool = block->small_pool;
    rest->mapped = true;
    link_after(block, rest, block->next);
    block->size = rounded;
    pool.free_blocks.insert(rest);
  }
  block->allocated = true;
  block->requested = size;
  s.allocated[block->addr] = block;
  s.stats.allocated_bytes += block->size;
  s.stats.requested_bytes += size;
  s.stats.peak_requested_bytes = std::max(s.stats.peak_requested_bytes, s.stats.requested_bytes);
  return block->addr;
}

void ExpandableModel::deallocate(Addr addr) {
  State& s = *state_;
  auto found = s.allocated.find(addr);
  if (found == s.allocated.end()) {
    std::ostringstream msg;
    msg << "expandable model: free of address 0x" << std::hex << addr
        << " that is not a live allocation (never allocated, or already freed)";
    throw ExpandableModelError(msg.str());
  }
  Block* block = found->second;
  s.allocated.erase(found);
  s.stats.allocated_bytes -= block->size;
  s.stats.requested_bytes -= block->requested;
  block->allocated = false;
  block->requested = 0;
  s.try_merge(block, block->prev);
  s.try_merge(block, block->next);
  s.pool(block->small_pool).free_blocks.insert(block);
}

std::size_t ExpandableModel::release_cached() {
  State& s = *state_;
  std::size_t released = 0;
  for (Pool* pool : {&s.large_pool, &s.small_pool}) {
    // unmap_block() changes the set: gather first.
    const std::vector<Block*> free_blocks(pool->free_blocks.begin(), pool->free_blocks.end());
    for (Block* b : free_blocks) {
      const std::size_t page = page_of(b->small_pool);
      const Addr begin = round_up(b->addr, page);
      const Addr end = round_down(b->end(), page);
      if (begin >= end) continue;
      pool->free_blocks.erase(b);
      if (begin > b->addr) {  // the mapped part before the whole pages stays free
        Block* before = new Block(*b);
        before->size = begin - b->addr;
        link_after(b->prev, before, b);
        pool->free_blocks.insert(before);
      }
      if (end < b->end()) {  // and so does the part after them
        Block* after = new Block(*b);
        after->addr = end;
        after->size = b->end() - end;
        link_after(b, after, b->next);
        pool->free_blocks.insert(after);
      }
      b->addr = begin;
      b->size = end - begin;
      b->mapped = false;
      s.try_merge(b, b->prev);
      s.try_merge(b, b->next);
      pool->unmapped.insert(b);
      s.stats.reserved_bytes -= end - begin;
      s.stats.pages_unmapped += (end - begin) / page;
      s.stats.modeled_us += static_cast<double>((end - begin) / page) * config_.unmap_page_us;
      released += end - begin;
    }
  }
  return released;
}

std::string ExpandableModel::check_invariants() const {
  const State& s = *state_;
  std::vector<const Block*> blocks;
  for (const Pool* p : {&s.small_pool, &s.large_pool}) {
    for (const Block* b : p->free_blocks) {
      if (!b->free_mapped()) return "a free set holds a block that is allocated or unmapped";
      if (b->small_pool != (p == &s.small_pool)) return "a free block sits in the other pool's set";
      blocks.push_back(b);
    }
    for (const Block* b : p->unmapped) {
      if (b->mapped || b->allocated) return "the unmapped set holds a mapped block";
      const std::size_t page = page_of(b->small_pool);
      if (b->addr % page != 0 || b->size % page != 0) return "an unmapped stretch is not page-aligned";
      blocks.push_back(b);
    }
  }
  std::size_t allocated_bytes = 0, requested_bytes = 0, mapped_bytes = 0;
  for (const auto& entry : s.allocated) {
    if (!entry.second->allocated || !entry.second->mapped) return "a live block is marked free or unmapped";
    allocated_bytes += entry.second->size;
    requested_bytes += entry.second->requested;
    blocks.push_back(entry.second);
  }
  std::sort(blocks.begin(), blocks.end(), [](const Block* a, const Block* b) { return a->addr < b->addr; });
  std::size_t i = 0;
  for (const Segment& segment : s.segments) {
    Addr cursor = segment.base;
    const Block* previous = nullptr;
    for (; i < blocks.size() && blocks[i]->addr < segment.base + segment.size; ++i) {
      const Block* b = blocks[i];
      std::ostringstream err;
      if (b->addr != cursor) err << "gap or overlap at 0x" << std::hex << b->addr;
      else if (b->prev != previous || (previous && previous->next != b)) err << "broken links at 0x" << std::hex << b->addr;
      else if (previous && !previous->allocated && !b->allocated && previous->mapped == b->mapped)
        err << "adjacent free blocks left unmerged at 0x" << std::hex << b->addr;
      else if (b->small_pool != segment.small_pool || b->stream != segment.stream)
        err << "block 0x" << std::hex << b->addr << ": pool or stream differs from its segment";
      if (!err.str().empty()) return err.str();
      if (b->mapped) mapped_bytes += b->size;
      cursor += b->size;
      previous = b;
    }
    if (cursor != segment.base + segment.size) return "blocks do not end at their segment's end";
  }
  if (i != blocks.size()) return "a block lies outside every segment";
  if (mapped_bytes != s.stats.reserved_bytes) return "reserved_bytes differs from the mapped blocks";
  if (allocated_bytes != s.stats.allocated_bytes) return "allocated_bytes differs from the live blocks";
  if (requested_bytes != s.stats.requested_bytes) return "requested_bytes differs from the live requests";
  return "";
}

}  // namespace torchmem
