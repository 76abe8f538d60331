// ipc.h: CUDA IPC, sharing a CUDA tensor's memory with another process
// (torch.multiprocessing, a Queue of CUDA tensors): what torch's
// CUDAAllocator::shareIpcHandle and getIpcDevPtr ask of the allocator.
//
// Like runtime.h, it includes no torch and no CUDA headers.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace torchmem::shim {

// The handle torch sends to the other process, and where the block lies
// inside what the handle describes.
struct IpcShare {
  std::ptrdiff_t offset = 0;
  std::string handle;
};

// `ptr` must be the start of a live block of a torchmem device pool. Throws
// std::runtime_error naming the problem and the fix otherwise, or when the
// memory cannot be exported (Note [CUDA IPC] in ipc.cpp).
IpcShare share_ipc(void* ptr);

// Maps the memory a handle from share_ipc (this or another process) or from
// PyTorch's own allocator (a cudaMalloc handle) describes, on the current
// device. The result points at what the handle describes (add the offset);
// the mapping lives until the last copy of the pointer goes.
std::shared_ptr<void> open_ipc(const std::string& handle);

}  // namespace torchmem::shim
