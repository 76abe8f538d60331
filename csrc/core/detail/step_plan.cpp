// step_plan.cpp: naming requests, recording their lifetimes and the
// greedy-by-size planner (Note [Step plan] in step_plan.h).
#include "core/detail/step_plan.h"

#include <algorithm>

namespace torchmem::detail {

namespace {
constexpr std::uint32_t kMaxItems = 1u << 24;  // ids keep 24 bits; the top 8 are the generation
}  // namespace

void StepPlan::arm() {
  if (state_ == State::kOff) {
    state_ = State::kRecording;
    record_start_ = last_new_ = allocs_;
    last_new_clock_ = clock_;
    low_live_ = high_live_ = named_live_bytes_;
    record_clock_ = kNever;
    return;
  }
  rerecord();
}

void StepPlan::reset() {
  state_ = State::kOff;
  generation_ = (generation_ + 1) & 0xFF;
  sig_index_.clear();
  sigs_.clear();
  item_index_.clear();
  items_.clear();
  intervals_.clear();
  before_ = ~std::uint32_t{0};
  history_.clear();
  cursor_ = kNever;
  named_live_bytes_ = planned_live_bytes_ = low_live_ = high_live_ = 0;
  clock_ = allocs_ = record_start_ = last_new_ = 0;
  record_clock_ = kNever;
  min_window_ = kMinQuiet;
}

void StepPlan::rerecord() {
  state_ = State::kRecording;
  record_start_ = last_new_ = allocs_;
  last_new_clock_ = clock_;
  low_live_ = high_live_ = named_live_bytes_;
  record_clock_ = clock_;
  for (std::size_t i = 0; i < items_.size(); ++i) {
    intervals_[i].clear();
    // A block live now counts as live from the window's start.
    if (items_[i].live) intervals_[i].push_back(Interval{clock_, kOpen});
  }
  ++clock_;
}

std::uint32_t StepPlan::Sig::next_slot() const {
  if (low_free != 0) return static_cast<std::uint32_t>(__builtin_ctzll(low_free));
  if (high_count != 0) {
    for (std::size_t w = 0;; ++w) {
      if (high_free[w] != 0) return static_cast<std::uint32_t>(64 + 64 * w + __builtin_ctzll(high_free[w]));
    }
  }
  return slots;
}

std::uint32_t StepPlan::Sig::take() { return take_at(next_slot()); }

std::uint32_t StepPlan::Sig::take_at(std::uint32_t slot) {
  if (slot == slots) {
    ++slots;
  } else if (slot < 64) {
    low_free &= low_free - 1;
  } else {
    high_free[(slot - 64) / 64] &= ~(std::uint64_t{1} << ((slot - 64) % 64));
    --high_count;
  }
  return slot;
}

void StepPlan::Sig::give(std::uint32_t slot) {
  if (slot < 64) {
    low_free |= std::uint64_t{1} << slot;
    return;
  }
  const std::size_t word = (slot - 64) / 64;
  if (high_free.size() <= word) high_free.resize(word + 1, 0);
  high_free[word] |= std::uint64_t{1} << ((slot - 64) % 64);
  ++high_count;
}

std::uint32_t StepPlan::predicted(std::size_t rounded, StreamId stream, bool small) {
  // cursor_ < allocs_ always, and the entry before it is the item named last
  // (note_named): the candidate followed that item once, so the signature
  // before it in its key is before_. An entry older than kHistory is gone.
  if (cursor_ == kNever || allocs_ - cursor_ >= kHistory) return kNoItem;
  const std::uint32_t idx = history_[cursor_ & (kHistory - 1)];
  Item& x = items_[idx];
  if (x.size != rounded || x.stream != stream || x.small != small || x.live) return kNoItem;
  Sig& s = sigs_[x.sig];
  if (s.next_slot() != x.slot) return kNoItem;
  s.take_at(x.slot);
  before_ = x.sig;
  return idx;
}

void StepPlan::note_named(std::uint32_t idx, bool predicted) {
  Item& x = items_[idx];
  // After a hit the next entry; after a miss the entry after this item's last time.
  cursor_ = predicted ? cursor_ + 1 : (x.named_at == kNever ? kNever : x.named_at + 1);
  x.named_at = allocs_;
  if (history_.size() < kHistory) {
    history_.push_back(idx);
  } else {
    history_[allocs_ & (kHistory - 1)] = idx;
  }
}

std::uint32_t StepPlan::looked_up(std::size_t rounded, StreamId stream, bool small) {
  auto [it, inserted] = sig_index_.try_emplace(SigKey{rounded, stream, small}, static_cast<std::uint32_t>(sigs_.size()));
  if (inserted) sigs_.emplace_back();
  const std::uint32_t sig = it->second;
  Sig& s = sigs_[sig];
  const std::uint32_t slot = s.take();
  const ItemKey key{sig, slot, before_};
  before_ = sig;
  auto found = item_index_.find(key);
  if (found != item_index_.end()) return found->second;
  if (items_.size() >= kMaxItems) {
    s.give(slot);
    return kNoItem;
  }
  const auto idx = static_cast<std::uint32_t>(items_.size());
  Item x;
  x.sig = sig;
  x.slot = slot;
  x.size = rounded;
  x.stream = stream;
  x.small = small;
  items_.push_back(x);
  intervals_.emplace_back();
  item_index_.emplace(key, idx);
  last_new_ = allocs_;
  last_new_clock_ = clock_;
  low_live_ = high_live_ = named_live_bytes_;  // the quiet stretch (a whole cycle) sets the range
  return idx;
}

std::uint32_t StepPlan::on_alloc(std::size_t rounded, StreamId stream, bool small, bool* by_lookup) {
  *by_lookup = false;
  if (state_ == State::kOff) return kNoItem;
  // Note [Naming on the host]: the prediction first, the hash lookups if it misses.
  std::uint32_t idx = predicted(rounded, stream, small);
  const bool hit = idx != kNoItem;
  if (!hit) {
    *by_lookup = true;
    idx = looked_up(rounded, stream, small);
  }
  if (idx == kNoItem) {
    // No name (the items are full): the history skips it, so the entry after
    // it may say another signature came before; predictions past it can name
    // a request otherwise than its lookup would, which costs the plan a hit,
    // never a wrong placement (Note [Step plan]: a hint).
    cursor_ = kNever;
    return kNoItem;
  }
  note_named(idx, hit);
  Item& x = items_[idx];
  x.live = true;
  named_live_bytes_ += x.size;
  ++allocs_;
  if (state_ == State::kRecording) {
    intervals_[idx].push_back(Interval{clock_++, kOpen});
    high_live_ = std::max(high_live_, named_live_bytes_);
  }
  return (generation_ << 24) | idx;
}

void StepPlan::on_free(std::uint32_t item) {
  const std::uint32_t idx = index_of(item);
  if (idx == kNoItem) return;
  Item& x = items_[idx];
  if (!x.live) return;
  x.live = false;
  named_live_bytes_ -= x.size;
  sigs_[x.sig].give(x.slot);
  if (state_ == State::kRecording) {
    low_live_ = std::min(low_live_, named_live_bytes_);
    std::vector<Interval>& lives = intervals_[idx];
    if (!lives.empty() && lives.back().end == kOpen) lives.back().end = clock_++;
  }
}

bool StepPlan::window_closed() const {
  if (state_ != State::kRecording) return false;
  const std::uint64_t quiet = allocs_ - last_new_;
  const std::uint64_t discovered = last_new_ - record_start_;
  if (quiet < std::max(discovered, kMinQuiet) || allocs_ - record_start_ < min_window_) return false;
  return named_live_bytes_ <= low_live_ + (high_live_ - low_live_) / 10;
}

std::uint64_t StepPlan::place(const std::vector<std::uint32_t>& order, std::vector<std::uint64_t>* offsets) const {
  struct Placed {
    std::uint64_t offset;
    std::size_t size;
    std::uint32_t item;
  };
  std::vector<Placed> placed;  // by offset
  offsets->assign(items_.size(), kNoOffset);
  std::uint64_t top = 0;
  for (std::uint32_t m : order) {
    const Item& x = items_[m];
    const std::vector<Interval>& lives = intervals_[m];
    const std::uint64_t first = lives.front().start, last = lives.back().end;
    // The smallest gap between the placed items it overlaps in time that holds
    // it (ties: the lowest), else above them all.
    std::uint64_t cursor = 0, at = 0, best_gap = ~std::uint64_t{0};
    for (const Placed& p : placed) {
      const std::vector<Interval>& other = intervals_[p.item];
      if (other.back().end < first || last < other.front().start || !overlap(lives, other)) continue;
      if (p.offset > cursor) {
        const std::uint64_t gap = p.offset - cursor;
        if (gap >= x.size && gap < best_gap) {
          best_gap = gap;
          at = cursor;
        }
      }
      cursor = std::max<std::uint64_t>(cursor, p.offset + p.size);
    }
    if (best_gap == ~std::uint64_t{0}) at = cursor;
    placed.insert(std::upper_bound(placed.begin(), placed.end(), at,
                                   [](std::uint64_t o, const Placed& p) { return o < p.offset; }),
                  Placed{at, x.size, m});
    (*offsets)[m] = at;
    top = std::max<std::uint64_t>(top, at + x.size);
  }
  return top;
}

void StepPlan::join_names_that_turn_over() {
  // Note [Names that turn over]
  if (record_clock_ == kNever) return;  // a first window opens with no lifetimes
  // Per place in the step (signature, signature before): the items seen live
  // only at the window's start (tails) and those live at its end but not
  // made before it (heads).
  struct Group {
    std::vector<std::uint32_t> tails, heads;
  };
  std::unordered_map<std::uint64_t, Group> groups;
  for (const auto& [key, idx] : item_index_) {
    const std::vector<Interval>& lives = intervals_[idx];
    if (lives.empty()) continue;
    // A tail lives only at the window's start; a head is still live at its end.
    const bool tail = lives.size() == 1 && lives.front().start == record_clock_ && lives.front().end != kOpen;
    const bool head = lives.back().end == kOpen && lives.back().start != record_clock_;
    if (!tail && !head) continue;
    Group& g = groups[std::uint64_t{key.sig} << 32 | key.before];
    (tail ? g.tails : g.heads).push_back(idx);
  }
  std::vector<Interval> all;
  std::vector<std::uint32_t> pair;
  for (auto& [place, g] : groups) {
    for (std::uint32_t t : g.tails) {
      // The heads made while this tail was still live: its name's successors.
      const std::uint64_t tail_end = intervals_[t].front().end;
      pair.assign(1, t);
      for (std::uint32_t h : g.heads) {
        if (intervals_[h].back().start < tail_end) pair.push_back(h);
      }
      if (pair.size() == 1) continue;
      all.clear();
      for (std::uint32_t idx : pair) {
        std::vector<Interval>& lives = intervals_[idx];
        if (lives.back().end == kOpen) lives.back().end = clock_;  // a head ends now, whenever it began
        all.insert(all.end(), lives.begin(), lives.end());
      }
      std::sort(all.begin(), all.end(), [](const Interval& a, const Interval& b) { return a.start < b.start; });
      std::vector<Interval> joined;
      for (const Interval& x : all) {
        if (!joined.empty() && x.start <= joined.back().end) {
          joined.back().end = std::max(joined.back().end, x.end);
        } else {
          joined.push_back(x);
        }
      }
      for (std::uint32_t idx : pair) intervals_[idx] = joined;
    }
  }
}

bool StepPlan::overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  // Both lists are in time order and each item's intervals are disjoint.
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const Interval& x = a[i];
    const Interval& y = b[j];
    if (x.start <= y.end && y.start <= x.end) return true;
    if (x.end < y.end) {
      ++i;
    } else {
      ++j;
    }
  }
  return false;
}

std::size_t StepPlan::plan(std::size_t align) {
  min_window_ = std::max(min_window_, allocs_ - record_start_);
  join_names_that_turn_over();  // before a head made early counts as not the step's
  // Intervals still open end now (Note [Step plan]).
  std::vector<std::uint32_t> members;
  planned_live_bytes_ = 0;
  for (std::uint32_t i = 0; i < items_.size(); ++i) {
    items_[i].offset = kNoOffset;
    std::vector<Interval>& lives = intervals_[i];
    if (lives.empty()) continue;
    if (lives.back().end == kOpen) {
      // Live through the whole last cycle: not the step's (parameters, optimizer
      // state); it holds this name from now on.
      if (lives.back().start <= last_new_clock_) continue;
      lives.back().end = clock_;
    }
    members.push_back(i);
  }
  // Largest first: what is left for the smaller ones is gaps (tried:
  // size x lifetime first, and first use first, left larger regions).
  std::sort(members.begin(), members.end(), [&](std::uint32_t a, std::uint32_t b) {
    return items_[a].size != items_[b].size ? items_[a].size > items_[b].size : a < b;
  });
  std::vector<std::uint64_t> offsets;
  const std::uint64_t top = place(members, &offsets);
  for (std::uint32_t m : members) {
    items_[m].offset = offsets[m];
    if (items_[m].live) planned_live_bytes_ += items_[m].size;
  }
  return (top + align - 1) / align * align;
}

}  // namespace torchmem::detail
