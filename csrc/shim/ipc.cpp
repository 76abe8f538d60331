// ipc.cpp: CUDA IPC for torchmem's blocks (see ipc.h).
//
// Note [CUDA IPC]
// torch.multiprocessing sends a CUDA tensor as an allocator handle plus an
// offset (shareIpcHandle); the receiver asks its own allocator to map the
// handle (getIpcDevPtr) and keeps the sender's tensor alive through torch's
// reference-counting file until it lets go. Two handle formats:
//
// - cuda_malloc backend: PyTorch's own: a version byte (2), 'c', and the
//   cudaIpcMemHandle_t of the block's segment. A process on PyTorch's native
//   allocator opens it, and torchmem opens native's.
// - vmm backend: a VMM handle is no cudaMalloc allocation, so legacy IPC
//   cannot describe it. Each driver handle under the block (a granule or a
//   run: Note [Block backing] in core/pool.h) is exported as a POSIX file
//   descriptor (Note [Shareable handles], vmm_backend_cuda.cpp), as PyTorch
//   does for expandable segments. The handle is 2, 't', "torchmem", the
//   sender's pid, the span and each piece's offset, size, descriptor number
//   and export id. The receiver duplicates the descriptors with pidfd_getfd
//   (Linux 5.6+; the same permission as ptrace: same user, and Yama's
//   ptrace_scope 0, or CAP_SYS_PTRACE), imports them and maps them in a range
//   of its own. A native receiver cannot read this format (torch says
//   "unexpected or illformed shareable handle type"): install torchmem in
//   both processes, or use backend='cuda_malloc'.
//
// The receiver caches its mappings by handle (weakly, as PyTorch does): two
// tensors of one block, or of one run, share one mapping. Export ids differ
// for every handle a process ever exported, so a handle string never names
// different memory twice. Dropping a mapping waits for the receiver's device
// first (Note [Device barrier]): its streams may still read it.
#include "shim/ipc.h"

#include <cuda_runtime_api.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "backend/cuda_support_cuda.h"
#include "backend/vmm_backend_cuda.h"
#include "shim/runtime_state.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace torchmem::shim {

namespace {

constexpr char kHandleVersion = 2;  // PyTorch's SHAREABLE_HANDLE_VERSION since 2.4
constexpr char kCudaMallocType = 'c';
constexpr char kTorchmemType = 't';
constexpr char kMagic[8] = {'t', 'o', 'r', 'c', 'h', 'm', 'e', 'm'};
constexpr std::size_t kCudaIpcHandleBytes = sizeof(cudaIpcMemHandle_t);  // 64

struct WirePiece {
  std::uint64_t offset;
  std::uint64_t bytes;
  std::int64_t fd;  // in the sender
  std::uint64_t id;
};

struct WireHeader {
  char magic[8];
  std::int64_t pid;
  std::uint64_t span;
  std::uint64_t count;
};

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("torchmem: " + what); }

template <typename T>
void put(std::string& out, const T& value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

template <typename T>
T take(const std::string& in, std::size_t& at) {
  if (at + sizeof(T) > in.size()) fail("malformed CUDA IPC handle (" + std::to_string(in.size()) + " bytes)");
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  at += sizeof(T);
  return value;
}

// ---- sending ----------------------------------------------------------------

IpcShare share_segment(const BlockBacking& backing, Addr ptr) {
  const BackingPiece& segment = backing.pieces.front();
  cudaIpcMemHandle_t handle;
  cuda::check(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(segment.at)), "cudaIpcGetMemHandle");
  IpcShare out;
  out.offset = static_cast<std::ptrdiff_t>(ptr - segment.at);
  out.handle.push_back(kHandleVersion);
  out.handle.push_back(kCudaMallocType);
  out.handle.append(reinterpret_cast<const char*>(&handle), kCudaIpcHandleBytes);
  return out;
}

IpcShare share_granules(VmmBackend& backend, const BlockBacking& backing, Addr ptr) {
  const Addr base = backing.pieces.front().at;
  const BackingPiece& last = backing.pieces.back();
  IpcShare out;
  out.offset = static_cast<std::ptrdiff_t>(ptr - base);
  out.handle.push_back(kHandleVersion);
  out.handle.push_back(kTorchmemType);
  WireHeader header{};
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.pid = static_cast<std::int64_t>(::getpid());
  header.span = last.at + last.bytes - base;
  header.count = backing.pieces.size();
  put(out.handle, header);
  for (const BackingPiece& piece : backing.pieces) {
    const VmmBackend::SharedHandle shared = backend.export_handle(piece.handle);
    put(out.handle, WirePiece{piece.at - base, piece.bytes, shared.fd, shared.id});
  }
  return out;
}

// ---- receiving ---------------------------------------------------------------

// Closes a descriptor when it goes out of scope.
struct Descriptor {
  int fd = -1;
  explicit Descriptor(int value) : fd(value) {}
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  Descriptor(Descriptor&& other) noexcept : fd(other.fd) { other.fd = -1; }
};

// A copy, in this process, of descriptor `fd` of process `pid`.
Descriptor copy_descriptor(const Descriptor& sender, std::int64_t pid, std::int64_t fd) {
  if (pid == ::getpid()) return Descriptor(::dup(static_cast<int>(fd)));
  const long copied = ::syscall(SYS_pidfd_getfd, sender.fd, static_cast<int>(fd), 0);
  if (copied < 0) {
    const int error = errno;
    fail("cannot receive a CUDA tensor from process " + std::to_string(pid) + ": pidfd_getfd failed (" +
         std::strerror(error) +
         "). Taking the sender's memory handle needs ptrace permission over it: the same user, and "
         "kernel.yama.ptrace_scope=0 or CAP_SYS_PTRACE (a container may also need pidfd_getfd allowed by its "
         "seccomp profile). Or share through backend='cuda_malloc', whose cudaIpc handles need none.");
  }
  return Descriptor(static_cast<int>(copied));
}

std::shared_ptr<void> open_granules(const std::string& handle) {
  std::size_t at = 2;
  const auto header = take<WireHeader>(handle, at);
  if (std::memcmp(header.magic, kMagic, sizeof(kMagic)) != 0) fail("malformed CUDA IPC handle (no torchmem magic)");
  if (header.count == 0 || header.count > (handle.size() - at) / sizeof(WirePiece)) {
    fail("malformed CUDA IPC handle (" + std::to_string(header.count) + " pieces in " +
         std::to_string(handle.size()) + " bytes)");
  }
  Descriptor sender(-1);
  if (header.pid != ::getpid()) {
    sender.fd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(header.pid), 0));
    if (sender.fd < 0) {
      const int error = errno;
      fail("cannot receive a CUDA tensor from process " + std::to_string(header.pid) + ": pidfd_open failed (" +
           std::strerror(error) + "); the sender must still be running (Linux 5.3+)");
    }
  }
  std::vector<Descriptor> local;
  std::vector<VmmBackend::ImportPiece> pieces;
  for (std::uint64_t i = 0; i < header.count; ++i) {
    const auto piece = take<WirePiece>(handle, at);
    if (piece.offset + piece.bytes > header.span) fail("malformed CUDA IPC handle (a piece past its span)");
    local.push_back(copy_descriptor(sender, header.pid, piece.fd));
    pieces.push_back(VmmBackend::ImportPiece{local.back().fd, piece.offset, piece.bytes});
  }
  int device = 0;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  return VmmBackend::import_shared(device, header.span, pieces);
}

std::shared_ptr<void> open_cuda_malloc(const char* raw_handle) {
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, raw_handle, kCudaIpcHandleBytes);
  int device = 0;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  void* ptr = nullptr;
  cuda::check(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return std::shared_ptr<void>(ptr, [device](void* opened) {
    cuda::DeviceGuard on_device(device);
    if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();  // Note [CUDA IPC]: readers first
    if (cudaIpcCloseMemHandle(opened) != cudaSuccess) (void)cudaGetLastError();
  });
}

std::shared_ptr<void> open_uncached(const std::string& handle) {
  if (handle.size() == kCudaIpcHandleBytes) return open_cuda_malloc(handle.data());  // torch before 2.4
  if (handle.size() < 2) fail("malformed CUDA IPC handle (" + std::to_string(handle.size()) + " bytes)");
  const char type = handle[1];
  if (type == kTorchmemType) return open_granules(handle);
  if (type == kCudaMallocType && handle.size() == 2 + kCudaIpcHandleBytes) return open_cuda_malloc(handle.data() + 2);
  fail(std::string("cannot open a CUDA IPC handle of type '") + type +
       "': PyTorch's expandable segments ('e') and other allocators' handles are not supported. Share from a "
       "process on torchmem or on PyTorch's default (non-expandable) allocator.");
}

}  // namespace

IpcShare share_ipc(void* ptr) {
  if (ptr == nullptr) fail("cannot share an empty (0-byte) CUDA tensor's memory");
  if (is_external_block(ptr)) {
    fail("cannot share a block of a torch.cuda.MemPool with its own allocator, or one allocated with caching "
         "off, with another process: allocate the tensor outside that pool");
  }
  const int device = owning_device(ptr);  // throws for memory torchmem does not own
  DeviceState& state = state_for(device);
  cuda::DeviceGuard on_device(device);
  const auto addr = reinterpret_cast<Addr>(ptr);
  BlockBacking backing;
  try {
    backing = state.pool->backing_of(addr);
  } catch (const PoolError& e) {
    throw std::runtime_error(std::string(e.what()) + " (torch shares a storage by its start)");
  }
  if (!state.backend->supports_vmm()) return share_segment(backing, addr);
  auto* vmm = dynamic_cast<VmmBackend*>(state.backend.get());
  if (vmm == nullptr) fail("cannot share memory of the '" + state.backend->name() + "' backend with another process");
  return share_granules(*vmm, backing, addr);
}

std::shared_ptr<void> open_ipc(const std::string& handle) {
  // Note [CUDA IPC]: one mapping per handle while anyone holds it.
  static std::mutex mutex;
  static auto* opened = new std::unordered_map<std::string, std::weak_ptr<void>>();  // outlives static teardown
  std::lock_guard<std::mutex> lock(mutex);
  auto found = opened->find(handle);
  if (found != opened->end()) {
    if (auto alive = found->second.lock()) return alive;
  }
  std::shared_ptr<void> mapped = open_uncached(handle);
  for (auto it = opened->begin(); it != opened->end();) it = it->second.expired() ? opened->erase(it) : std::next(it);
  (*opened)[handle] = mapped;
  return mapped;
}

}  // namespace torchmem::shim
