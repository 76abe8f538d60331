// step_plan.h: a static layout for a repeating step, learnt from the requests
// themselves (the pool side is in detail/plan_pool.cpp).
//
// Note [Step plan]
// A training or decoding step makes the same requests in the same order every
// time its shapes repeat. An online allocator under a tight budget cannot keep
// one layout for them: the virtual footprint of best fit is larger than the
// budget, so granules move under every step, with driver calls and, sooner or
// later, a device barrier (Note [Device barrier] in pool.h). Given the step's
// lifetimes a layout that fits can be computed once (dynamic storage
// allocation, as STAlloc does from profiled iterations), and then kept.
//
// Names. A request is named by its signature (rounded size, stream, heap), a
// sub-slot (the lowest index not held by a live block of the same
// signature) and the signature of the request just before it. Two tensors
// of one shape live at once (the same layer's activations, saved for
// backward, in two layers) get two sub-slots; a temporary freed before the
// next of its kind keeps sub-slot 0; the request before tells apart the
// places in the step where one shape recurs, so each can have an address of
// its own (without it, every use of a name shared one address, and a GPT-2
// step's plan came out ~7% over the bytes it holds). A repeating step hands
// out the same names in the same order every time, with no step boundary to
// detect and no phase to keep; blocks that were live before naming began
// hold no sub-slot. A name is an item.
//
// Recording. Each item's lifetimes (intervals of a clock that ticks at every
// recorded alloc and free) are kept from the moment the plan is armed. The
// window closes once no new item has appeared for at least as many
// allocations as it took to see them all (and at least kMinQuiet): a cycle
// (micro-steps and the optimizer step together) was seen whole and has
// repeated, and at the cycle's low point: where the fewest named bytes are
// live (between steps), so that the arena starts nearly empty. A window
// recorded again (the plan was dropped, names kept) is at least as long as
// the last one that closed, and, when the plan was dropped because it
// missed part of the cycle, as long as it was in force: the part it missed
// came that late, so the cycle is at least that long (gradient
// accumulation: a window of a few micro-steps, then the optimizer step). A workload whose shapes never repeat keeps finding new items; its
// recording gives up at kMaxRecordAllocs and backs off.
//
// Planning: greedy by size. Items sorted by size, largest first, each placed
// in the smallest gap that holds it between the placed items it overlaps in
// time (else above them all). Items of every stream share one layout: a
// side stream's buffers (FSDP's all-gathers) fit in the main stream's gaps,
// where a region per stream would add each stream's own peak; the arena
// orders a range's new stream after its old one on the device (Note [Arena
// across streams] in plan_pool.cpp). An
// item live when the window closed counts as live until then, except one
// live since before the last cycle began (parameters, optimizer state made
// in the window): it is not the step's, and stays where it is.
//
// The plan is a hint, never a promise: the pool places a planned item at its
// offset only if that range is free, and otherwise serves it as before.
//
// Note [Names that turn over]
// A tensor that lives a little longer than the cycle (made in one step, freed
// just after the next step made its successor) finds its last copy still live
// when it is made, so its copies take sub-slots 0 and 1 in turn, and its two
// names repeat every two cycles, not every cycle. A window of one cycle,
// recorded again after a drop, sees one of them only live at its start, freed
// soon after (a tail), and the other made near the start and live at the
// window's end (a head; made before the window's last new item, it would
// count as live since before the cycle and get no place). Planned so, the
// tail's name gets a range that is free only in the window's first requests,
// and its next copy, a cycle later, lives there for a whole cycle on top of
// ranges planned for others (a large range so held sends the plan to the
// OOM ladder). So the items of one place in the step (signature and the
// signature before) that turn over at the window's ends are planned as one:
// a tail and the heads made while it was still live each take the union of
// their lifetimes, which is what either name holds in some cycle. Names
// that repeat every cycle are live at both ends (or at neither) and are left
// as they are; a first window opens with no lifetimes and has no tails.
//
// Note [Naming on the host]
// Naming runs on every request of a step under a plan, between two stretches
// of the framework's own host work that push the pool's data out of the CPU
// caches; a host-bound step pays for each cache line it touches. So a request
// that repeats the step touches two lines: the item a prediction names
// (checked against the request's key: its signature, the sub-slot its
// signature would hand out, and the signature before) and that item's
// signature, whose free sub-slots are bits. The prediction follows the
// history of names (a ring, read in order: a line per 16 requests) from
// where the same sequence ran before: after a hit, the entry after the one
// that hit; after a miss, the entry after the looked-up item's previous
// occurrence. A step that repeats is followed from the last step's entries
// after at most a few misses (an item recurs in every layer, so a miss can
// first land on the previous layer, which the step follows until the layers
// end). Only a miss pays for the two hash lookups. The names are the same
// either way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/types.h"

namespace torchmem::detail {

class StepPlan {
 public:
  static constexpr std::uint32_t kNoItem = ~std::uint32_t{0};
  static constexpr std::uint64_t kNoOffset = ~std::uint64_t{0};
  // Recording window bounds (allocations).
  static constexpr std::uint64_t kMinQuiet = 64;
  static constexpr std::uint64_t kMaxRecordAllocs = std::uint64_t{1} << 20;

  enum class State { kOff, kRecording, kActive };

  State state() const { return state_; }
  // Names are handed out (and returned) from arm() until reset().
  bool naming() const { return state_ != State::kOff; }
  bool active() const { return state_ == State::kActive; }

  // Starts naming and recording; items named so far are kept.
  void arm();
  // Forgets everything; blocks still holding names give them back to nobody
  // (their ids carry the old generation).
  void reset();
  // A new request: its item (naming it, recording its start), or kNoItem
  // when not naming. `item` ids carry a generation in their top 8 bits.
  // *by_lookup: whether the prediction missed and the key's hash lookups named
  // it (Note [Naming on the host]).
  std::uint32_t on_alloc(std::size_t rounded, StreamId stream, bool small, bool* by_lookup);
  // The block named `item` was freed (or its allocation failed).
  void on_free(std::uint32_t item);
  // Recording: a full cycle was seen and repeated, and this is the cycle's
  // low point (Note [Step plan]: the plan is adopted where the fewest named
  // blocks are live, so that little lives outside the arena meanwhile).
  bool window_closed() const;
  // Recording went on too long without repeating.
  bool window_hopeless() const { return state_ == State::kRecording && allocs_ - record_start_ >= kMaxRecordAllocs; }
  // Computes offsets for every recorded item; returns the footprint in bytes
  // (rounded up to `align`). Stops recording.
  std::size_t plan(std::size_t align);
  void activate() {
    state_ = State::kActive;
    adopted_at_ = allocs_;
  }
  // Back to recording, keeping names (a new window starts now).
  void rerecord();
  // The plan in force missed part of the cycle: the next window is at least
  // as long as the plan was in force (Note [Step plan]).
  void cycle_outgrew_window() { min_window_ = std::max(min_window_, allocs_ - adopted_at_); }

  // Planned offset of `item` (kNoOffset if none).
  std::uint64_t offset_of(std::uint32_t item) const {
    const std::uint32_t i = index_of(item);
    return i == kNoItem ? kNoOffset : items_[i].offset;
  }
  // Bytes of live named blocks (they move into the plan's arena as they are
  // allocated again).
  std::size_t named_live_bytes() const { return named_live_bytes_; }
  // Of those, the bytes of the items the last plan() placed (the others, live
  // since before the last cycle, stay where they are).
  std::size_t planned_live_bytes() const { return planned_live_bytes_; }
  std::size_t items() const { return items_.size(); }
  std::uint64_t allocs_recorded() const { return allocs_ - record_start_; }

 private:
  struct SigKey {
    std::size_t size;
    StreamId stream;
    bool small;
    bool operator==(const SigKey& o) const { return size == o.size && stream == o.stream && small == o.small; }
  };
  struct SigHash {
    std::size_t operator()(const SigKey& k) const {
      return std::hash<std::size_t>()(k.size * 0x9E3779B97F4A7C15ull ^ (k.stream + (k.small ? 1 : 0)));
    }
  };
  // Free sub-slots below `slots` as bits, the lowest handed out first: slots
  // 0-63 in one word beside the count (most signatures never hold more), the
  // rest in words of their own (Note [Naming on the host]).
  struct Sig {
    std::uint32_t slots = 0;      // sub-slots handed out so far
    std::uint32_t high_count = 0;  // bits set in high_free
    std::uint64_t low_free = 0;    // sub-slots 0-63
    std::vector<std::uint64_t> high_free;  // sub-slot 64 + i at bit i % 64 of word i / 64
    // The sub-slot the next request of this signature gets (the lowest free, else a new one).
    std::uint32_t next_slot() const;
    std::uint32_t take();
    // Takes `slot`, which must be next_slot().
    std::uint32_t take_at(std::uint32_t slot);
    void give(std::uint32_t slot);
  };
  // An item: a signature, a sub-slot and the signature of the request before it.
  struct ItemKey {
    std::uint32_t sig, slot, before;
    bool operator==(const ItemKey& o) const { return sig == o.sig && slot == o.slot && before == o.before; }
  };
  struct ItemHash {
    std::size_t operator()(const ItemKey& k) const {
      return std::hash<std::uint64_t>()((std::uint64_t{k.sig} << 32 | k.slot) * 0x9E3779B97F4A7C15ull ^ k.before);
    }
  };
  struct Interval {
    std::uint64_t start, end;  // end == kOpen while live
  };
  // One cache line: a planned request touches its item and its signature only
  // (its recorded lifetimes are apart, in intervals_).
  struct alignas(64) Item {
    std::uint32_t sig;
    std::uint32_t slot;
    std::size_t size;
    StreamId stream;
    std::uint64_t offset = kNoOffset;
    std::uint64_t named_at = kNever;  // allocs_ when it was last named (Note [Naming on the host])
    bool live = false;
    bool small = false;
  };
  static_assert(sizeof(Item) == 64, "an item is one cache line (Note [Naming on the host])");
  static constexpr std::uint64_t kNever = ~std::uint64_t{0};
  // The items named, in order, the last kHistory of them (a ring indexed by allocs_).
  static constexpr std::uint64_t kHistory = std::uint64_t{1} << 20;
  static constexpr std::uint64_t kOpen = ~std::uint64_t{0};

  std::uint32_t index_of(std::uint32_t item) const {
    if (item == kNoItem || (item >> 24) != generation_) return kNoItem;
    return item & 0xFFFFFF;
  }
  static bool overlap(const std::vector<Interval>& a, const std::vector<Interval>& b);
  // Records that `idx` is named now (the history and its item's named_at),
  // and where to predict from next.
  void note_named(std::uint32_t idx, bool predicted);
  // The item of a request by prediction (the one named after the last one,
  // last time), when its key is the request's; kNoItem otherwise. Takes its
  // sub-slot.
  std::uint32_t predicted(std::size_t rounded, StreamId stream, bool small);
  // The item of a request by its key (made if new), or kNoItem when full. Takes its sub-slot.
  std::uint32_t looked_up(std::size_t rounded, StreamId stream, bool small);
  // Greedy placement of `order`'s items (each at the smallest gap it fits
  // between the placed items it overlaps in time, else above them); fills
  // (*offsets)[item] and returns the region's top.
  std::uint64_t place(const std::vector<std::uint32_t>& order, std::vector<std::uint64_t>* offsets) const;
  // Note [Names that turn over]: items of one place in the step whose names
  // the window saw live only at its start, or only at its end, share their
  // lifetimes.
  void join_names_that_turn_over();

  State state_ = State::kOff;
  std::uint32_t generation_ = 0;
  std::unordered_map<SigKey, std::uint32_t, SigHash> sig_index_;
  std::vector<Sig> sigs_;
  std::unordered_map<ItemKey, std::uint32_t, ItemHash> item_index_;
  std::vector<Item> items_;
  std::vector<std::vector<Interval>> intervals_;  // per item: its lifetimes while recording
  std::uint32_t before_ = ~std::uint32_t{0};  // the signature of the last named request
  std::vector<std::uint32_t> history_;  // Note [Naming on the host]: grows to kHistory, then a ring
  std::uint64_t cursor_ = kNever;       // the position in history_ the next request is predicted from
  std::uint64_t clock_ = 0;          // ticks at every recorded alloc and free
  std::uint64_t allocs_ = 0;         // named allocations
  std::uint64_t record_start_ = 0;   // allocs_ when the window opened
  std::uint64_t record_clock_ = kNever;  // clock_ of the lifetimes a window recorded again opens with
  std::uint64_t last_new_ = 0;       // allocs_ when the last new item appeared
  std::uint64_t last_new_clock_ = 0; // clock_ then
  std::size_t named_live_bytes_ = 0;
  std::size_t planned_live_bytes_ = 0;
  // The window's range of named live bytes, and the length of the last
  // window that closed (a window recorded again is at least as long).
  std::size_t low_live_ = 0, high_live_ = 0;
  std::uint64_t min_window_ = kMinQuiet;
  std::uint64_t adopted_at_ = 0;     // allocs_ when the plan came into force
};

}  // namespace torchmem::detail
