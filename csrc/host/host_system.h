// host_system.h: what the host pool asks of Linux: NUMA and huge-page facts
// read from sysfs, anonymous mappings with huge-page advice, NUMA binding and
// parallel first touch. CUDA-free, so the simulated backend runs the same code.
//
// Every sysfs reader takes the sysfs root as an argument ("/sys" in real use),
// so tests point it at a fake directory tree.
//
// Note [NUMA placement]
// A GPU's DMA engine reads pinned memory over the PCIe root complex of its own
// socket; memory on the other socket crosses the inter-socket link (users
// report loaders 30% slower). The GPU's node comes from sysfs
// (/sys/bus/pci/devices/<bus id>/numa_node, the bus id from the driver); -1 or
// a missing file means unknown, and then nothing is bound. With one node online
// binding is a no-op and is skipped. Binding uses the mbind system call with
// MPOL_PREFERRED (not libnuma, which may be absent): pages go to the node while
// it has room and elsewhere after, rather than failing.
//
// Note [Huge pages]
// Pinning faults in and locks every page; with 2 MiB pages there are 512x fewer
// of them, which made pinning 1 GiB about 3x faster on the H200 host (0.31 s vs
// 0.92 s). Transparent huge pages are asked for with madvise(MADV_HUGEPAGE) on a
// 2 MiB-aligned range, which works in THP modes "always" and "madvise";
// mode "never" refuses. hugetlbfs pages (MAP_HUGETLB) are used only when asked
// for, since they exist only if the administrator reserved them.
#pragma once

#include <cstddef>
#include <string>

namespace torchmem::host {

constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;
constexpr std::size_t kSmallPageBytes = std::size_t{4} << 10;

enum class HugePages { kOff = 0, kTransparent = 1, kHugetlb = 2 };

// Parses "off", "thp" (or "transparent"), "hugetlb"; throws std::invalid_argument naming the choices.
HugePages parse_huge_pages(const std::string& text);

// The NUMA node of a PCI device, or -1 when unknown. `bus_id` as the driver
// gives it ("0000:1A:00.0"); sysfs spells it in lower case.
int numa_node_of_pci(const std::string& sysfs_root, const std::string& bus_id);
// Number of NUMA nodes online (parses <root>/devices/system/node/online, e.g.
// "0-1" or "0,2-3"); 1 when the file is missing.
int numa_node_count(const std::string& sysfs_root);
// The THP mode in brackets in <root>/kernel/mm/transparent_hugepage/enabled
// ("always", "madvise" or "never"); "" when the file is missing.
std::string thp_mode(const std::string& sysfs_root);

struct Mapping {
  void* ptr = nullptr;     // nullptr: mmap failed (out of memory)
  std::size_t bytes = 0;
  bool huge_pages = false;
  std::string refused;     // why huge pages were asked for and not obtained ("" if not refused)
};

// An anonymous read-write mapping of `bytes` (a multiple of 2 MiB when huge
// pages are asked for). `thp` is the system's THP mode (thp_mode()).
Mapping map_anonymous(std::size_t bytes, HugePages huge, const std::string& thp);
void unmap_anonymous(void* ptr, std::size_t bytes);

// Binds [ptr, ptr + bytes) to prefer `node` (Note [NUMA placement]). Returns ""
// on success, else the error.
std::string bind_to_node(void* ptr, std::size_t bytes, int node);

// Writes one byte per `page` bytes so every page exists before registration,
// split over `threads` threads (the first touch is what takes the time).
void touch_pages(void* ptr, std::size_t bytes, std::size_t page, int threads);

// "memlock limit unlimited, MemAvailable 12.3 GiB" (from getrlimit and /proc/meminfo).
std::string describe_host_limits();

// "1.50 GiB"
std::string format_bytes(std::size_t bytes);

}  // namespace torchmem::host
