"""The one table of KV modes: what each is, where it runs, what it costs, how its cache is built.

Planner, sizes, CLI, worker, window and the engine's make_cache all read this table; adding a
mode is one row here plus its algorithm's package. Pure data: factories are named as
"module:function" and imported only when a cache is built, so the window process can read the
table without importing MLX.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

BACKENDS = ("metal", "cuda", "cpu")
BACKEND_NEEDS = {
    "metal": "an Apple GPU (MLX's Metal backend)",
    "cuda": "an NVIDIA GPU (MLX's CUDA backend)",
    "cpu": "MLX's CPU backend",
}
FLOAT = "fp16"  # mlx-lm's own cache in the model's dtype: no compression
KV_STEP = 256  # mlx-lm's KVCache grows in steps of 256 tokens
DEFAULT_WINDOW = 64  # IsoQuant's float tail, chosen from benchmarks/kv_quality.py (SmolLM2-135M)
DEFAULT_SINK = 0  # first tokens IsoQuant keeps in float (attention sinks); see results JSON
ZIPFUSION_PAGE = 16  # tokens per ZipFusion page; the page being written stays raw
ZIPFUSION_RATIO = 0.75  # 12 of 16 bits per value when a block compresses (SPEC §5)
# The planner's own choices when it compresses full-attention KV: lossless where the backend
# runs it and it fits, else the compact one.
AUTO_LOSSLESS = "zipfusion"
AUTO_COMPACT = "isoquant3"


@dataclass(frozen=True)
class AttentionDims:
    """One attention layer's KV geometry; value_bytes is the activation dtype's size."""

    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    value_bytes: int = 2

    @property
    def float_bytes_per_token(self) -> int:
        return self.kv_heads * (self.k_head_dim + self.v_head_dim) * self.value_bytes


def float_nbytes(d: AttentionDims, tokens: int) -> int:
    return -(-tokens // KV_STEP) * KV_STEP * d.float_bytes_per_token


def isoquant_nbytes(
    key_bits: int, value_bits: int, d: AttentionDims, tokens: int, window: int = DEFAULT_WINDOW
) -> int:
    # codes + an fp16 norm per vector; the most recent `window` tokens stay in float
    recent = min(tokens, window)
    packed = lambda dim, bits: dim * bits // 8 + 2  # noqa: E731
    per_tok = d.kv_heads * (packed(d.k_head_dim, key_bits) + packed(d.v_head_dim, value_bits))
    return (tokens - recent) * per_tok + recent * d.float_bytes_per_token


@dataclass(frozen=True)
class LayerBand:
    """IsoQuant settings for a band of layers by relative depth: layer i of n is in the band
    when start <= (i + 0.5) / n < stop (on a 30-layer model, 0.5..5/6 is layers 15-24).
    Pure data (the window process reads it); the factory applies it per layer."""

    start: float
    stop: float
    key_bits: int
    value_bits: int
    window: int

    def holds(self, layer: int, layers: int) -> bool:
        return self.start <= (layer + 0.5) / layers < self.stop

    def layers(self, n: int) -> list[int]:
        return [i for i in range(n) if self.holds(i, n)]


def banded_isoquant_nbytes(
    key_bits: int, value_bits: int, window: int, band: LayerBand, d: AttentionDims, tokens: int
) -> int:
    """Bytes of one full-attention layer, averaged over the model's layers: `band` on its share
    of them, key_bits/value_bits/window on the rest."""
    inside = isoquant_nbytes(band.key_bits, band.value_bits, d, tokens, band.window)
    outside = isoquant_nbytes(key_bits, value_bits, d, tokens, window)
    share = band.stop - band.start
    return round(share * inside + (1 - share) * outside)


def zipfusion_nbytes(d: AttentionDims, tokens: int) -> int:
    # full pages compressed (+ 8 bytes of metadata per page, head and K/V), the last one raw
    full_pages, tail = divmod(tokens, ZIPFUSION_PAGE)
    page = (
        math.ceil(ZIPFUSION_PAGE * d.float_bytes_per_token * ZIPFUSION_RATIO) + 8 * 2 * d.kv_heads
    )
    return full_pages * page + tail * d.float_bytes_per_token


@dataclass(frozen=True)
class KVMode:
    """One row. nbytes(dims, tokens): bytes one full-attention layer holds at `tokens`.
    factory: "module:function" called as f(model, **options, max_tokens=...) -> prompt cache.
    offered: in the chat's menu and the planner's choices (False: benchmarks and CLI only)."""

    name: str
    label: str
    lossless: bool
    backends: tuple[str, ...]
    nbytes: Callable[[AttentionDims, int], int] = field(compare=False)
    factory: str
    offered: bool = True
    description: str = ""
    options: Mapping = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not set(self.backends) <= set(BACKENDS) or not self.backends:
            raise ValueError(f"KV mode {self.name}: backends must be among {BACKENDS}")
        if ":" not in self.factory:
            raise ValueError(f"KV mode {self.name}: factory must be 'module:function'")

    def runs_on(self, backend: str) -> bool:
        return backend in self.backends

    def make_cache(self, model, **options) -> list:
        module, name = self.factory.split(":")
        return getattr(importlib.import_module(module), name)(model, **{**self.options, **options})


def _isoquant(name, rotation, kb, vb, description, offered=True) -> KVMode:
    return KVMode(
        name, f"IsoQuant {kb}/{vb}-bit" if kb != vb else f"IsoQuant {kb}-bit", False, BACKENDS,
        functools.partial(isoquant_nbytes, kb, vb), "app.engine.kvcache.isoquant:make_cache",
        offered, description, {"rotation": rotation, "key_bits": kb, "value_bits": vb},
    )  # fmt: skip


_ROWS = (
    KVMode(FLOAT, "fp16", True, BACKENDS, float_nbytes, "app.engine.kvcache.modes:float_cache",
           description="mlx-lm's float cache (model dtype)"),
    _isoquant("isoquant3", "v3", 3, 3, "IsoQuant WHT+SO(4), 3-bit K and V"),
    _isoquant("isoquant4", "v3", 4, 4, "IsoQuant WHT+SO(4), 4-bit K and V"),
    _isoquant("isoquant_k4v3", "v3", 4, 3, "IsoQuant WHT+SO(4), 4-bit K, 3-bit V"),
    _isoquant("isoquant3_v1", "v1", 3, 3, "ablation: SO(3) quaternion conjugation, no WHT", False),
    _isoquant("isoquant3_v2", "v2", 3, 3, "ablation: SO(4) blocks, no WHT", False),
    _isoquant("turboquant3", "dense", 3, 3, "baseline: dense random orthogonal rotation", False),
    KVMode("zipfusion", "ZipFusion", True, ("cuda",), zipfusion_nbytes,
           "app.engine.kvcache.zipfusion:make_cache", description="lossless BF16, 12 bits a value"),
)  # fmt: skip
MODES: dict[str, KVMode] = {r.name: r for r in _ROWS}


def register(row: KVMode) -> KVMode:
    """Add a row (a new mode, or tests' own); a name already taken is refused."""
    if row.name in MODES:
        raise ValueError(f"KV mode {row.name!r} is already in the table")
    MODES[row.name] = row
    return row


def names(backend: str | None = None, offered: bool = False) -> tuple[str, ...]:
    """Modes in table order; only those that run on `backend` / that are offered if asked."""
    return tuple(
        r.name
        for r in MODES.values()
        if (backend is None or r.runs_on(backend)) and (r.offered or not offered)
    )


def mode(name: str) -> KVMode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown KV mode {name!r}; modes are {', '.join(MODES)}") from None


def needs(name: str) -> str:
    """What mode `name` needs to run, in words."""
    r = mode(name)
    return f"{r.label} needs {' or '.join(BACKEND_NEEDS[b] for b in r.backends)}"


def unavailable_reason(name: str, backend: str) -> str | None:
    """Why mode `name` cannot run on `backend` (None: it can)."""
    if name not in MODES:
        return f"unknown KV mode {name!r}"
    if MODES[name].runs_on(backend):
        return None
    return f"{needs(name)}; this machine runs on {backend}"


def make_cache(model, kv_mode: str = FLOAT, **options) -> list:
    """The model's prompt cache in `kv_mode`. Options go to the mode's factory: IsoQuant takes
    window, sink, seed, decoded_shadow; every factory takes max_tokens (the request's bound) and
    max_kv_size (mlx-lm's rotating bound: fp16 honours it, compressed modes refuse it)."""
    return mode(kv_mode).make_cache(model, **options)


def float_cache(model, max_tokens: int | None = None, max_kv_size: int | None = None, **_) -> list:
    """mlx-lm's own caches (rotating ones of max_kv_size tokens where mlx-lm makes them); the
    float mode has no other knobs, so other modes' options are ignored."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    if max_kv_size is None:
        return caches
    # models with their own make_cache ignore the bound: their growing caches rotate as
    # mlx-lm's default ones do (keeping the first 4 tokens)
    return [RotatingKVCache(max_kv_size, keep=4) if type(c) is KVCache else c for c in caches]


def fallbacks(cache_list) -> list[dict]:
    """[{"layer", "reason"}]: the layers a compressed mode keeps in a float cache, and why."""
    out = []
    for i, c in enumerate(cache_list):
        reason = getattr(c, "fallback_reason", None)
        if reason:
            out.append({"layer": i, "reason": reason})
    return out


def finish_prefill(cache_list) -> None:
    """After the prompt, before the first decode step: caches with deferred prefill compress
    their prompt in bulk (IsoQuant)."""
    for c in cache_list:
        finish = getattr(c, "finish_prefill", None)
        if finish is not None:
            finish()


def _float_geometry(c):
    """(keys array, tokens held) of a cache's float K/V, or None (no per-token float KV)."""
    inner = getattr(c, "_float", None)  # an IsoQuant layer running as a float cache
    if inner is not None:
        c = inner
    arr = getattr(c, "fp_keys", None)
    if arr is None:
        arr = getattr(c, "keys", None)
    n = int(getattr(c, "offset", 0) or 0)
    if n <= 0 or arr is None or not hasattr(arr, "shape") or len(arr.shape) != 4:
        return None
    vals = getattr(c, "fp_values", None)
    vals = getattr(c, "values", None) if vals is None else vals
    dv = vals.shape[-1] if vals is not None and hasattr(vals, "shape") else arr.shape[-1]
    n = min(n, getattr(c, "max_size", n) or n)  # rotating caches hold a window
    return arr, n, dv


def layer_used_nbytes(c) -> int:
    """Bytes a cache holds for its tokens, without spare capacity: compressed caches count
    themselves (nbytes); mlx-lm's float caches hold tokens × K and V at their dtype."""
    if getattr(c, "used_nbytes", None) is not None:
        return int(c.used_nbytes)
    g = _float_geometry(c)
    if g is not None and type(c).__name__ in ("KVCache", "RotatingKVCache", "ChunkedKVCache"):
        arr, n, dv = g
        return arr.shape[0] * arr.shape[1] * n * (arr.shape[-1] + dv) * arr.itemsize
    try:
        return int(c.nbytes)
    except (NotImplementedError, AttributeError):
        return 0  # a cache type that cannot count itself holds no KV we manage


def float_baseline_nbytes(c) -> int:
    """What the same tokens would take in mlx-lm's float cache at the dtype this cache keeps
    its float K/V in (float32 on MLX's CPU backend, the model's dtype elsewhere)."""
    g = _float_geometry(c)
    if g is None:
        return layer_used_nbytes(c)  # SSM state and the like: the same in every mode
    arr, n, dv = g
    return arr.shape[0] * arr.shape[1] * n * (arr.shape[-1] + dv) * arr.itemsize


def cache_nbytes(cache_list) -> int:
    """Bytes held by all caches of a prompt cache (every mode's and mlx-lm's own), counted as
    what they hold for their tokens, not their spare capacity."""
    return sum(layer_used_nbytes(c) for c in cache_list)


def cache_capacity_nbytes(cache_list) -> int:
    """Bytes of the buffers all caches have allocated (spare capacity included)."""
    total = 0
    for c in cache_list:
        try:
            total += int(getattr(c, "capacity_nbytes", None) or c.nbytes)
        except (NotImplementedError, AttributeError):
            continue
    return total
