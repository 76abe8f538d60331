// types.h: the plain value types shared by the core, the backends and the shim.
//
// The core never sees a CUDA type: device addresses are integers, streams and
// events are opaque integers that only a backend interprets. This keeps
// csrc/core buildable and testable on a machine with no CUDA at all.
#pragma once

#include <cstddef>
#include <cstdint>

namespace torchmem {

using Addr = std::uintptr_t;          // a device (or simulated) address; 0 = none
using StreamId = std::uintptr_t;      // a raw cudaStream_t value; 0 = legacy default stream
using GranuleHandle = std::uint64_t;  // a backend's physical granule; 0 = none
using EventHandle = std::uint64_t;    // a backend's stream event; 0 = none
using PoolId = std::uint64_t;         // a private pool (CUDA graphs, MemPool); 0 = the default pool

// No stream known (0 is a real one, the legacy default stream): a free whose
// caller's current stream is unknown, a free block with no reader.
constexpr StreamId kNoStream = ~StreamId{0} - 1;

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

// Every request rounds up to this; it is also the carving unit inside a range.
constexpr std::size_t kMinBlockSize = 512;

struct MemInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

}  // namespace torchmem
