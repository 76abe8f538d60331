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
// torch.OutOfMemoryError. (Not through TORCH_CHECK_WITH: raised that way out of
// the allocator, it ends the process.) Under
// torch.cuda.MemPool the native allocator asks for whole segments and handles
// nullptr itself (free its cache, retry, raise), so that path returns nullptr.
//
// Note [Zero-size requests] torch sends size-0 requests through the pluggable
// allocator, and its bookkeeping map is keyed by pointer, so two live nullptrs
// would collide. The core rejects size 0, so we serve them as 1-byte requests
// (one 512-byte block): each gets a distinct address.
#include "shim/runtime.h"
#include "shim/device_stats.h"
#include "shim/diagnostics.h"
#include "shim/runtime_state.h"

#include <cuda_runtime_api.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "backend/cuda_malloc_backend_cuda.h"
#include "backend/cuda_support_cuda.h"
#include "backend/vmm_backend_cuda.h"

namespace torchmem::shim {

namespace {

// Note [Device-tagged deleter context] (allocation.h)
constexpr std::uintptr_t kDeviceTagMask = 127;
static_assert(kMaxDevices < static_cast<int>(kDeviceTagMask) && kMinBlockSize > kDeviceTagMask,
              "the device tag must fit under the block alignment");
std::atomic<std::uint64_t> failed_deleter_free_count{0};

}  // namespace

Registry& registry() {
  static Registry* instance = new Registry();  // leaked on purpose: see DeviceState
  return *instance;
}

namespace {

bool same_config(const RuntimeConfig& a, const RuntimeConfig& b) {
  return a.backend == b.backend && a.oom_hook_retries == b.oom_hook_retries &&
         a.park_private_frees == b.park_private_frees && a.initial_fraction == b.initial_fraction &&
         a.limit == b.limit && a.pool == b.pool;
}

void check_device(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("torchmem: device index " + std::to_string(device) + " is out of range [0, " +
                                std::to_string(kMaxDevices) + ")");
  }
}

std::unique_ptr<CudaDeviceBackend> make_backend(const std::string& kind, int device) {
  if (kind == "cuda_malloc") return std::make_unique<CudaMallocBackend>(device);
  if (kind == "vmm") return std::make_unique<VmmBackend>(device);
  if (kind == "auto") {
    if (VmmBackend::device_supports_vmm(device)) return std::make_unique<VmmBackend>(device);
    return std::make_unique<CudaMallocBackend>(device);
  }
  throw std::invalid_argument("torchmem: unknown backend '" + kind + "'; expected auto, vmm or cuda_malloc");
}

// Note [Caching off] (allocation.h): plain cudaMalloc / cudaFree on `device`;
// nullptr when the device is full (the caller's OOM path takes over).
std::shared_ptr<ExternalAllocator> make_uncached_allocator(int device) {
  auto uncached = std::make_shared<ExternalAllocator>();
  uncached->allocate = [device](std::size_t size, CudaStream) -> void* {
    cuda::DeviceGuard guard(device);
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, size);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the error, as for any OOM
      return nullptr;
    }
    cuda::check(status, "cudaMalloc (caching off)");
    return ptr;
  };
  uncached->free = [](void* ptr) { cuda::check(cudaFree(ptr), "cudaFree (caching off)"); };
  return uncached;
}

}  // namespace

std::unique_ptr<Backend> make_segment_backend(int device, std::function<void*(std::size_t)> allocate,
                                              std::function<void(void*, std::size_t)> free,
                                              const std::atomic<int>* active_captures) {
  auto backend = std::make_unique<CudaMallocBackend>(
      device, SegmentSource{"mem_pool_allocator", std::move(allocate), std::move(free)});
  backend->refuse_device_sync_while(active_captures);
  return backend;
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
  std::unique_ptr<CudaDeviceBackend> backend = make_backend(r.config.backend, device);
  // Note [Device barrier] in pool.h: no device-wide wait while a graph captures.
  backend->refuse_device_sync_while(&fresh->active_captures);
  fresh->backend = std::move(backend);
  fresh->total_bytes = fresh->backend->mem_info().total_bytes;
  PoolConfig pool_config = r.config.pool;
  pool_config.limit_bytes = r.config.limit.resolve(fresh->total_bytes);  // the Budget's starting limit
  fresh->pool = std::make_unique<Pool>(*fresh->backend, pool_config);
  fresh->budget = std::make_unique<Budget>(fresh->pool.get(), r.config.limit, r.config.initial_fraction,
                                           fresh->total_bytes, fresh->backend->granularity());
  fresh->uncached = make_uncached_allocator(device);
  r.configured = true;  // pools exist: the config in force is now fixed
  state = fresh.release();
  r.states[device].store(state, std::memory_order_release);
  return *state;
}

DeviceState* existing_state(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return registry().states[device].load(std::memory_order_acquire);
}

namespace {

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

// The context of a free or a release: only when history asks for free stacks.
std::uint64_t free_context() {
  return registry().free_context.load(std::memory_order_relaxed) ? current_context() : 0;
}

bool run_oom_callback(int device, std::size_t requested) {
  std::shared_ptr<OomCallback> callback;
  {
    std::lock_guard<std::mutex> lock(registry().callback_mutex);
    callback = registry().oom_callback;
  }
  return callback && *callback && (*callback)(device, requested);
}

void* try_allocate(DeviceState& state, std::size_t size, CudaStream stream) {
  std::size_t request = size == 0 ? 1 : size;  // Note [Zero-size requests]
  if (!caching_enabled()) return allocate_uncached(state.uncached, request, stream);  // Note [Caching off]
  Route route = route_to_pool(state, stream);
  if (route.external) return allocate_in_external_pool(route.external, request, stream, current_context());
  if (state.budget->refuses_all()) return nullptr;  // Note [Budget rule]
  const MempoolKey key = route.key;
  const PoolId pool = route.pool;
  const std::uint64_t context = current_context();
  Addr addr = state.pool->allocate(request, reinterpret_cast<StreamId>(stream), pool, context);
  if (addr == 0 && pool == 0) return borrow_from_oom_lenders(state, request, stream, context);
  if (addr != 0 && pool != 0) note_private_block(state, addr, key);
  return reinterpret_cast<void*>(addr);
}

// PyTorch's human units (bytes, KiB, MiB, GiB with two decimals) and
// thresholds (1024 bytes prints as "1024 bytes"), so OOM messages read like
// the native allocator's.
// Note [No iostreams here] Sizes and addresses are formatted with snprintf, not
// std::ostream. Why: `ostream << double` from this module has crashed inside
// libstdc++'s locale facets (a segfault in codecvt under _M_insert<double>
// while building the OOM message), turning an OOM into a crash; snprintf has
// no locale machinery.
std::string format_size(std::uint64_t size) {
  char text[64];
  if (size <= 1024) {
    std::snprintf(text, sizeof text, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(text, sizeof text, "%.2f KiB", static_cast<double>(size) / 1024.0);
  } else if (size <= 1073741824ULL) {
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

// Note [OOM message] The native allocator's sentences first (tools and tests
// match "CUDA out of memory. Tried to allocate X. GPU N has a total capacity
// of T of which F is free."), then torchmem's own figures and advice.
std::string oom_message(DeviceState& state, std::size_t size, const MemInfo& mem) {
  PoolStats stats = state.pool->stats();
  const auto live = static_cast<std::uint64_t>(stats.allocated_bytes[kStatAll].current);
  const auto reserved = static_cast<std::uint64_t>(stats.reserved_bytes[kStatAll].current);
  const std::uint64_t cached = reserved > live ? reserved - live : 0;
  const std::size_t limit = state.pool->limit();
  const bool zero_budget = state.budget->refuses_all();
  std::string msg = "CUDA out of memory. Tried to allocate " + format_size(size) + ". GPU " +
                    std::to_string(state.device) + " has a total capacity of " + format_size(mem.total_bytes) +
                    " of which " + format_size(mem.free_bytes) + " is free. ";
  if (zero_budget || limit != 0) {
    msg += "Process has " + format_size(zero_budget ? 0 : limit) + " memory allowed. ";
  }
  msg += "Of the allocated memory " + format_size(live) + " is allocated by PyTorch, and " + format_size(cached) +
         " is reserved by PyTorch but unallocated. torchmem (" + state.backend->name() +
         " backend): largest free block " + format_size(stats.largest_free_block) + ". ";
  if (state.active_captures.load(std::memory_order_acquire) > 0) {
    // Note [Unmapped tail]: waits and barriers are refused there, so memory
    // other streams cached could not be handed over.
    msg += "A CUDA graph capture or MemPool scope is in progress on this device: memory other streams "
           "freed cannot be reused before it ends. ";
  }
  msg += "Try a smaller batch or sequence length, let torchmem.BatchSizeController pick the largest "
         "batch that fits, or raise the budget (torchmem.install(limit=...) or "
         "torch.cuda.set_per_process_memory_fraction).";
  return msg;
}

MemInfo mem_info_or_total(DeviceState& state) {
  MemInfo mem;
  try {
    mem = state.backend->mem_info();
  } catch (const std::exception&) {
    mem.total_bytes = state.total_bytes;
  }
  return mem;
}

// torch's observers, in the order attached, with no torchmem lock held.
void notify_oom_observers(DeviceState& state, std::size_t size, const MemInfo& mem) {
  std::vector<OomObserver> observers;
  {
    std::lock_guard<std::mutex> lock(registry().callback_mutex);
    observers = registry().oom_observers;
  }
  if (observers.empty()) return;
  const bool refuses_all = state.budget->refuses_all();
  const std::size_t limit = refuses_all ? 0 : state.pool->limit();
  const bool budgeted = refuses_all || limit != 0;
  for (const OomObserver& observer : observers) {
    observer(state.device, size, budgeted ? limit : mem.total_bytes, mem.free_bytes);
  }
}

}  // namespace

// ---- configuration -------------------------------------------------------------

void check_config(const RuntimeConfig& config) {
  if (config.backend != "auto" && config.backend != "vmm" && config.backend != "cuda_malloc") {
    throw std::invalid_argument("torchmem: unknown backend '" + config.backend +
                                "'; expected auto, vmm or cuda_malloc");
  }
  if (config.pool.limit_bytes != 0) {
    throw std::invalid_argument("torchmem: RuntimeConfig.pool.limit_bytes must be 0; give the limit as "
                                "RuntimeConfig.limit (the device's Budget resolves it)");
  }
  Budget::check_limit(config.limit);
  if (config.initial_fraction >= 0.0) Budget::check_initial_fraction(config.initial_fraction);
}

void configure(const RuntimeConfig& config) {
  check_config(config);
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

void set_caching_enabled(bool enabled) { registry().caching.store(enabled, std::memory_order_relaxed); }
bool caching_enabled() { return registry().caching.load(std::memory_order_relaxed); }
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
  const std::uint64_t context = free_context();  // one stack for the call, not one per device
  for (int d = 0; d < kMaxDevices; ++d) {
    DeviceState* state = existing_state(d);
    if (state == nullptr) continue;
    // External pools first: an X that is torchmem frees its segments into the device pool.
    returned += release_external_caches(*state, nullptr);  // Note [External pool allocators]
    returned += state->pool->release_cached(context);
  }
  return returned;
}

void set_trace_capacity(std::size_t entries) {
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    registry().config.pool.trace_capacity = entries;
  }
  for (int d = 0; d < kMaxDevices; ++d) {
    if (DeviceState* state = existing_state(d)) state->pool->set_trace_capacity(entries);
  }
}

void clear_trace() {
  for (int d = 0; d < kMaxDevices; ++d) {
    if (DeviceState* state = existing_state(d)) state->pool->clear_trace();
  }
}

// ---- callbacks -----------------------------------------------------------------

void set_oom_callback(OomCallback callback) {
  auto shared = callback ? std::make_shared<OomCallback>(std::move(callback)) : nullptr;
  std::lock_guard<std::mutex> lock(registry().callback_mutex);
  registry().oom_callback = std::move(shared);
}

void add_oom_observer(OomObserver observer) {
  if (!observer) return;
  std::lock_guard<std::mutex> lock(registry().callback_mutex);
  registry().oom_observers.push_back(std::move(observer));
}

void set_free_context(bool enabled) { registry().free_context.store(enabled); }

std::uint64_t pool_sequence(int device) {
  DeviceState* state = existing_state(device);
  return state == nullptr ? 0 : state->pool->sequence();
}

std::uint64_t provider_context_now() { return current_context(); }

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

namespace {

// torch.profiler(profile_memory=True) hears of every block, as from PyTorch's
// own allocator (which reports each malloc and free); a thread-local check when
// no profiler is on. External allocators' blocks are theirs to report.
void report_to_profiler(DeviceState& state, void* ptr, std::int64_t delta, int device) {
  const Pool::Usage usage = state.pool->usage();
  c10::reportMemoryUsageToProfiler(ptr, delta, usage.allocated, usage.reserved,
                                   c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

void report_allocation(DeviceState& state, void* ptr, int device) {
  if (!c10::memoryProfilingEnabled() || is_external_block(ptr)) return;
  report_to_profiler(state, ptr, static_cast<std::int64_t>(state.pool->block_size(reinterpret_cast<Addr>(ptr))),
                     device);
}

}  // namespace

void* allocate_or_throw(std::size_t size, int device, CudaStream stream) {
  // As the native allocator: absurd sizes are refused before anything is asked.
  constexpr std::size_t kOneExaByte = std::size_t{1} << 60;
  if (size >= kOneExaByte) {
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                "CUDA out of memory. Tried to allocate more than 1EB memory.");
  }
  DeviceState& state = state_for(device);
  void* ptr = try_allocate(state, size, stream);
  if (ptr != nullptr) {
    report_allocation(state, ptr, device);
    return ptr;
  }
  // Note [OOM error]: hooks run with no lock held, then we retry.
  int retries = registry().config.oom_hook_retries;
  for (int attempt = 0; attempt < retries && ptr == nullptr; ++attempt) {
    if (!run_oom_callback(device, size)) break;
    ptr = try_allocate(state, size, stream);
  }
  if (ptr != nullptr) {
    report_allocation(state, ptr, device);
    return ptr;
  }
  const MemInfo mem = mem_info_or_total(state);
  notify_oom_observers(state, size, mem);
  throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              oom_message(state, size, mem));
}

void deallocate(void* ptr, int device) {
  if (free_if_external(ptr)) return;  // Note [External pool allocators]
  DeviceState* state = existing_state(device);
  if (state == nullptr) {
    throw std::runtime_error("torchmem: free of address " + format_address(ptr) + " on device " +
                             std::to_string(device) +
                             ", where torchmem has allocated nothing; it was not allocated by torchmem");
  }
  const bool profiling = c10::memoryProfilingEnabled();
  const std::size_t size = profiling ? state->pool->block_size(reinterpret_cast<Addr>(ptr)) : 0;
  try {
    if (!park_if_private(*state, reinterpret_cast<Addr>(ptr))) {
      // Note [Freed under another stream] (core/pool.h): the current stream may have read it
      const auto current = reinterpret_cast<StreamId>(
          c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
      state->pool->deallocate(reinterpret_cast<Addr>(ptr), free_context(), current);
    }
  } catch (const PoolError& error) {
    throw std::runtime_error("torchmem: free of address " + format_address(ptr) + " on device " +
                             std::to_string(device) +
                             " that is not a live torchmem block (unknown or already freed): " + error.what());
  }
  if (profiling && size != 0) report_to_profiler(*state, ptr, -static_cast<std::int64_t>(size), device);
}

int owning_device(void* ptr) {
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) current = 0;
  if (is_external_block(ptr)) return current;  // deallocate() hands it to its allocator
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
  if (ptr == nullptr) return;  // a 0-byte tensor holds no block (Note [Zero bytes, no block], install.cpp)
  if (record_stream_if_external(ptr, stream)) return;  // Note [External pool allocators]
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

// ---- budget (Note [Budget rule] in budget.h) ---------------------------------

void set_memory_fraction(double fraction, int device) {
  Budget::check_fraction(fraction);  // before state_for: a bad value makes no pool
  state_for(device).budget->set_fraction(fraction);
}

double memory_fraction(int device) { return state_for(device).budget->memory_fraction(); }

void set_share_grant(int device, std::size_t bytes) { state_for(device).budget->set_grant(bytes); }

std::size_t budget_limit(int device) { return state_for(device).budget->limit_bytes(); }

BudgetState budget_state(int device) { return state_for(device).budget->state(); }

PrivateBlocks private_blocks(int device, MempoolKey key) {
  DeviceState& state = state_for(device);
  PrivateBlocks out;
  {
    std::lock_guard<std::mutex> lock(state.capture_mutex);
    auto found = state.private_pools.find(key);
    if (found == state.private_pools.end()) return out;
    out.pool = found->second.id;
  }
  std::lock_guard<std::mutex> lock(state.parked_mutex);
  for (const auto& [addr, owner] : state.private_live) {
    if (owner == key) out.live.push_back(addr);
  }
  auto parked = state.parked.find(key);
  if (parked != state.parked.end()) out.parked = parked->second;
  return out;
}

bool parks_private_frees() { return registry().config.park_private_frees; }

std::vector<MempoolKey> private_pool_keys(int device) {
  DeviceState& state = state_for(device);
  std::lock_guard<std::mutex> lock(state.capture_mutex);
  std::vector<MempoolKey> keys;
  for (const auto& entry : state.private_pools) keys.push_back(entry.first);
  return keys;
}

PrivatePoolNames private_pool_names(int device) {
  DeviceState& state = state_for(device);
  PrivatePoolNames out;
  {
    std::lock_guard<std::mutex> lock(state.capture_mutex);
    for (const auto& [key, pool] : state.private_pools) out.keys.emplace(pool.id, key);
    // A released pool's blocks that are still live (a CUDA graph's cuBLAS workspace) keep its
    // key, as natively; labelled by the core's id instead, (0, id) could be a MemPool's key.
    for (const auto& [key, pool] : state.released_pools) out.keys.emplace(pool, key);
  }
  std::lock_guard<std::mutex> lock(state.parked_mutex);
  // only pools in use park (release_pool hands a pool's parked blocks back to the core)
  for (const auto& entry : state.parked) out.parked.insert(entry.second.begin(), entry.second.end());
  return out;
}

void repark_private_blocks(int device, MempoolKey key, const std::vector<Addr>& park, const std::vector<Addr>& hold) {
  DeviceState& state = state_for(device);
  std::lock_guard<std::mutex> lock(state.parked_mutex);
  std::vector<Addr>& parked = state.parked[key];
  const bool parking = parks_private_frees();
  for (Addr addr : park) {
    state.private_live.erase(addr);
    if (parking) parked.push_back(addr);
  }
  for (Addr addr : hold) {
    parked.erase(std::remove(parked.begin(), parked.end(), addr), parked.end());
    state.private_live[addr] = key;
  }
  state.private_live_count.store(state.private_live.size(), std::memory_order_release);
}

}  // namespace torchmem::shim
