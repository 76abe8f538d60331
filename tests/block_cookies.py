"""Cookies at the ends of a block on the sim backend (host_memory=True): how the pool
tests see a block that another block overlapped, or a granule remapped under it.

The whole block is written when it is small, else its first and last EDGE bytes: a
stitch or a remap moves whole granules, so an error shows at a block's ends, and
writing gigabytes would make a churn test slow for nothing."""

EDGE = 4096


def write_ends(sim, addr, size, seed):
    if size <= 2 * EDGE:
        sim.write_pattern(addr, size, seed)
    else:
        sim.write_pattern(addr, EDGE, seed)
        sim.write_pattern(addr + size - EDGE, EDGE, seed)


def ends_intact(sim, addr, size, seed):
    if size <= 2 * EDGE:
        return sim.check_pattern(addr, size, seed)
    return sim.check_pattern(addr, EDGE, seed) and sim.check_pattern(addr + size - EDGE, EDGE, seed)
