// compile_context.cpp: which torch.compile region each thread runs, for
// allocation history (Note [Compile context], torchmem/runtime/stacks.py).
//
// Compiled code runs inside a RecordFunction named "Torch-Compiled Region:
// <frame>/<recompile>". torch's own _record_memory_history(compile_context=True)
// follows those with a global callback that calls the allocator's
// pushCompileContext / popCompileContext (install.cpp forwards them here).
// torchmem's patched _record_memory_history does not go through torch's C++
// function, so it adds the same kind of callback itself; both feed one stack
// per thread, and a region entered twice (both callbacks on) is left twice.
#include <ATen/record_function.h>

#include <mutex>
#include <string>
#include <vector>

#include "shim/callbacks.h"

namespace torchmem::shim {

namespace {

constexpr const char kRegionPrefix[] = "Torch-Compiled Region";

thread_local std::vector<std::string> regions;

std::mutex callback_mutex;
at::CallbackHandle callback_handle = 0;  // guarded by callback_mutex; 0: none

bool is_region(const at::RecordFunction& fn) {
  const char* name = fn.name();
  return name != nullptr && std::string(name).rfind(kRegionPrefix, 0) == 0;
}

}  // namespace

void push_compile_context(const std::string& name) { regions.push_back(name); }

void pop_compile_context() {
  if (!regions.empty()) regions.pop_back();
}

std::string current_compile_context() { return regions.empty() ? std::string() : regions.back(); }

void set_compile_context_recording(bool enabled) {
  std::lock_guard<std::mutex> lock(callback_mutex);
  if (enabled == (callback_handle != 0)) return;
  if (!enabled) {
    at::removeCallback(callback_handle);
    callback_handle = 0;
    return;
  }
  callback_handle = at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            if (is_region(fn)) push_compile_context(fn.name());
            return nullptr;
          },
          [](const at::RecordFunction& fn, at::ObserverContext*) {
            if (is_region(fn)) pop_compile_context();
          })
          .scopes({at::RecordScope::FUNCTION}));
}

}  // namespace torchmem::shim
