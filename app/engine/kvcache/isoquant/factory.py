"""IsoQuant's row factory in the KV modes table (kvcache/modes.py)."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache, make_prompt_cache

from .. import reach
from ..modes import DEFAULT_SINK, DEFAULT_WINDOW, LayerBand
from . import dispatch
from .cache import IsoQuantKVCache


def make_cache(
    model,
    rotation: str,
    key_bits: int,
    value_bits: int,
    *,
    window: int | None = None,
    default_window: int = DEFAULT_WINDOW,
    band: LayerBand | None = None,
    sink: int = DEFAULT_SINK,
    seed: int = 0,
    decoded_shadow: bool = False,
    max_tokens: int | None = None,
    max_kv_size: int | None = None,
) -> list:
    """The model's prompt cache with every growing full-attention KVCache replaced by an
    IsoQuantKVCache (layer i seeded with (seed, i)) where the layer's attention module passes
    the fetched K/V straight to attention (reach.py); the others keep mlx-lm's float cache
    with `fallback_reason` set. Sliding-window and SSM caches are kept.
    window: recent tokens kept in float on every layer (the user's setting); None: the mode's
    own, default_window, and band.window on the layers of `band` (a mode that codes a band of
    layers at other bits, e.g. keys 4-bit in the costliest layers); sink: first tokens kept in
    float; decoded_shadow:
    also keep levels[codes] in float32 (CPU benchmarks only: same numbers, more memory).
    Installs the attention dispatch in the model's modules and the kernel path (kernels where
    the backend has them). max_tokens: unused, the cache grows as it goes. max_kv_size (mlx-lm's
    rotating bound) is refused: a compressed cache keeps every token."""
    if max_kv_size is not None:
        raise ValueError(
            f"max_kv_size={max_kv_size}: IsoQuant caches keep every token (compressed) and "
            "cannot drop old ones; use the fp16 KV mode for a bounded rotating cache"
        )
    from . import kernel_path  # builds the kernels on first use, not when the package is imported

    dispatch.install(model)
    kernel_path.install()
    base = make_prompt_cache(model)
    # type() is exact on purpose: subclasses of KVCache may not be growing full-attention KV.
    reasons = reach.layer_reasons(model, base, lambda c: type(c) is KVCache)
    out = []
    for i, c in enumerate(base):
        if i in reasons and reasons[i] is None:
            kb, vb, w = key_bits, value_bits, default_window
            if band is not None and band.holds(i, len(base)):
                kb, vb, w = band.key_bits, band.value_bits, band.window
            w = w if window is None else window
            c = IsoQuantKVCache(rotation, kb, vb, w, seed, i, decoded_shadow, sink)
        elif reasons.get(i):
            c.fallback_reason = reasons[i]
        out.append(c)
    reach.log_fallbacks(reasons, f"IsoQuant {key_bits}/{value_bits}-bit")
    return out
