// replay_bindings.cpp: placeholder until its owner lands it (bind_replay).
#include "bindings/bindings.h"

namespace torchmem::bindings {

void bind_replay(pybind11::module_& m) { (void)m; }

}  // namespace torchmem::bindings
