"""The switch between IsoQuant's fused kernels (kernels.py, Metal and CUDA) and the MLX-ops
reference (attention.py).

The cache's attention calls the kernels whenever the backend has them, the reference otherwise;
the setting ROTARYQUANT_ISOQUANT_ATTENTION = auto | kernel | reference (or `use_kernel=`)
forces either. `install()` registers the kernel path with the cache; the modes table's factory
(factory.make_cache) calls it when it builds caches, nothing is registered at import.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .attention import register_kernel
from .cache import register_encoder, register_step_kernel, register_tc16_packer
from .kernels import (
    BACKEND,
    Problem,
    Unsupported,
    attention,
    attention_reference,
    encode_pair,
    fused_attention,
    kernels_available,
    pack_tc16,
    unfused_attention,
    v_layout,
    window_attention,
)
from .packing import register_v_layout

SETTING_ENV = "ROTARYQUANT_ISOQUANT_ATTENTION"
SETTINGS = ("auto", "kernel", "reference")

# Prefill chunks (at least this many queries per head) on the kernel path attend through the
# layer's compressed K/V dequantized once, in the queries' dtype, and mx.fast's SDPA: the
# backend's own prefill attention, as on a float cache. The fused kernel is built for decode:
# it writes split-K partials for every query row, which for a 2048-token chunk costs memory
# and time that flash attention does not spend. Dequantizing is O(T·D) per layer and chunk.
# ROTARYQUANT_ISOQUANT_PREFILL = dequant (default) | kernel picks the path for such chunks.
DEQUANT_MIN_QUERIES = 64
PREFILL_ENV = "ROTARYQUANT_ISOQUANT_PREFILL"
PREFILL_PATHS = ("dequant", "kernel")


_parsed: dict = {}  # raw value of the setting -> parsed (read on every attention call)


def setting() -> str:
    raw = os.environ.get(SETTING_ENV, "auto")
    value = _parsed.get(raw)
    if value is None:
        value = raw.strip().lower() or "auto"
        if value not in SETTINGS:
            raise ValueError(f"{SETTING_ENV}={value!r}: expected one of {SETTINGS}")
        _parsed[raw] = value
    return value


def _resolve(use_kernel: bool | None) -> bool | None:
    """None = kernel where possible; True = kernel or raise; False = reference."""
    if use_kernel is not None:
        return use_kernel
    s = setting()
    return {"auto": None, "kernel": True, "reference": False}[s]


def prefill_path() -> str:
    value = os.environ.get(PREFILL_ENV, "dequant").strip().lower() or "dequant"
    if value not in PREFILL_PATHS:
        raise ValueError(f"{PREFILL_ENV}={value!r}: expected one of {PREFILL_PATHS}")
    return value


# Tokens dequantized at a time on the prefill path: the float32 temporaries (levels, scale, the
# rotation's blocks) are a piece's, not the whole layer's (32K tokens, Qwen3's 4 KV heads x 128:
# 324 MiB above the cache for K and V, against 1131 MiB in one piece; the dequant rows of
# benchmarks/kv_prefill_peak.py). The pieces are exact: every token is its own.
DEQUANT_CHUNK = 1024


def _dequantized(t, dtype, chunk: int | None = None) -> mx.array:
    """An IsoQuant K or V as the float keys or values attention reads: [B, Hkv, T, D] dtype
    (float sink prefix, x̂ = Rᵀ ŷ of the compressed tokens, the float window), the compressed
    tokens `chunk` at a time (default DEQUANT_CHUNK; 0: all at once)."""
    parts = [] if t.prefix is None else [t.prefix.astype(dtype)]
    n = t.compressed_len
    if n:
        size = DEQUANT_CHUNK if chunk is None else chunk
        step = size if size > 0 else n
        codes = None if t.decoded is not None else t.codes_unpacked()
        for i in range(0, n, step):
            if codes is None:
                levels = t.decoded[:, :, i : i + step]
            else:
                levels = t.quantizer.levels[codes[:, :, i : i + step]]
            y = t.quantizer.scale_levels(levels, t.norms[:, :, i : i + step])
            parts.append(t.rotation.inverse(y).astype(dtype))
    if t.fp is not None:
        parts.append(t.fp.astype(dtype))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def dequantized_attention(queries, keys, values, scale, mask=None, sinks=None):
    """queries [B, Hq, L, D] over an IsoQuant K/V pair through the dequantized K/V and
    mx.fast.scaled_dot_product_attention (mask None or "causal", as mlx-lm passes it)."""
    dt = queries.dtype
    return mx.fast.scaled_dot_product_attention(
        queries, _dequantized(keys, dt), _dequantized(values, dt), scale=scale, mask=mask,
        sinks=sinks,
    )  # fmt: skip


def isoquant_attention(
    queries, keys, values, scale, mask=None, sinks=None, use_kernel=None, lens=None, path=None
):
    """queries [B, Hq, L, D] over an IsoQuant K/V pair -> [B, Hq, L, D] (queries' dtype).
    mask as mlx-lm passes it; sinks [Hq] (gpt-oss); lens [B] valid compressed tokens per
    sequence (ragged batches). Inputs the kernels don't take (array masks, other head dims)
    go to the reference unless use_kernel=True, which raises instead."""
    want = _resolve(use_kernel)
    if want is False:
        return attention_reference(queries, keys, values, scale, mask, sinks, lens)
    if want and not kernels_available():
        raise RuntimeError("IsoQuant kernels need MLX's Metal or CUDA backend")
    if not kernels_available():
        return attention_reference(queries, keys, values, scale, mask, sinks, lens)
    if (
        queries.shape[2] >= DEQUANT_MIN_QUERIES
        and lens is None
        and (mask is None or isinstance(mask, str))
        and prefill_path() == "dequant"
    ):
        return dequantized_attention(queries, keys, values, scale, mask, sinks)
    try:
        return attention(
            queries, keys, values, scale, mask, sinks, lens, use_kernel=True, path=path
        )
    except Unsupported:
        if want:
            raise
        return attention_reference(queries, keys, values, scale, mask, sinks, lens)


def _cache_entry(queries, keys, values, scale, mask=None, sinks=None, lens=None):
    # The signature attention.isoquant_attention calls a registered kernel with.
    return isoquant_attention(queries, keys, values, scale, mask, sinks, use_kernel=None, lens=lens)


def install() -> bool:
    """Register the kernel paths with the cache (attention, its one-token step over the
    cache's buffers, the fused K/V encoder of its decode-time compression and its tc16 write,
    and the V layout the kernels read fastest) when the backend has kernels and the setting is
    not "reference"; otherwise make sure none is registered.
    Returns whether they are."""
    on = kernels_available() and setting() != "reference"
    register_kernel(_cache_entry if on else None)
    register_encoder(encode_pair if on else None)
    register_v_layout(v_layout if on else None)
    register_tc16_packer(pack_tc16 if on else None)
    register_step_kernel(window_attention if on else None)
    return on


__all__ = [
    "BACKEND",
    "SETTINGS",
    "SETTING_ENV",
    "Problem",
    "Unsupported",
    "attention_reference",
    "dequantized_attention",
    "encode_pair",
    "fused_attention",
    "install",
    "isoquant_attention",
    "kernels_available",
    "pack_tc16",
    "setting",
    "unfused_attention",
    "v_layout",
]
