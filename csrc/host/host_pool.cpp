// host_pool.cpp: the pinned host pool's policy (see host_pool.h for the
// contract and the notes on size classes, stream-safe reuse and OOM).
#include "host/host_pool.h"

#include <algorithm>
#include <chrono>
#include <unordered_set>

#include "host/host_system.h"

namespace torchmem::host {

namespace {

std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

std::uint64_t micros_since(std::chrono::steady_clock::time_point start) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count());
}

}  // namespace

std::size_t host_size_class(std::size_t bytes) {
  constexpr std::size_t kMin = 512;
  if (bytes <= kMin) return kMin;
  std::size_t top = std::size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(bytes)));
  std::size_t step = std::max(kMin, top / 4);
  return round_up(bytes, step);
}

HostPool::HostPool(HostBackend& backend, const HostPoolConfig& config) : backend_(backend), config_(config) {
  const std::size_t page = backend.page_bytes();
  if (config.chunk_bytes < (std::size_t{2} << 20) || config.chunk_bytes % page != 0) {
    throw HostPoolError("torchmem.host: chunk_bytes must be a multiple of " + format_bytes(page) +
                        " and at least 2 MiB, got " + std::to_string(config.chunk_bytes));
  }
}

HostPool::~HostPool() {
  std::lock_guard<std::mutex> lock(mutex_);
  // A destructor must not throw: at process exit the driver may already be
  // gone, and then the memory goes back with the process anyway.
  try {
    for (Block* block : parked_) {
      for (EventHandle e : block->events) {
        backend_.synchronize_event(e);
        backend_.destroy_event(e);
      }
    }
    parked_.clear();
    for (auto& chunk : chunks_) backend_.unmap_chunk(chunk->memory);
  } catch (const std::exception&) {
  }
}

void* HostPool::allocate(std::size_t bytes, StreamId stream) {
  if (bytes == 0) throw HostPoolError("torchmem.host: cannot allocate 0 bytes; ask for at least one byte");
  const std::size_t size = host_size_class(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  // Cheapest first: a cached block; parked frees that completed; new space;
  // parked frees waited for; idle chunks given back to make room; give up.
  Block* block = take_cached(size);
  if (block == nullptr && poll_parked() > 0) block = take_cached(size);
  if (block == nullptr) block = carve(size);
  if (block == nullptr && !parked_.empty()) {
    wait_parked();
    block = take_cached(size);
  }
  if (block == nullptr && release_idle_chunks() > 0) block = carve(size);
  if (block == nullptr) throw_oom(bytes, size, refusal_);
  block->requested = bytes;
  if (copies_reported_.load(std::memory_order_relaxed)) {
    block->streams.clear();
  } else {
    block->streams.assign(1, stream);
  }
  block->live = true;
  stats_.allocations_current += 1;
  stats_.allocations_allocated += 1;
  stats_.allocations_peak = std::max(stats_.allocations_peak, stats_.allocations_current);
  stats_.allocated_bytes_current += block->size;
  stats_.allocated_bytes_peak = std::max(stats_.allocated_bytes_peak, stats_.allocated_bytes_current);
  stats_.requested_bytes_current += bytes;
  return block->ptr;
}

HostPool::Block* HostPool::take_cached(std::size_t size) {
  // Blocks are never split, so a much larger block would waste its rest
  // (Note [Host size classes]): accept up to twice the class.
  Block* block = nullptr;
  for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= 2 * size; ++it) {
    if (!it->second.empty()) {
      block = it->second.back();  // the most recently freed: warmest in the caches
      it->second.pop_back();
      break;
    }
  }
  if (block == nullptr) return nullptr;
  stats_.cached_bytes -= block->size;
  stats_.cache_hits += 1;
  block->chunk->live += 1;
  return block;
}

HostPool::Block* HostPool::carve(std::size_t size) {
  Chunk* chunk = nullptr;
  std::size_t block_size = size;
  if (size > config_.chunk_bytes / 4) {
    block_size = round_up(size, backend_.page_bytes());
    chunk = new_chunk(block_size, /*dedicated=*/true);
  } else {
    if (current_ == nullptr || current_->memory.bytes - current_->carved < size) {
      Chunk* fresh = new_chunk(config_.chunk_bytes, /*dedicated=*/false);
      if (fresh != nullptr) current_ = fresh;
    }
    if (current_ != nullptr && current_->memory.bytes - current_->carved >= size) chunk = current_;
  }
  if (chunk == nullptr) return nullptr;
  auto block = std::make_unique<Block>();
  block->ptr = static_cast<char*>(chunk->memory.ptr) + chunk->carved;
  block->size = block_size;
  block->requested = 0;
  block->chunk = chunk;
  chunk->carved += block_size;
  chunk->live += 1;
  by_ptr_.emplace(block->ptr, block.get());
  chunk->blocks.push_back(std::move(block));
  stats_.cache_misses += 1;
  return chunk->blocks.back().get();
}

HostPool::Chunk* HostPool::new_chunk(std::size_t bytes, bool dedicated) {
  if (config_.limit_bytes != 0 && stats_.held_bytes + bytes > config_.limit_bytes) {
    refusal_ = "a new chunk of " + format_bytes(bytes) + " would pass the pool's limit of " +
               format_bytes(config_.limit_bytes);
    return nullptr;
  }
  auto start = std::chrono::steady_clock::now();
  HostChunk memory = backend_.map_chunk(bytes);
  if (memory.ptr == nullptr) {
    refusal_ = "the system refused a new chunk of " + format_bytes(bytes) + " (mmap failed: out of host memory)";
    return nullptr;
  }
  if (!memory.pinned && config_.require_pinned) {
    backend_.unmap_chunk(memory);
    refusal_ = "pinning a new chunk of " + format_bytes(bytes) + " was refused and require_pinned is set";
    return nullptr;
  }
  std::uint64_t took = micros_since(start);
  auto chunk = std::make_unique<Chunk>();
  chunk->memory = memory;
  chunk->dedicated = dedicated;
  stats_.held_bytes += memory.bytes;
  stats_.held_bytes_peak = std::max(stats_.held_bytes_peak, stats_.held_bytes);
  if (memory.pinned) stats_.pinned_bytes += memory.bytes;
  if (memory.huge_pages) stats_.huge_page_bytes += memory.bytes;
  stats_.chunks += 1;
  stats_.num_host_alloc += 1;
  stats_.host_alloc_time_us_total += took;
  stats_.host_alloc_time_us_max = std::max(stats_.host_alloc_time_us_max, took);
  chunks_.push_back(std::move(chunk));
  return chunks_.back().get();
}

void HostPool::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = live_block(ptr);
  if (block == nullptr) {
    throw HostPoolError("torchmem.host: free of a pointer that is not a live block of this pool "
                        "(freed twice, or allocated elsewhere)");
  }
  // Record every event before changing anything, so a failure leaves the block live.
  std::vector<EventHandle> events;
  try {
    for (StreamId stream : block->streams) events.push_back(backend_.record_event(stream));
  } catch (...) {
    for (EventHandle e : events) backend_.destroy_event(e);
    throw;
  }
  block->live = false;
  stats_.allocations_current -= 1;
  stats_.allocations_freed += 1;
  stats_.allocated_bytes_current -= block->size;
  stats_.requested_bytes_current -= block->requested;
  block->requested = 0;
  stats_.pending_bytes += block->size;
  if (events.empty()) {  // no stream used it (copies reported): reusable now
    make_free(block);
    return;
  }
  block->events = std::move(events);
  parked_.push_back(block);
}

HostPool::Block* HostPool::live_block(const void* ptr) const {
  auto it = by_ptr_.find(ptr);
  return it != by_ptr_.end() && it->second->live ? it->second : nullptr;
}

void HostPool::set_copies_reported(bool reported) {
  std::lock_guard<std::mutex> lock(mutex_);
  copies_reported_.store(reported, std::memory_order_relaxed);
}

void HostPool::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = live_block(ptr);
  if (block == nullptr) throw HostPoolError("torchmem.host: record_stream on a pointer that is not a live block");
  auto& streams = block->streams;
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
}

bool HostPool::poll_block(Block* block) {
  auto& events = block->events;
  auto done = std::remove_if(events.begin(), events.end(), [&](EventHandle e) {
    if (!backend_.event_completed(e)) return false;
    backend_.destroy_event(e);
    return true;
  });
  events.erase(done, events.end());
  return events.empty();
}

void HostPool::make_free(Block* block) {
  stats_.pending_bytes -= block->size;
  stats_.cached_bytes += block->size;
  block->streams.clear();
  block->chunk->live -= 1;
  free_[block->size].push_back(block);
}

std::size_t HostPool::process_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  return poll_parked();
}

std::size_t HostPool::poll_parked() {
  std::size_t freed = 0;
  auto keep = std::remove_if(parked_.begin(), parked_.end(), [&](Block* block) {
    if (!poll_block(block)) return false;
    make_free(block);
    freed += 1;
    return true;
  });
  parked_.erase(keep, parked_.end());
  return freed;
}

void HostPool::wait_parked() {
  for (Block* block : parked_) {
    for (EventHandle e : block->events) backend_.synchronize_event(e);
  }
  poll_parked();
}

std::size_t HostPool::release_idle_chunks() {
  std::size_t released = 0;
  // The free lists lose every block of an idle chunk: one pass per list, not
  // a search per block (a chunk may hold many thousands of small blocks).
  std::unordered_set<const Chunk*> idle;
  for (const auto& chunk : chunks_) {
    if (chunk->live == 0) idle.insert(chunk.get());
  }
  if (idle.empty()) return 0;
  for (auto& [size, list] : free_) {
    list.erase(std::remove_if(list.begin(), list.end(), [&](const Block* b) { return idle.count(b->chunk) != 0; }),
               list.end());
  }
  auto keep = std::remove_if(chunks_.begin(), chunks_.end(), [&](std::unique_ptr<Chunk>& chunk) {
    if (chunk->live != 0) return false;
    for (auto& block : chunk->blocks) {
      by_ptr_.erase(block->ptr);
      stats_.cached_bytes -= block->size;
    }
    auto start = std::chrono::steady_clock::now();
    backend_.unmap_chunk(chunk->memory);
    stats_.host_free_time_us_total += micros_since(start);
    stats_.held_bytes -= chunk->memory.bytes;
    if (chunk->memory.pinned) stats_.pinned_bytes -= chunk->memory.bytes;
    if (chunk->memory.huge_pages) stats_.huge_page_bytes -= chunk->memory.bytes;
    stats_.chunks -= 1;
    stats_.num_host_free += 1;
    released += chunk->memory.bytes;
    if (current_ == chunk.get()) current_ = nullptr;
    return true;
  });
  chunks_.erase(keep, chunks_.end());
  return released;
}

std::size_t HostPool::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  wait_parked();
  return release_idle_chunks();
}

void HostPool::throw_oom(std::size_t bytes, std::size_t size, const std::string& why) {
  stats_.num_ooms += 1;
  std::string limit = config_.limit_bytes ? format_bytes(config_.limit_bytes) : std::string("none");
  throw HostOutOfMemory(
      "torchmem.host: out of host memory: cannot allocate " + format_bytes(bytes) + " (" + format_bytes(size) +
      " as a block): " + why + ". The pool holds " + format_bytes(stats_.held_bytes) + " in " +
      std::to_string(stats_.chunks) + " chunks (" + format_bytes(stats_.pinned_bytes) + " pinned; " +
      format_bytes(stats_.allocated_bytes_current) + " in " + std::to_string(stats_.allocations_current) +
      " live blocks, " + format_bytes(stats_.cached_bytes) + " cached); pool limit " + limit + "; " +
      backend_.describe_limits() +
      ". Nothing was freed or lost: drop host tensors you no longer need, or raise the limit "
      "(torchmem.host.set_limit), or raise the memlock limit (ulimit -l).");
}

bool HostPool::is_pinned(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Block* block = live_block(ptr);
  return block != nullptr && block->chunk->memory.pinned;
}

std::size_t HostPool::block_size(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Block* block = live_block(ptr);
  return block == nullptr ? 0 : block->size;
}

void HostPool::set_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  config_.limit_bytes = bytes;
}

std::size_t HostPool::limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return config_.limit_bytes;
}

HostPoolStats HostPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void HostPool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.allocations_peak = stats_.allocations_current;
  stats_.allocated_bytes_peak = stats_.allocated_bytes_current;
  stats_.held_bytes_peak = stats_.held_bytes;
}

std::string HostPool::check_invariants() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t held = 0, pinned = 0, live_bytes = 0, cached = 0, pending = 0, live_count = 0, indexed = 0;
  for (const auto& chunk : chunks_) {
    held += chunk->memory.bytes;
    if (chunk->memory.pinned) pinned += chunk->memory.bytes;
    std::size_t offset = 0, busy = 0;
    for (const auto& block : chunk->blocks) {
      if (block->ptr != static_cast<char*>(chunk->memory.ptr) + offset) return "blocks do not tile their chunk";
      offset += block->size;
      bool is_live = block->live;
      auto found = by_ptr_.find(block->ptr);
      if (found == by_ptr_.end() || found->second != block.get()) return "a block is missing from the address index";
      ++indexed;
      bool is_parked = std::find(parked_.begin(), parked_.end(), block.get()) != parked_.end();
      if (is_live && is_parked) return "a block is both live and parked";
      if (is_live) live_bytes += block->size, ++live_count;
      if (is_parked) pending += block->size;
      if (!is_live && !is_parked) cached += block->size;
      busy += (is_live || is_parked) ? 1 : 0;
    }
    if (offset != chunk->carved) return "a chunk's carved bytes differ from its blocks' sizes";
    if (chunk->carved > chunk->memory.bytes) return "a chunk is carved past its end";
    if (busy != chunk->live) return "a chunk's live count differs from its live and parked blocks";
  }
  std::size_t free_sum = 0;
  for (const auto& [size, list] : free_) {
    for (const Block* block : list) {
      if (size != block->size) return "a free-list key differs from its block's size";
      if (block->live) return "a live block is on the free list";
      free_sum += size;
    }
  }
  if (indexed != by_ptr_.size()) return "the address index holds blocks of no chunk";
  if (free_sum != cached) return "the free list differs from the blocks neither live nor parked";
  if (held != stats_.held_bytes) return "held_bytes differs from the chunks' sizes";
  if (pinned != stats_.pinned_bytes) return "pinned_bytes differs from the pinned chunks";
  if (live_bytes != stats_.allocated_bytes_current || live_count != stats_.allocations_current)
    return "allocated counters differ from the live blocks";
  if (cached != stats_.cached_bytes) return "cached_bytes differs from the free blocks";
  if (pending != stats_.pending_bytes) return "pending_bytes differs from the parked blocks";
  return "";
}

}  // namespace torchmem::host
