// diagnostics.cpp: times the CUDA backends' primitives on a real device, for
// torchmem.runtime.probe (bench/gpu_probe.py, BENCHMARKS.md: Growth and driver calls) (diagnostics.h).
//
// probe_backend_costs runs on fresh backends outside every pool, so it measures
// the driver, not torchmem's policy (memory used: `granules` granules, the
// `live_granules` it holds mapped meanwhile, and one 1 GiB segment).
// probe_pool_pair_ns times torchmem's own allocation path on the device's pool,
// to split the Python-level churn figure into torchmem's share and the share of
// torch's wrapper.
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda_malloc_backend_cuda.h"
#include "backend/vmm_backend_cuda.h"
#include "shim/allocation.h"
#include "shim/diagnostics.h"
#include "shim/runtime.h"

namespace torchmem::shim {

namespace {

using Clock = std::chrono::steady_clock;

double micros_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// Note [Probe conditions] A call timed in a tight loop finds the driver's code
// and data in the host's caches and few mappings beside its own; inside a
// training process the same call runs between framework work that has evicted
// them, with thousands of granule handles mapped. The probe can time the calls
// in both conditions: `evict_bytes` of host memory are walked before each timed
// call (outside its time), and `live_granules` granules, each its own handle as
// the pool grows them under a limit, stay mapped while it times.
struct Timer {
  double total_us = 0;
  int calls = 0;
  std::vector<unsigned char>* evict = nullptr;  // walked before each timed call (Note [Probe conditions])
  template <typename Fn>
  void time(Fn&& fn) {
    if (evict != nullptr) walk(*evict);
    auto start = Clock::now();
    fn();
    total_us += micros_since(start);
    calls += 1;
  }
  double mean() const { return calls ? total_us / calls : 0.0; }
  static void walk(std::vector<unsigned char>& bytes) {
    for (std::size_t i = 0; i < bytes.size(); i += 64) bytes[i] = static_cast<unsigned char>(bytes[i] + 1);
  }
};

// Granules mapped one handle each for as long as it lives (Note [Probe conditions]).
class LiveGranules {
 public:
  LiveGranules(VmmBackend& vmm, std::size_t count) : vmm_(vmm), count_(count) {
    if (count_ == 0) return;
    base_ = vmm_.reserve(count_ * vmm_.granularity());
    if (base_ == 0) throw std::runtime_error("probe: cuMemAddressReserve failed for the live granules");
    handles_.reserve(count_);
    try {
      for (std::size_t i = 0; i < count_; ++i) {
        GranuleHandle h = vmm_.create_granule();
        if (h == 0) {
          throw std::runtime_error("probe: out of memory creating " + std::to_string(count_) +
                                   " live granules; ask for fewer");
        }
        try {
          vmm_.map(base_ + i * vmm_.granularity(), &h, 1);
        } catch (...) {
          vmm_.release_granule(h);
          throw;
        }
        handles_.push_back(h);
      }
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
  }
  ~LiveGranules() { release(); }
  LiveGranules(const LiveGranules&) = delete;
  LiveGranules& operator=(const LiveGranules&) = delete;

 private:
  void release() {
    for (std::size_t i = 0; i < handles_.size(); ++i) {
      vmm_.unmap(base_ + i * vmm_.granularity(), 1);
      vmm_.release_granule(handles_[i]);
    }
    handles_.clear();
    if (base_ != 0) vmm_.unreserve(base_, count_ * vmm_.granularity());
    base_ = 0;
  }
  VmmBackend& vmm_;
  std::size_t count_;
  Addr base_ = 0;
  std::vector<GranuleHandle> handles_;
};

}  // namespace

std::vector<std::pair<std::string, double>> probe_backend_costs(int device, int repeats, std::size_t granules,
                                                                std::size_t live_granules, std::size_t evict_bytes) {
  if (repeats <= 0 || granules == 0) throw std::invalid_argument("probe: repeats and granules must be > 0");
  std::vector<std::pair<std::string, double>> out;
  std::vector<unsigned char> evict(evict_bytes);
  if (VmmBackend::device_supports_vmm(device)) {
    VmmBackend vmm(device);
    const std::size_t g = vmm.granularity();
    const std::size_t span = granules * g;
    LiveGranules live(vmm, live_granules);
    Timer reserve, create, first_map, remap, unmap, release;
    if (evict_bytes > 0) {
      for (Timer* t : {&reserve, &create, &first_map, &remap, &unmap, &release}) t->evict = &evict;
    }
    // Fresh virtual ranges each round: the first cuMemSetAccess on a range is the costly one.
    for (int r = 0; r < repeats; ++r) {
      Addr base = 0;
      reserve.time([&] { base = vmm.reserve(span * 2); });
      if (base == 0) throw std::runtime_error("probe: cuMemAddressReserve failed");
      std::vector<GranuleHandle> handles(granules);
      for (auto& h : handles) {
        create.time([&] { h = vmm.create_granule(); });
        if (h == 0) throw std::runtime_error("probe: out of memory creating granules");
      }
      first_map.time([&] { vmm.map(base, handles.data(), granules); });
      unmap.time([&] { vmm.unmap(base, granules); });
      remap.time([&] { vmm.map(base + span, handles.data(), granules); });  // a second, adjacent place
      vmm.unmap(base + span, granules);
      for (auto h : handles) release.time([&] { vmm.release_granule(h); });
      vmm.unreserve(base, span * 2);
    }
    out.emplace_back("granularity_bytes", static_cast<double>(g));
    out.emplace_back("granules_per_map", static_cast<double>(granules));
    out.emplace_back("cuMemAddressReserve_us", reserve.mean());
    out.emplace_back("cuMemCreate_us_per_granule", create.mean());
    out.emplace_back("map_and_set_access_us_per_call", first_map.mean());
    out.emplace_back("map_and_set_access_again_us_per_call", remap.mean());
    out.emplace_back("cuMemUnmap_us_per_call", unmap.mean());
    out.emplace_back("cuMemRelease_us_per_granule", release.mean());
    out.emplace_back("live_granules", static_cast<double>(live_granules));
    out.emplace_back("evict_bytes", static_cast<double>(evict_bytes));
  }
  CudaMallocBackend plain(device);
  for (std::size_t bytes : {std::size_t{2} * kMiB, std::size_t{20} * kMiB, std::size_t{1} * kGiB}) {
    Timer malloc_timer, free_timer;
    for (int r = 0; r < repeats; ++r) {
      Addr base = 0;
      malloc_timer.time([&] { base = plain.allocate_segment(bytes); });
      if (base == 0) throw std::runtime_error("probe: out of memory in cudaMalloc");
      free_timer.time([&] { plain.free_segment(base, bytes); });
    }
    std::string size = std::to_string(bytes / kMiB) + "MiB";
    out.emplace_back("cudaMalloc_" + size + "_us", malloc_timer.mean());
    out.emplace_back("cudaFree_" + size + "_us", free_timer.mean());
  }
  Timer record, query, wait;
  cudaStream_t side = nullptr;
  cuda::check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  for (int r = 0; r < repeats; ++r) {
    EventHandle event = 0;
    record.time([&] { event = plain.record_event(0); });
    plain.synchronize_event(event);
    query.time([&] { plain.event_completed(event); });
    plain.destroy_event(event);
    // an event recorded on the side stream and waited for by the default one
    wait.time([&] { plain.order_streams(0, reinterpret_cast<StreamId>(side)); });
  }
  cudaStreamSynchronize(nullptr);
  cudaStreamDestroy(side);
  out.emplace_back("event_record_us", record.mean());
  out.emplace_back("event_query_us", query.mean());
  out.emplace_back("stream_wait_us", wait.mean());
  return out;
}

double probe_pool_pair_ns(int device, int iterations) {
  if (iterations <= 0) throw std::invalid_argument("probe: iterations must be > 0");
  // Mixed sizes, 64 live blocks replaced one at a time: the churn benchmark's
  // pattern without torch's wrapper, through the same path torch calls.
  constexpr int kLive = 64;
  std::vector<std::size_t> sizes(static_cast<std::size_t>(iterations));
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  for (auto& size : sizes) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    size = std::size_t{512} << (state % 16);  // 512 B .. 16 MiB
  }
  std::vector<void*> live(kLive, nullptr);
  auto churn = [&](std::size_t i) {
    void*& slot = live[i % kLive];
    if (slot) deallocate(slot, device);
    slot = allocate_or_throw(sizes[i], device, nullptr);
  };
  for (std::size_t i = 0; i < sizes.size() / 10; ++i) churn(i);  // warm the cache
  auto start = Clock::now();
  for (std::size_t i = 0; i < sizes.size(); ++i) churn(i);
  double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count() / iterations;
  for (void* ptr : live) {
    if (ptr) deallocate(ptr, device);
  }
  return ns;
}

}  // namespace torchmem::shim
