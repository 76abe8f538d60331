// random_ops.cpp: the randomized checker (see random_ops.h).
//
// The reference model is a map of live blocks: every address the pool returns
// must be 512-aligned, must not overlap a live block, must report its rounded
// size through block_size(), and the pool's byte and count stats must equal
// the model's sums. Caller errors (zero size, unknown and double frees, bad
// private pool ids) must throw PoolError and leave the stats unchanged.
#include "replay/random_ops.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <sstream>
#include <vector>

#include "backend/sim_backend.h"
#include "core/pool.h"

namespace torchmem::replay {

namespace {

struct LiveBlock {
  std::size_t requested;
  std::size_t rounded;
  PoolId pool;
  StreamId stream;
};

class Runner {
 public:
  Runner(std::uint64_t seed, const RandomOpsOptions& o)
      : seed_(seed), o_(o), rng_(seed), sim_(sim_config(o)), pool_(sim_, pool_config(o)) {}

  std::string run(std::size_t ops, RandomOpsSummary* out) {
    try {
      for (step_ = 0; step_ < ops; ++step_) {
        one_op();
        if (!problem_.empty()) return problem_;
        if (o_.check_every && step_ % o_.check_every == 0) {
          check();
          if (!problem_.empty()) return problem_;
        }
      }
      // Drain: everything freed, every private pool released (an in-use one
      // keeps its memory: Note [Private pools]), everything released.
      what_ = "drain";
      set_scope(false);
      while (!order_.empty()) free_at(0);
      for (PoolId id : active_pools_) pool_.release_private_pool(id);
      active_pools_.clear();
      pool_.release_cached();
      check();
      if (!problem_.empty()) return problem_;
      const PoolStats s = pool_.stats();
      if (s.reserved_bytes[kStatAll].current != 0) {
        fail("after freeing everything and release_cached, " +
             std::to_string(s.reserved_bytes[kStatAll].current) + " bytes are still reserved");
        return problem_;
      }
      summary_.reclaims = s.num_reclaims;
    } catch (const std::exception& e) {
      fail(std::string("unexpected exception: ") + e.what());
      return problem_;
    }
    summary_.ops = ops;
    *out = summary_;
    return "";
  }

 private:
  static SimConfig sim_config(const RandomOpsOptions& o) {
    SimConfig c;
    c.capacity_bytes = o.capacity;
    c.vmm = o.vmm;
    c.event_delay = o.event_delay;
    return c;
  }
  static PoolConfig pool_config(const RandomOpsOptions& o) {
    PoolConfig c;
    c.limit_bytes = o.limit;
    c.reclaim_slack = o.reclaim_slack;
    c.stitch_above = o.stitch_above;
    c.stitch_above_limit = o.stitch_above;
    c.run_below = o.run_below;
    c.run_below_limit = o.run_below_limit;
    c.alias_reclaim = o.alias_reclaim;
    c.trace_capacity = 64;
    return c;
  }

  void fail(const std::string& why) {
    if (!problem_.empty()) return;
    std::ostringstream s;
    s << "seed " << seed_ << ", op " << step_ << " (" << what_ << "): " << why;
    problem_ = s.str();
  }

  std::uint64_t below(std::uint64_t n) { return n ? rng_() % n : 0; }

  std::size_t draw_size() {
    const std::uint64_t r = below(100);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    double lo, hi;
    if (r < 60) {
      lo = 0, hi = std::log2(double(kMiB));          // small heap
    } else if (r < 97) {
      lo = 20, hi = std::log2(64.0 * double(kMiB));   // large blocks
    } else {
      lo = 26, hi = std::log2(double(o_.capacity) / 3);  // rare huge ones
    }
    return std::max<std::size_t>(1, static_cast<std::size_t>(std::exp2(lo + (hi - lo) * u(rng_))));
  }

  StreamId draw_stream() { return StreamId{0x1000} * below(std::max(1u, o_.streams)); }

  // A capture or MemPool scope, as the sim sees it: barriers and waits refused.
  void set_scope(bool open) {
    in_scope_ = open;
    sim_.allow_device_sync(!open);
    sim_.allow_stream_order(!open);
  }

  void one_op() {
    if (o_.scopes && below(o_.scopes) == 0) {
      what_ = "scope";
      set_scope(!in_scope_);
    }
    const std::uint64_t r = below(1000);
    if (order_.size() >= o_.max_live || (r >= 480 && r < 900)) {
      if (!order_.empty()) {
        what_ = "free";
        free_at(below(order_.size()));
      }
    } else if (r < 480) {
      what_ = "allocate";
      allocate();
    } else if (r < 940) {
      if (order_.empty()) return;
      what_ = "record_stream";
      pool_.record_stream(order_[below(order_.size())], draw_stream());
    } else if (r < 950) {
      what_ = "release_cached";
      pool_.release_cached();
    } else if (r < 958) {
      what_ = "set_limit";
      const std::uint64_t choice = below(3);
      pool_.set_limit(choice == 0 ? 0 : o_.limit ? o_.limit : o_.capacity / (choice + 1));
    } else if (r < 972) {
      if (!o_.private_pools || active_pools_.size() >= 3) return;
      what_ = "create_private_pool";
      pool_.create_private_pool(++next_pool_);
      active_pools_.push_back(next_pool_);
    } else if (r < 980) {
      if (active_pools_.empty()) return;
      what_ = "release_private_pool";
      const std::size_t i = below(active_pools_.size());
      pool_.release_private_pool(active_pools_[i]);
      active_pools_.erase(active_pools_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      what_ = "caller error";
      caller_error();
    }
  }

  void allocate() {
    const std::size_t size = draw_size();
    PoolId pid = 0;
    if (!active_pools_.empty() && below(10) == 0) pid = active_pools_[below(active_pools_.size())];
    const StreamId stream = draw_stream();
    const Addr a = pool_.allocate(size, stream, pid, step_);
    if (!a) {
      ++summary_.ooms;
      return;
    }
    ++summary_.allocs;
    if (in_scope_) ++summary_.scope_allocs;
    const std::size_t rounded = (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
    if (a % kMinBlockSize) return fail("address is not 512-aligned");
    auto next = live_.lower_bound(a);
    if (next != live_.end() && next->first < a + rounded) return fail("new block overlaps a live block");
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.rounded > a) return fail("new block overlaps a live block");
    }
    if (pool_.block_size(a) != rounded) return fail("block_size() does not return the rounded size");
    if (o_.declared_readers) {
      if (sim_.unordered_reader(stream, a, rounded)) {
        return fail("memory handed to a stream while a declared reader on another still reads it, with no wait");
      }
      sim_.reused_by_owner(stream, a, rounded);
    }
    live_.emplace(a, LiveBlock{size, rounded, pid, stream});
    order_.push_back(a);
    live_bytes_ += rounded;
    summary_.peak_live = std::max<std::uint64_t>(summary_.peak_live, live_bytes_);
    summary_.peak_held = std::max<std::uint64_t>(summary_.peak_held, sim_.device_used());
  }

  void free_at(std::size_t i) {
    const Addr a = order_[i];
    order_[i] = order_.back();
    order_.pop_back();
    auto it = live_.find(a);
    live_bytes_ -= it->second.rounded;
    if (o_.foreign_readers && below(o_.foreign_readers) == 0) {
      sim_.launch(draw_stream() + 1, a, it->second.requested, 1 + below(200));
    }
    StreamId current = kNoStream;
    if (o_.declared_readers && below(o_.declared_readers) == 0) {
      const StreamId reader = draw_stream();
      if (reader != it->second.stream) {
        sim_.launch_read_of(it->second.stream, reader, a, it->second.requested, 1 + below(200));
        current = reader;
      }
    }
    live_.erase(it);
    pool_.deallocate(a, 0, current);
    ++summary_.frees;
  }

  void caller_error() {
    const PoolStats before = pool_.stats();
    const std::uint64_t kind = below(4);
    bool threw = false;
    try {
      if (kind == 0) {
        pool_.allocate(0, 0);
      } else if (kind == 1) {
        pool_.deallocate(Addr{0xdead} * kMinBlockSize);  // never handed out
      } else if (kind == 2) {
        pool_.allocate(kMiB, 0, next_pool_ + 1000);      // no such private pool
      } else {
        // A double free: free a live block, then free it again.
        if (order_.empty()) {
          threw = true;
        } else {
          const Addr a = order_.back();
          free_at(order_.size() - 1);
          const PoolStats mid = pool_.stats();
          try {
            pool_.deallocate(a);
          } catch (const PoolError&) {
            threw = true;
          }
          if (!same_counts(mid, pool_.stats())) fail("a double free changed the stats");
          return;
        }
      }
    } catch (const PoolError&) {
      threw = true;
    }
    if (!threw) return fail("a caller error did not throw PoolError");
    if (!same_counts(before, pool_.stats())) fail("a caller error changed the stats");
  }

  static bool same_counts(const PoolStats& a, const PoolStats& b) {
    return a.allocated_bytes[kStatAll].current == b.allocated_bytes[kStatAll].current &&
           a.reserved_bytes[kStatAll].current == b.reserved_bytes[kStatAll].current &&
           a.allocation[kStatAll].current == b.allocation[kStatAll].current &&
           a.num_allocs == b.num_allocs && a.num_frees == b.num_frees;
  }

  void check() {
    ++summary_.checks;
    const std::string problem = pool_.check_invariants();
    if (!problem.empty()) return fail(problem);
    const PoolStats s = pool_.stats();
    std::size_t requested = 0;
    for (const auto& kv : live_) requested += kv.second.requested;
    if (s.allocated_bytes[kStatAll].current != static_cast<std::int64_t>(live_bytes_)) {
      return fail("allocated_bytes " + std::to_string(s.allocated_bytes[kStatAll].current) +
                  " != model " + std::to_string(live_bytes_));
    }
    if (s.requested_bytes[kStatAll].current != static_cast<std::int64_t>(requested)) {
      return fail("requested_bytes differs from the model");
    }
    if (s.allocation[kStatAll].current != static_cast<std::int64_t>(live_.size())) {
      return fail("allocation count differs from the model");
    }
    if (static_cast<std::size_t>(s.reserved_bytes[kStatAll].current) != sim_.device_used()) {
      return fail("reserved_bytes " + std::to_string(s.reserved_bytes[kStatAll].current) +
                  " != backend device_used " + std::to_string(sim_.device_used()));
    }
    const std::size_t limit = pool_.limit() ? pool_.limit() : o_.capacity;
    (void)limit;
  }

  std::uint64_t seed_;
  RandomOpsOptions o_;
  std::mt19937_64 rng_;
  SimBackend sim_;
  Pool pool_;
  std::map<Addr, LiveBlock> live_;
  std::vector<Addr> order_;
  std::size_t live_bytes_ = 0;
  std::vector<PoolId> active_pools_;
  PoolId next_pool_ = 0;
  std::size_t step_ = 0;
  bool in_scope_ = false;
  const char* what_ = "";
  std::string problem_;
  RandomOpsSummary summary_;
};

}  // namespace

std::string run_random_ops(std::uint64_t seed, std::size_t ops, const RandomOpsOptions& options,
                           RandomOpsSummary* summary) {
  Runner runner(seed, options);
  return runner.run(ops, summary);
}

}  // namespace torchmem::replay
