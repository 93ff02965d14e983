"""IsoQuant's row factory in the KV modes table (kvcache/modes.py)."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..modes import DEFAULT_SINK, DEFAULT_WINDOW
from . import dispatch, kernel_path
from .cache import IsoQuantKVCache


def make_cache(
    model,
    rotation: str,
    key_bits: int,
    value_bits: int,
    *,
    window: int = DEFAULT_WINDOW,
    sink: int = DEFAULT_SINK,
    seed: int = 0,
    decoded_shadow: bool = False,
    max_tokens: int | None = None,
) -> list:
    """The model's prompt cache with every growing full-attention KVCache replaced by an
    IsoQuantKVCache (layer i seeded with (seed, i)); sliding-window and SSM caches are kept.
    window: recent tokens kept in float; sink: first tokens kept in float; decoded_shadow:
    also keep levels[codes] in float32 (CPU benchmarks only: same numbers, more memory).
    Installs the attention dispatch in the model's modules and the kernel path (kernels where
    the backend has them). max_tokens: unused, the cache grows as it goes."""
    dispatch.install(model)
    kernel_path.install()
    # type() is exact on purpose: subclasses of KVCache may not be growing full-attention KV.
    return [
        IsoQuantKVCache(rotation, key_bits, value_bits, window, seed, i, decoded_shadow, sink)
        if type(c) is KVCache
        else c
        for i, c in enumerate(make_prompt_cache(model))
    ]
