"""Does a VMM driver call wait for the device? Times cuMemCreate, cuMemMap +
cuMemSetAccess, cuMemUnmap and cuMemRelease on the host, once with the device
idle and once while a kernel of known length runs (torch.cuda._sleep on a side
stream, on memory that the call does not touch), and prints how long each call
took and how much of the kernel was left when it returned.

Why: the replay's time model prices a call at what it costs in isolation, and
at a tight budget it misses about half of the time the GPU adds (BENCHMARKS.md,
The replay's time model against the GPU). If a call waits for queued work, a
call in the middle of a step costs the rest of the queue, like a barrier.

    python bench/vmm_busy_probe.py [--device 0] [--repeats 10] [--busy-ms 20] [--out busy.json]

Driver API through ctypes on torch's primary context; torchmem is not installed.
"""

import argparse
import ctypes
import json
import statistics
import sys
import time

from common import environment  # bench/common.py, beside this file
from vmm_ctypes import device_prop, read_write  # beside this file too

GRANULE = 2 << 20
CALLS = ("create", "map_access", "unmap", "release")  # one granule's life, in order


class Driver:
    """The five VMM calls, each raising on an error code."""

    def __init__(self, device):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.prop = device_prop(device)
        self.access = read_write(device)

    def _check(self, name, rc):
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def reserve(self, size):
        ptr = ctypes.c_uint64()
        self._check("cuMemAddressReserve",
                    self.lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size),
                                                 ctypes.c_size_t(GRANULE), ctypes.c_uint64(0),
                                                 ctypes.c_uint64(0)))
        return ptr.value

    def create(self):
        handle = ctypes.c_uint64()
        self._check("cuMemCreate", self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(GRANULE),
                                                        ctypes.byref(self.prop), ctypes.c_uint64(0)))
        return handle.value

    def map(self, addr, handle):
        self._check("cuMemMap", self.lib.cuMemMap(ctypes.c_uint64(addr), ctypes.c_size_t(GRANULE),
                                                  ctypes.c_size_t(0), ctypes.c_uint64(handle),
                                                  ctypes.c_uint64(0)))
        self._check("cuMemSetAccess", self.lib.cuMemSetAccess(ctypes.c_uint64(addr), ctypes.c_size_t(GRANULE),
                                                              ctypes.byref(self.access), ctypes.c_size_t(1)))

    def unmap(self, addr):
        self._check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_uint64(addr), ctypes.c_size_t(GRANULE)))

    def release(self, handle):
        self._check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_uint64(handle)))

    def cycle(self, addr):
        """One granule's whole life at addr: create, map with access, unmap, release."""
        handle = self.create()
        self.map(addr, handle)
        self.unmap(addr)
        self.release(handle)


def timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return (time.perf_counter() - t0) * 1e6, result


def probe(torch, driver, repeats, busy_ms):
    """Per call and state (idle, busy), the host microseconds of each repetition and, when busy,
    whether the kernel launched just before the call had finished when it returned."""
    side = torch.cuda.Stream()
    # calibrate _sleep: cycles per ms on this GPU
    rates = []
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)  # the first launch loads the kernel: not timed
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); torch.cuda._sleep(10_000_000); end.record()
            end.synchronize()
            rates.append(10_000_000 / start.elapsed_time(end))
    cycles_per_ms = sorted(rates)[2]
    base = driver.reserve(GRANULE * 4 * repeats)
    figures = {"cycles_per_ms": cycles_per_ms, "busy_ms": busy_ms, "calls": {}}

    def run(state, slot):
        """One create, map, unmap, release; when busy, each call right after its own kernel launch."""
        out = {}
        addr = base + GRANULE * slot

        def call(name, fn, *args):
            kernel_end = torch.cuda.Event()
            if state == "busy":
                with torch.cuda.stream(side):
                    torch.cuda._sleep(int(cycles_per_ms * busy_ms))
                    kernel_end.record()
            # Both states sleep alike before the call (busy: so that the launch reaches the device), so
            # that the kernel is the only difference: with the sleep in the busy state alone, busy calls
            # took 3-6x the idle ones, while calls made back to back during copies cost the idle price.
            time.sleep(0.001)
            out[name], result = timed(fn, *args)
            if state == "busy":
                out[name + "_waited"] = kernel_end.query()  # done already: the call waited for it
                kernel_end.synchronize()
            return result

        handle = call("create", driver.create)
        call("map_access", driver.map, addr, handle)
        call("unmap", driver.unmap, addr)
        call("release", driver.release, handle)
        return out

    for round_, state in enumerate(("idle", "busy", "idle", "busy")):
        for i in range(repeats):
            torch.cuda.synchronize()
            figures["calls"].setdefault(state, []).append(run(state, round_ * repeats + i))
    return figures


def slowdown(torch, driver, rounds, cycles):
    """Do VMM calls slow the kernels running meanwhile (a TLB flush, a device-wide fence)? GPU time of
    a queue of memory-bound copies (events), with and without `cycles` create + map + unmap + release
    cycles made by the host while the queue runs, alternating, `rounds` each."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    base = driver.reserve(GRANULE * 4)
    out = {"quiet_ms": [], "with_calls_ms": [], "host_calls_ms": [], "queue_done_after_calls": [], "cycles": cycles}
    for _ in range(rounds):
        for state in ("quiet", "with_calls"):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                dst.copy_(src)
            end.record()
            if state == "with_calls":
                t0 = time.perf_counter()
                for i in range(cycles):
                    driver.cycle(base + GRANULE * (i % 4))
                out["host_calls_ms"].append((time.perf_counter() - t0) * 1e3)
                out["queue_done_after_calls"].append(end.query())
            end.synchronize()
            out[f"{state}_ms"].append(start.elapsed_time(end))
    return out


def summarize(figures):
    lines = []
    for state, rows in figures["calls"].items():
        for name in CALLS:
            values = [r[name] for r in rows]
            lines.append(f"{state:5s} {name:11s} median {statistics.median(values):9.1f} us  "
                         f"max {max(values):9.1f} us")
        if state == "busy":
            waited = {name: sum(1 for r in rows if r[name + "_waited"]) for name in CALLS}
            lines.append(f"busy: calls that returned after their {figures['busy_ms']} ms kernel had finished "
                         f"(of {len(rows)}): {waited}")
    slow = figures.get("slowdown")
    if slow:
        lines.append(f"copies queue, GPU ms: quiet median {statistics.median(slow['quiet_ms']):.2f}, with "
                     f"{slow['cycles']} create+map+unmap+release cycles on the host meanwhile "
                     f"{statistics.median(slow['with_calls_ms']):.2f} (host spent "
                     f"{statistics.median(slow['host_calls_ms']):.2f} ms on them; queue done when they "
                     f"returned, per round: {slow['queue_done_after_calls']})")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--busy-ms", type=float, default=20.0)
    parser.add_argument("--cycles", type=int, default=50,
                        help="driver call cycles made while the copies queue runs")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("vmm_busy_probe: no CUDA GPU here", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context, current on this thread
    driver = Driver(args.device)
    figures = {**environment(torch, args.device), **probe(torch, driver, args.repeats, args.busy_ms)}
    figures["slowdown"] = slowdown(torch, driver, rounds=5, cycles=args.cycles)
    for line in summarize(figures):
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
