// core_bindings.cpp: placeholder until its owner lands it (bind_core).
#include "bindings/bindings.h"

namespace torchmem::bindings {

void bind_core(pybind11::module_& m) { (void)m; }

}  // namespace torchmem::bindings
