"""The one place that detects the compute backend (Metal, CUDA, CPU) and what it offers."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field

import mlx.core as mx

from . import kvcache


@dataclass(frozen=True)
class Backend:
    name: str  # "metal" | "cuda" | "cpu"
    device: str  # human-readable device description
    metal_kernels: bool  # mx.fast.metal_kernel works
    cuda_kernels: bool  # mx.fast.cuda_kernel works
    unified_memory: bool  # weights and KV share host RAM (Apple silicon, CPU)
    recommended_working_set: int | None  # bytes the GPU may wire (Metal), else None
    info: dict = field(default_factory=dict, compare=False)

    @property
    def kv_modes(self) -> tuple[str, ...]:
        """KV-cache modes this backend can run (the modes table's rows, research ones included)."""
        return kvcache.names(self.name)

    def unavailable_reason(self, kv_mode: str) -> str | None:
        return kvcache.unavailable_reason(kv_mode, self.name)


def _device_info() -> dict:
    try:
        return dict(mx.device_info())
    except Exception:  # older MLX or no GPU: not fatal, the fields are optional
        try:
            return dict(mx.metal.device_info())
        except Exception:
            return {}


@functools.cache
def detect() -> Backend:
    metal = bool(getattr(mx, "metal", None) and mx.metal.is_available())
    cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    info = _device_info() if (metal or cuda) else {}
    if metal:
        ws = info.get("max_recommended_working_set_size")
        return Backend(
            "metal",
            str(info.get("device_name", "Apple GPU")),
            True,
            False,
            True,
            int(ws) if ws else None,
            info,
        )
    if cuda:
        return Backend(
            "cuda", str(info.get("device_name", "NVIDIA GPU")), False, True, False, None, info
        )
    cpu = platform.processor() or platform.machine()
    return Backend("cpu", f"CPU ({cpu})", False, False, True, None, info)
