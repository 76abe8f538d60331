// offload_copies_cuda.cpp: torchmem._C.offload_copy_out / offload_copy_in /
// offload_use: the CUDA work of moving one saved activation to the pinned host
// pool and back (torchmem/host/offload.py), one call each.
//
// Llama's training step is host-bound on the H200 host: the GPU finishes
// forward and backward as soon as the host has queued them. Written in Python,
// each moved tensor cost about 200 us of host time in the pack hook and as
// much again in the unpack hook (about ten torch calls each: a stream wait made
// of two event objects, the pool's empty(), a strided view, a stream context,
// copy_, record_stream), and with a quarter of the activations moved that host
// time was most of the step's excess (BENCHMARKS.md, Host memory and offload). These
// functions do the same steps, in the same order, with the same guarantees:
//
//   copy_out  the side stream waits for the current stream (the tensor was
//             produced there); a pool block first used on the side stream; one
//             cudaMemcpyAsync of the tensor's dense span; the device block is
//             recorded on the side stream, so the caching allocator (PyTorch's
//             or torchmem's) does not reuse it before the copy ran.
//   copy_in   the side stream waits for the copy out's event; a device tensor
//             allocated with the side stream current (its block belongs to that
//             stream); one cudaMemcpyAsync; the host block is recorded on the
//             side stream, so the pool does not reuse it before the copy ran.
//   use       the current stream waits for the copy in's event, and the fetched
//             tensor is recorded on it (it may be freed while still in use there).
//
// The hook has checked that the tensor is dense: its elements fill exactly
// [data_ptr, data_ptr + nbytes) (strides are never negative in torch).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <unordered_map>

#include "bindings/bindings.h"
#include "bindings/host_pool_holder.h"

namespace py = pybind11;

namespace torchmem::bindings {

namespace {

c10::cuda::CUDAStream side_stream(std::int64_t stream_id, std::int64_t device_index, std::int64_t device_type) {
  return c10::cuda::CUDAStream::unpack3(static_cast<c10::StreamId>(stream_id),
                                        static_cast<c10::DeviceIndex>(device_index),
                                        static_cast<c10::DeviceType>(device_type));
}

// The host pool's name for a stream: the cudaStream_t (torchmem.host uses stream.cuda_stream).
std::uint64_t pool_stream_id(const c10::cuda::CUDAStream& s) {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(s.stream()));
}

// One event per device and thread for "the side stream waits for the current one": a wait
// captures the event's last record when it is queued, so recording it again later is safe.
cudaEvent_t wait_event_for(c10::DeviceIndex device) {
  thread_local std::unordered_map<int, cudaEvent_t> events;  // never destroyed: lives as long as the thread
  cudaEvent_t& e = events[device];
  if (e == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

std::size_t dense_bytes(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()) * t.element_size(); }

// (host block as bytes, the same block as a tensor shaped and strided like `t`).
py::tuple copy_out(const at::Tensor& t, const HostPoolHolder& holder, std::int64_t stream_id,
                   std::int64_t device_index, std::int64_t device_type) {
  TORCH_CHECK(t.is_cuda(), "torchmem offload_copy_out: expected a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(holder->device >= 0, "torchmem offload_copy_out: the host pool is not a CUDA pool");
  const std::size_t nbytes = dense_bytes(t);
  TORCH_CHECK(nbytes > 0, "torchmem offload_copy_out: an empty tensor has nothing to move");
  c10::cuda::CUDAGuard guard(t.device());
  const c10::cuda::CUDAStream side = side_stream(stream_id, device_index, device_type);
  const cudaEvent_t produced = wait_event_for(t.device().index());
  C10_CUDA_CHECK(cudaEventRecord(produced, c10::cuda::getCurrentCUDAStream(t.device().index()).stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), produced, 0));
  void* ptr = nullptr;
  {
    py::gil_scoped_release released;
    ptr = holder->pool->allocate(nbytes, pool_stream_id(side));
  }
  HostPoolHolder keep = holder;
  at::Tensor base = torch::from_blob(
      ptr, {static_cast<std::int64_t>(nbytes)},
      [keep](void* p) {
        try {
          keep->pool->free(p);
        } catch (const std::exception&) {
          // A deleter must not throw; the pool refuses only pointers it never gave out.
        }
      },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  // Recorded on the side stream whether or not torch's copies report to the pool
  // (installed as torch's host allocator): this copy does not go through torch.
  holder->pool->record_stream(ptr, pool_stream_id(side));
  C10_CUDA_CHECK(cudaMemcpyAsync(ptr, t.data_ptr(), nbytes, cudaMemcpyDeviceToHost, side.stream()));
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), side);
  at::Tensor view = base.view(t.scalar_type()).as_strided(t.sizes(), t.strides());
  return py::make_tuple(base, view);
}

at::Tensor copy_in(const at::Tensor& host, const at::Tensor& host_base, const HostPoolHolder& holder,
                   std::int64_t device_index, std::int64_t stream_id, std::int64_t stream_device_index,
                   std::int64_t device_type, std::uintptr_t after_event) {
  TORCH_CHECK(host.device().is_cpu(), "torchmem offload_copy_in: expected the host copy, got a tensor on ",
              host.device());
  const std::size_t nbytes = dense_bytes(host);
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream side = side_stream(stream_id, stream_device_index, device_type);
  if (after_event != 0) C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), reinterpret_cast<cudaEvent_t>(after_event), 0));
  at::Tensor out;
  {
    c10::cuda::CUDAStreamGuard on_side(side);  // the block belongs to the stream that fills it
    out = at::empty_strided(host.sizes(), host.strides(), at::TensorOptions().dtype(host.scalar_type()).device(device));
  }
  C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), host.data_ptr(), nbytes, cudaMemcpyHostToDevice, side.stream()));
  holder->pool->record_stream(host_base.data_ptr(), pool_stream_id(side));
  return out;
}

void use(const at::Tensor& out, std::uintptr_t after_event) {
  TORCH_CHECK(out.is_cuda(), "torchmem offload_use: expected a CUDA tensor, got one on ", out.device());
  c10::cuda::CUDAGuard guard(out.device());
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(out.device().index());
  if (after_event != 0) C10_CUDA_CHECK(cudaStreamWaitEvent(current.stream(), reinterpret_cast<cudaEvent_t>(after_event), 0));
  c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(), current);
}

}  // namespace

void bind_offload_copies(py::module_& m) {
  m.def("offload_copy_out", &copy_out, py::arg("tensor"), py::arg("pool"), py::arg("stream_id"),
        py::arg("device_index"), py::arg("device_type"),
        "Copies a dense CUDA tensor into a new host pool block on a side stream; returns (block, view)");
  m.def("offload_copy_in", &copy_in, py::arg("host"), py::arg("host_base"), py::arg("pool"), py::arg("device_index"),
        py::arg("stream_id"), py::arg("stream_device_index"), py::arg("device_type"), py::arg("after_event"),
        "Copies a host copy back into a new CUDA tensor on a side stream, after the given cudaEvent_t");
  m.def("offload_use", &use, py::arg("tensor"), py::arg("after_event"),
        "Makes the current stream wait for the given cudaEvent_t and records the tensor on it");
}

}  // namespace torchmem::bindings
