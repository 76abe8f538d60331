// allocation.h: what torch calls on the installed allocator (install.cpp's
// hooks, exports.cpp's extern "C" pairs): allocate, free, record_stream, the
// tagged deleter context, and the switch that turns caching off.
// Defined in runtime.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shim/runtime.h"

namespace torchmem::shim {

// Throw c10::OutOfMemoryError (allocate_or_throw) or return nullptr (allocate_or_null).
void* allocate_or_throw(std::size_t size, int device, CudaStream stream);
void* allocate_or_null(std::size_t size, int device, CudaStream stream);
void deallocate(void* ptr, int device);
// The device whose pool holds the live block at `ptr` (the current device's
// pool is asked first); throws std::runtime_error naming the address if none does.
int owning_device(void* ptr);

// Note [Device-tagged deleter context] torch's DataPtr hands its deleter one
// pointer, the context. torchmem's allocate() (install.cpp) stores the block
// address with device + 1 in its low bits (blocks are at least 512-byte
// aligned, kMaxDevices is 64), so the free needs no lookup and no map of
// torch's own; an untagged context (raw_alloc, an unaligned address) makes the
// free ask owning_device(). delete_tagged_block never throws (it runs inside
// tensor destructors): a bad free is reported on stderr, counted, and leaves
// the pool unchanged.
void* tag_with_device(void* ptr, int device);
void delete_tagged_block(void* context) noexcept;
std::uint64_t failed_deleter_frees();  // bad frees reported by delete_tagged_block
void record_stream(void* ptr, CudaStream stream);
void* base_allocation(void* ptr, std::size_t* size);

// Note [Caching off] torch.cuda.caching_allocator_enable(False) is PyTorch's
// switch for debugging memory errors: from then on every allocation is its own
// cudaMalloc and every free a cudaFree, so a stale pointer faults instead of
// reading memory someone else now owns, and such blocks stay out of the
// allocator's pools and statistics. torchmem serves them through the path of
// a MemPool's own allocator (Note [External pool allocators] in
// private_pools.h): each device has one over cudaMalloc / cudaFree, so their
// frees find their way back whenever they happen, also after caching is on
// again.
void set_caching_enabled(bool enabled);
bool caching_enabled();

}  // namespace torchmem::shim
