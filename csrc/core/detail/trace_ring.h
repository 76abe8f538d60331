// trace_ring.h: the last N trace entries, for torch-style snapshots.
//
// A fixed ring: pushing never allocates once the ring is full, so tracing can
// stay on in training. Capacity 0 disables it (push is one branch).
// set_capacity() resizes a live ring (torch lets _record_memory_history start,
// stop and change max_entries at any time), keeping the newest entries that fit.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "core/pool.h"

namespace torchmem::detail {

class TraceRing {
 public:
  explicit TraceRing(std::size_t capacity) : capacity_(capacity) {}
  bool enabled() const { return capacity_ != 0; }
  void push(const TraceEntry& entry) {
    if (capacity_ == 0) return;
    if (entries_.size() < capacity_) {
      entries_.push_back(entry);
    } else {
      entries_[next_] = entry;
    }
    next_ = (next_ + 1) % capacity_;
  }
  // Keeps the newest min(size, capacity) entries; capacity 0 drops them all.
  void set_capacity(std::size_t capacity) {
    std::vector<TraceEntry> kept = entries();
    if (kept.size() > capacity) kept.erase(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(capacity));
    capacity_ = capacity;
    entries_ = std::move(kept);
    entries_.shrink_to_fit();
    next_ = capacity_ == 0 ? 0 : entries_.size() % capacity_;
  }
  void clear() {
    entries_.clear();
    next_ = 0;
  }
  std::size_t capacity() const { return capacity_; }
  // Oldest first.
  std::vector<TraceEntry> entries() const {
    if (entries_.size() < capacity_) return entries_;
    std::vector<TraceEntry> out(entries_.begin() + static_cast<std::ptrdiff_t>(next_), entries_.end());
    out.insert(out.end(), entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(next_));
    return out;
  }

 private:
  std::size_t capacity_;
  std::size_t next_ = 0;
  std::vector<TraceEntry> entries_;
};

}  // namespace torchmem::detail
