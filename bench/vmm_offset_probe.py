"""bench/vmm_offset_probe.py: can one physical handle be mapped in pieces on this GPU?

Why: torchmem backs each 2 MiB granule with a handle of its own under a limit, so that any
free granule can be moved to back any address (stitching); growth then costs a cuMemCreate
and a cuMemMap per 2 MiB where expandable_segments pays two calls per 20 MiB page
(BENCHMARKS.md, Replay at the budget: shapes that vary). cuda.h documents cuMemMap's
`offset` both ways: the body says it may be any multiple of the minimum granularity, the
parameter's note says "currently must be zero". If the driver takes a non-zero offset, a
20 MiB handle could be mapped whole (two calls) and still lend single granules elsewhere.
This asks the driver, through libcuda with ctypes (no build), and checks that the pieces
alias the same bytes: a value written through the whole mapping reads back through a piece.

    python bench/vmm_offset_probe.py          # one JSON line: every call's CUresult
"""

import ctypes
import json
import sys

from vmm_ctypes import GRANULARITY_MINIMUM, device_prop, read_write  # beside this file


def probe(cu, device=0):
    """Every step's CUresult (0: success) and what the pieces read, as a dict."""
    out = {}
    version = ctypes.c_int()
    cu.cuDriverGetVersion(ctypes.byref(version))
    out["driver_version"] = version.value
    prop = device_prop(device)
    granule = ctypes.c_size_t()
    out["granularity_rc"] = cu.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(prop),
                                                             GRANULARITY_MINIMUM)
    g = granule.value
    out["granularity"] = g
    run = 10 * g  # a 20 MiB run on a 2 MiB granularity
    handle, base = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    out["create_rc"] = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(run), ctypes.byref(prop), 0)
    out["reserve_rc"] = cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(4 * run), ctypes.c_size_t(g),
                                               ctypes.c_ulonglong(0), 0)
    if out["create_rc"] or out["reserve_rc"]:
        return out
    access = read_write(device)

    def map_at(addr, size, offset):
        rc = cu.cuMemMap(ctypes.c_ulonglong(addr), ctypes.c_size_t(size), ctypes.c_size_t(offset), handle, 0)
        if rc == 0:
            rc = cu.cuMemSetAccess(ctypes.c_ulonglong(addr), ctypes.c_size_t(size), ctypes.byref(access), 1)
        return rc

    def read_word(addr):
        word = ctypes.c_uint32()
        rc = cu.cuMemcpyDtoH_v2(ctypes.byref(word), ctypes.c_ulonglong(addr), ctypes.c_size_t(4))
        return word.value if rc == 0 else f"rc {rc}"

    whole = base.value
    out["map_whole_rc"] = map_at(whole, run, 0)
    if out["map_whole_rc"]:
        return out
    for i in range(run // g):  # granule i holds the value 1000 + i
        cu.cuMemsetD32_v2(ctypes.c_ulonglong(whole + i * g), ctypes.c_uint(1000 + i), ctypes.c_size_t(g // 4))
    cu.cuCtxSynchronize()
    # A piece of the handle (granules 3-4) at a second address while the whole mapping stands.
    piece = whole + 2 * run
    out["map_piece_rc"] = map_at(piece, 2 * g, 3 * g)
    if out["map_piece_rc"] == 0:
        out["piece_reads"] = [read_word(piece), read_word(piece + g)]  # 1003, 1004 if the pieces alias
    out["unmap_subrange_rc"] = cu.cuMemUnmap(ctypes.c_ulonglong(whole), ctypes.c_size_t(g))  # documented: refused
    # Split: unmap the whole mapping, map granules 0-2 and 5-9 back in place, two pieces.
    out["unmap_whole_rc"] = cu.cuMemUnmap(ctypes.c_ulonglong(whole), ctypes.c_size_t(run))
    if out["unmap_whole_rc"] == 0:
        out["remap_head_rc"] = map_at(whole, 3 * g, 0)
        out["remap_tail_rc"] = map_at(whole + 5 * g, 5 * g, 5 * g)
        if out["remap_head_rc"] == 0 and out["remap_tail_rc"] == 0:
            out["split_reads"] = [read_word(whole), read_word(whole + 2 * g), read_word(whole + 5 * g),
                                  read_word(whole + 9 * g)]  # 1000, 1002, 1005, 1009
    for addr, size in ((whole, 3 * g), (whole + 5 * g, 5 * g), (piece, 2 * g)):
        cu.cuMemUnmap(ctypes.c_ulonglong(addr), ctypes.c_size_t(size))
    out["release_rc"] = cu.cuMemRelease(handle)
    out["free_rc"] = cu.cuMemAddressFree(base, ctypes.c_size_t(4 * run))
    out["pieces_work"] = (out.get("piece_reads") == [1003, 1004]
                          and out.get("split_reads") == [1000, 1002, 1005, 1009])
    return out


def main():
    import torch

    torch.empty(1, device="cuda")  # the primary context, current on this thread
    cu = ctypes.CDLL("libcuda.so.1")
    result = probe(cu, torch.cuda.current_device())
    result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
