"""Rotate → normalize → Lloyd–Max codes → pack, and the way back (format: packing.py)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .codebook import kv_codebook
from .packing import pack_codes, packed_row_bytes, unpack_codes, word_codes
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
    # A 3-bit table on the int8 grid (codebook.py), levels[c] = grid_scale · g_c in float32
    # arithmetic, as a byte table: byte c of the uint64 `grid` is g_c + 128. With D % 32 == 0
    # the codes are looked up by word (lookup_words); None otherwise.
    grid: mx.array | None = None  # uint64 scalar
    grid_scale: mx.array | None = None  # float32 scalar

    @classmethod
    def make(cls, dim: int, bits: int) -> Quantizer:
        packed_row_bytes(dim, bits)  # validates dim and bits
        cb = kv_codebook(dim, bits)
        thresholds = mx.array(cb.thresholds, mx.float32)
        if cb.scale is None or bits != 3:
            return cls(dim, bits, mx.array(cb.levels, mx.float32), thresholds)
        # the levels as float32 products of the grid's integers and the float32 scale, so
        # the byte table gives them bit for bit (within an ulp of the codebook's levels)
        g = np.rint(np.asarray(cb.levels) / cb.scale).astype(np.int64)
        scale = np.float32(cb.scale)
        levels = mx.array(g.astype(np.float32) * scale)
        if dim % 32:
            return cls(dim, bits, levels, thresholds)
        table = sum((int(v) + 128) << (8 * c) for c, v in enumerate(g))
        grid = mx.array(np.array(table, dtype=np.uint64))  # from data: no graph to evaluate
        return cls(dim, bits, levels, thresholds, grid, mx.array(scale))

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

    def lookup_words(self, words: mx.array, w0: mx.array, w1: mx.array, w2: mx.array):
        """levels[codes] of 3-bit codes given as words (packing.code_words and its three
        columns) -> [..., D] float32, the same values bit for bit as lookup(unpack_codes(..)):
        the unpacking and the table lookup are one elementwise pass (needs `grid`)."""
        if self.grid is None:
            raise ValueError(f"no byte table for {self.bits}-bit codes of head dim {self.dim}")
        return _lookup_words(self.grid, self.grid_scale, words, w0, w1, w2)

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


@functools.partial(mx.compile, shapeless=True)  # one fused pass; joins a compiled caller
def _lookup_words(grid, scale, words, w0, w1, w2):
    shift = word_codes(words, w0, w1, w2).astype(mx.uint64) << 3  # byte c of the table
    g = ((grid >> shift) & 255).astype(mx.int32) - 128
    return mx.flatten(g.astype(mx.float32) * scale, -3, -1)


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
