"""The CUDA driver's VMM structures for ctypes, shared by the probes that call libcuda
directly (bench/vmm_busy_probe.py, bench/vmm_offset_probe.py): they ask the driver
itself, with torchmem neither built nor installed.

Layouts as cuda.h declares them (CUmemLocation, CUmemAllocationProp, CUmemAccessDesc).
"""

import ctypes

PINNED = 1          # CU_MEM_ALLOCATION_TYPE_PINNED
DEVICE = 1          # CU_MEM_LOCATION_TYPE_DEVICE
READ_WRITE = 3      # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
GRANULARITY_MINIMUM = 0


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", MemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


def device_prop(device):
    """Pinned device memory on `device`, no shareable handle type."""
    return AllocationProp(type=PINNED, requestedHandleTypes=0, location=MemLocation(DEVICE, device))


def read_write(device):
    """Read-write access for `device`."""
    return AccessDesc(location=MemLocation(DEVICE, device), flags=READ_WRITE)
