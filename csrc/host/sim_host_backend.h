// sim_host_backend.h: a host backend for tests without a GPU.
//
// Memory is real (the Python layer hands it out as CPU tensors) and comes from
// the same map_anonymous() path as the CUDA backend, so huge-page advice and
// its fallback run for real, driven by a THP mode read from a (possibly fake)
// sysfs root. What is simulated: registration (a chunk counts as pinned unless
// pinning is refused or would pass a simulated memlock limit), the system's
// memory (a capacity past which map_chunk reports out of memory), and events
// (they complete only when the test says so, or at once with auto_complete).
#pragma once

#include <cstddef>
#include <string>
#include <unordered_map>

#include "host/host_backend.h"
#include "host/host_system.h"

namespace torchmem::host {

struct SimHostConfig {
  HugePages huge_pages = HugePages::kTransparent;
  std::string sysfs_root = "/sys";  // where the THP mode is read
  bool refuse_pinning = false;      // every registration fails (no permission)
  std::size_t memlock_bytes = 0;    // registrations past this many pinned bytes fail; 0 = unlimited
  std::size_t capacity_bytes = 0;   // map_chunk fails past this many held bytes; 0 = unlimited
  bool auto_complete = true;        // events complete as soon as they are recorded
};

class SimHostBackend final : public HostBackend {
 public:
  explicit SimHostBackend(const SimHostConfig& config);
  ~SimHostBackend() override = default;

  std::string name() const override { return "sim"; }
  std::size_t page_bytes() const override;
  HostChunk map_chunk(std::size_t bytes) override;
  void unmap_chunk(const HostChunk& chunk) override;
  std::string describe_limits() const override;

  EventHandle record_event(StreamId stream) override;
  bool event_completed(EventHandle event) override;
  void synchronize_event(EventHandle event) override;
  void destroy_event(EventHandle event) override;

  // Completes every event recorded on `stream` so far (all streams if 0).
  void complete_events(StreamId stream = 0);
  std::size_t open_events() const { return events_.size(); }
  std::size_t mapped_bytes() const { return mapped_; }
  std::size_t pinned_bytes() const { return pinned_; }
  const std::string& thp() const { return thp_; }

 private:
  struct SimEvent {
    StreamId stream;
    bool completed;
  };
  SimHostConfig config_;
  std::string thp_;
  std::size_t mapped_ = 0;
  std::size_t pinned_ = 0;
  EventHandle next_event_ = 1;
  std::unordered_map<EventHandle, SimEvent> events_;
};

}  // namespace torchmem::host
