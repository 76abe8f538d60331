// vmm_chunk_probe: what does growing a CUDA virtual-memory pool cost per granule, depending on
// how the physical memory is created (one handle per granule vs one handle of N granules) and
// how it is mapped (per granule vs whole run) and given access (per granule vs one call)?
// torchmem grows today at ~37-78 us per 2 MiB granule while cuMemAlloc(1 GiB) costs ~1.2 us per
// 2 MiB; these numbers choose the design for creating physical memory in bigger chunks.
// Standalone: CUDA driver API only (cuda.h, -lcuda), no torch. Build/run: make bench-vmm-chunks.

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// ---- error checking: every driver call goes through CK ----
static void check(CUresult r, const char* call, int line) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown CUresult";
  std::fprintf(stderr, "vmm_chunk_probe: %s failed: %s (%d) at line %d\n", call, name, (int)r, line);
  std::exit(1);
}
#define CK(call) check((call), #call, __LINE__)

static double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// Time one driver call and add its duration (us) to `bucket`.
#define TIMED(bucket, call)      \
  do {                           \
    double t0_ = now_us();       \
    CK(call);                    \
    (bucket) += now_us() - t0_;  \
  } while (0)

// ---- globals set up once in main ----
static CUdevice g_dev;
static size_t g_gran = 0;  // allocation granularity (2 MiB on current GPUs)
static CUmemAllocationProp g_prop;
static CUmemAccessDesc g_access;

struct Range {
  CUdeviceptr ptr;
  size_t size;
};

// Microseconds spent in each phase during one repeat of one variant.
struct Sample {
  double reserve = 0, create = 0, map = 0, access = 0, unmap = 0, release = 0, addr_free = 0;
  // Moving one middle granule (C and D only): unmap it, reserve a fresh 1-granule range, map the
  // same physical slice there, set access.
  double move_unmap = 0, move_reserve = 0, move_map = 0, move_access = 0;
  // VA reservations of this repeat. They are freed only after all repeats of a (variant, N), so
  // that every repeat maps into a range the driver has never handed out before in this group.
  std::vector<Range> ranges;
};

struct Checks {
  // C/D: the driver refused to map a slice of the multi-granule handle (cuMemMap documents
  // "offset: currently must be zero"; on H200, driver 580.159 / CUDA 13.0 even slice 0 of a
  // larger handle gives CUDA_ERROR_NOT_SUPPORTED). Recorded as a result, not a crash; any other
  // error, and this one on any other call, still exits.
  bool supported = true;
  int failed_slice = -1;
  std::string failed_error;
  bool move_data_ok = true;     // C/D: the moved slice reads back the bytes written before the move
  bool mem_returned_ok = true;  // C: cuMemGetInfo free memory came back after unmap + release
  size_t free_before = 0, free_mapped = 0, free_after = 0;  // C: last repeat, bytes
};

static CUdeviceptr reserve(Sample& s, size_t size, double* bucket) {
  CUdeviceptr p = 0;
  TIMED(*bucket, cuMemAddressReserve(&p, size, g_gran, 0, 0));
  s.ranges.push_back({p, size});
  return p;
}

// Untimed: write the whole run once so that the memory is really usable (and touched, as it would
// be in use), and wait for it.
static void touch(CUdeviceptr p, size_t bytes) {
  CK(cuMemsetD8(p, 0, bytes));
  CK(cuCtxSynchronize());
}

// A (access_per_granule=false) and B (true): N handles of one granule each, each mapped
// separately; A: one cuMemSetAccess over the run after all maps; B: map i then access i.
static void run_handle_per_granule(int n, bool access_per_granule, Sample& s) {
  const size_t g = g_gran;
  CUdeviceptr base = reserve(s, n * g, &s.reserve);
  std::vector<CUmemGenericAllocationHandle> h(n);
  for (int i = 0; i < n; i++) TIMED(s.create, cuMemCreate(&h[i], g, &g_prop, 0));
  for (int i = 0; i < n; i++) {
    TIMED(s.map, cuMemMap(base + i * g, g, 0, h[i], 0));
    if (access_per_granule) TIMED(s.access, cuMemSetAccess(base + i * g, g, &g_access, 1));
  }
  if (!access_per_granule) TIMED(s.access, cuMemSetAccess(base, n * g, &g_access, 1));
  touch(base, n * g);
  for (int i = 0; i < n; i++) TIMED(s.unmap, cuMemUnmap(base + i * g, g));
  for (int i = 0; i < n; i++) TIMED(s.release, cuMemRelease(h[i]));
}

// C (access_per_slice=false) and D (true): ONE handle of N granules, mapped slice by slice
// (cuMemMap of g bytes at offset i*g); C: one cuMemSetAccess over the run; D: access per slice.
// Then moves the middle slice to a fresh address and checks its data survived.
// C also checks with cuMemGetInfo that the memory comes back after all unmaps + cuMemRelease.
static void run_one_handle_sliced(int n, bool access_per_slice, bool check_mem, Sample& s,
                                  Checks& c) {
  const size_t g = g_gran;
  size_t free0 = 0, total = 0;
  if (check_mem) CK(cuMemGetInfo(&free0, &total));

  CUdeviceptr base = reserve(s, n * g, &s.reserve);
  CUmemGenericAllocationHandle h;
  TIMED(s.create, cuMemCreate(&h, n * g, &g_prop, 0));
  for (int i = 0; i < n; i++) {
    double t0 = now_us();
    CUresult r = cuMemMap(base + i * g, g, (size_t)i * g, h, 0);
    s.map += now_us() - t0;
    if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_VALUE) {
      // Slice mapping refused: record which slice and why, undo what was mapped, give up.
      const char* ename = nullptr;
      cuGetErrorName(r, &ename);
      c.supported = false;
      c.failed_slice = i;
      c.failed_error = ename ? ename : "unknown CUresult";
      for (int j = 0; j < i; j++) CK(cuMemUnmap(base + j * g, g));
      CK(cuMemRelease(h));
      return;
    }
    check(r, "cuMemMap(base + i * g, g, (size_t)i * g, h, 0)", __LINE__);
    if (access_per_slice) TIMED(s.access, cuMemSetAccess(base + i * g, g, &g_access, 1));
  }
  if (!access_per_slice) TIMED(s.access, cuMemSetAccess(base, n * g, &g_access, 1));
  touch(base, n * g);

  // Move the middle slice m: stamp it (untimed), unmap it, map the same physical slice at a fresh
  // address, and read it back there.
  const int m = n / 2;
  const uint32_t stamp = 0x5EED0000u + (uint32_t)m;
  CK(cuMemsetD32(base + m * g, stamp, g / 4));
  CK(cuCtxSynchronize());
  TIMED(s.move_unmap, cuMemUnmap(base + m * g, g));
  CUdeviceptr moved = reserve(s, g, &s.move_reserve);
  TIMED(s.move_map, cuMemMap(moved, g, (size_t)m * g, h, 0));
  TIMED(s.move_access, cuMemSetAccess(moved, g, &g_access, 1));
  std::vector<uint32_t> head(1024), tail(1024);  // first and last 4 KiB of the moved slice
  CK(cuMemcpyDtoH(head.data(), moved, 4096));
  CK(cuMemcpyDtoH(tail.data(), moved + g - 4096, 4096));
  for (int k = 0; k < 1024; k++)
    if (head[k] != stamp || tail[k] != stamp) c.move_data_ok = false;

  size_t free_mapped = 0;
  if (check_mem) CK(cuMemGetInfo(&free_mapped, &total));

  // Teardown: unmap every slice where it is mapped now (slice m at `moved`), then release.
  for (int i = 0; i < n; i++) {
    CUdeviceptr at = (i == m) ? moved : base + i * g;
    TIMED(s.unmap, cuMemUnmap(at, g));
  }
  TIMED(s.release, cuMemRelease(h));

  if (check_mem) {
    size_t free_after = 0;
    CK(cuMemGetInfo(&free_after, &total));
    // Creating must have taken at least N granules, and after release free memory must be back
    // to where it was (one granule of slack for unrelated driver bookkeeping).
    bool took = free0 >= free_mapped + (size_t)n * g;
    bool back = free_after + g >= free0;
    if (!took || !back) c.mem_returned_ok = false;
    c.free_before = free0;
    c.free_mapped = free_mapped;
    c.free_after = free_after;
  }
}

// E: ONE handle of N granules, ONE cuMemMap of the whole, ONE cuMemSetAccess, ONE cuMemUnmap.
static void run_one_handle_whole(int n, Sample& s) {
  const size_t g = g_gran;
  CUdeviceptr base = reserve(s, n * g, &s.reserve);
  CUmemGenericAllocationHandle h;
  TIMED(s.create, cuMemCreate(&h, n * g, &g_prop, 0));
  TIMED(s.map, cuMemMap(base, n * g, 0, h, 0));
  TIMED(s.access, cuMemSetAccess(base, n * g, &g_access, 1));
  touch(base, n * g);
  TIMED(s.unmap, cuMemUnmap(base, n * g));
  TIMED(s.release, cuMemRelease(h));
}

// F: the cudaMalloc-equivalent reference. cuMemAlloc is counted as "create", cuMemFree as
// "release"; there is no separate reserve/map/access/unmap.
static void run_mem_alloc(int n, Sample& s) {
  CUdeviceptr p = 0;
  TIMED(s.create, cuMemAlloc(&p, (size_t)n * g_gran));
  touch(p, (size_t)n * g_gran);
  TIMED(s.release, cuMemFree(p));
}

static const char* describe(char v) {
  switch (v) {
    case 'A': return "N handles x 1 granule, map per granule, 1 setAccess";
    case 'B': return "N handles x 1 granule, map+setAccess per granule";
    case 'C': return "1 handle x N granules, map per slice, 1 setAccess";
    case 'D': return "1 handle x N granules, map+setAccess per slice";
    case 'E': return "1 handle x N granules, 1 map, 1 setAccess";
    case 'F': return "cuMemAlloc + cuMemFree (cudaMalloc reference)";
  }
  return "?";
}

static double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / v.size();
}

static void usage() {
  std::fprintf(stderr,
               "usage: vmm_chunk_probe [--granules N ...] [--repeats R] [--warmup W]\n"
               "  --granules  run lengths in granules (default 1 4 16 64 256; also 1,4,16)\n"
               "  --repeats   measured repeats per (variant, N) (default 10)\n"
               "  --warmup    unmeasured repeats before them (default 1)\n");
}

int main(int argc, char** argv) {
  std::vector<int> granules;
  int repeats = 10, warmup = 1;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--granules") {
      // Take every following argument that does not start with "--"; each may be comma separated.
      while (i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0) {
        std::string list = argv[++i];
        size_t pos = 0;
        while (pos <= list.size()) {
          size_t comma = list.find(',', pos);
          if (comma == std::string::npos) comma = list.size();
          std::string item = list.substr(pos, comma - pos);
          if (!item.empty()) granules.push_back(std::atoi(item.c_str()));
          pos = comma + 1;
        }
      }
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else if (a == "--warmup" && i + 1 < argc) {
      warmup = std::atoi(argv[++i]);
    } else {
      usage();
      return 2;
    }
  }
  if (granules.empty()) granules = {1, 4, 16, 64, 256};
  for (int n : granules)
    if (n < 1) { usage(); return 2; }
  if (repeats < 1 || warmup < 0) { usage(); return 2; }

  // ---- driver, primary context on device 0 ----
  CK(cuInit(0));
  CK(cuDeviceGet(&g_dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, g_dev));
  CK(cuCtxSetCurrent(ctx));
  char name[256] = {0};
  CK(cuDeviceGetName(name, sizeof(name), g_dev));
  int driver = 0;
  CK(cuDriverGetVersion(&driver));

  std::memset(&g_prop, 0, sizeof(g_prop));
  g_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  g_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  g_prop.location.id = g_dev;
  CK(cuMemGetAllocationGranularity(&g_gran, &g_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  std::memset(&g_access, 0, sizeof(g_access));
  g_access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  g_access.location.id = g_dev;
  g_access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  size_t free0 = 0, total0 = 0;
  CK(cuMemGetInfo(&free0, &total0));
  std::printf("vmm_chunk_probe: device 0 %s, driver %d, granularity %zu bytes (%.1f MiB), "
              "free %.1f / %.1f GiB, repeats %d (+%d warmup)\n",
              name, driver, g_gran, g_gran / 1048576.0, free0 / 1073741824.0,
              total0 / 1073741824.0, repeats, warmup);
  std::printf("All times: mean microseconds PER GRANULE over the repeats (move: us per move of one "
              "granule). grow = create+map+access; teardown = unmap+release; total = reserve + "
              "grow + teardown + addr_free.\n\n");
  std::printf("%-3s %5s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n", "var", "N", "reserve",
              "create", "map", "access", "GROW", "grow_min", "unmap", "release", "teardown",
              "addr_free", "TOTAL", "move");

  const char variants[] = {'A', 'B', 'C', 'D', 'E', 'F'};
  bool all_ok = true;
  for (int n : granules) {
    size_t free_now = 0, total = 0;
    CK(cuMemGetInfo(&free_now, &total));
    const size_t need = (size_t)n * g_gran + ((size_t)1 << 30);  // run + 1 GiB headroom
    if (need > free_now) {
      std::printf("skip N=%d: needs %.1f GiB, %.1f GiB free\n", n, need / 1073741824.0,
                  free_now / 1073741824.0);
      continue;
    }
    for (char v : variants) {
      Checks c;
      std::vector<Sample> samples(warmup + repeats);
      for (Sample& s : samples) {
        if (!c.supported) break;
        switch (v) {
          case 'A': run_handle_per_granule(n, false, s); break;
          case 'B': run_handle_per_granule(n, true, s); break;
          case 'C': run_one_handle_sliced(n, false, true, s, c); break;
          case 'D': run_one_handle_sliced(n, true, false, s, c); break;
          case 'E': run_one_handle_whole(n, s); break;
          case 'F': run_mem_alloc(n, s); break;
        }
      }
      for (Sample& s : samples)
        for (const Range& r : s.ranges) TIMED(s.addr_free, cuMemAddressFree(r.ptr, r.size));
      if (!c.supported) {
        std::printf("%-3c %5d UNSUPPORTED: cuMemMap of slice %d (offset %d granules, %zu bytes) of "
                    "a %d-granule handle -> %s\n", v, n, c.failed_slice, c.failed_slice, g_gran,
                    n, c.failed_error.c_str());
        std::printf("JSON {\"variant\":\"%c\",\"desc\":\"%s\",\"n\":%d,\"granule_bytes\":%zu,"
                    "\"supported\":false,\"failed_call\":\"cuMemMap\",\"failed_slice\":%d,"
                    "\"failed_error\":\"%s\"}\n", v, describe(v), n, g_gran, c.failed_slice,
                    c.failed_error.c_str());
        std::fflush(stdout);
        continue;
      }
      samples.erase(samples.begin(), samples.begin() + warmup);

      // Per-granule means over the measured repeats.
      std::vector<double> reserve, create, map, access, grow, unmap, release, teardown, afree,
          total_v, mv_unmap, mv_reserve, mv_map, mv_access, mv;
      for (const Sample& s : samples) {
        reserve.push_back(s.reserve / n);
        create.push_back(s.create / n);
        map.push_back(s.map / n);
        access.push_back(s.access / n);
        grow.push_back((s.create + s.map + s.access) / n);
        unmap.push_back(s.unmap / n);
        release.push_back(s.release / n);
        teardown.push_back((s.unmap + s.release) / n);
        afree.push_back(s.addr_free / n);
        total_v.push_back((s.reserve + s.create + s.map + s.access + s.unmap + s.release +
                           s.addr_free) / n);
        mv_unmap.push_back(s.move_unmap);
        mv_reserve.push_back(s.move_reserve);
        mv_map.push_back(s.move_map);
        mv_access.push_back(s.move_access);
        mv.push_back(s.move_unmap + s.move_map + s.move_access);
      }
      const double grow_min = *std::min_element(grow.begin(), grow.end());
      const double grow_max = *std::max_element(grow.begin(), grow.end());
      const bool has_move = (v == 'C' || v == 'D');

      char move_col[32] = "-";
      if (has_move) std::snprintf(move_col, sizeof(move_col), "%9.2f", mean(mv));
      std::printf("%-3c %5d %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9s\n",
                  v, n, mean(reserve), mean(create), mean(map), mean(access), mean(grow), grow_min,
                  mean(unmap), mean(release), mean(teardown), mean(afree), mean(total_v),
                  move_col);
      if (has_move && !c.move_data_ok) {
        std::printf("    CHECK FAILED: %c N=%d moved slice did not read back its data\n", v, n);
        all_ok = false;
      }
      if (v == 'C' && !c.mem_returned_ok) {
        std::printf("    CHECK FAILED: C N=%d free memory before %zu, mapped %zu, after release %zu"
                    "\n", n, c.free_before, c.free_mapped, c.free_after);
        all_ok = false;
      }

      std::printf("JSON {\"variant\":\"%c\",\"desc\":\"%s\",\"n\":%d,\"granule_bytes\":%zu,"
                  "\"supported\":true,\"repeats\":%d,\"warmup\":%d,"
                  "\"reserve_us_pg\":%.3f,\"create_us_pg\":%.3f,\"map_us_pg\":%.3f,"
                  "\"access_us_pg\":%.3f,\"grow_us_pg\":%.3f,\"grow_min_us_pg\":%.3f,"
                  "\"grow_max_us_pg\":%.3f,\"grow_us_run\":%.3f,\"unmap_us_pg\":%.3f,"
                  "\"release_us_pg\":%.3f,\"teardown_us_pg\":%.3f,\"addr_free_us_pg\":%.3f,"
                  "\"total_us_pg\":%.3f",
                  v, describe(v), n, g_gran, repeats, warmup, mean(reserve), mean(create),
                  mean(map), mean(access), mean(grow), grow_min, grow_max, mean(grow) * n,
                  mean(unmap), mean(release), mean(teardown), mean(afree), mean(total_v));
      if (has_move)
        std::printf(",\"move_unmap_us\":%.3f,\"move_reserve_us\":%.3f,\"move_map_us\":%.3f,"
                    "\"move_access_us\":%.3f,\"move_us\":%.3f,\"move_data_ok\":%s",
                    mean(mv_unmap), mean(mv_reserve), mean(mv_map), mean(mv_access), mean(mv),
                    c.move_data_ok ? "true" : "false");
      if (v == 'C')
        std::printf(",\"free_before_bytes\":%zu,\"free_mapped_bytes\":%zu,"
                    "\"free_after_bytes\":%zu,\"mem_returned_ok\":%s",
                    c.free_before, c.free_mapped, c.free_after,
                    c.mem_returned_ok ? "true" : "false");
      std::printf("}\n");
      std::fflush(stdout);
    }
  }

  CK(cuDevicePrimaryCtxRelease(g_dev));
  if (!all_ok) {
    std::printf("vmm_chunk_probe: SOME CHECKS FAILED\n");
    return 3;
  }
  return 0;
}
