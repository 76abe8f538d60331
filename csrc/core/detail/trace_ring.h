// trace_ring.h: the last N trace entries, for torch-style snapshots.
//
// A fixed ring: pushing never allocates once the ring is full, so tracing can
// stay on in training. Capacity 0 disables it (push is one branch).
#pragma once

#include <cstddef>
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
