"""IsoQuant packed KV format (version 2): the contract between the cache, the MLX reference
attention and the fused Metal/CUDA kernels.

Per layer, per K and per V, the compressed part of the cache holds two arrays:

    codes: [B, Hkv, T, D*bits/8] uint8   one row of packed codes per cached vector
    norms: [B, Hkv, T]           float16 ‖x‖ of the original (= rotated) vector

Codes. One row of packed codes per vector, D*bits/8 bytes:
- 3-bit, D a multiple of 32 (every head dim the kernels take): blocks of 32 codes in 12 bytes.
  Block b (codes 32b..32b+31) is three little-endian uint32 words W0, W1, W2 at bytes 12b,
  12b+4, 12b+8; nibble k (bits 4k..4k+3) of W_j holds code 32b+8j+k in its low 3 bits and bit
  j of code 32b+24+k in its top bit. So `W_j & 0x77777777` has codes 8j..8j+7 one per nibble
  (a byte-permute selector, or shifts by 4k), and codes 24..31 are
  `(W0 >> 3 & 0x11111111) | (W1 >> 2 & 0x22222222) | (W2 >> 1 & 0x44444444)`.
- 3-bit, other D (a multiple of 8): a little-endian bit stream, code i in bits 3i..3i+2, where
  bit j of the stream is bit (j % 8) of byte j // 8: every 8 codes take 3 bytes.
- 4-bit: byte i holds code 2i in its low nibble and code 2i+1 in its high nibble.
Version 1 packed every 3-bit row as the bit stream.
D must be a multiple of 8.

Levels. code c of a K (V) row means levels[c] of the key (value) codebook, a float32 table of
2**bits ascending values (codebook.kv_codebook(D, bits)), fitted for unit-variance coordinates:
for 3 bits Lloyd–Max on the int8 grid (levels = scale · integers in [-127, 127]; version 2), for
4 bits plain Lloyd–Max. Version 1 had plain Lloyd–Max levels for 3 bits too.

Meaning. With R the layer's rotation for that KV head (rotation.py), the vector is represented as

    x̂ = Rᵀ · (norm / √D) · levels[codes]          (rotated space: ŷ = (norm/√D)·levels[codes])

so, for a rotated query q̃ = R q, <q, x̂> = (norm/√D) · Σ_i q̃_i · levels[code_i]: attention never
needs x̂ itself (attention.py).

V layouts. K codes are always stored as above, one packed row per token ("rows"). V codes have a
second layout, "tc16", which a CUDA tensor-core kernel reads without transposing tokens:
- It applies to 3-bit codes with D % 64 == 0 (`tc16_ok`). The codes array is
  [..., N, 3D/8] uint8 with N a multiple of 16 (N = ceil16(T)); the number of valid tokens T
  comes from the norms array ([..., T]); rows T..N-1 are padding (any content; the cache writes
  the packing of zero codes there).
- Chunk c = rows 16c..16c+15, seen as 6D contiguous bytes (16 rows × 3D/8 bytes).
- Token position p in [0, 16) of a chunk is in group i = (p & 7) >> 1, slot
  s = (p & 1) | ((p >> 3) << 1): group i's slots s = 0, 1, 2, 3 are tokens 2i, 2i+1, 2i+8,
  2i+9 of the chunk.
- NBL = D/64. Coordinate d -> lane-block lb = d // (D/8) (0..7), sub-block
  bb = (d % (D/8)) // 8, cc = d % 8.
- Block (lb, i, bb) is 12 bytes at chunk byte offset 12·((lb·4 + i)·NBL + bb). It packs the 32
  codes x[k], k = 4·cc + s, exactly as a 32-code block of the rows format (three
  little-endian uint32 words W0, W1, W2 at bytes 0, 4, 8; nibble n of W_j holds x[8j+n] in
  bits 0-2 and bit j of x[24+n] in bit 3), i.e. `pack_codes(x, 3)` of a 32-long code vector.
`pack_codes_tc16` / `unpack_codes_tc16` convert [..., N, D] codes to and from it.
`preferred_v_layout(D, bits)` is the layout new caches store V in: the environment variable
ROTARYQUANT_ISOQUANT_V_LAYOUT ("rows" or "tc16") if set, else what a backend registered with
`register_v_layout` says, else "rows"; "tc16" only where `tc16_ok`.

Tokens. The cache keeps tokens [0, T_c) compressed and tokens [T_c, offset) — prefill before the
first decode step, then the recent window — in the model's float dtype (`fp`: [B, Hkv, T_f, D]).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx

FORMAT_VERSION = 2
SUPPORTED_BITS = (3, 4)
TC16_CHUNK = 16  # tokens per tc16 chunk
V_LAYOUTS = ("rows", "tc16")
V_LAYOUT_ENV = "ROTARYQUANT_ISOQUANT_V_LAYOUT"


def packed_row_bytes(dim: int, bits: int) -> int:
    """Bytes of one packed row of `dim` codes."""
    _check(dim, bits)
    return dim * bits // 8


def _check(dim: int, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"IsoQuant packs 3- or 4-bit codes, not {bits}-bit")
    if dim % 8:
        raise ValueError(f"head dim {dim} is not a multiple of 8: IsoQuant cannot pack it")


# Shift tables built once: every decode step unpacks the codes, and building an array from
# Python costs host time on each call. Made from lists, so they hold data, not a graph: a lazy
# array made at import would be evaluated on the importing thread's stream, which another
# thread (the API server's batcher) cannot use.
_NIBBLES = mx.array([4 * k for k in range(8)], dtype=mx.uint32)  # nibble k: bits 4k..4k+3
_TRIPLETS = mx.array([3 * k for k in range(8)], dtype=mx.uint32)  # code k of 24 bits: 3k..3k+2
_TOP_BITS = mx.array([[0], [1], [2]], dtype=mx.uint32)  # bit j of codes 24..31 in word j
_BYTES4 = mx.array([0, 8, 16, 24], dtype=mx.uint32)
_BYTES3 = mx.array([0, 8, 16], dtype=mx.uint32)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """codes: [..., D] uint8 in [0, 2**bits) -> [..., D*bits/8] uint8 (layout above)."""
    dim = codes.shape[-1]
    _check(dim, bits)
    lead = codes.shape[:-1]
    c = codes.astype(mx.uint32)
    if bits == 4:
        c = c.reshape(*lead, dim // 2, 2)
        return (c[..., 0] | (c[..., 1] << 4)).astype(mx.uint8)
    if dim % 32 == 0:
        c = c.reshape(*lead, dim // 32, 32)
        low = c[..., :24].reshape(*lead, dim // 32, 3, 8)  # [.., block, word j, nibble k]
        top = c[..., None, 24:] >> _TOP_BITS  # bit j of code 24+k
        nib = (low & 7) | ((top & 1) << 3)
        w = mx.sum(nib << _NIBBLES, axis=-1)  # [.., block, 3]
        b = (w[..., None] >> _BYTES4) & 0xFF
        return b.astype(mx.uint8).reshape(*lead, dim * 3 // 8)
    c = c.reshape(*lead, dim // 8, 8)
    # w: [..., D/8] uint32 holding 8 codes in its low 24 bits
    w = mx.sum(c << _TRIPLETS, axis=-1)
    b = (w[..., None] >> _BYTES3) & 0xFF  # [..., D/8, 3]
    return b.astype(mx.uint8).reshape(*lead, dim * 3 // 8)


def unpack_codes(packed: mx.array, bits: int) -> mx.array:
    """packed: [..., D*bits/8] uint8 -> codes [..., D] uint8 (inverse of pack_codes).
    No slices and no reshape of the leading dims: a shapeless compiled trace (the attention
    reference's decode step, attention.py) follows the token count."""
    nbytes = packed.shape[-1]
    dim = nbytes * 8 // bits
    _check(dim, bits)
    p = packed.astype(mx.uint32)
    if bits == 4:
        codes = mx.stack([p & 0xF, p >> 4], axis=-1)
        return mx.flatten(codes, -2, -1).astype(mx.uint8)
    if dim % 32 == 0:
        p = mx.unflatten(p, -1, (dim // 32, 3, 4))
        w = mx.sum(p << _BYTES4, axis=-1)  # [.., block, 3]: the bytes' bits never overlap
        nib = (w[..., None] >> _NIBBLES) & 0xF  # [.., block, 3, 8]
        low = mx.flatten(nib & 7, -2, -1)  # [.., block, 24]
        top = mx.sum((nib >> 3) << _TOP_BITS, axis=-2)  # [.., 8]
        return mx.flatten(mx.concatenate([low, top], axis=-1), -2, -1).astype(mx.uint8)
    p = mx.unflatten(p, -1, (dim // 8, 3))
    w = mx.sum(p << _BYTES3, axis=-1)  # [..., D/8]
    codes = (w[..., None] >> _TRIPLETS) & 0x7  # [..., D/8, 8]
    return mx.flatten(codes, -2, -1).astype(mx.uint8)


def code_words(packed: mx.array) -> mx.array:
    """3-bit codes with D % 32 == 0, [..., 3D/8] uint8 -> the blocks' words W0, W1, W2 as
    [..., D/32, 3] uint32 (a view of the bytes where their strides allow; every platform MLX
    runs on is little-endian, as the format is). MLX cannot trace a view: call it outside a
    compiled graph and hand the words in."""
    return mx.unflatten(packed.view(mx.uint32), -1, (packed.shape[-1] // 12, 3))


def word_codes(words: mx.array, w0: mx.array, w1: mx.array, w2: mx.array) -> mx.array:
    """The codes of words [..., D/32, 3] (code_words; w0, w1, w2 its columns [..., D/32, 1],
    taken outside a compiled graph, which cannot trace a slice) as [..., D/32, 4, 8] uint32:
    row j < 3 of a block holds its codes 8j..8j+7, row 3 codes 24..31, so the last three axes
    flattened are the codes in order. Elementwise but for one small concatenation: no sum
    over the bytes as unpack_codes does, which on a CPU costs ~2x as much."""
    top = ((w0 >> 3) & 0x11111111) | ((w1 >> 2) & 0x22222222) | ((w2 >> 1) & 0x44444444)
    return (mx.concatenate([words, top], axis=-1)[..., None] >> _NIBBLES) & 7


# ---- the tc16 V layout ---------------------------------------------------------------------
# Slot j = 4·i + s of a chunk holds token _TC16_PERM[j] = 2i + (s & 1) + 8·(s >> 1).
_TC16_PERM = [2 * i + (s & 1) + 8 * (s >> 1) for i in range(4) for s in range(4)]
_TC16_INV = [_TC16_PERM.index(p) for p in range(TC16_CHUNK)]


def tc16_ok(dim: int, bits: int) -> bool:
    """Whether V codes of this head dim and width can be stored in the tc16 layout."""
    return bits == 3 and dim % 64 == 0


def check_tc16(dim: int, bits: int, n: int = 0) -> None:
    """Raise ValueError unless (dim, bits) codes, n rows of them, fit the tc16 layout."""
    if not tc16_ok(dim, bits):
        raise ValueError(
            f"the tc16 layout takes 3-bit codes with D % 64 == 0, not {bits}-bit D={dim}"
        )
    if n % TC16_CHUNK:
        raise ValueError(f"the tc16 layout packs whole chunks of {TC16_CHUNK} rows, not {n} rows")


def pack_codes_tc16(codes: mx.array, bits: int = 3) -> mx.array:
    """codes: [..., N, D] uint8 in [0, 8), N % 16 == 0 -> [..., N, 3D/8] uint8 (tc16 layout)."""
    *lead, n, dim = codes.shape
    check_tc16(dim, bits, n)
    nc, nbl, k = n // TC16_CHUNK, dim // 64, len(lead)
    c = codes.reshape(*lead, nc, TC16_CHUNK, dim)[..., mx.array(_TC16_PERM), :]
    c = c.reshape(*lead, nc, 4, 4, 8, nbl, 8)  # [.., C, i, s, lb, bb, cc]
    ax = list(range(k + 1))
    c = c.transpose(*ax, k + 3, k + 1, k + 4, k + 5, k + 2)  # [.., C, lb, i, bb, cc, s]
    blocks = pack_codes(c.reshape(*lead, nc, 32 * nbl, 32), 3)  # [.., C, block, 12]
    return blocks.reshape(*lead, n, dim * 3 // 8)


def unpack_codes_tc16(packed: mx.array, bits: int = 3) -> mx.array:
    """packed: [..., N, 3D/8] uint8 in the tc16 layout -> codes [..., N, D] uint8."""
    *lead, n, nbytes = packed.shape
    dim = nbytes * 8 // 3
    check_tc16(dim, bits, n)
    nc, nbl, k = n // TC16_CHUNK, dim // 64, len(lead)
    x = unpack_codes(packed.reshape(*lead, nc, 32 * nbl, 12), 3)  # [.., C, block, 32]
    x = x.reshape(*lead, nc, 8, 4, nbl, 8, 4)  # [.., C, lb, i, bb, cc, s]
    ax = list(range(k + 1))
    x = x.transpose(*ax, k + 2, k + 5, k + 1, k + 3, k + 4)  # [.., C, i, s, lb, bb, cc]
    x = x.reshape(*lead, nc, TC16_CHUNK, dim)[..., mx.array(_TC16_INV), :]
    return x.reshape(*lead, n, dim)


def pack_v_codes(codes: mx.array, bits: int, layout: str) -> mx.array:
    """codes [..., T, D] -> packed V codes in `layout`: rows, or tc16 with the rows up to the
    next whole chunk as zero codes."""
    if layout == "rows":
        return pack_codes(codes, bits)
    pad = -codes.shape[-2] % TC16_CHUNK
    if pad:
        zeros = mx.zeros((*codes.shape[:-2], pad, codes.shape[-1]), mx.uint8)
        codes = mx.concatenate([codes, zeros], axis=-2)
    return pack_codes_tc16(codes, bits)


def unpack_v_codes(packed: mx.array, bits: int, layout: str) -> mx.array:
    """Packed V codes in `layout` -> codes [..., N, D] (tc16: every row, padding included)."""
    return unpack_codes_tc16(packed, bits) if layout == "tc16" else unpack_codes(packed, bits)


# ---- which layout new caches store V in ---------------------------------------------------
_v_layout_fn: Callable[[int, int], str] | None = None


def register_v_layout(fn: Callable[[int, int], str] | None) -> None:
    """Install (or with None remove) fn(dim, bits) -> "rows" | "tc16": the V layout a backend's
    attention kernel prefers. The environment variable V_LAYOUT_ENV overrides it."""
    global _v_layout_fn
    _v_layout_fn = fn


def _valid_layout(layout, source: str) -> str:
    if layout not in V_LAYOUTS:
        raise ValueError(
            f"unknown IsoQuant V layout {layout!r} from {source}; expected one of {V_LAYOUTS}"
        )
    return layout


def preferred_v_layout(dim: int, bits: int) -> str:
    """The layout a new cache stores (dim, bits) V codes in: V_LAYOUT_ENV if set, else the
    registered preference, else "rows"; "tc16" only where tc16_ok(dim, bits)."""
    env = os.environ.get(V_LAYOUT_ENV)
    if env:
        layout = _valid_layout(env, f"${V_LAYOUT_ENV}")
    elif _v_layout_fn is not None:
        layout = _valid_layout(_v_layout_fn(dim, bits), "the registered V layout preference")
    else:
        layout = "rows"
    return layout if layout == "rows" or tc16_ok(dim, bits) else "rows"
