// runtime_pools.cpp: private pools (torch.cuda.MemPool, CUDA graph pools),
// the blocks parked while such a pool is in use, and users' own allocators
// behind torch.cuda.MemPool(allocator=X).
//
// Note [Parked stats] A parked block (Note [Parked private blocks],
// runtime_state.h) was freed by the user; it is parked only so a graph replay
// keeps its address. The native allocator counts such a free at once (the
// block becomes inactive in the graph's pool), and torch's own tests compare
// memory_stats() deltas around a capture, so device_stats() reports parked
// blocks as freed: allocation/active counts and allocated/active bytes drop by
// them (current) and their `freed` totals grow; the inactive gauges grow by
// them (reserved = active + inactive still holds). Peaks stay as the core measured.
#include <algorithm>
#include <utility>

#include "shim/runtime_state.h"

namespace torchmem::shim {

namespace {

// Set while an external allocator runs on this thread: an allocator that calls
// back into torchmem (mem_pool_allocator()) must not be routed to itself again.
thread_local bool in_external_allocator = false;

int stat_kind(const DeviceState& state, std::int64_t bytes) {
  return static_cast<std::size_t>(bytes) <= state.pool->config().small_threshold ? kStatSmallPool : kStatLargePool;
}

}  // namespace

// The private pool whose filter claims `stream` (pool 0 when none does).
Route route_to_pool(DeviceState& state, CudaStream stream) {
  Route route;
  if (state.active_captures.load(std::memory_order_acquire) == 0 || in_external_allocator) return route;
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  for (auto it = state.captures.rbegin(); it != state.captures.rend(); ++it) {
    if (it->filter && it->filter(stream)) {
      route.pool = it->pool;
      route.key = it->key;
      route.external = it->external;
      break;
    }
  }
  return route;
}

// Note [External pool allocators]: the user's allocator serves the request.
void* allocate_external(const std::shared_ptr<ExternalAllocator>& external, std::size_t size, CudaStream stream) {
  void* ptr = nullptr;
  in_external_allocator = true;
  try {
    ptr = external->allocate(size, stream);
  } catch (...) {
    in_external_allocator = false;
    throw;
  }
  in_external_allocator = false;
  if (ptr == nullptr) return nullptr;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.external_mutex);
  r.external_live[reinterpret_cast<Addr>(ptr)] = external;
  r.external_count.store(r.external_live.size(), std::memory_order_release);
  return ptr;
}

// True if `ptr` was an external allocator's block: then that allocator freed it.
bool free_if_external(void* ptr) {
  Registry& r = registry();
  if (r.external_count.load(std::memory_order_acquire) == 0) return false;
  std::shared_ptr<ExternalAllocator> external;
  {
    std::lock_guard<std::mutex> lock(r.external_mutex);
    auto found = r.external_live.find(reinterpret_cast<Addr>(ptr));
    if (found == r.external_live.end()) return false;
    external = std::move(found->second);
    r.external_live.erase(found);
    r.external_count.store(r.external_live.size(), std::memory_order_release);
  }
  external->free(ptr);  // no lock held: the user's code may call back into torch
  return true;
}

void note_private_block(DeviceState& state, Addr addr, MempoolKey key) {
  std::lock_guard<std::mutex> lock(state.parked_mutex);
  state.private_live.emplace(addr, key);
  state.private_live_count.store(state.private_live.size(), std::memory_order_release);
}

bool park_if_private(DeviceState& state, Addr addr) {
  if (state.private_live_count.load(std::memory_order_acquire) == 0) return false;
  MempoolKey key;
  {
    std::lock_guard<std::mutex> lock(state.parked_mutex);
    auto found = state.private_live.find(addr);
    if (found == state.private_live.end()) return false;
    key = found->second;
    state.private_live.erase(found);
    state.private_live_count.store(state.private_live.size(), std::memory_order_release);
  }
  if (!parks_private_frees()) return false;  // the core frees it into its frozen pool
  bool in_use = false;
  {
    std::lock_guard<std::mutex> lock(state.capture_mutex);
    in_use = state.private_pools.count(key) != 0;
  }
  if (!in_use) return false;
  const auto bytes = static_cast<std::int64_t>(state.pool->block_size(addr));
  const int kind = stat_kind(state, bytes);
  std::lock_guard<std::mutex> lock(state.parked_mutex);
  state.parked[key].push_back(addr);
  for (int k : {static_cast<int>(kStatAll), kind}) {
    state.parked_blocks[k] += 1;
    state.parked_bytes[k] += bytes;
  }
  return true;
}

bool is_external_block(void* ptr) {
  Registry& r = registry();
  if (r.external_count.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(r.external_mutex);
  return r.external_live.count(reinterpret_cast<Addr>(ptr)) != 0;
}

PoolStats device_stats(int device) {
  DeviceState& state = state_for(device);
  PoolStats stats = state.pool->stats();
  std::array<std::int64_t, kStatKinds> blocks{};
  std::array<std::int64_t, kStatKinds> bytes{};
  {
    std::lock_guard<std::mutex> lock(state.parked_mutex);
    blocks = state.parked_blocks;
    bytes = state.parked_bytes;
  }
  // Note [Parked stats]
  for (int kind = 0; kind < kStatKinds; ++kind) {
    for (Stat* stat : {&stats.allocation[kind], &stats.active[kind]}) {
      stat->current -= blocks[kind];
      stat->freed += static_cast<std::uint64_t>(blocks[kind]);
    }
    for (Stat* stat : {&stats.allocated_bytes[kind], &stats.active_bytes[kind]}) {
      stat->current -= bytes[kind];
      stat->freed += static_cast<std::uint64_t>(bytes[kind]);
    }
    // ...and they sit in the graph's pool as cached free blocks.
    stats.inactive_split[kind].current += blocks[kind];
    stats.inactive_split_bytes[kind].current += bytes[kind];
  }
  return stats;
}

namespace {

// One more use of the private pool `key`, creating it at the first use (Note
// [Private pool uses]). Caller holds state.capture_mutex; the core pool's
// mutex is taken under it (Note [Lock order]).
PrivatePool& add_pool_use(DeviceState& state, MempoolKey key, std::shared_ptr<ExternalAllocator> external = nullptr) {
  auto found = state.private_pools.find(key);
  if (found == state.private_pools.end()) {
    PoolId id = state.next_pool_id++;
    state.pool->create_private_pool(id);  // throws before anything is recorded
    found = state.private_pools.emplace(key, PrivatePool{id, 0, std::move(external)}).first;
  }
  found->second.uses += 1;
  return found->second;
}

}  // namespace

void incref_pool(int device, MempoolKey key, std::shared_ptr<ExternalAllocator> external) {
  DeviceState& state = state_for(device);
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  add_pool_use(state, key, std::move(external));
}

int pool_use_count(int device, MempoolKey key) {
  DeviceState& state = state_for(device);
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  auto found = state.private_pools.find(key);
  return found == state.private_pools.end() ? 0 : found->second.uses;
}

void begin_allocate_to_pool(int device, MempoolKey key, std::function<bool(CudaStream)> filter) {
  DeviceState& state = state_for(device);
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  PrivatePool& pool = add_pool_use(state, key);
  state.captures.push_back(Capture{key, pool.id, std::move(filter), pool.external});
  state.active_captures.store(static_cast<int>(state.captures.size()), std::memory_order_release);
}

void end_allocate_to_pool(int device, MempoolKey key) {
  DeviceState& state = state_for(device);
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  auto& captures = state.captures;
  captures.erase(std::remove_if(captures.begin(), captures.end(), [&](const Capture& c) { return c.key == key; }),
                 captures.end());
  state.active_captures.store(static_cast<int>(captures.size()), std::memory_order_release);
}

void release_pool(int device, MempoolKey key) {
  DeviceState& state = state_for(device);
  PoolId pool = 0;
  {
    std::lock_guard<std::mutex> lock(state.capture_mutex);
    auto found = state.private_pools.find(key);
    if (found == state.private_pools.end()) return;  // never allocated to: nothing to release
    if (--found->second.uses > 0) return;             // Note [Private pool uses]
    pool = found->second.id;
    state.private_pools.erase(found);
    state.released_pools.emplace_back(key, pool);
    if (state.released_pools.size() > DeviceState::kMaxReleasedKeys) state.released_pools.pop_front();
  }
  std::vector<Addr> parked;
  {
    std::lock_guard<std::mutex> lock(state.parked_mutex);
    auto found = state.parked.find(key);
    if (found != state.parked.end()) {
      parked = std::move(found->second);
      state.parked.erase(found);
    }
  }
  for (Addr addr : parked) {
    const auto bytes = static_cast<std::int64_t>(state.pool->block_size(addr));
    const int kind = stat_kind(state, bytes);
    {
      std::lock_guard<std::mutex> lock(state.parked_mutex);  // Note [Parked stats]
      for (int k : {static_cast<int>(kStatAll), kind}) {
        state.parked_blocks[k] -= 1;
        state.parked_bytes[k] -= bytes;
      }
    }
    state.pool->deallocate(addr);
  }
  state.pool->release_private_pool(pool);
}

std::size_t empty_pool_cache(MempoolKey key) {
  if (key == MempoolKey(0, 0)) return empty_cache();
  std::size_t returned = 0;
  for (int d = 0; d < kMaxDevices; ++d) {
    DeviceState* state = existing_state(d);
    if (state == nullptr) continue;
    // A pool still in use keeps its cache frozen (Note [Private pools]): only a
    // released one has anything to give, and it is emptied once.
    PoolId pool = 0;
    {
      std::lock_guard<std::mutex> lock(state->capture_mutex);
      auto& released = state->released_pools;
      auto found = std::find_if(released.begin(), released.end(), [&](const auto& entry) { return entry.first == key; });
      if (found != released.end()) {
        pool = found->second;
        released.erase(found);
      }
    }
    if (pool != 0) returned += state->pool->release_pool_cache(pool);
  }
  return returned;
}

}  // namespace torchmem::shim
