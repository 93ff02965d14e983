"""IsoQuant packed KV format (version 2): the contract between the cache, the MLX reference
attention and the fused Metal/CUDA kernels.

Per layer, per K and per V, the compressed part of the cache holds two arrays:

    codes: [B, Hkv, T, D*bits/8] uint8   one row of packed codes per cached vector
    norms: [B, Hkv, T]           float16 ‖x‖ of the original (= rotated) vector

Codes. A row is a little-endian bit stream of D codes of `bits` bits each: code i occupies bits
[bits*i, bits*i + bits) of the row, where bit j of the stream is bit (j % 8) of byte j // 8.
- 3-bit: every 8 coordinates take 3 bytes. For group g (coordinates 8g..8g+7), the 24-bit word
  w = b[3g] | b[3g+1] << 8 | b[3g+2] << 16 holds code 8g+k in bits 3k..3k+2 (D = 64 → 24 bytes,
  D = 128 → 48 bytes). Read as uint32 words, word j holds stream bits 32j..32j+31 (a code may
  straddle two words); D*3/8 is a multiple of 4 for every D that is a multiple of 32.
- 4-bit: byte i holds code 2i in its low nibble and code 2i+1 in its high nibble.
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
    p = p.reshape(*lead, dim // 8, 3)
    w = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)  # [..., D/8]
    codes = (w[..., None] >> (mx.arange(8, dtype=mx.uint32) * 3)) & 0x7  # [..., D/8, 8]
    return codes.reshape(*lead, dim).astype(mx.uint8)
