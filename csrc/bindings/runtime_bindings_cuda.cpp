// runtime_bindings_cuda.cpp: placeholder until its owner lands it (bind_runtime).
#include "bindings/bindings.h"

namespace torchmem::bindings {

void bind_runtime(pybind11::module_& m) { (void)m; }

}  // namespace torchmem::bindings
