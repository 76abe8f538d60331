// sim_backend.h: a simulated device behind the Backend interface.
//
// Fake addresses, a capacity and a granule size; every primitive is counted
// and charged a modeled cost (microseconds, defaults measured on an H200, see
// BENCHMARKS.md, Growth and driver calls), so trace replay reports both memory and the driver
// time a policy would spend. It is also a checker of the pool: a call that a
// real driver would reject or that would corrupt memory (mapping over a mapped
// granule, unmapping an unmapped one, releasing a mapped granule, freeing an
// unknown segment) throws std::logic_error.
//
// With host_memory, every granule or segment is backed by real host memory
// and write_pattern()/check_pattern() read and write through the simulated
// mapping, so stress tests can detect overlapping blocks (a cookie written by
// one owner and overwritten by another) and stitching bugs (the data of a
// live block must not move when granules are remapped elsewhere).
//
// A run handle (create_run) backs several granules and is mapped and
// unmapped whole, at one place (map_run / unmap_run); the driver refuses
// slices, so the simulator does too.
//
// Like CUDA, one granule handle may be mapped at several addresses at once
// (the pool's alias reclaim does so); every mapping of a handle sees the same
// bytes. Real misuse still throws: mapping over a mapped address, unmapping
// an unmapped one, releasing a handle still mapped anywhere.
//
// Events: event_delay = N makes an event report "not completed" to its first
// N event_completed() polls (synchronize_event completes it at once). This
// models queued kernels that still read freed memory (Note [Fences] in pool.h).
//
// Kernels: launch(stream, addr, size, polls) models a kernel on `stream` that
// touches [addr, addr + size) and stays in flight for `polls` event polls
// (any event's), or until a wait covers it: an event recorded on the same
// stream after it (stream order) or synchronize_device(). Unmapping memory
// that a kernel in flight touches throws, as the GPU would fault with an
// illegal address: this is how the tests catch an unmap ordered after the
// free's own stream but not after a kernel on another stream still reading
// (Note [Device barrier] in pool.h). free_segment synchronizes the device
// first, as cudaFree does.
//
// Locking: the pool calls it under its own lock, but stress tests call
// write_pattern/check_pattern from other threads at the same time, so every
// call takes the backend's own mutex (only slow pool paths reach a backend).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "core/types.h"

namespace torchmem {

// Microseconds per call, declared once (the bindings parse them from a dict
// by this list), fitted to the H200 (BENCHMARKS.md, Growth and driver calls): growing
// by a handle per granule costs create + map + set_access ~29 us per granule
// (access is charged per handle it covers: the driver's cost follows handles,
// not calls); a run handle of N granules costs the same once plus
// run_granule_us per granule (28.6 us at N = 1, 82 us at N = 256 measured),
// and tearing it down unmap + release plus run_unmap_granule_us per granule
// (77 us at N = 64). device_sync_us is the host's wait plus the bubble of a
// drained GPU, a rough figure.
#define TORCHMEM_SIM_COSTS(X) \
  X(reserve_us, 20)           \
  X(create_us, 9.6)           \
  X(release_us, 10.7)         \
  X(map_us, 1.1)              \
  X(set_access_us, 18.5)      \
  X(unmap_us, 13.3)           \
  X(run_granule_us, 0.2)      \
  X(run_unmap_granule_us, 0.8) \
  X(segment_alloc_us, 60)     \
  X(segment_free_us, 100)     \
  X(event_record_us, 1.0)     \
  X(event_query_us, 0.2)      \
  X(stream_wait_us, 2.0)      \
  X(device_sync_us, 50)

struct SimCosts {
#define TORCHMEM_DECLARE_SIM_COST(name, value) double name = value;
  TORCHMEM_SIM_COSTS(TORCHMEM_DECLARE_SIM_COST)
#undef TORCHMEM_DECLARE_SIM_COST
};

struct SimConfig {
  std::size_t capacity_bytes = 80 * kGiB;  // device memory
  std::size_t granularity = 2 * kMiB;
  bool vmm = true;               // false: behaves like cuda_malloc (segments)
  bool host_memory = false;      // back addresses with real host memory
  std::uint64_t event_delay = 0; // polls an event answers "not yet" before completing
  SimCosts costs;
};

class SimBackend final : public Backend, public VmmPrimitives, public SegmentPrimitives {
 public:
  // Throws std::invalid_argument for a granularity that is not a power of two
  // multiple of kMinBlockSize or a zero capacity.
  explicit SimBackend(const SimConfig& config);
  ~SimBackend() override;

  double modeled_us() const { return modeled_us_; }
  // Bytes of granules (vmm) or segments (cuda_malloc) currently created.
  std::size_t device_used() const { return device_used_; }
  const SimConfig& config() const { return config_; }

  // host_memory only: fill [addr, addr+size) with a pattern derived from
  // `seed` and the address / check that it is still there. Every byte must lie
  // in mapped granules or a live segment (else std::logic_error).
  void write_pattern(Addr addr, std::size_t size, std::uint64_t seed);
  bool check_pattern(Addr addr, std::size_t size, std::uint64_t seed);

  // A kernel on `stream` touching [addr, addr + size) for `polls` event polls
  // (see Kernels above). The memory must be mapped (or in a segment) now.
  void launch(StreamId stream, Addr addr, std::size_t size, std::uint64_t polls);
  // The same kernel as the read of a tensor that `owner` allocated, made on
  // `stream` and declared to the pool at its free (Note [Freed under another
  // stream]): unordered_reader() watches it.
  void launch_read_of(StreamId owner, StreamId stream, Addr addr, std::size_t size, std::uint64_t polls);
  // True if memory just handed to `taker` at [at, at + bytes) is still read by
  // such a kernel that neither runs on `taker` nor belongs to a tensor of
  // `taker`'s (whose reuse on its own stream PyTorch allows) and that `taker`
  // was not ordered after (order_streams) since its launch: on a GPU, taker's
  // kernels would write under the read.
  bool unordered_reader(StreamId taker, Addr at, std::size_t bytes) const;
  // Memory at [at, at + bytes) went back to `owner` itself: PyTorch's own
  // allocator reuses it there at once, so what such a read sees from then on is
  // the program's to order; unordered_reader() stops watching those kernels.
  void reused_by_owner(StreamId owner, Addr at, std::size_t bytes);
  std::size_t kernels_in_flight() const;
  // false: synchronize_device() refuses, as during a CUDA graph capture.
  void allow_device_sync(bool allowed);
  // false: order_streams() refuses, as while one of its streams captures.
  void allow_stream_order(bool allowed);

  // ---- Backend (serves vmm() or segments(), as config.vmm says) -------------
  std::string name() const override { return "sim"; }
  std::size_t granularity() const override { return config_.granularity; }
  MemInfo mem_info() override;
  // ---- VmmPrimitives ---------------------------------------------------------
  Addr reserve(std::size_t bytes) override;
  void unreserve(Addr base, std::size_t bytes) override;
  GranuleHandle create_granule() override;
  GranuleHandle create_run(std::size_t granules) override;
  void release_granule(GranuleHandle handle) override;
  void map(Addr at, const GranuleHandle* handles, std::size_t count) override;
  void unmap(Addr at, std::size_t count) override;
  void map_run(Addr at, GranuleHandle handle, std::size_t granules) override;
  void unmap_run(Addr at, std::size_t granules) override;
  // ---- SegmentPrimitives -----------------------------------------------------
  Addr allocate_segment(std::size_t bytes) override;
  void free_segment(Addr base, std::size_t bytes) override;
  // ---- Backend: stream ordering ------------------------------------------------
  EventHandle record_event(StreamId stream) override;
  bool event_completed(EventHandle event) override;
  void synchronize_event(EventHandle event) override;
  void destroy_event(EventHandle event) override;
  bool synchronize_device() override;
  // Counted and charged (stream_wait_us: the event record and the wait);
  // refused while device syncs or stream orders are not allowed. Kernels run
  // in no particular order here, so the ordering itself is not modeled.
  bool order_streams(StreamId waiter, StreamId signaler) override;

 private:
  struct GranuleState {
    std::size_t granules = 1;     // > 1: a run handle (create_run), mapped whole only
    std::vector<Addr> mapped_at;  // every address it is mapped at (usually 0 or 1)
    std::unique_ptr<unsigned char[]> host;  // host_memory only
  };
  GranuleHandle create_handle(const char* call, std::size_t granules);
  // The handle mapped at granule address `at` and that handle's state, or throws.
  std::pair<GranuleHandle, GranuleState*> mapping_at(const char* call, Addr at);
  struct SegmentState {
    std::size_t bytes = 0;
    std::unique_ptr<unsigned char[]> host;
  };
  struct EventState {
    std::uint64_t polls_left = 0;
    std::vector<std::uint64_t> after;  // kernels queued before it on its stream
  };
  struct KernelState {
    StreamId stream = 0;
    Addr addr = 0;
    std::size_t size = 0;
    std::uint64_t polls_left = 0;
    StreamId owner = kNoStream;          // launch_read_of(): the tensor's allocation stream
    std::vector<StreamId> ordered_for;   // streams made to wait for it, directly or through another (order_streams)
  };
  // One event poll's worth of time passes for every kernel in flight.
  void tick_kernels();
  // Throws if a kernel in flight touches [at, at + bytes).
  void require_untouched(const char* call, Addr at, std::size_t bytes) const;

  void require_vmm(const char* call) const;
  void require_segments(const char* call) const;
  // The reserved range holding [at, at + bytes), or throws.
  void require_reserved(const char* call, Addr at, std::size_t bytes) const;
  // Host bytes behind `addr` and how many follow contiguously, or throws.
  unsigned char* host_at(Addr addr, std::size_t* contiguous);

  SimConfig config_;
  double modeled_us_ = 0;
  std::size_t device_used_ = 0;
  Addr next_virtual_;   // bump pointer for reserve()
  Addr next_segment_;   // bump pointer for allocate_segment()
  std::map<Addr, std::size_t> reserved_;              // base -> bytes
  std::unordered_map<Addr, GranuleHandle> mappings_;  // granule address -> handle
  std::unordered_map<GranuleHandle, GranuleState> granules_;
  std::map<Addr, SegmentState> segments_;
  std::unordered_map<EventHandle, EventState> events_;
  std::map<std::uint64_t, KernelState> kernels_;  // in flight, by launch order
  std::uint64_t next_kernel_ = 1;
  bool device_sync_allowed_ = true;
  bool stream_order_allowed_ = true;
  GranuleHandle next_handle_ = 1;
  EventHandle next_event_ = 1;
  mutable std::mutex mutex_;  // guards the maps against write_pattern from test threads
};

}  // namespace torchmem
