"""KV-cache compression, one wing: the table of KV modes (`modes`) and one package per
algorithm with its kernels beside it: IsoQuant (`isoquant/`: rotated 3/4-bit codes) and
ZipFusion (`zipfusion/`: lossless BF16). Shared CUDA JIT helpers: `jit`.

Importing this package (or `modes`) does not import MLX: the window process reads the table.
"""

from .modes import (
    FLOAT,
    MODES,
    AttentionDims,
    KVMode,
    cache_capacity_nbytes,
    cache_nbytes,
    fallbacks,
    finish_prefill,
    float_baseline_nbytes,
    make_cache,
    mode,
    names,
    needs,
    register,
    unavailable_reason,
)


def __getattr__(name):
    # save/load a prompt cache (MLX arrays): imported on first use only
    if name in ("load_cache", "save_cache"):
        from . import persist

        return getattr(persist, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FLOAT",
    "MODES",
    "AttentionDims",
    "KVMode",
    "cache_capacity_nbytes",
    "cache_nbytes",
    "fallbacks",
    "float_baseline_nbytes",
    "finish_prefill",
    "load_cache",
    "make_cache",
    "mode",
    "names",
    "needs",
    "register",
    "save_cache",
    "unavailable_reason",
]
