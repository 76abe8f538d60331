// sim_backend.cpp: the simulated device (see sim_backend.h).
//
// Addresses are fake but realistic: virtual ranges are handed out from
// 0x100000000000 upward and segments from 0x700000000000 upward, each aligned
// to the granule and separated by a gap, so an off-by-one in the pool lands in
// no man's land and is caught by the checks below.
#include "backend/sim_backend.h"

#include "core/format.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>

namespace torchmem {

namespace {

constexpr Addr kVirtualStart = Addr{0x100000000000};
constexpr Addr kSegmentStart = Addr{0x700000000000};

[[noreturn]] void misuse(const char* call, const std::string& what) {
  throw std::logic_error(std::string("SimBackend::") + call + ": " + what);
}

// The cookie byte for `addr` under `seed`: cheap, and different for
// neighbouring addresses and seeds so shifted or overlapping data shows.
inline unsigned char cookie(Addr addr, std::uint64_t seed) {
  std::uint64_t x = (addr >> 3) * 0x9E3779B97F4A7C15ull ^ seed * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<unsigned char>(x ^ (addr & 7) * 31);
}

}  // namespace

SimBackend::SimBackend(const SimConfig& config)
    : config_(config), next_virtual_(kVirtualStart), next_segment_(kSegmentStart) {
  const std::size_t g = config_.granularity;
  if (g < kMinBlockSize || (g & (g - 1)) != 0) {
    throw std::invalid_argument("SimBackend: granularity must be a power of two >= 512 bytes, got " +
                                std::to_string(g));
  }
  if (config_.capacity_bytes == 0) {
    throw std::invalid_argument("SimBackend: capacity must be > 0 bytes");
  }
  if (config_.vmm) {
    serve(static_cast<VmmPrimitives*>(this));
  } else {
    serve(static_cast<SegmentPrimitives*>(this));
  }
}

SimBackend::~SimBackend() = default;

MemInfo SimBackend::mem_info() {
  std::lock_guard<std::mutex> lock(mutex_);
  return MemInfo{config_.capacity_bytes - device_used_, config_.capacity_bytes};
}

void SimBackend::require_vmm(const char* call) const {
  if (!config_.vmm) misuse(call, "called on a backend without VMM (vmm=False)");
}

void SimBackend::require_segments(const char* call) const {
  if (config_.vmm) misuse(call, "called on a VMM backend (vmm=True); segments are for vmm=False");
}

void SimBackend::require_reserved(const char* call, Addr at, std::size_t bytes) const {
  auto it = reserved_.upper_bound(at);
  if (it == reserved_.begin()) misuse(call, "address " + hex(at) + " is not in a reserved range");
  --it;
  if (at + bytes > it->first + it->second) {
    misuse(call, "range " + hex(at) + "+" + std::to_string(bytes) + " leaves its reserved range");
  }
}

Addr SimBackend::reserve(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_vmm("reserve");
  if (bytes == 0 || bytes % config_.granularity != 0) {
    misuse("reserve", "size " + std::to_string(bytes) + " is not a positive multiple of the granularity");
  }
  ++counters_.reserve_calls;
  modeled_us_ += config_.costs.reserve_us;
  Addr base = next_virtual_;
  // Leave a gap of one granule-aligned GiB between ranges.
  next_virtual_ += bytes + kGiB;
  reserved_[base] = bytes;
  return base;
}

void SimBackend::unreserve(Addr base, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_vmm("unreserve");
  auto it = reserved_.find(base);
  if (it == reserved_.end() || it->second != bytes) {
    misuse("unreserve", "no reserved range " + hex(base) + "+" + std::to_string(bytes));
  }
  for (Addr a = base; a < base + bytes; a += config_.granularity) {
    if (mappings_.count(a)) misuse("unreserve", "granule " + hex(a) + " is still mapped");
  }
  reserved_.erase(it);
}

GranuleHandle SimBackend::create_granule() {
  std::lock_guard<std::mutex> lock(mutex_);
  return create_handle("create_granule", 1);
}

GranuleHandle SimBackend::create_run(std::size_t granules) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (granules < 2) misuse("create_run", "a run needs at least 2 granules, got " + std::to_string(granules));
  return create_handle("create_run", granules);
}

GranuleHandle SimBackend::create_handle(const char* call, std::size_t granules) {
  require_vmm(call);
  const std::size_t bytes = granules * config_.granularity;
  modeled_us_ += config_.costs.create_us;
  if (device_used_ + bytes > config_.capacity_bytes) return 0;
  ++counters_.create_calls;
  GranuleHandle h = next_handle_++;
  GranuleState& state = granules_[h];
  state.granules = granules;
  if (config_.host_memory) state.host.reset(new unsigned char[bytes]);
  device_used_ += bytes;
  return h;
}

void SimBackend::release_granule(GranuleHandle handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_vmm("release_granule");
  auto it = granules_.find(handle);
  if (it == granules_.end()) misuse("release_granule", "unknown handle " + std::to_string(handle));
  if (!it->second.mapped_at.empty()) {
    misuse("release_granule", "handle " + std::to_string(handle) + " is still mapped at " +
                                  hex(it->second.mapped_at.front()));
  }
  ++counters_.release_calls;
  modeled_us_ += config_.costs.release_us;
  device_used_ -= it->second.granules * config_.granularity;
  granules_.erase(it);
}

std::pair<GranuleHandle, SimBackend::GranuleState*> SimBackend::mapping_at(const char* call, Addr at) {
  auto it = mappings_.find(at);
  if (it == mappings_.end()) misuse(call, "granule " + hex(at) + " is not mapped");
  return {it->second, &granules_.at(it->second)};
}

void SimBackend::map(Addr at, const GranuleHandle* handles, std::size_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_vmm("map");
  const std::size_t g = config_.granularity;
  if (count == 0 || at % g != 0) misuse("map", "bad run " + hex(at) + " x" + std::to_string(count));
  require_reserved("map", at, count * g);
  // Check everything first so a failed call changes nothing. A handle that
  // is mapped elsewhere already is fine (an alias, as CUDA allows).
  for (std::size_t i = 0; i < count; ++i) {
    if (mappings_.count(at + i * g)) misuse("map", "granule " + hex(at + i * g) + " is already mapped");
    auto h = granules_.find(handles[i]);
    if (h == granules_.end()) misuse("map", "unknown handle " + std::to_string(handles[i]));
    if (h->second.granules > 1) misuse("map", "handle " + std::to_string(handles[i]) + " is a run; use map_run");
  }
  for (std::size_t i = 0; i < count; ++i) {
    mappings_[at + i * g] = handles[i];
    granules_[handles[i]].mapped_at.push_back(at + i * g);
  }
  counters_.map_calls += count;
  modeled_us_ += count * (config_.costs.map_us + config_.costs.set_access_us);
}

void SimBackend::map_run(Addr at, GranuleHandle handle, std::size_t granules) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_vmm("map_run");
  const std::size_t g = config_.granularity;
  if (at % g != 0) misuse("map_run", "address " + hex(at) + " is not granule-aligned");
  auto h = granules_.find(handle);
  if (h == granules_.end()) misuse("map_run", "unknown handle " + std::to_string(handle));
  if (h->second.granules != granules) {
    misuse("map_run", "handle " + std::to_string(handle) + " has " + std::to_string(h->second.granules) +
                          " granules; a run maps whole (" + std::to_string(granules) + " asked)");
  }
  if (!h->second.mapped_at.empty()) misuse("map_run", "run handle " + std::to_string(handle) + " is mapped already");
  require_reserved("map_run", at, granules * g);
  for (std::size_t i = 0; i < granules; ++i) {
    if (mappings_.count(at + i * g)) misuse("map_run", "granule " + hex(at + i * g) + " is already mapped");
  }
  for (std::size_t i = 0; i < granules; ++i) mappings_[at + i * g] = handle;
  h->second.mapped_at.push_back(at);
  counters_.map_calls += 1;
  modeled_us_ += config_.costs.map_us + config_.costs.set_access_us + granules * config_.costs.run_granule_us;
}

void SimBackend::unmap_run(Addr at, std::size_t granules) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_vmm("unmap_run");
  auto [handle, state] = mapping_at("unmap_run", at);
  if (state->granules != granules || state->mapped_at.empty() || state->mapped_at.front() != at) {
    misuse("unmap_run", "no run of " + std::to_string(granules) + " granules is mapped at " + hex(at) +
                            " (a run unmaps whole, from its first granule)");
  }
  const std::size_t g = config_.granularity;
  require_untouched("unmap_run", at, granules * g);
  for (std::size_t i = 0; i < granules; ++i) mappings_.erase(at + i * g);
  state->mapped_at.clear();
  counters_.unmap_calls += 1;
  modeled_us_ += config_.costs.unmap_us + granules * config_.costs.run_unmap_granule_us;
}

void SimBackend::unmap(Addr at, std::size_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_vmm("unmap");
  const std::size_t g = config_.granularity;
  if (count == 0 || at % g != 0) misuse("unmap", "bad run " + hex(at) + " x" + std::to_string(count));
  for (std::size_t i = 0; i < count; ++i) {
    if (mapping_at("unmap", at + i * g).second->granules > 1) {
      misuse("unmap", "granule " + hex(at + i * g) + " belongs to a run handle; unmap_run unmaps it whole");
    }
  }
  require_untouched("unmap", at, count * g);
  for (std::size_t i = 0; i < count; ++i) {
    auto it = mappings_.find(at + i * g);
    std::vector<Addr>& places = granules_[it->second].mapped_at;
    places.erase(std::find(places.begin(), places.end(), at + i * g));
    mappings_.erase(it);
  }
  counters_.unmap_calls += count;
  modeled_us_ += count * config_.costs.unmap_us;
}

Addr SimBackend::allocate_segment(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_segments("allocate_segment");
  if (bytes == 0) misuse("allocate_segment", "size 0");
  modeled_us_ += config_.costs.segment_alloc_us;
  if (device_used_ + bytes > config_.capacity_bytes) return 0;
  ++counters_.segment_alloc_calls;
  Addr base = next_segment_;
  const std::size_t g = config_.granularity;
  next_segment_ += (bytes + g - 1) / g * g + g;
  SegmentState& seg = segments_[base];
  seg.bytes = bytes;
  if (config_.host_memory) seg.host.reset(new unsigned char[bytes]);
  device_used_ += bytes;
  return base;
}

void SimBackend::free_segment(Addr base, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_segments("free_segment");
  auto it = segments_.find(base);
  if (it == segments_.end()) misuse("free_segment", "unknown segment " + hex(base));
  if (it->second.bytes != bytes) {
    misuse("free_segment", "segment " + hex(base) + " has " + std::to_string(it->second.bytes) +
                               " bytes, not " + std::to_string(bytes));
  }
  // cudaFree synchronizes the device: every kernel in flight finishes first.
  kernels_.clear();
  ++counters_.segment_free_calls;
  modeled_us_ += config_.costs.segment_free_us;
  device_used_ -= bytes;
  segments_.erase(it);
}

EventHandle SimBackend::record_event(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++counters_.event_record_calls;
  modeled_us_ += config_.costs.event_record_us;
  EventHandle e = next_event_++;
  EventState& state = events_[e];
  state.polls_left = config_.event_delay;
  for (const auto& [id, kernel] : kernels_) {
    if (kernel.stream == stream) state.after.push_back(id);
  }
  return e;
}

bool SimBackend::event_completed(EventHandle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = events_.find(event);
  if (it == events_.end()) misuse("event_completed", "unknown event " + std::to_string(event));
  modeled_us_ += config_.costs.event_query_us;
  tick_kernels();
  if (it->second.polls_left > 0) {
    --it->second.polls_left;
    return false;
  }
  for (std::uint64_t id : it->second.after) {
    if (kernels_.count(id)) return false;
  }
  return true;
}

void SimBackend::synchronize_event(EventHandle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = events_.find(event);
  if (it == events_.end()) misuse("synchronize_event", "unknown event " + std::to_string(event));
  ++counters_.event_sync_calls;
  it->second.polls_left = 0;
  for (std::uint64_t id : it->second.after) kernels_.erase(id);
}

bool SimBackend::synchronize_device() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!device_sync_allowed_) return false;
  ++counters_.device_sync_calls;
  modeled_us_ += config_.costs.device_sync_us;
  for (auto& [handle, state] : events_) state.polls_left = 0;
  kernels_.clear();
  return true;
}

bool SimBackend::order_streams(StreamId waiter, StreamId signaler) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (waiter == signaler) return true;
  if (!device_sync_allowed_ || !stream_order_allowed_) return false;
  ++counters_.event_record_calls;
  ++counters_.stream_wait_calls;
  modeled_us_ += config_.costs.stream_wait_us;
  // An event recorded on `signaler` now completes after everything `signaler`
  // was itself made to wait for, so the order is transitive.
  for (auto& [id, kernel] : kernels_) {
    std::vector<StreamId>& waiters = kernel.ordered_for;
    const bool covered = kernel.stream == signaler ||
                         std::find(waiters.begin(), waiters.end(), signaler) != waiters.end();
    if (covered && std::find(waiters.begin(), waiters.end(), waiter) == waiters.end()) waiters.push_back(waiter);
  }
  return true;
}

void SimBackend::launch(StreamId stream, Addr addr, std::size_t size, std::uint64_t polls) {
  launch_read_of(kNoStream, stream, addr, size, polls);
}

void SimBackend::launch_read_of(StreamId owner, StreamId stream, Addr addr, std::size_t size, std::uint64_t polls) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (size == 0) misuse("launch", "size 0");
  if (config_.vmm) {
    const std::size_t g = config_.granularity;
    for (Addr a = addr / g * g; a < addr + size; a += g) {
      if (!mappings_.count(a)) misuse("launch", "kernel touches unmapped " + hex(a) + " (illegal address)");
    }
  } else {
    auto it = segments_.upper_bound(addr);
    if (it == segments_.begin() || addr + size > std::prev(it)->first + std::prev(it)->second.bytes) {
      misuse("launch", "kernel touches " + hex(addr) + " outside any segment (illegal address)");
    }
  }
  kernels_[next_kernel_++] = KernelState{stream, addr, size, polls, owner, {}};
}

void SimBackend::reused_by_owner(StreamId owner, Addr at, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [id, k] : kernels_) {
    if (k.owner == owner && k.addr < at + bytes && at < k.addr + k.size) k.owner = kNoStream;
  }
}

bool SimBackend::unordered_reader(StreamId taker, Addr at, std::size_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [id, k] : kernels_) {
    if (k.owner == kNoStream || k.stream == taker || k.owner == taker) continue;
    if (!(k.addr < at + bytes && at < k.addr + k.size)) continue;
    if (std::find(k.ordered_for.begin(), k.ordered_for.end(), taker) == k.ordered_for.end()) return true;
  }
  return false;
}

std::size_t SimBackend::kernels_in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return kernels_.size();
}

void SimBackend::allow_device_sync(bool allowed) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_sync_allowed_ = allowed;
}

void SimBackend::allow_stream_order(bool allowed) {
  std::lock_guard<std::mutex> lock(mutex_);
  stream_order_allowed_ = allowed;
}

void SimBackend::tick_kernels() {
  for (auto it = kernels_.begin(); it != kernels_.end();) {
    if (it->second.polls_left <= 1) {
      it = kernels_.erase(it);
    } else {
      --it->second.polls_left;
      ++it;
    }
  }
}

void SimBackend::require_untouched(const char* call, Addr at, std::size_t bytes) const {
  for (const auto& [id, k] : kernels_) {
    if (k.addr < at + bytes && at < k.addr + k.size) {
      misuse(call, "memory at " + hex(std::max(at, k.addr)) + " is still touched by a kernel in flight on stream " +
                       std::to_string(k.stream) + " (on a GPU: an illegal-address fault)");
    }
  }
}

void SimBackend::destroy_event(EventHandle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!events_.erase(event)) misuse("destroy_event", "unknown event " + std::to_string(event));
}

unsigned char* SimBackend::host_at(Addr addr, std::size_t* contiguous) {
  if (config_.vmm) {
    const std::size_t g = config_.granularity;
    Addr granule = addr / g * g;
    auto it = mappings_.find(granule);
    if (it == mappings_.end()) misuse("pattern", "address " + hex(addr) + " is not mapped");
    const GranuleState& state = granules_[it->second];
    // A run's bytes lie in one buffer from its (only) place on.
    const Addr start = state.granules > 1 ? state.mapped_at.front() : granule;
    *contiguous = granule + g - addr;
    return state.host.get() + (addr - start);
  }
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) misuse("pattern", "address " + hex(addr) + " is in no segment");
  --it;
  if (addr >= it->first + it->second.bytes) misuse("pattern", "address " + hex(addr) + " is in no segment");
  *contiguous = it->first + it->second.bytes - addr;
  return it->second.host.get() + (addr - it->first);
}

void SimBackend::write_pattern(Addr addr, std::size_t size, std::uint64_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!config_.host_memory) misuse("write_pattern", "needs host_memory=True");
  while (size > 0) {
    std::size_t run = 0;
    unsigned char* p = host_at(addr, &run);
    run = std::min(run, size);
    for (std::size_t i = 0; i < run; ++i) p[i] = cookie(addr + i, seed);
    addr += run;
    size -= run;
  }
}

bool SimBackend::check_pattern(Addr addr, std::size_t size, std::uint64_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!config_.host_memory) misuse("check_pattern", "needs host_memory=True");
  while (size > 0) {
    std::size_t run = 0;
    const unsigned char* p = host_at(addr, &run);
    run = std::min(run, size);
    for (std::size_t i = 0; i < run; ++i) {
      if (p[i] != cookie(addr + i, seed)) return false;
    }
    addr += run;
    size -= run;
  }
  return true;
}

}  // namespace torchmem
