"""Free and total memory of a CUDA device, from the driver (``cuMemGetInfo``).

JAX's device memory statistics come from its allocator, and XLA's VMM allocator keeps none
(``memory_stats()`` is None; ``serving/engine/xla_allocator.py``), so the KV cache could not be
sized from memory under it. The driver knows what every allocator has taken: it is asked
through the device's primary context, the one XLA itself runs in, so asking creates nothing.
"""

from __future__ import annotations

import ctypes


def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver on this machine
        return None


def cuda_free_and_total(ordinal: int) -> tuple[int, int] | None:
    """``(free, total)`` bytes of CUDA device ``ordinal`` (in this process's numbering, as
    ``jax.Device.local_hardware_id``), or None without a driver or on any driver error."""
    cuda = _driver()
    if cuda is None:
        return None
    device, context = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal):
        return None
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device):
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(context):
            return None
        try:
            if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
                return None
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(device)
    return free.value, total.value
