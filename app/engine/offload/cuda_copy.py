"""Host-to-device copies into slot memory through the CUDA driver API (ctypes), for the pager.

MLX's CUDA arrays live in managed memory: a host write through the array's buffer (the
pager's zero-copy read) migrates the pages the GPU holds back to the host, page by page, and
the GPU's next read faults them back (the H200 measured ~1 GB/s that way against 21 GB/s of
bare preadv). Instead a record is read into pinned host staging and copied with an
asynchronous cuMemcpyHtoD on the copier's own stream (DMA) straight into the slot's pages on
the device, issued by the thread that read the record as soon as its read ends, so copies
overlap the call's other reads; the call waits for the stream once, before the slots are
used. MLX has no API for this, so the driver library is called directly; `DeviceCopier.open`
returns None wherever that is not possible (no CUDA, no driver, a failed self-test), and the
pager keeps its other paths.

Pinned record files (`map_file`): where the host has the memory, a layer's record file is
mapped read-only and page-locked once (cuMemHostRegister with the read-only flag), and a miss
is copied by the driver straight out of the page cache into its slot: no host copy and no
reader threads (on the H200 two 1.47 MB records a call took 162 µs this way against 552 µs
through preadv into staging).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading

import numpy as np

_DRIVER_NAMES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")
CU_MEMHOSTREGISTER_READ_ONLY = 0x08  # the driver may map the pages read-only (a file mapping)
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02  # kernels may read the pages (cuMemHostGetDevicePointer)


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
        lib.cuMemHostGetDevicePointer_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.c_void_p,
            ctypes.c_uint,
        ]
        lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [
            ctypes.c_uint64,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
        lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
        self._check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self._check(
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        self._registered: list[int] = []
        self._maps: list[tuple[int, mmap.mmap]] = []  # pinned file mappings (address, map)
        self._device_mapped: set[int] = set()  # mappings kernels can read (device pointers)
        self._local = threading.local()  # which threads have the context current
        self.bind()
        self.stream = ctypes.c_void_p()
        # non-blocking: no implicit ordering with MLX's streams (the pager orders by sync())
        self._check(lib.cuStreamCreate(ctypes.byref(self.stream), 1), "cuStreamCreate")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed (CUresult {rc})")

    def bind(self) -> None:
        """Make MLX's device context current on this thread (the driver API needs one);
        once per thread."""
        if getattr(self._local, "bound", False):
            return
        self._check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self._local.bound = True

    def register(self, host: np.ndarray) -> None:
        """Pin `host` (page-locked): copies from it are DMA, and can be asynchronous."""
        self.bind()
        ptr = host.ctypes.data
        self._check(self.lib.cuMemHostRegister_v2(ptr, host.nbytes, 0), "cuMemHostRegister")
        self._registered.append(ptr)

    def unregister(self, host: np.ndarray) -> None:
        ptr = host.ctypes.data
        if ptr in self._registered:
            self._registered.remove(ptr)
            self.lib.cuMemHostUnregister(ptr)

    def map_file(self, path, size: int) -> tuple[int, mmap.mmap] | None:
        """Map `size` bytes of the file at `path` read-only and page-lock them (the pages are
        read in now, and stay resident until close()): (address, map), or None where the
        driver refuses (the caller keeps its staging path)."""
        self.bind()
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        ro, dm = CU_MEMHOSTREGISTER_READ_ONLY, CU_MEMHOSTREGISTER_DEVICEMAP
        if self.lib.cuMemHostRegister_v2(addr, size, ro | dm) == 0:
            self._device_mapped.add(addr)
        elif self.lib.cuMemHostRegister_v2(addr, size, ro) != 0:
            mm.close()
            return None
        self._maps.append((addr, mm))
        return addr, mm

    def device_pointer(self, addr: int) -> int | None:
        """The device address of a pinned mapping's start (kernels read the file's pages over
        the bus), or None where the driver did not map it for the device."""
        if addr not in self._device_mapped:
            return None
        self.bind()
        out = ctypes.c_uint64()
        if self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), addr, 0) != 0:
            return None
        return int(out.value)

    def unmap_all(self) -> None:
        for addr, mm in self._maps:
            self.lib.cuMemHostUnregister(addr)
            mm.close()
        self._maps.clear()
        self._device_mapped.clear()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Synchronous copy (the self-test)."""
        self._check(self.lib.cuMemcpyHtoD_v2(dst, src, nbytes), "cuMemcpyHtoD")

    def copy_async(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy on the copier's stream (from any thread); `src` must stay unchanged
        until sync() returns."""
        self.bind()
        self._check(
            self.lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, self.stream), "cuMemcpyHtoDAsync"
        )

    def sync(self) -> None:
        """Wait until every queued copy has landed."""
        self.bind()
        self._check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def close(self) -> None:
        self.unmap_all()
        for ptr in self._registered:
            self.lib.cuMemHostUnregister(ptr)
        self._registered.clear()
        if self.stream:
            self.lib.cuStreamDestroy_v2(self.stream)
            self.stream = ctypes.c_void_p()

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
            c.copy_async(buffer_address(a) + (1 << 16), host.ctypes.data, host.nbytes)
            c.sync()
            ok = (
                a[1].astype(mx.uint32).sum().item() == 5 << 16
                and a[0].astype(mx.uint32).sum().item() == 0
            )
            c.unregister(host)
            return c if ok else None
        except (RuntimeError, AttributeError, OSError, ValueError, TypeError):
            return None
