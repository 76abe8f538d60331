// block.h: a block of a heap, the arena that recycles them, and the ordered
// set of free blocks that best fit searches.
//
// A Block is a run of bytes of one range: the heap's virtual range (VMM) or
// one segment (cuda_malloc). Blocks of a range tile it exactly and are linked
// to their address neighbours (prev/next), so a free merges in O(1).
//
// Blocks are recycled through a BlockArena so the fast path allocates no
// memory for them. Free blocks are indexed by free_index.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/pool.h"
#include "core/types.h"

namespace torchmem::detail {

struct Heap;
struct Segment;

// A free block merged from blocks freed on different streams: reusing it on
// any stream needs every stream's fence (Note [Fences] in pool.h).
constexpr StreamId kMixedStreams = ~StreamId{0};

// Field order and alignment: best fit, split and merge read only the first
// cache line (address, size, links, state, fence tag) of a candidate block
// and of its neighbours; the live-block fields share the second line. With
// the 120-byte record packed at any offset, best fit touched two lines per
// candidate.
struct alignas(64) Block {
  Addr addr = 0;
  std::size_t size = 0;         // rounded, a multiple of kMinBlockSize
  Block* prev = nullptr;        // address neighbours in the same range
  Block* next = nullptr;
  Heap* heap = nullptr;
  // Free blocks: the stream that last freed (part of) it and the pool sequence
  // number of that free; free_seq == 0 means never used (no fence needed).
  StreamId free_stream = 0;
  std::uint64_t free_seq = 0;
  BlockState state = BlockState::kInactive;
  // Free blocks: the slot (Pool::Impl::slots) of the stream current where it
  // was freed, when that was not the stream that freed it (Note [Freed under
  // another stream] in pool.h); 0, the never-used slot: none. A slot, not a
  // StreamId, so that it fits the first line, which merge and split read.
  std::uint16_t reader_slot = 0;
  // The block's name in the step plan (Note [Step plan]), or ~0 for none.
  std::uint32_t plan_item = ~std::uint32_t{0};
  // Live blocks: what allocate() was told.
  std::size_t requested = 0;
  StreamId stream = 0;          // the allocating stream
  std::uint64_t context = 0;
  std::vector<StreamId> uses;   // record_stream() streams other than `stream`
  Segment* segment = nullptr;   // cuda_malloc mode: the segment it lies in

  bool is_free() const { return state == BlockState::kInactive; }
  Addr end() const { return addr + size; }
};

// Recycles Block objects: allocated in chunks, never returned to the system
// until the arena dies.
class BlockArena {
 public:
  Block* make() {
    if (free_.empty()) grow();
    Block* b = free_.back();
    free_.pop_back();
    return b;
  }
  void recycle(Block* b) {
    if (b->uses.capacity()) b->uses = std::vector<StreamId>();
    b->state = BlockState::kInactive;
    b->free_seq = 0;
    b->free_stream = 0;
    b->reader_slot = 0;
    b->plan_item = ~std::uint32_t{0};
    b->requested = 0;
    b->prev = b->next = nullptr;
    b->segment = nullptr;
    free_.push_back(b);
  }

 private:
  void grow() {
    constexpr std::size_t kChunk = 256;
    chunks_.emplace_back(new Block[kChunk]);
    for (std::size_t i = kChunk; i-- > 0;) free_.push_back(&chunks_.back()[i]);
  }
  std::vector<std::unique_ptr<Block[]>> chunks_;
  std::vector<Block*> free_;
};


}  // namespace torchmem::detail
