"""bench/vmm_offset_probe.py against a made-up driver (CPU): what the probe concludes from the
driver's answers. One driver refuses any map that is not of a whole handle from offset 0 (what
an H100 with driver API 13000 answered: BENCHMARKS.md, One handle in pieces); the other maps
pieces, and the probe must then see the pieces read the bytes written through the whole."""

from bench_support import load_bench

probe = load_bench("vmm_offset_probe")

GRANULE = 2 << 20
NOT_SUPPORTED, INVALID_VALUE = 801, 1


class MadeUpDriver:
    """libcuda's VMM calls over dicts: a handle is a list of per-granule words, a mapping an
    address -> (handle, offset, size); `pieces` says whether a map may take part of a handle."""

    def __init__(self, pieces):
        self.pieces, self.handles, self.maps = pieces, {}, {}

    def cuDriverGetVersion(self, ref):
        ref._obj.value = 13000
        return 0

    def cuMemGetAllocationGranularity(self, ref, prop, flag):
        ref._obj.value = GRANULE
        return 0

    def cuMemCreate(self, ref, size, prop, flags):
        ref._obj.value = len(self.handles) + 1
        self.handles[ref._obj.value] = [0] * (size.value // GRANULE)
        return 0

    def cuMemAddressReserve(self, ref, size, alignment, addr, flags):
        ref._obj.value = 1 << 40
        return 0

    def cuMemMap(self, at, size, offset, handle, flags):
        whole = len(self.handles[handle.value]) * GRANULE
        if not self.pieces and (offset.value or size.value != whole):
            return NOT_SUPPORTED
        self.maps[at.value] = (handle.value, offset.value, size.value)
        return 0

    def cuMemUnmap(self, at, size):
        mapping = self.maps.get(at.value)
        if mapping is None or mapping[2] != size.value:  # a mapping unmaps only whole
            return INVALID_VALUE
        del self.maps[at.value]
        return 0

    def word(self, addr):
        """(handle's words, granule index) behind `addr`."""
        for at, (handle, offset, size) in self.maps.items():
            if at <= addr < at + size:
                return self.handles[handle], (offset + addr - at) // GRANULE
        raise AssertionError(f"no mapping at {addr:#x}")

    def cuMemsetD32_v2(self, addr, value, count):
        words, i = self.word(addr.value)
        words[i] = value.value
        return 0

    def cuMemcpyDtoH_v2(self, ref, addr, size):
        words, i = self.word(addr.value)
        ref._obj.value = words[i]
        return 0

    def cuMemSetAccess(self, *args):
        return 0

    def cuCtxSynchronize(self):
        return 0

    def cuMemRelease(self, handle):
        return 0

    def cuMemAddressFree(self, base, size):
        return 0


def test_a_driver_that_maps_only_whole_handles_gives_no_pieces():
    out = probe.probe(MadeUpDriver(pieces=False))
    assert out["map_whole_rc"] == 0 and out["unmap_whole_rc"] == 0
    assert out["map_piece_rc"] == out["remap_head_rc"] == out["remap_tail_rc"] == NOT_SUPPORTED
    assert out["unmap_subrange_rc"] == INVALID_VALUE
    assert out["pieces_work"] is False


def test_a_driver_that_maps_pieces_is_seen_to_alias_the_same_bytes():
    out = probe.probe(MadeUpDriver(pieces=True))
    assert out["piece_reads"] == [1003, 1004] and out["split_reads"] == [1000, 1002, 1005, 1009]
    assert out["pieces_work"] is True
