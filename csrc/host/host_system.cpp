// host_system.cpp: sysfs parsing, mmap with huge-page advice, mbind and
// parallel first touch for the host pool (see host_system.h).
#include "host/host_system.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace torchmem::host {

namespace {

// The first line of a file, or "" if it cannot be read.
std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
  return line;
}

}  // namespace

HugePages parse_huge_pages(const std::string& text) {
  if (text == "off" || text == "none") return HugePages::kOff;
  if (text == "thp" || text == "transparent") return HugePages::kTransparent;
  if (text == "hugetlb") return HugePages::kHugetlb;
  throw std::invalid_argument("torchmem.host: huge_pages must be 'thp', 'hugetlb' or 'off', got '" + text + "'");
}

int numa_node_of_pci(const std::string& sysfs_root, const std::string& bus_id) {
  std::string lower = bus_id;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  // The driver may give an 8-digit domain ("00000000:1a:00.0"); sysfs uses 4.
  auto colon = lower.find(':');
  if (colon != std::string::npos && colon > 4) lower = lower.substr(colon - 4);
  const std::string text = read_line(sysfs_root + "/bus/pci/devices/" + lower + "/numa_node");
  if (text.empty()) return -1;
  try {
    int node = std::stoi(text);
    return node >= 0 ? node : -1;
  } catch (const std::exception&) {
    return -1;
  }
}

int numa_node_count(const std::string& sysfs_root) {
  const std::string text = read_line(sysfs_root + "/devices/system/node/online");
  if (text.empty()) return 1;
  int count = 0;
  std::stringstream ranges(text);
  std::string range;
  while (std::getline(ranges, range, ',')) {
    try {
      auto dash = range.find('-');
      if (dash == std::string::npos) {
        std::stoi(range);
        count += 1;
      } else {
        int first = std::stoi(range.substr(0, dash));
        int last = std::stoi(range.substr(dash + 1));
        if (last >= first) count += last - first + 1;
      }
    } catch (const std::exception&) {
      return 1;  // unreadable: treat as one node (binding skipped), never guess
    }
  }
  return std::max(count, 1);
}

std::string thp_mode(const std::string& sysfs_root) {
  const std::string text = read_line(sysfs_root + "/kernel/mm/transparent_hugepage/enabled");
  auto open = text.find('[');
  auto close = text.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "";
  return text.substr(open + 1, close - open - 1);
}

Mapping map_anonymous(std::size_t bytes, HugePages huge, const std::string& thp) {
  Mapping m;
  m.bytes = bytes;
  if (huge == HugePages::kHugetlb) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p != MAP_FAILED) {
      m.ptr = p;
      m.huge_pages = true;
      return m;
    }
    m.refused = "hugetlbfs pages were asked for (huge_pages='hugetlb') but mmap(MAP_HUGETLB) failed (" +
                std::string(std::strerror(errno)) +
                "): reserve them with `sysctl vm.nr_hugepages=N`; falling back to transparent huge pages";
    huge = HugePages::kTransparent;
  }
  if (huge == HugePages::kOff) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) m.ptr = p;
    return m;
  }
  // Transparent huge pages need a 2 MiB-aligned range: map one huge page more
  // and trim both ends.
  const std::size_t padded = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return m;
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  auto aligned = (base + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  if (aligned > base) munmap(raw, aligned - base);
  std::size_t tail = (base + padded) - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  m.ptr = reinterpret_cast<void*>(aligned);
  if (thp == "never") {
    std::string why = "transparent huge pages are disabled (/sys/kernel/mm/transparent_hugepage/enabled is "
                      "[never]): using 4 KiB pages, which makes pinning about 3x slower; enable them with "
                      "`echo madvise > /sys/kernel/mm/transparent_hugepage/enabled`";
    m.refused = m.refused.empty() ? why : m.refused + "; and " + why;
    return m;
  }
  if (madvise(m.ptr, bytes, MADV_HUGEPAGE) != 0) {
    std::string why = std::string("madvise(MADV_HUGEPAGE) failed (") + std::strerror(errno) +
                      "): using 4 KiB pages, which makes pinning about 3x slower";
    m.refused = m.refused.empty() ? why : m.refused + "; and " + why;
    return m;
  }
  m.huge_pages = true;
  return m;
}

void unmap_anonymous(void* ptr, std::size_t bytes) {
  if (ptr != nullptr) munmap(ptr, bytes);
}

std::string bind_to_node(void* ptr, std::size_t bytes, int node) {
  // mbind(2) without libnuma: MPOL_PREFERRED = 1, one bit per node.
  constexpr int kMpolPreferred = 1;
  if (node < 0 || node >= 1024) return "node " + std::to_string(node) + " out of range";
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
  long rc = syscall(SYS_mbind, ptr, bytes, kMpolPreferred, mask, 1024UL, 0U);
  if (rc != 0) return std::string("mbind failed: ") + std::strerror(errno);
  return "";
}

void touch_pages(void* ptr, std::size_t bytes, std::size_t page, int threads) {
  auto* base = static_cast<volatile char*>(ptr);
  const std::size_t pages = (bytes + page - 1) / page;
  auto touch = [&](std::size_t first, std::size_t last) {
    for (std::size_t i = first; i < last; ++i) base[i * page] = 0;
  };
  // A thread costs tens of microseconds to start: give each at least 16 MiB.
  const std::size_t per_thread_min = (std::size_t{16} << 20) / page;
  int n = static_cast<int>(std::min<std::size_t>(std::max(threads, 1), std::max<std::size_t>(pages / per_thread_min, 1)));
  if (n <= 1) {
    touch(0, pages);
    return;
  }
  std::vector<std::thread> workers;
  const std::size_t step = (pages + n - 1) / n;
  for (int t = 0; t < n; ++t) {
    std::size_t first = t * step, last = std::min(pages, first + step);
    if (first < last) workers.emplace_back(touch, first, last);
  }
  for (auto& w : workers) w.join();
}

std::string format_bytes(std::size_t bytes) {
  char text[64];
  double b = static_cast<double>(bytes);
  if (b >= (1ULL << 30)) std::snprintf(text, sizeof(text), "%.2f GiB", b / (1ULL << 30));
  else if (b >= (1ULL << 20)) std::snprintf(text, sizeof(text), "%.2f MiB", b / (1ULL << 20));
  else if (b >= 1024) std::snprintf(text, sizeof(text), "%.2f KiB", b / 1024);
  else std::snprintf(text, sizeof(text), "%zu B", bytes);
  return text;
}

std::string describe_host_limits() {
  std::string out = "memlock limit ";
  struct rlimit lim {};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) == 0) {
    out += lim.rlim_cur == RLIM_INFINITY ? "unlimited" : format_bytes(static_cast<std::size_t>(lim.rlim_cur));
  } else {
    out += "unknown";
  }
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      out += ", MemAvailable " + format_bytes(kib * 1024);
      break;
    }
  }
  return out;
}

}  // namespace torchmem::host
