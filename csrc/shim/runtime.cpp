// runtime.cpp: the per-device registry and the allocation path torch calls.
//
// Each device gets, at first use, a backend (vmm where the device supports it,
// unless the config says cuda_malloc) and a torchmem::Pool built from the
// config given at install. Torch reaches it through the allocator subclass
// install.cpp installs, and through the extern "C" symbols of exports.cpp
// (torch.cuda.MemPool and CUDAPluggableAllocator built from Python).
//
// Note [OOM error] After Pool::allocate returns 0 (its ladder is exhausted) the
// OOM callback runs OUTSIDE every lock, and the allocation is retried while the
// callback says it freed memory (at most oom_hook_retries times). Then we throw
// c10::OutOfMemoryError constructed directly: torch turns it into
// torch.OutOfMemoryError. (Raising the same error through TORCH_CHECK_WITH out
// of the allocator crashed the process on torch 2.11, seen on the H200.) Under
// torch.cuda.MemPool the native allocator asks for whole segments and handles
// nullptr itself (free its cache, retry, raise), so that path returns nullptr.
//
// Note [Zero-size requests] torch sends size-0 requests through the pluggable
// allocator, and its bookkeeping map is keyed by pointer, so two live nullptrs
// would collide. The core rejects size 0, so we serve them as 1-byte requests
// (one 512-byte block): each gets a distinct address.
#include "shim/runtime.h"

#include <cuda_runtime_api.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>

#include "backend/cuda_malloc_backend_cuda.h"
#include "backend/cuda_support_cuda.h"
#include "backend/vmm_backend_cuda.h"

namespace torchmem::shim {

namespace {

constexpr int kMaxDevices = 64;
// Note [Device-tagged deleter context] (runtime.h)
constexpr std::uintptr_t kDeviceTagMask = 127;
static_assert(kMaxDevices < static_cast<int>(kDeviceTagMask) && kMinBlockSize > kDeviceTagMask,
              "the device tag must fit under the block alignment");
std::atomic<std::uint64_t> failed_deleter_free_count{0};

// Note [Private pool uses] As in PyTorch's allocator, every
// begin_allocate_to_pool and every incref_pool (torch.cuda.MemPool creation;
// newer torch's graph capture) counts one use of its pool (graphs may share a
// pool: torch.cuda.graph(pool=other.pool())), and every release_pool drops
// one; the core pool is released when the last use is dropped.
struct PrivatePool {
  PoolId id = 0;
  int uses = 0;
};

// Note [Parked private blocks] A CUDA graph replays into the addresses its
// capture used, including those of intermediates freed during the capture.
// The core pool may reclaim (unmap and move) granules of any free block whose
// fence completed, and release_cached() returns them, which would pull memory
// out from under a later replay. So while a private pool is in use, frees of
// its blocks are parked here (the core still counts them as allocated) and
// handed to the core only when the pool is released. The cost: blocks freed
// inside a capture are not reused by the same capture.
struct Capture {
  MempoolKey key;
  PoolId pool;
  std::function<bool(CudaStream)> filter;
};

// Everything torchmem keeps for one device. Never destroyed: torch may free
// tensors during interpreter shutdown, after static destructors would have run.
struct DeviceState {
  int device = 0;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Pool> pool;
  std::size_t total_bytes = 0;

  std::mutex capture_mutex;            // guards captures, private_pools, next_pool_id
  std::atomic<int> active_captures{0};  // fast-path check: any filter to consult?
  std::vector<Capture> captures;
  std::map<MempoolKey, PrivatePool> private_pools;
  PoolId next_pool_id = 1;

  // Note [Parked private blocks]
  std::mutex parked_mutex;                            // guards private_live, parked
  std::atomic<std::size_t> private_live_count{0};     // fast-path check for frees
  std::unordered_map<Addr, MempoolKey> private_live;  // live blocks of private pools
  std::map<MempoolKey, std::vector<Addr>> parked;     // freed, held until the pool's release
};

struct Registry {
  std::mutex mutex;  // guards config and creation of device states
  RuntimeConfig config;
  bool configured = false;
  std::atomic<bool> installed{false};
  std::array<std::atomic<DeviceState*>, kMaxDevices> states{};

  std::mutex callback_mutex;
  std::shared_ptr<OomCallback> oom_callback;
  std::shared_ptr<ContextProvider> context_provider;
  std::atomic<bool> has_context_provider{false};
};

Registry& registry() {
  static Registry* instance = new Registry();  // leaked on purpose: see DeviceState
  return *instance;
}

bool same_config(const RuntimeConfig& a, const RuntimeConfig& b) {
  const PoolConfig& p = a.pool;
  const PoolConfig& q = b.pool;
  return a.backend == b.backend && a.oom_hook_retries == b.oom_hook_retries && a.limit.kind == b.limit.kind &&
         a.limit.bytes == b.limit.bytes && a.limit.fraction == b.limit.fraction &&
         p.reserve_bytes == q.reserve_bytes && p.small_threshold == q.small_threshold &&
         p.small_page_bytes == q.small_page_bytes && p.reclaim_slack == q.reclaim_slack &&
         p.virtual_bytes == q.virtual_bytes && p.debug_checks == q.debug_checks &&
         p.trace_capacity == q.trace_capacity && p.alias_reclaim == q.alias_reclaim;
}

void check_device(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("torchmem: device index " + std::to_string(device) + " is out of range [0, " +
                                std::to_string(kMaxDevices) + ")");
  }
}

std::unique_ptr<Backend> make_backend(const std::string& kind, int device) {
  if (kind == "cuda_malloc") return std::make_unique<CudaMallocBackend>(device);
  if (kind == "vmm") return std::make_unique<VmmBackend>(device);
  if (kind == "auto") {
    if (VmmBackend::device_supports_vmm(device)) return std::make_unique<VmmBackend>(device);
    return std::make_unique<CudaMallocBackend>(device);
  }
  throw std::invalid_argument("torchmem: unknown backend '" + kind + "'; expected auto, vmm or cuda_malloc");
}

std::size_t resolve_limit(const LimitSpec& limit, std::size_t total_bytes) {
  switch (limit.kind) {
    case LimitSpec::Kind::kNone: return 0;
    case LimitSpec::Kind::kBytes: return limit.bytes;
    case LimitSpec::Kind::kFraction: return static_cast<std::size_t>(limit.fraction * static_cast<double>(total_bytes));
  }
  return 0;
}

DeviceState& state_for(int device) {
  check_device(device);
  Registry& r = registry();
  DeviceState* state = r.states[device].load(std::memory_order_acquire);
  if (state != nullptr) return *state;
  std::lock_guard<std::mutex> lock(r.mutex);
  state = r.states[device].load(std::memory_order_relaxed);
  if (state != nullptr) return *state;
  cuda::RelaxedCaptureGuard relaxed;
  auto fresh = std::make_unique<DeviceState>();
  fresh->device = device;
  fresh->backend = make_backend(r.config.backend, device);
  fresh->total_bytes = fresh->backend->mem_info().total_bytes;
  PoolConfig pool_config = r.config.pool;
  pool_config.limit_bytes = resolve_limit(r.config.limit, fresh->total_bytes);
  fresh->pool = std::make_unique<Pool>(*fresh->backend, pool_config);
  r.configured = true;  // pools exist: the config in force is now fixed
  state = fresh.release();
  r.states[device].store(state, std::memory_order_release);
  return *state;
}

DeviceState* existing_state(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return registry().states[device].load(std::memory_order_acquire);
}

std::uint64_t current_context() {
  Registry& r = registry();
  if (!r.has_context_provider.load(std::memory_order_relaxed)) return 0;
  std::shared_ptr<ContextProvider> provider;
  {
    std::lock_guard<std::mutex> lock(r.callback_mutex);
    provider = r.context_provider;
  }
  return provider && *provider ? (*provider)() : 0;
}

bool run_oom_callback(int device, std::size_t requested) {
  std::shared_ptr<OomCallback> callback;
  {
    std::lock_guard<std::mutex> lock(registry().callback_mutex);
    callback = registry().oom_callback;
  }
  return callback && *callback && (*callback)(device, requested);
}

// The private pool whose filter claims `stream` (0 and nullptr when none does).
PoolId route_to_pool(DeviceState& state, CudaStream stream, MempoolKey* key) {
  if (state.active_captures.load(std::memory_order_acquire) == 0) return 0;
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  for (auto it = state.captures.rbegin(); it != state.captures.rend(); ++it) {
    if (it->filter && it->filter(stream)) {
      *key = it->key;
      return it->pool;
    }
  }
  return 0;
}

void* try_allocate(DeviceState& state, std::size_t size, CudaStream stream) {
  std::size_t request = size == 0 ? 1 : size;  // Note [Zero-size requests]
  MempoolKey key{0, 0};
  PoolId pool = route_to_pool(state, stream, &key);
  Addr addr = state.pool->allocate(request, reinterpret_cast<StreamId>(stream), pool, current_context());
  if (addr != 0 && pool != 0) {
    std::lock_guard<std::mutex> lock(state.parked_mutex);
    state.private_live.emplace(addr, key);
    state.private_live_count.store(state.private_live.size(), std::memory_order_release);
  }
  return reinterpret_cast<void*>(addr);
}

// True if `addr` is a block of a private pool still in use: then it is parked
// (Note [Parked private blocks]) instead of freed.
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
  bool in_use = false;
  {
    std::lock_guard<std::mutex> lock(state.capture_mutex);
    in_use = state.private_pools.count(key) != 0;
  }
  if (!in_use) return false;
  std::lock_guard<std::mutex> lock(state.parked_mutex);
  state.parked[key].push_back(addr);
  return true;
}

// PyTorch's human units (bytes, KiB, MiB, GiB with two decimals), so OOM messages
// read like the native allocator's; exact powers print in the larger unit.
// Note [No iostreams here] Sizes and addresses are formatted with snprintf, not
// std::ostream: on the H200 machine (torch 2.11's venv), `ostream << double`
// from this module crashed inside libstdc++'s locale facets (seen with
// cuda-gdb: a segfault in codecvt under _M_insert<double>, while building the
// OOM message), which turned every OOM into a crash. snprintf has no locale
// machinery to disagree about.
std::string format_size(std::uint64_t size) {
  char text[64];
  if (size < 1024) {
    std::snprintf(text, sizeof text, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size < 1048576) {
    std::snprintf(text, sizeof text, "%.2f KiB", static_cast<double>(size) / 1024.0);
  } else if (size < 1073741824ULL) {
    std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(size) / 1048576.0);
  } else {
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(size) / 1073741824.0);
  }
  return text;
}

std::string format_address(const void* ptr) {
  char text[32];
  std::snprintf(text, sizeof text, "%p", ptr);
  return text;
}

std::string oom_message(DeviceState& state, std::size_t size) {
  PoolStats stats = state.pool->stats();
  MemInfo mem;
  try {
    mem = state.backend->mem_info();
  } catch (const std::exception&) {
    mem.total_bytes = state.total_bytes;
  }
  const auto live = static_cast<std::uint64_t>(stats.allocated_bytes[kStatAll].current);
  const auto reserved = static_cast<std::uint64_t>(stats.reserved_bytes[kStatAll].current);
  const std::uint64_t cached = reserved > live ? reserved - live : 0;
  const std::size_t limit = state.pool->limit();
  std::string msg = "CUDA out of memory. Tried to allocate " + format_size(size) + ". GPU " +
                    std::to_string(state.device) + " has a total capacity of " + format_size(mem.total_bytes) +
                    " of which " + format_size(mem.free_bytes) + " is free. torchmem (" + state.backend->name() +
                    " backend) holds " + format_size(reserved) + " reserved: " + format_size(live) + " live, " +
                    format_size(cached) + " cached; largest free block " + format_size(stats.largest_free_block) +
                    ". Budget: " +
                    (limit ? format_size(limit) : "the whole device (" + format_size(mem.total_bytes) + ")") +
                    ". Try a smaller batch or sequence length, let torchmem.BatchSizeController pick the largest "
                    "batch that fits, or raise the budget (torchmem.install(limit=...) or "
                    "torch.cuda.set_per_process_memory_fraction).";
  return msg;
}

template <typename P, typename = void>
struct has_set_trace_capacity : std::false_type {};
template <typename P>
struct has_set_trace_capacity<P, std::void_t<decltype(std::declval<P&>().set_trace_capacity(std::size_t{}))>>
    : std::true_type {};

template <typename P>
void apply_trace_capacity(P& pool, std::size_t entries) {
  if constexpr (has_set_trace_capacity<P>::value) {
    pool.set_trace_capacity(entries);
  } else {
    if (pool.config().trace_capacity != entries) {
      throw std::runtime_error(
          "torchmem: this build's pool cannot change its trace capacity after it was created; "
          "pass trace_capacity=N to torchmem.install() instead");
    }
  }
}

}  // namespace

// ---- configuration -------------------------------------------------------------

void configure(const RuntimeConfig& config) {
  if (config.backend != "auto" && config.backend != "vmm" && config.backend != "cuda_malloc") {
    throw std::invalid_argument("torchmem: unknown backend '" + config.backend +
                                "'; expected auto, vmm or cuda_malloc");
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.configured) {
    if (same_config(r.config, config)) return;  // no write: allocation paths read the config unlocked
    throw std::invalid_argument(
        "torchmem: the allocator is already configured with a different config, and its pools hold memory; "
        "configure torchmem once per process (call torchmem.install() with the same options)");
  }
  r.config = config;
  r.configured = true;
}

bool is_configured() {
  std::lock_guard<std::mutex> lock(registry().mutex);
  return registry().configured;
}

bool is_installed() { return registry().installed.load(); }
void mark_installed() { registry().installed.store(true); }

// ---- per-device pools ----------------------------------------------------------

Pool& device_pool(int device) { return *state_for(device).pool; }

std::vector<int> devices() {
  std::vector<int> found;
  for (int d = 0; d < kMaxDevices; ++d) {
    if (existing_state(d) != nullptr) found.push_back(d);
  }
  return found;
}

std::string backend_name(int device) { return state_for(device).backend->name(); }

MemInfo device_mem_info(int device) { return state_for(device).backend->mem_info(); }

std::size_t empty_cache() {
  std::size_t returned = 0;
  for (int d = 0; d < kMaxDevices; ++d) {
    if (DeviceState* state = existing_state(d)) returned += state->pool->release_cached();
  }
  return returned;
}

void set_trace_capacity(std::size_t entries) {
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    registry().config.pool.trace_capacity = entries;
  }
  for (int d = 0; d < kMaxDevices; ++d) {
    if (DeviceState* state = existing_state(d)) apply_trace_capacity(*state->pool, entries);
  }
}

// ---- callbacks -----------------------------------------------------------------

void set_oom_callback(OomCallback callback) {
  auto shared = callback ? std::make_shared<OomCallback>(std::move(callback)) : nullptr;
  std::lock_guard<std::mutex> lock(registry().callback_mutex);
  registry().oom_callback = std::move(shared);
}

void set_context_provider(ContextProvider provider) {
  Registry& r = registry();
  auto shared = provider ? std::make_shared<ContextProvider>(std::move(provider)) : nullptr;
  std::lock_guard<std::mutex> lock(r.callback_mutex);
  r.has_context_provider.store(shared != nullptr);
  r.context_provider = std::move(shared);
}

// ---- what torch calls ----------------------------------------------------------

void* allocate_or_null(std::size_t size, int device, CudaStream stream) {
  return try_allocate(state_for(device), size, stream);
}

void* allocate_or_throw(std::size_t size, int device, CudaStream stream) {
  DeviceState& state = state_for(device);
  void* ptr = try_allocate(state, size, stream);
  if (ptr != nullptr) return ptr;
  // Note [OOM error]: hooks run with no lock held, then we retry.
  int retries = registry().config.oom_hook_retries;
  for (int attempt = 0; attempt < retries && ptr == nullptr; ++attempt) {
    if (!run_oom_callback(device, size)) break;
    ptr = try_allocate(state, size, stream);
  }
  if (ptr != nullptr) return ptr;
  throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              oom_message(state, size));
}

void deallocate(void* ptr, int device) {
  DeviceState* state = existing_state(device);
  if (state == nullptr) {
    throw std::runtime_error("torchmem: free of address " + format_address(ptr) + " on device " +
                             std::to_string(device) +
                             ", where torchmem has allocated nothing; it was not allocated by torchmem");
  }
  try {
    if (park_if_private(*state, reinterpret_cast<Addr>(ptr))) return;
    state->pool->deallocate(reinterpret_cast<Addr>(ptr));
  } catch (const PoolError& error) {
    throw std::runtime_error("torchmem: free of address " + format_address(ptr) + " on device " +
                             std::to_string(device) +
                             " that is not a live torchmem block (unknown or already freed): " + error.what());
  }
}

int owning_device(void* ptr) {
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) current = 0;
  auto addr = reinterpret_cast<Addr>(ptr);
  DeviceState* state = existing_state(current);
  if (state != nullptr && state->pool->block_size(addr) != 0) return current;
  for (int d = 0; d < kMaxDevices; ++d) {
    state = existing_state(d);
    if (d != current && state != nullptr && state->pool->block_size(addr) != 0) return d;
  }
  throw std::runtime_error("torchmem: address " + format_address(ptr) +
                           " is not a live torchmem block on any device (unknown or already freed)");
}

void* tag_with_device(void* ptr, int device) {
  auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if ((addr & kDeviceTagMask) != 0) return ptr;  // untagged: the free looks the device up
  return reinterpret_cast<void*>(addr | static_cast<std::uintptr_t>(device + 1));
}

void delete_tagged_block(void* context) noexcept {
  auto tagged = reinterpret_cast<std::uintptr_t>(context);
  void* ptr = reinterpret_cast<void*>(tagged & ~kDeviceTagMask);
  const int tag = static_cast<int>(tagged & kDeviceTagMask);
  try {
    deallocate(ptr, tag != 0 ? tag - 1 : owning_device(ptr));
  } catch (const std::exception& error) {
    failed_deleter_free_count.fetch_add(1, std::memory_order_relaxed);
    std::fprintf(stderr, "%s (reported, not raised: this free came from a tensor's destructor; the pool is unchanged)\n",
                 error.what());
  }
}

std::uint64_t failed_deleter_frees() { return failed_deleter_free_count.load(std::memory_order_relaxed); }

void record_stream(void* ptr, CudaStream stream) {
  // The hook gets no device: the pool that owns the block takes the stream.
  existing_state(owning_device(ptr))->pool->record_stream(reinterpret_cast<Addr>(ptr),
                                                          reinterpret_cast<StreamId>(stream));
}

void* base_allocation(void* ptr, std::size_t* size) {
  // Blocks are torchmem's unit of ownership: report the block itself.
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) current = 0;
  DeviceState* state = existing_state(current);
  if (size != nullptr) *size = state ? state->pool->block_size(reinterpret_cast<Addr>(ptr)) : 0;
  return ptr;
}

void set_memory_fraction(double fraction, int device) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw std::invalid_argument("torchmem: memory fraction must be in (0, 1], got " + std::to_string(fraction));
  }
  DeviceState& state = state_for(device);
  state.pool->set_limit(static_cast<std::size_t>(fraction * static_cast<double>(state.total_bytes)));
}

namespace {

// One more use of the private pool `key`, creating it at the first use (Note
// [Private pool uses]). Caller holds state.capture_mutex; the core pool's
// mutex is taken under it (Note [Lock order]).
PoolId add_pool_use(DeviceState& state, MempoolKey key) {
  auto found = state.private_pools.find(key);
  if (found == state.private_pools.end()) {
    PoolId id = state.next_pool_id++;
    state.pool->create_private_pool(id);  // throws before anything is recorded
    found = state.private_pools.emplace(key, PrivatePool{id, 0}).first;
  }
  found->second.uses += 1;
  return found->second.id;
}

}  // namespace

void incref_pool(int device, MempoolKey key) {
  DeviceState& state = state_for(device);
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  add_pool_use(state, key);
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
  PoolId pool = add_pool_use(state, key);
  state.captures.push_back(Capture{key, pool, std::move(filter)});
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
  for (Addr addr : parked) state.pool->deallocate(addr);
  state.pool->release_private_pool(pool);
}

}  // namespace torchmem::shim
