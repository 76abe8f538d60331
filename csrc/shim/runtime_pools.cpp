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
#include <optional>
#include <utility>

#include "shim/runtime_state.h"

namespace torchmem::shim {

namespace {

// Set while an external allocator runs on this thread: an allocator that calls
// back into torchmem (mem_pool_allocator()) must not be routed to itself again.
thread_local bool in_external_allocator = false;
thread_local bool external_reentered = false;  // ...and set if it did
// The stream of the request an external pool is growing for (X's allocate
// takes one; the core's segment calls do not).
thread_local CudaStream growing_for_stream = nullptr;

// Sets a thread-local for a scope and puts the previous value back, also when
// the scope throws (X may throw; X may free into torchmem, which nests).
template <typename T>
class Restore {
 public:
  Restore(T& slot, T value) : slot_(slot), saved_(slot) { slot_ = value; }
  ~Restore() { slot_ = saved_; }
  Restore(const Restore&) = delete;
  Restore& operator=(const Restore&) = delete;

 private:
  T& slot_;
  T saved_;
};

int stat_kind(const DeviceState& state, std::int64_t bytes) {
  return static_cast<std::size_t>(bytes) <= state.pool->config().small_threshold ? kStatSmallPool : kStatLargePool;
}

void remember_external_block(void* ptr, Registry::ExternalBlock block) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.external_mutex);
  r.external_live[reinterpret_cast<Addr>(ptr)] = std::move(block);
  r.external_count.store(r.external_live.size(), std::memory_order_release);
}

// The external block at `ptr` (taken out of the registry with `forget`), or
// none: an empty pool and allocator. One atomic read when there are none.
std::optional<Registry::ExternalBlock> find_external_block(void* ptr, bool forget) {
  Registry& r = registry();
  if (r.external_count.load(std::memory_order_acquire) == 0) return std::nullopt;
  std::lock_guard<std::mutex> lock(r.external_mutex);
  auto found = r.external_live.find(reinterpret_cast<Addr>(ptr));
  if (found == r.external_live.end()) return std::nullopt;
  if (!forget) return found->second;
  Registry::ExternalBlock block = std::move(found->second);
  r.external_live.erase(found);
  r.external_count.store(r.external_live.size(), std::memory_order_release);
  return block;
}

// Note [External pool allocators]: X's segments count against the device's
// budget as PyTorch counts them in its per-process fraction.
bool external_may_grow(DeviceState& state, std::size_t bytes) {
  if (state.budget->refuses_all()) return false;
  const std::size_t limit = state.pool->limit();
  if (limit == 0) return true;  // no budget: X itself says when the device is full
  const std::size_t held = state.pool->usage().reserved + state.external_reserved.load();
  return held + bytes <= limit;
}

void count_external_bytes(DeviceState& state, ExternalPool& external, std::size_t bytes, bool added) {
  auto count = [&](std::atomic<std::size_t>& total) {
    if (added) {
      total += bytes;
    } else {
      total -= bytes;
    }
  };
  count(external.reserved);
  if (external.inside_device_pool) return;  // already the device pool's own
  // One lock, so the total the device pool sees is the last one counted (Note [Foreign bytes]).
  std::lock_guard<std::mutex> lock(state.external_bytes_mutex);
  count(state.external_reserved);
  state.pool->set_foreign_bytes(state.external_reserved.load());
}

std::shared_ptr<ExternalPool> make_external_pool(DeviceState& state, MempoolKey key,
                                                 std::shared_ptr<ExternalAllocator> allocator) {
  auto external = std::make_shared<ExternalPool>();
  external->device = state.device;
  external->key = key;
  external->allocator = std::move(allocator);
  ExternalPool* self = external.get();  // the backend lives inside it
  DeviceState* device = &state;          // never destroyed
  external->backend = make_segment_backend(
      state.device,
      [self, device](std::size_t bytes) -> void* {
        if (!self->inside_device_pool && !external_may_grow(*device, bytes)) return nullptr;
        void* ptr = nullptr;
        bool reentered = false;
        {
          Restore<bool> inside(in_external_allocator, true);
          Restore<bool> seen(external_reentered, false);
          ptr = self->allocator->allocate(bytes, growing_for_stream);
          reentered = external_reentered;
        }
        if (ptr == nullptr) return nullptr;
        // The first segment decides, for the life of the pool: X is the same function each time.
        if (!self->grown) {
          self->inside_device_pool = reentered;
          self->grown = true;
        }
        count_external_bytes(*device, *self, bytes, true);
        return ptr;
      },
      [self, device](void* ptr, std::size_t bytes) {
        {
          Restore<bool> inside(in_external_allocator, true);
          self->allocator->free(ptr);
        }
        count_external_bytes(*device, *self, bytes, false);
      },
      &state.active_captures);
  PoolConfig config = registry().config.pool;
  config.limit_bytes = 0;  // the device pool's budget decides (external_may_grow)
  config.reserve_bytes = 0;
  config.trace_capacity = 0;  // history is the device pool's; snapshots read these segments
  external->pool = std::make_unique<Pool>(*external->backend, config);
  return external;
}

// The external pools of `state` that `pick` selects, under the capture mutex.
template <typename Pick>
std::vector<std::shared_ptr<ExternalPool>> external_pools_where(DeviceState& state, Pick&& pick) {
  std::vector<std::shared_ptr<ExternalPool>> picked;
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  for (const auto& external : state.external_pools) {
    if (pick(*external)) picked.push_back(external);
  }
  return picked;
}

}  // namespace

// The private pool whose filter claims `stream` (pool 0 when none does).
Route route_to_pool(DeviceState& state, CudaStream stream) {
  Route route;
  if (state.active_captures.load(std::memory_order_acquire) == 0) return route;
  if (in_external_allocator) {
    external_reentered = true;
    return route;
  }
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

// Note [Caching off]: the device's cudaMalloc serves the request.
void* allocate_uncached(const std::shared_ptr<ExternalAllocator>& uncached, std::size_t size, CudaStream stream) {
  if (in_external_allocator) external_reentered = true;  // X is torchmem, with caching off
  void* ptr = uncached->allocate(size, stream);
  if (ptr != nullptr) remember_external_block(ptr, Registry::ExternalBlock{nullptr, uncached});
  return ptr;
}

void* allocate_in_external_pool(const std::shared_ptr<ExternalPool>& external, std::size_t size, CudaStream stream,
                                std::uint64_t context) {
  Addr addr = 0;
  {
    Restore<CudaStream> growing(growing_for_stream, stream);
    addr = external->pool->allocate(size, reinterpret_cast<StreamId>(stream), 0, context);
  }
  if (addr == 0) return nullptr;
  void* ptr = reinterpret_cast<void*>(addr);
  remember_external_block(ptr, Registry::ExternalBlock{external, nullptr});
  return ptr;
}

void* borrow_from_oom_lenders(DeviceState& state, std::size_t size, CudaStream stream, std::uint64_t context) {
  if (state.oom_lenders.load(std::memory_order_acquire) == 0) return nullptr;
  // A request from inside X (X allocating through torchmem while its pool grows) never borrows:
  // that pool's lock is held, and natively a request already in a pool does not either.
  if (in_external_allocator) return nullptr;
  auto lenders = external_pools_where(state, [](const ExternalPool& e) { return !e.released && e.use_on_oom; });
  for (const auto& lender : lenders) {
    // As natively, a cached block of the lender or nothing: never a new X segment, and a
    // failed borrow leaves the lender's cache as it was.
    const Addr addr = lender->pool->allocate_cached(size, reinterpret_cast<StreamId>(stream), 0, context);
    if (addr == 0) continue;
    void* ptr = reinterpret_cast<void*>(addr);
    remember_external_block(ptr, Registry::ExternalBlock{lender, nullptr});
    return ptr;
  }
  return nullptr;
}

bool record_stream_if_external(void* ptr, CudaStream stream) {
  const auto block = find_external_block(ptr, /*forget=*/false);
  if (!block) return false;
  // A cached X block must not be reused while another stream may use it (Note [Record
  // stream]); caching off frees at once, with nothing to track.
  if (block->pool) block->pool->pool->record_stream(reinterpret_cast<Addr>(ptr), reinterpret_cast<StreamId>(stream));
  return true;
}

// True if `ptr` was a block of an external pool or of caching off: then it went back there.
bool free_if_external(void* ptr) {
  const auto block = find_external_block(ptr, /*forget=*/true);
  if (!block) return false;
  // No lock held: the user's code may call back into torch.
  if (block->pool) {
    block->pool->pool->deallocate(reinterpret_cast<Addr>(ptr));
  } else {
    block->uncached->free(ptr);
  }
  return true;
}

std::size_t release_external_caches(DeviceState& state, const MempoolKey* key) {
  auto targets = external_pools_where(state, [key](const ExternalPool& e) {
    return e.released && (key == nullptr || e.key == *key);
  });
  if (targets.empty()) return 0;
  std::size_t returned = 0;
  for (const auto& external : targets) returned += external->pool->release_cached();
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  auto& pools = state.external_pools;
  pools.erase(std::remove_if(pools.begin(), pools.end(),
                             [](const auto& e) { return e->released && e->reserved.load() == 0; }),
              pools.end());
  return returned;
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

bool is_external_block(void* ptr) { return find_external_block(ptr, /*forget=*/false).has_value(); }

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
  // Note [External pool allocators]: X's segments are the device's too, as natively.
  for (const auto& external :
       external_pools_where(state, [](const ExternalPool& e) { return !e.inside_device_pool.load(); })) {
    const PoolStats theirs = external->pool->stats();
#define TORCHMEM_ADD_STAT_ARRAY(name)                          \
    for (int kind = 0; kind < kStatKinds; ++kind) {            \
      stats.name[kind].current += theirs.name[kind].current;   \
      stats.name[kind].peak += theirs.name[kind].peak;         \
      stats.name[kind].allocated += theirs.name[kind].allocated; \
      stats.name[kind].freed += theirs.name[kind].freed;       \
    }
    TORCHMEM_STAT_ARRAYS(TORCHMEM_ADD_STAT_ARRAY)
#undef TORCHMEM_ADD_STAT_ARRAY
    stats.num_device_alloc += theirs.num_device_alloc;
    stats.num_device_free += theirs.num_device_free;
  }
  return stats;
}

namespace {

// One more use of the private pool `key`, creating it at the first use (Note
// [Private pool uses]). Caller holds state.capture_mutex; the core pool's
// mutex is taken under it (Note [Lock order]).
PrivatePool& add_pool_use(DeviceState& state, MempoolKey key, std::shared_ptr<ExternalAllocator> allocator = nullptr) {
  auto found = state.private_pools.find(key);
  if (found == state.private_pools.end()) {
    // Note [External pool allocators]: X's pool is made first (it may throw), then the core's.
    std::shared_ptr<ExternalPool> external = allocator ? make_external_pool(state, key, std::move(allocator)) : nullptr;
    PoolId id = state.next_pool_id++;
    state.pool->create_private_pool(id);  // throws before anything is recorded
    if (external) state.external_pools.push_back(external);
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
    if (const auto& external = found->second.external) {
      external->released = true;  // its cache goes at emptyCache, as a released pool's natively
      if (external->use_on_oom.exchange(false)) state.oom_lenders -= 1;
    }
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
    returned += release_external_caches(*state, &key);
  }
  return returned;
}

std::vector<std::pair<MempoolKey, PoolSnapshot>> external_pool_snapshots(int device) {
  std::vector<std::pair<MempoolKey, PoolSnapshot>> out;
  DeviceState* state = existing_state(device);
  if (state == nullptr) return out;
  for (const auto& external :
       external_pools_where(*state, [](const ExternalPool& e) { return !e.inside_device_pool.load(); })) {
    out.emplace_back(external->key, external->pool->snapshot());
  }
  return out;
}

namespace {

// `reset` on the device pool and on each of its external pools, whose figures torch's stats include.
void reset_each_pool(int device, void (Pool::*reset)()) {
  DeviceState& state = state_for(device);
  (state.pool.get()->*reset)();
  for (const auto& external : external_pools_where(state, [](const ExternalPool&) { return true; })) {
    (external->pool.get()->*reset)();
  }
}

}  // namespace

void reset_peak_stats(int device) { reset_each_pool(device, &Pool::reset_peak_stats); }

void reset_accumulated_stats(int device) { reset_each_pool(device, &Pool::reset_accumulated_stats); }

void set_use_on_oom(int device, MempoolKey key, bool use_on_oom) {
  DeviceState& state = state_for(device);
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  auto found = state.private_pools.find(key);
  if (found == state.private_pools.end() || !found->second.external) return;
  if (found->second.external->use_on_oom.exchange(use_on_oom) != use_on_oom) {
    state.oom_lenders += use_on_oom ? 1 : -1;
  }
}

}  // namespace torchmem::shim
