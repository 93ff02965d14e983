"""Host-to-device copies into slot memory through the CUDA driver API (ctypes), for the pager.

MLX's CUDA arrays live in managed memory: a host write through the array's buffer (the
pager's zero-copy read) migrates the pages the GPU holds back to the host, page by page, and
the GPU's next read faults them back (the H200 measured ~1 GB/s that way against 21 GB/s of
bare preadv). Instead a record is read into pinned host staging and copied with
cuMemcpyHtoD (DMA, synchronous for pinned memory) straight into the slot's pages on the
device. MLX has no API for this, so the driver library is called directly; `DeviceCopier.open`
returns None wherever that is not possible (no CUDA, no driver, a failed self-test), and the
pager keeps its other paths.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

_DRIVER_NAMES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


def _load_driver():
    for name in (*_DRIVER_NAMES, ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def buffer_address(a) -> int:
    """Address of an MLX (or numpy) array's memory, through the buffer protocol."""
    mv = memoryview(a).cast("B")
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


class DeviceCopier:
    """cuMemcpyHtoD from registered (pinned) host buffers into device-visible addresses."""

    def __init__(self, lib):
        self.lib = lib
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self._check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self._check(
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        self._registered: list[int] = []

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed (CUresult {rc})")

    def bind(self) -> None:
        """Make MLX's device context current on this thread (the driver API needs one)."""
        self._check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def register(self, host: np.ndarray) -> None:
        """Pin `host` (page-locked) so copies from it are DMA and synchronous."""
        self.bind()
        ptr = host.ctypes.data
        self._check(self.lib.cuMemHostRegister_v2(ptr, host.nbytes, 0), "cuMemHostRegister")
        self._registered.append(ptr)

    def unregister(self, host: np.ndarray) -> None:
        ptr = host.ctypes.data
        if ptr in self._registered:
            self._registered.remove(ptr)
            self.lib.cuMemHostUnregister(ptr)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._check(self.lib.cuMemcpyHtoD_v2(dst, src, nbytes), "cuMemcpyHtoD")

    def close(self) -> None:
        for ptr in self._registered:
            self.lib.cuMemHostUnregister(ptr)
        self._registered.clear()

    @classmethod
    def open(cls) -> DeviceCopier | None:
        """A copier that passed a self-test on an MLX array used by the GPU, or None."""
        import mlx.core as mx

        if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
            return None
        lib = _load_driver()
        if lib is None:
            return None
        try:
            c = cls(lib)
            a = mx.zeros((2, 1 << 16), dtype=mx.uint8)
            mx.eval(a)
            mx.eval(a.sum())  # the GPU has used it: its pages are on the device
            host = np.full(1 << 16, 5, dtype=np.uint8)
            c.register(host)
            c.copy(buffer_address(a) + (1 << 16), host.ctypes.data, host.nbytes)
            ok = (
                a[1].astype(mx.uint32).sum().item() == 5 << 16
                and a[0].astype(mx.uint32).sum().item() == 0
            )
            c.unregister(host)
            return c if ok else None
        except (RuntimeError, AttributeError, OSError, ValueError, TypeError):
            return None
