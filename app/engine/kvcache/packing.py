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
needs x̂ itself (isoquant_attention.py).

Tokens. The cache keeps tokens [0, T_c) compressed and tokens [T_c, offset) — prefill before the
first decode step, then the recent window — in the model's float dtype (`fp`: [B, Hkv, T_f, D]).
"""

from __future__ import annotations

import mlx.core as mx

FORMAT_VERSION = 2
SUPPORTED_BITS = (3, 4)


def packed_row_bytes(dim: int, bits: int) -> int:
    """Bytes of one packed row of `dim` codes."""
    _check(dim, bits)
    return dim * bits // 8


def _check(dim: int, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"IsoQuant packs 3- or 4-bit codes, not {bits}-bit")
    if dim % 8:
        raise ValueError(f"head dim {dim} is not a multiple of 8: IsoQuant cannot pack it")


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
        top = c[..., None, 24:] >> mx.arange(3, dtype=mx.uint32)[:, None]  # bit j of code 24+k
        nib = (low & 7) | ((top & 1) << 3)
        w = mx.sum(nib << (mx.arange(8, dtype=mx.uint32) * 4), axis=-1)  # [.., block, 3]
        b = (w[..., None] >> mx.array([0, 8, 16, 24], dtype=mx.uint32)) & 0xFF
        return b.astype(mx.uint8).reshape(*lead, dim * 3 // 8)
    c = c.reshape(*lead, dim // 8, 8)
    # w: [..., D/8] uint32 holding 8 codes in its low 24 bits
    w = mx.sum(c << (mx.arange(8, dtype=mx.uint32) * 3), axis=-1)
    shifts = mx.array([0, 8, 16], dtype=mx.uint32)
    b = (w[..., None] >> shifts) & 0xFF  # [..., D/8, 3]
    return b.astype(mx.uint8).reshape(*lead, dim * 3 // 8)


def unpack_codes(packed: mx.array, bits: int) -> mx.array:
    """packed: [..., D*bits/8] uint8 -> codes [..., D] uint8 (inverse of pack_codes)."""
    nbytes = packed.shape[-1]
    dim = nbytes * 8 // bits
    _check(dim, bits)
    lead = packed.shape[:-1]
    p = packed.astype(mx.uint32)
    if bits == 4:
        codes = mx.stack([p & 0xF, p >> 4], axis=-1)
        return codes.reshape(*lead, dim).astype(mx.uint8)
    if dim % 32 == 0:
        p = p.reshape(*lead, dim // 32, 3, 4)
        w = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16) | (p[..., 3] << 24)  # [.., block, 3]
        nib = (w[..., None] >> (mx.arange(8, dtype=mx.uint32) * 4)) & 0xF  # [.., block, 3, 8]
        low = (nib & 7).reshape(*lead, dim // 32, 24)
        top = mx.sum((nib >> 3) << mx.arange(3, dtype=mx.uint32)[:, None], axis=-2)  # [.., 8]
        return mx.concatenate([low, top], axis=-1).reshape(*lead, dim).astype(mx.uint8)
    p = p.reshape(*lead, dim // 8, 3)
    w = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)  # [..., D/8]
    codes = (w[..., None] >> (mx.arange(8, dtype=mx.uint32) * 3)) & 0x7  # [..., D/8, 8]
    return codes.reshape(*lead, dim).astype(mx.uint8)
