// free_index.h: the free blocks of a heap, ordered by (size, address), for
// exact best fit in O(1) expected time.
//
// Note [Binned best fit]
// A balanced tree keyed by (size, address) gives best fit in O(log n) but
// chases a pointer per level, and one malloc+free pair touches it four or five
// times: several hundred ns. Instead, free blocks are binned by size class:
// exact classes below 32 KiB (one per 512 B), then 32 classes per power of
// two. Each bin is a small vector sorted by (size, address), and a two-level
// bitmap finds the next non-empty bin. Best fit stays exact: the request's
// own bin is searched by binary search for the first block >= the request;
// failing that, the first block of the next non-empty bin is the smallest
// larger one (ties to the lowest address, as in PyTorch). Bins stay short in
// practice (sizes within ~3% of each other); a long bin only costs a memmove.
//
// Note [Deferred carve]
// A cached malloc carves its block out of a free one: the free block's entry
// now stands for the rest (or goes, for an exact fit), which moves it to
// another bin, often one holding several blocks (a search and a memmove).
// When the block is freed before the index is used again (a temporary
// tensor: malloc, free), the free merges the rest back and moves the entry
// back. So carve() leaves its change pending: the bins keep the old entry
// and the index records what it now stands for. The next call on the index
// either undoes exactly that change (the merge back, or the exact fit's
// insert: nothing moves at all) or applies it first. A bin's order follows
// from its entries' keys alone (addresses are unique within a heap), so the
// bins are the same at every read as if each change had been made at once,
// and so are best fit's answers. Every method applies a pending change first
// except size() and empty() (the count is kept exact throughout); const
// readers (best_fit, contains, for_each_descending) apply it too, hence the
// mutable members. The pool's lock covers them like everything else.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/detail/block.h"

namespace torchmem::detail {

struct FreeEntry {
  std::size_t size;
  Addr addr;
  Block* block;
  bool operator<(const FreeEntry& o) const { return size != o.size ? size < o.size : addr < o.addr; }
};

class FreeIndex {
 public:
  static constexpr int kExact = 64;       // classes 0..63: sizes of 0..63 units of 512 B
  static constexpr int kSubBins = 32;     // per power of two above that
  static constexpr int kBins = kExact + (64 - 6) * kSubBins;
  static constexpr int kWords = (kBins + 63) / 64;

  static int bin_of(std::size_t size) {
    const std::size_t units = size >> 9;
    if (units < kExact) return static_cast<int>(units);
    const int e = 63 - __builtin_clzll(units);  // >= 6
    return kExact + (e - 6) * kSubBins + static_cast<int>((units >> (e - 5)) & (kSubBins - 1));
  }

  std::size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }

  void insert(Block* b) {
    if (pending_.active) {
      if (pending_.gone && b == pending_.block && b->size == pending_.size && b->addr == pending_.addr) {
        pending_.active = false;  // an exact fit freed again: its entry never left
        ++count_;
        return;
      }
      apply_pending();
    }
    const int bin = bin_of(b->size);
    put(bin, FreeEntry{b->size, b->addr, b});
    ++count_;
  }

  // `b` must be in the index with its current size and address.
  void erase(const Block* b) {
    if (pending_.active) apply_pending();
    take(bin_of(b->size), b->size, b->addr);
    --count_;
  }

  // The entry (old_size, old_addr) now stands for `b` (its new size and
  // address). A split or merge usually moves the block to another bin, so
  // that case goes first, as one take and one put. (A malloc+free pair's
  // merge back undoes its carve here: Note [Deferred carve].)
  void replace(std::size_t old_size, Addr old_addr, Block* b) {
    if (pending_.active) {
      if (!pending_.gone && old_addr == pending_.rest_addr && old_size == pending_.rest_size && b == pending_.block &&
          b->size == pending_.size && b->addr == pending_.addr) {
        pending_.active = false;  // the carved block merged its rest back: its entry never left
        return;
      }
      apply_pending();
    }
    const int old_bin = bin_of(old_size), bin = bin_of(b->size);
    if (old_bin != bin) {
      take(old_bin, old_size, old_addr);
      put(bin, FreeEntry{b->size, b->addr, b});
      return;
    }
    replace_in_bin(bin, old_size, old_addr, b);
  }

  // carve(): free block `b`, still indexed with its current size and address,
  // becomes live; its entry now stands for `rest` (its upper part, still
  // free), or goes if `rest` is null (Note [Deferred carve]). Call it before
  // changing b.
  void carve(Block* b, Block* rest) {
    if (pending_.active) apply_pending();
    pending_.active = true;
    pending_.gone = rest == nullptr;
    pending_.block = b;
    pending_.size = b->size;
    pending_.addr = b->addr;
    if (rest) {
      pending_.rest = rest;
      pending_.rest_size = rest->size;
      pending_.rest_addr = rest->addr;
    } else {
      --count_;
    }
  }

  bool contains(const Block* b) const {
    if (pending_.active) apply_pending();
    const std::vector<FreeEntry>& v = bins_[bin_of(b->size)];
    auto it = std::lower_bound(v.begin(), v.end(), FreeEntry{b->size, b->addr, nullptr});
    return it != v.end() && it->block == b;
  }

  // Calls visit(Block*) for free blocks of size >= `size` in best-fit order
  // until it returns true; returns that block or null.
  template <typename Visit>
  Block* best_fit(std::size_t size, Visit&& visit) const {
    if (pending_.active) apply_pending();
    int bin = bin_of(size);
    // Most bins are empty: the bitmap says so without touching the bin.
    if (marked(bin)) {
      const std::vector<FreeEntry>& v = bins_[bin];
      for (auto it = std::lower_bound(v.begin(), v.end(), FreeEntry{size, 0, nullptr}); it != v.end(); ++it) {
        if (visit(it->block)) return it->block;
      }
    }
    for (bin = next_bin(bin + 1); bin < kBins; bin = next_bin(bin + 1)) {
      for (const FreeEntry& e : bins_[bin]) {
        if (visit(e.block)) return e.block;
      }
    }
    return nullptr;
  }

  // Largest first.
  template <typename Visit>
  void for_each_descending(Visit&& visit) const {
    if (pending_.active) apply_pending();
    for (int bin = kBins - 1; bin >= 0; --bin) {
      const std::vector<FreeEntry>& v = bins_[bin];
      for (auto it = v.rbegin(); it != v.rend(); ++it) {
        if (!visit(it->block)) return;
      }
    }
  }

 private:
  // Makes the pending carve's change to the bins (Note [Deferred carve]),
  // from the keys it recorded: the blocks may have changed since. Out of
  // line: inlined, it bloated every method for the rare call.
  [[gnu::noinline]] void apply_pending() const {
    pending_.active = false;
    const int old_bin = bin_of(pending_.size);
    take(old_bin, pending_.size, pending_.addr);
    if (!pending_.gone) put(bin_of(pending_.rest_size), FreeEntry{pending_.rest_size, pending_.rest_addr, pending_.rest});
  }
  // Adds `e` to its bin in order. Most bins hold zero or one block, so the
  // end is tried first: an append needs no search and no memmove.
  void put(int bin, const FreeEntry& e) const {
    std::vector<FreeEntry>& v = bins_[bin];
    if (v.empty()) mark(bin);
    if (v.empty() || v.back() < e) {
      v.push_back(e);
      return;
    }
    insert_inside(v, e);
  }
  // Removes the entry (size, addr), which must be in `bin`. Most often it is
  // the bin's last (its only one, a split's rest, the block a free merged, at
  // the top of its class): no search and no memmove. Addresses are unique
  // within a heap, so the address alone matches.
  void take(int bin, std::size_t size, Addr addr) const {
    std::vector<FreeEntry>& v = bins_[bin];
    if (v.back().addr == addr) {
      v.pop_back();
      if (v.empty()) unmark(bin);
      return;
    }
    erase_inside(v, size, addr);
  }
  // The searching cases of put() and take(), out of line: inlined, they made
  // every replace() save and restore registers it needs only here.
  [[gnu::noinline]] static void insert_inside(std::vector<FreeEntry>& v, const FreeEntry& e) {
    v.insert(std::upper_bound(v.begin(), v.end(), e), e);
  }
  [[gnu::noinline]] static void erase_inside(std::vector<FreeEntry>& v, std::size_t size, Addr addr) {
    v.erase(std::lower_bound(v.begin(), v.end(), FreeEntry{size, addr, nullptr}));
  }
  // replace() within one bin. When the new key sorts into the same slot, as
  // when a split or merge changes a block only a little, the entry is
  // rewritten in place: no memmove.
  [[gnu::noinline]] void replace_in_bin(int bin, std::size_t old_size, Addr old_addr, Block* b) {
    std::vector<FreeEntry>& v = bins_[bin];
    auto it = std::lower_bound(v.begin(), v.end(), FreeEntry{old_size, old_addr, nullptr});
    const FreeEntry e{b->size, b->addr, b};
    if ((it == v.begin() || *(it - 1) < e) && (it + 1 == v.end() || e < *(it + 1))) {
      *it = e;
      return;
    }
    v.erase(it);
    insert_inside(v, e);
  }
  bool marked(int bin) const { return (words_[bin >> 6] >> (bin & 63)) & 1; }
  void mark(int bin) const {
    words_[bin >> 6] |= std::uint64_t{1} << (bin & 63);
    summary_ |= std::uint64_t{1} << (bin >> 6);
  }
  void unmark(int bin) const {
    words_[bin >> 6] &= ~(std::uint64_t{1} << (bin & 63));
    if (!words_[bin >> 6]) summary_ &= ~(std::uint64_t{1} << (bin >> 6));
  }
  // The first non-empty bin >= `bin`, or kBins.
  int next_bin(int bin) const {
    if (bin >= kBins) return kBins;
    int w = bin >> 6;
    std::uint64_t bits = words_[w] & (~std::uint64_t{0} << (bin & 63));
    if (bits) return (w << 6) + __builtin_ctzll(bits);
    const std::uint64_t rest = (w + 1 < 64) ? summary_ & (~std::uint64_t{0} << (w + 1)) : 0;
    if (!rest) return kBins;
    w = __builtin_ctzll(rest);
    return (w << 6) + __builtin_ctzll(words_[w]);
  }

  // Mutable: const readers apply a pending carve first (Note [Deferred carve]).
  mutable std::vector<FreeEntry> bins_[kBins];
  mutable std::uint64_t words_[kWords] = {};
  mutable std::uint64_t summary_ = 0;
  std::size_t count_ = 0;
  // The carve whose change the bins do not show yet: the entry (size, addr)
  // of `block` stands for `rest` (rest_size, rest_addr) now, or is gone.
  struct Pending {
    bool active = false;
    bool gone = false;
    const Block* block = nullptr;
    std::size_t size = 0;
    Addr addr = 0;
    Block* rest = nullptr;
    std::size_t rest_size = 0;
    Addr rest_addr = 0;
  };
  mutable Pending pending_;
};

}  // namespace torchmem::detail
