// sim_host_backend.cpp: real memory, simulated registration and events (see
// sim_host_backend.h).
#include "host/sim_host_backend.h"

#include <stdexcept>

namespace torchmem::host {

SimHostBackend::SimHostBackend(const SimHostConfig& config) : config_(config), thp_(thp_mode(config.sysfs_root)) {}

std::size_t SimHostBackend::page_bytes() const {
  return config_.huge_pages == HugePages::kOff ? kSmallPageBytes : kHugePageBytes;
}

HostChunk SimHostBackend::map_chunk(std::size_t bytes) {
  HostChunk chunk;
  if (config_.capacity_bytes != 0 && mapped_ + bytes > config_.capacity_bytes) return chunk;
  Mapping m = map_anonymous(bytes, config_.huge_pages, thp_);
  if (m.ptr == nullptr) return chunk;
  if (!m.refused.empty()) notice_once("huge_pages", "torchmem.host: " + m.refused);
  touch_pages(m.ptr, bytes, kSmallPageBytes, 1);
  chunk.ptr = m.ptr;
  chunk.bytes = bytes;
  chunk.huge_pages = m.huge_pages;
  const bool over_memlock = config_.memlock_bytes != 0 && pinned_ + bytes > config_.memlock_bytes;
  if (config_.refuse_pinning || over_memlock) {
    notice_once("pinning",
                "torchmem.host: pinning " + format_bytes(bytes) + " was refused (simulated: " +
                    (over_memlock ? "memlock limit " + format_bytes(config_.memlock_bytes) + ", " +
                                        format_bytes(pinned_) + " pinned"
                                  : std::string("registration refused")) +
                    "); using pageable memory: copies from it are synchronous and several times slower");
  } else {
    chunk.pinned = true;
    pinned_ += bytes;
  }
  mapped_ += bytes;
  return chunk;
}

void SimHostBackend::unmap_chunk(const HostChunk& chunk) {
  unmap_anonymous(chunk.ptr, chunk.bytes);
  mapped_ -= chunk.bytes;
  if (chunk.pinned) pinned_ -= chunk.bytes;
}

std::string SimHostBackend::describe_limits() const {
  return "simulated system: capacity " +
         (config_.capacity_bytes ? format_bytes(config_.capacity_bytes) : std::string("unlimited")) +
         ", memlock limit " + (config_.memlock_bytes ? format_bytes(config_.memlock_bytes) : std::string("unlimited"));
}

EventHandle SimHostBackend::record_event(StreamId stream) {
  EventHandle handle = next_event_++;
  events_[handle] = SimEvent{stream, config_.auto_complete};
  return handle;
}

bool SimHostBackend::event_completed(EventHandle event) {
  auto it = events_.find(event);
  if (it == events_.end()) throw std::logic_error("SimHostBackend: query of an unknown event");
  return it->second.completed;
}

void SimHostBackend::synchronize_event(EventHandle event) {
  auto it = events_.find(event);
  if (it == events_.end()) throw std::logic_error("SimHostBackend: wait on an unknown event");
  it->second.completed = true;  // the host waited: the stream's work is done
}

void SimHostBackend::destroy_event(EventHandle event) {
  if (events_.erase(event) == 0) throw std::logic_error("SimHostBackend: destroy of an unknown event");
}

void SimHostBackend::complete_events(StreamId stream) {
  for (auto& [handle, event] : events_) {
    if (stream == 0 || event.stream == stream) event.completed = true;
  }
}

}  // namespace torchmem::host
