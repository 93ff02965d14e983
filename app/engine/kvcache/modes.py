"""KV modes: the prompt-cache factory, deferred-prefill hook and byte counting for the engine."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import KVCache, make_prompt_cache

from .isoquant.cache import IsoQuantKVCache

DEFAULT_WINDOW = 64  # chosen from benchmarks/kv_quality.py (SmolLM2-135M): see results JSON
DEFAULT_SINK = 0  # first tokens kept in float (attention sinks); see results JSON


@dataclass(frozen=True)
class KVModeSpec:
    name: str
    rotation: str | None  # None: plain float cache
    key_bits: int = 16
    value_bits: int = 16
    description: str = ""

    def __post_init__(self):
        if self.rotation is not None and (
            self.key_bits not in (3, 4) or self.value_bits not in (3, 4)
        ):
            raise ValueError(f"KV mode {self.name}: IsoQuant needs 3- or 4-bit codes")


_SPECS = (
    KVModeSpec("fp16", None, description="mlx-lm's float cache (model dtype)"),
    KVModeSpec("isoquant3", "v3", 3, 3, "IsoQuant WHT+SO(4), 3-bit K and V"),
    KVModeSpec("isoquant4", "v3", 4, 4, "IsoQuant WHT+SO(4), 4-bit K and V"),
    KVModeSpec("isoquant_k4v3", "v3", 4, 3, "IsoQuant WHT+SO(4), 4-bit K, 3-bit V"),
    KVModeSpec("isoquant3_v1", "v1", 3, 3, "ablation: SO(3) quaternion conjugation, no WHT"),
    KVModeSpec("isoquant3_v2", "v2", 3, 3, "ablation: SO(4) blocks, no WHT"),
    KVModeSpec("turboquant3", "dense", 3, 3, "baseline: dense random orthogonal rotation"),
)
MODES: dict[str, KVModeSpec] = {s.name: s for s in _SPECS}
KV_MODES: tuple[str, ...] = tuple(MODES)


def mode_spec(kv_mode: str) -> KVModeSpec:
    try:
        return MODES[kv_mode]
    except KeyError:
        raise ValueError(f"unknown KV mode {kv_mode!r}; expected one of {KV_MODES}") from None


def make_cache(
    model,
    kv_mode: str = "fp16",
    *,
    window: int = DEFAULT_WINDOW,
    sink: int = DEFAULT_SINK,
    seed: int = 0,
    decoded_shadow: bool = False,
) -> list:
    """The model's prompt cache with every growing full-attention KVCache replaced by an
    IsoQuantKVCache (layer i seeded with (seed, i)); sliding-window and SSM caches are kept.
    window: recent tokens kept in float; sink: first tokens kept in float; decoded_shadow:
    also keep levels[codes] in float32 (CPU benchmarks only: same numbers, more memory)."""
    spec = mode_spec(kv_mode)
    caches = make_prompt_cache(model)
    if spec.rotation is None:
        return caches
    # type() is exact on purpose: subclasses of KVCache may not be growing full-attention KV.
    return [
        IsoQuantKVCache(
            spec.rotation, spec.key_bits, spec.value_bits, window, seed, i, decoded_shadow, sink
        )
        if type(c) is KVCache
        else c
        for i, c in enumerate(caches)
    ]


def finish_prefill(cache_list) -> None:
    """After the prompt, before the first decode step: compress each IsoQuant prefix in bulk."""
    for c in cache_list:
        if isinstance(c, IsoQuantKVCache):
            c.finish_prefill()


def cache_nbytes(cache_list) -> int:
    """Bytes held by all caches of a prompt cache (IsoQuant and mlx-lm's own)."""
    total = 0
    for c in cache_list:
        try:
            total += int(c.nbytes)
        except (NotImplementedError, AttributeError):
            continue  # a cache type that cannot count itself holds no KV we manage
    return total
