// backend.h: the contract between the pool and whatever provides memory.
//
// A Backend is a handful of primitives, in the manner of mimalloc's prim.h: the
// pool (csrc/core/pool.h) holds all policy and calls these only to obtain,
// place and give back physical memory and to order work on streams. What every
// source has (granule size, memory figures, stream ordering, counters) is the
// Backend; how it obtains memory is one of two interfaces, VmmPrimitives
// (reserve, create, map, unmap) or SegmentPrimitives (allocate and free whole
// segments), so no backend stubs calls it cannot make. Three implementations
// exist: `vmm` (CUDA driver virtual memory, csrc/backend/vmm_backend_cuda.cpp),
// `cuda_malloc` (cudaMalloc/cudaFree) and `sim` (fake addresses with per-call
// costs, either kind, for tests and trace replay).
//
// Threading: the pool calls a backend only under its own lock, so a backend
// needs no locking of its own unless it is shared between pools of different
// devices (it is not: one backend per device).
//
// Errors: running out of device memory is NOT an error here: the calls that can
// run out return 0 and the pool climbs its OOM ladder. Everything else (a driver
// failure, a bad argument) throws std::runtime_error with the call's name.
#pragma once

#include <cstddef>
#include <string>

#include "core/types.h"

namespace torchmem {

// How many times each primitive was called, declared once (an X-macro, like
// stats.h) so every backend fills them the same way and the bindings export
// them without a hand-kept list.
//   reserve_calls        address ranges reserved
//   create_calls         handles created (cuMemCreate): a granule or a run
//   release_calls        handles released (cuMemRelease)
//   map_calls            handles mapped (cuMemMap + access)
//   unmap_calls          handles unmapped (cuMemUnmap)
//   segment_alloc_calls  segments allocated (cudaMalloc)
//   segment_free_calls   segments freed (cudaFree)
//   event_record_calls   events recorded
//   event_sync_calls     host waits on an event
//   device_sync_calls    host waits for the whole device (Note [Device barrier])
//   stream_wait_calls    device-side waits of one stream for another (the host does not wait)
#define TORCHMEM_BACKEND_COUNTERS(X) \
  X(reserve_calls)                   \
  X(create_calls)                    \
  X(release_calls)                   \
  X(map_calls)                       \
  X(unmap_calls)                     \
  X(segment_alloc_calls)             \
  X(segment_free_calls)              \
  X(event_record_calls)              \
  X(event_sync_calls)                \
  X(device_sync_calls)               \
  X(stream_wait_calls)

struct BackendCounters {
#define TORCHMEM_DECLARE_BACKEND_COUNTER(name) std::uint64_t name = 0;
  TORCHMEM_BACKEND_COUNTERS(TORCHMEM_DECLARE_BACKEND_COUNTER)
#undef TORCHMEM_DECLARE_BACKEND_COUNTER
};

// What a virtual-memory source provides (the `vmm` backend; `sim` in vmm
// mode): address ranges with no memory behind them, physical granules and runs,
// and their mapping. The pool uses them to stitch granules (pool.h).
class VmmPrimitives {
 public:
  virtual ~VmmPrimitives() = default;
  // Reserve `bytes` (a multiple of granularity()) of address space with no
  // physical memory behind it. Returns 0 when the address space is unavailable.
  virtual Addr reserve(std::size_t bytes) = 0;
  virtual void unreserve(Addr base, std::size_t bytes) = 0;
  // Create one physical granule. Returns 0 when the device is out of memory.
  virtual GranuleHandle create_granule() = 0;
  // Create one handle backing `granules` (>= 2) consecutive granules: a run.
  // It can only be mapped whole, at one place, and so never moves granule by
  // granule; what it buys is the driver's cost: one create, map and access
  // for the whole run (Note [Run handles] in detail/runs.cpp).
  // Returns 0 when the device is out of memory.
  virtual GranuleHandle create_run(std::size_t granules) = 0;
  // Give a handle (a granule or a run) back to the device. It must not be
  // mapped anywhere.
  virtual void release_granule(GranuleHandle handle) = 0;
  // Map `count` granules at consecutive granule-aligned addresses starting at
  // `at` (inside a reserved range, currently unmapped) and make them readable
  // and writable by the device. One call for a run lets the backend set access
  // once over the whole run.
  virtual void map(Addr at, const GranuleHandle* handles, std::size_t count) = 0;
  // Unmap `count` granules starting at `at`. The caller guarantees no queued
  // device work on ANY stream still touches them: the pool unmaps only behind
  // a device barrier (Note [Device barrier] in pool.h). The handles stay valid
  // and can be mapped elsewhere.
  virtual void unmap(Addr at, std::size_t count) = 0;
  // Map run handle `handle` of `granules` granules at `at` (granule-aligned,
  // reserved, currently unmapped) and make it readable and writable; unmap a
  // run mapped so, whole (same rule as unmap).
  virtual void map_run(Addr at, GranuleHandle handle, std::size_t granules) = 0;
  virtual void unmap_run(Addr at, std::size_t granules) = 0;
};

// What a segment source provides (the `cuda_malloc` backend, a MemPool's own
// allocator; `sim` in segment mode): whole segments, allocated and freed.
// The pool carves blocks out of them and cannot stitch.
class SegmentPrimitives {
 public:
  virtual ~SegmentPrimitives() = default;
  // Returns 0 when the device is out of memory.
  virtual Addr allocate_segment(std::size_t bytes) = 0;
  virtual void free_segment(Addr base, std::size_t bytes) = 0;
};

// What every source provides, plus the one kind of memory it serves: exactly
// one of vmm() and segments() is non-null, set by the backend's constructor
// and fixed from then on (the pool reads it once, at construction).
class Backend {
 public:
  virtual ~Backend() = default;

  // ---- capabilities --------------------------------------------------------
  virtual std::string name() const = 0;  // "vmm", "cuda_malloc", "sim"
  // The VMM primitives (the pool stitches granules), or null.
  VmmPrimitives* vmm() const { return vmm_; }
  // The segment primitives (the pool carves segments, no stitching), or null.
  SegmentPrimitives* segments() const { return segments_; }
  bool supports_vmm() const { return vmm_ != nullptr; }
  // Physical granule size in bytes: a power of two, a multiple of kMinBlockSize.
  virtual std::size_t granularity() const = 0;
  // Free and total device memory as the device reports them now.
  virtual MemInfo mem_info() = 0;

  // ---- stream ordering ------------------------------------------------------
  // Record an event on `stream` that completes once all work queued on it so far
  // completes. Never returns 0.
  virtual EventHandle record_event(StreamId stream) = 0;
  // Non-blocking poll.
  virtual bool event_completed(EventHandle event) = 0;
  // Block the host until the event completes.
  virtual void synchronize_event(EventHandle event) = 0;
  virtual void destroy_event(EventHandle event) = 0;
  // Block the host until every stream of the device finished all work queued
  // so far (a device barrier). Returns false, doing nothing, when a barrier is
  // not allowed now (a CUDA graph is being captured): the caller then treats
  // the memory it wanted to unmap as still in use.
  virtual bool synchronize_device() = 0;
  // Make the work queued on `waiter` from now on wait, on the device, for the
  // work queued on `signaler` so far (an event recorded on one and waited for
  // by the other; the host does not wait). Returns false, doing nothing, when
  // either stream is being captured into a CUDA graph: the caller then treats
  // memory `signaler` freed as not yet reusable on `waiter`.
  virtual bool order_streams(StreamId waiter, StreamId signaler) = 0;

  const BackendCounters& counters() const { return counters_; }

 protected:
  // Each backend names the kind it serves in its constructor, once.
  void serve(VmmPrimitives* vmm) { vmm_ = vmm; }
  void serve(SegmentPrimitives* segments) { segments_ = segments; }

  BackendCounters counters_;

 private:
  VmmPrimitives* vmm_ = nullptr;
  SegmentPrimitives* segments_ = nullptr;
};

}  // namespace torchmem
