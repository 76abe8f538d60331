// format.h: addresses and byte counts in error messages, one way everywhere
// (the pool, its checks and the simulated backend). snprintf, not iostreams:
// see Note [No iostreams here] in csrc/shim/runtime.cpp.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

#include "core/types.h"

namespace torchmem {

// An address as 0x....
inline std::string hex(Addr a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

// A byte count with its MiB figure, for error messages.
inline std::string mib(std::size_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%zu bytes (%.2f MiB)", bytes, bytes / double(kMiB));
  return buf;
}

}  // namespace torchmem
