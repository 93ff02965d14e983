"""Rotate → normalize → Lloyd–Max codes → pack, and the way back (format: packing.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from .codebook import kv_codebook
from .packing import pack_codes, packed_row_bytes, unpack_codes
from .rotation import Rotation

_CHUNK_ELEMS = 1 << 22  # bound the [.., D, 2^bits-1] comparison temporaries in bulk compression
_FP16_MAX = 65504.0


@dataclass(frozen=True, eq=False)
class Quantizer:
    """One codebook (D, bits) as MLX arrays."""

    dim: int
    bits: int
    levels: mx.array  # [2**bits] float32, ascending
    thresholds: mx.array  # [2**bits - 1] float32

    @classmethod
    def make(cls, dim: int, bits: int) -> Quantizer:
        packed_row_bytes(dim, bits)  # validates dim and bits
        cb = kv_codebook(dim, bits)
        return cls(dim, bits, mx.array(cb.levels, mx.float32), mx.array(cb.thresholds, mx.float32))

    @property
    def row_bytes(self) -> int:
        return packed_row_bytes(self.dim, self.bits)

    def encode_rotated(self, y: mx.array) -> tuple[mx.array, mx.array]:
        """y: [..., D] already rotated -> (codes [..., D*bits/8] uint8, norms [...] float16)."""
        y = y.astype(mx.float32)
        norms = mx.sqrt(mx.sum(y * y, axis=-1))
        inv = math.sqrt(self.dim) / mx.maximum(norms, 1e-30)
        u = y * inv[..., None]  # unit coordinate variance
        codes = mx.sum(u[..., None] > self.thresholds, axis=-1).astype(mx.uint8)
        return pack_codes(codes, self.bits), mx.minimum(norms, _FP16_MAX).astype(mx.float16)

    def lookup(self, codes: mx.array) -> mx.array:
        """levels[codes] for unpacked codes [...] uint8 -> [...] float32, the table's values
        exactly (lookup())."""
        return lookup(self.levels, codes)

    def decode_rotated(self, codes: mx.array, norms: mx.array) -> mx.array:
        """codes [..., D*bits/8] uint8, norms [...] -> ŷ [..., D] float32 (rotated space)."""
        return self.scale_levels(self.lookup(unpack_codes(codes, self.bits)), norms)

    def scale_levels(self, levels: mx.array, norms: mx.array) -> mx.array:
        """levels[codes] [..., D] (unit coordinate variance), norms [...] -> ŷ [..., D] float32."""
        return levels * (norms.astype(mx.float32) / math.sqrt(self.dim))[..., None]


def _select_tree(n: int):
    """levels[codes] for a table of n = 2**k values: bit 0 picks within pairs, bit 1 within
    pairs of pairs, ...: n - 1 selects of exact table values, no gather. A function of its own
    per n (MLX keys compiled traces by the function, and a shapeless trace would serve another
    table size)."""

    def select(levels: mx.array, codes: mx.array) -> mx.array:
        vals = [levels[j] for j in range(n)]
        bit = 0
        while len(vals) > 1:
            m = (codes & (1 << bit)) != 0
            vals = [mx.where(m, vals[i + 1], vals[i]) for i in range(0, len(vals), 2)]
            bit += 1
        return vals[0]

    return select


TREE_MAX_LEVELS = 8  # 3-bit tables; a 16-level tree (15 selects) ran slower than the gather
_LOOKUPS: dict[int, object] = {}  # table size -> its compiled tree


def lookup(levels: mx.array, codes: mx.array) -> mx.array:
    """levels[codes] (codes uint8 of any shape): for a table of up to 8 values a tree of selects,
    compiled once per table size and shapeless (it joins a compiled caller's graph), else the
    gather. The same values bit for bit; on MLX's CPU backend, where a gather costs ~5-10 ns an
    element, the 3-bit tree is ~4x faster (benchmarks/isoquant_lookup.py)."""
    n = levels.shape[0]
    if n & (n - 1) or n > TREE_MAX_LEVELS:
        return levels[codes]
    fn = _LOOKUPS.get(n)
    if fn is None:
        fn = _LOOKUPS[n] = mx.compile(_select_tree(n), shapeless=True)
    return fn(levels, codes)


def encode(x: mx.array, rotation: Rotation, quantizer: Quantizer) -> tuple[mx.array, mx.array]:
    """x: [B, Hkv, T, D] -> (codes [B, Hkv, T, D*bits/8] uint8, norms [B, Hkv, T] float16)."""
    b, h, t, d = x.shape
    step = max(1, _CHUNK_ELEMS // max(1, b * h * d * 2**quantizer.bits))
    if t <= step:
        return quantizer.encode_rotated(rotation.forward(x))
    parts = [
        quantizer.encode_rotated(rotation.forward(x[:, :, i : i + step])) for i in range(0, t, step)
    ]
    return (
        mx.concatenate([p[0] for p in parts], axis=2),
        mx.concatenate([p[1] for p in parts], axis=2),
    )


def decode(codes: mx.array, norms: mx.array, rotation: Rotation, quantizer: Quantizer) -> mx.array:
    """The dequantized vectors x̂ = Rᵀ ŷ: [B, Hkv, T, D] float32 (tests and oracles only)."""
    return rotation.inverse(quantizer.decode_rotated(codes, norms))
