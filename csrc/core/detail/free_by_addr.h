// free_by_addr.h: a step plan arena's free blocks by address, a sorted array.
//
// Note [Arena address index]
// A planned request finds the free block under its offset here, and every
// planned allocation and free edits an entry (Note [Arena free set] in
// plan_pool.cpp). The arena's free set stays small: a plan lays the step's
// blocks out once, so its holes are the few gaps between them (tens of
// blocks on real training steps, where the online heaps hold thousands).
// A sorted array of (address, block) answers that in a few adjacent cache
// lines and edits by a short move, where a balanced tree chases a pointer
// per level, each node wherever it was allocated. Positions, not iterators:
// an edit moves the entries above it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "core/detail/block.h"
#include "core/types.h"

namespace torchmem::detail {

class FreeByAddr {
 public:
  std::size_t size() const { return entries_.size(); }
  Addr addr_at(std::size_t pos) const { return entries_[pos].addr; }
  Block* block_at(std::size_t pos) const { return entries_[pos].block; }

  // The position of the first entry at or above `addr` (size() if none).
  std::size_t lower_bound(Addr addr) const {
    return static_cast<std::size_t>(
        std::lower_bound(entries_.begin(), entries_.end(), addr,
                         [](const Entry& e, Addr a) { return e.addr < a; }) -
        entries_.begin());
  }
  // The position of the first entry above `addr` (size() if none).
  std::size_t upper_bound(Addr addr) const {
    return static_cast<std::size_t>(
        std::upper_bound(entries_.begin(), entries_.end(), addr,
                         [](Addr a, const Entry& e) { return a < e.addr; }) -
        entries_.begin());
  }

  // `b` at `pos`, which must keep the order (b->addr between its neighbours').
  void insert_at(std::size_t pos, Block* b) {
    entries_.insert(entries_.begin() + static_cast<std::ptrdiff_t>(pos), Entry{b->addr, b});
  }
  void insert(Block* b) { insert_at(lower_bound(b->addr), b); }
  // The entry at `pos` becomes `b`, whose address keeps the order.
  void replace_at(std::size_t pos, Block* b) { entries_[pos] = Entry{b->addr, b}; }
  void erase_at(std::size_t pos) { entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(pos)); }

  // `b` is indexed under its own address.
  bool holds(const Block* b) const {
    const std::size_t pos = lower_bound(b->addr);
    return pos < entries_.size() && entries_[pos].addr == b->addr && entries_[pos].block == b;
  }

  template <typename Visit>
  void for_each(Visit&& visit) const {
    for (const Entry& e : entries_) visit(e.block);
  }

 private:
  struct Entry {
    Addr addr;
    Block* block;
  };
  std::vector<Entry> entries_;
};

}  // namespace torchmem::detail
