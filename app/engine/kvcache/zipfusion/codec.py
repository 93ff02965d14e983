"""ZipFusion's lossless BF16 block codec (SPEC §5), as a reference in MLX ops.

A block is 512 BF16 values. Base `b` = smallest exponent rounded down to even; if every exponent
lies in [b, b+15] the block is stored as 256 code bytes + 512 low bytes (768 B, 75%), else raw
(1024 B). Each group of 8 values (the 8 one GPU thread decodes) has 4 code bytes: byte i holds
value i's sign in bit 7 and d = (e-b)>>1 in bits 0-2, value i+4's sign in bit 6 and d in bits 3-5.

Values inside a page are stored in *fragment order*: the order in which the fused kernel's lanes
feed them to `mma.m16n8k16` (K as the B operand of Q·Kᵀ, V as the B operand of P·V), so a lane's
8 values are contiguous and decode straight into MMA registers. Everything here runs on any
backend and is bit-exact; the CUDA kernels in `kernels.py` beside it must match it.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

PAGE_TOKENS = 16  # tokens per KV page
BLOCK_VALUES = 512  # values per independently compressed block
GROUP_VALUES = 8  # values one thread decodes with the two-add trick
GRANULE = 256  # bytes: unit of pool rows, block sizes and metadata offsets
RAW_FLAG = 0xFF  # metadata byte of a block stored raw (b/2 <= 127 otherwise)
RAW_BLOCK_BYTES = 1024
ZIP_BLOCK_BYTES = 768
CODE_BYTES = 256  # 64 groups x 4 code bytes, then 512 low bytes

# Dims a lane holds in one K group: two k-tiles (16 dims each) of the B fragment of m16n8k16.
_K_GROUP_DIMS = (0, 1, 8, 9, 16, 17, 24, 25)
# Tokens a lane holds in one V group (k = token axis of the B fragment of P·V).
_V_GROUP_TOKENS = (0, 1, 8, 9)


def group_index(lane: int, g: int) -> int:
    """Where lane `lane`'s group `g` (0 or 1) sits in a block: lanes contiguous per g, so a
    warp's reads of one g are contiguous (coalesced in global, conflict-free in shared memory)."""
    return 32 * g + lane


def check_head_dim(head_dim: int) -> int:
    """Blocks per (page, head, K or V); head dims must be multiples of 32 up to 256."""
    if head_dim % 32 or not 32 <= head_dim <= 256:
        raise ValueError(
            f"ZipFusion needs a head dim that is a multiple of 32 in [32, 256], got {head_dim}"
        )
    return head_dim // 32


def meta_words(head_dim: int) -> int:
    """uint32 words of metadata per (page, head, K or V): offset + one byte per block.

    SPEC §5 gives 8 bytes (4 blocks, head dim <= 128); head dim 256 has 8 blocks -> 16 bytes."""
    nb = check_head_dim(head_dim)
    return 2 if nb <= 4 else 4


@functools.cache
def k_perm(head_dim: int) -> np.ndarray:
    """Fragment position -> index (token * D + dim) in a [16, D] K page."""
    nb = check_head_dim(head_dim)
    out = np.empty(PAGE_TOKENS * head_dim, np.int32)
    for j in range(nb):
        for lane in range(32):
            for g in range(2):
                token = 8 * g + (lane >> 2)
                for i, dd in enumerate(_K_GROUP_DIMS):
                    dim = 32 * j + 2 * (lane & 3) + dd
                    out[j * BLOCK_VALUES + group_index(lane, g) * 8 + i] = token * head_dim + dim
    return out


@functools.cache
def v_perm(head_dim: int) -> np.ndarray:
    """Fragment position -> index (token * D + dim) in a [16, D] V page."""
    nb = check_head_dim(head_dim)
    out = np.empty(PAGE_TOKENS * head_dim, np.int32)
    for j in range(nb):
        for lane in range(32):
            for g in range(2):
                for i in range(8):
                    dim = 32 * j + 16 * g + (lane >> 2) + 8 * (i >> 2)
                    token = 2 * (lane & 3) + _V_GROUP_TOKENS[i & 3]
                    out[j * BLOCK_VALUES + group_index(lane, g) * 8 + i] = token * head_dim + dim
    return out


def perm(kind: str, head_dim: int) -> np.ndarray:
    if kind == "k":
        return k_perm(head_dim)
    if kind == "v":
        return v_perm(head_dim)
    raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")


@functools.cache
def positions(kind: str, head_dim: int) -> np.ndarray:
    """Inverse of `perm`: [16, D] -> fragment position of (token, dim)."""
    p = perm(kind, head_dim)
    inv = np.empty_like(p)
    inv[p] = np.arange(p.size, dtype=np.int32)
    return inv.reshape(PAGE_TOKENS, head_dim)


def as_bits(x: mx.array) -> mx.array:
    """BF16 values -> their uint16 bit patterns (no rounding)."""
    if x.dtype == mx.uint16:
        return x
    if x.dtype != mx.bfloat16:
        raise TypeError(f"ZipFusion stores BF16 KV, got {x.dtype}")
    return x.view(mx.uint16)


def to_fragment_order(pages: mx.array, kind: str) -> mx.array:
    """pages: [..., 16, D] bf16 or uint16 -> [..., nb, 512] uint16 in fragment order."""
    *lead, t, d = pages.shape
    if t != PAGE_TOKENS:
        raise ValueError(f"a page holds {PAGE_TOKENS} tokens, got {t}")
    flat = as_bits(pages).reshape(*lead, t * d)
    out = mx.take(flat, mx.array(perm(kind, d)), axis=-1)
    return out.reshape(*lead, d // 32, BLOCK_VALUES)


def from_fragment_order(blocks: mx.array, kind: str) -> mx.array:
    """blocks: [..., nb, 512] uint16 -> [..., 16, D] bf16."""
    *lead, nb, _ = blocks.shape
    d = 32 * nb
    flat = blocks.reshape(*lead, nb * BLOCK_VALUES)
    inv = mx.array(positions(kind, d).reshape(-1))
    return mx.take(flat, inv, axis=-1).reshape(*lead, PAGE_TOKENS, d).view(mx.bfloat16)


def _bytes_to_u16(b: mx.array) -> mx.array:
    b = b.astype(mx.uint16)
    return b[..., 0::2] | (b[..., 1::2] << 8)


def _u16_to_bytes(w: mx.array) -> mx.array:
    lo = (w & 0xFF).astype(mx.uint8)
    hi = (w >> 8).astype(mx.uint8)
    return mx.stack([lo, hi], axis=-1).reshape(*w.shape[:-1], w.shape[-1] * 2)


def encode_blocks(blocks: mx.array) -> tuple[mx.array, mx.array]:
    """blocks: [N, 512] uint16 (fragment order) -> (flags [N] uint8, payload [N, 512] uint16).

    payload holds the block's stored bytes little-endian: 768 bytes (codes, lows) then zeros for
    a compressed block, the 512 values verbatim for a raw one. flags: b/2, or 0xFF for raw."""
    if blocks.ndim != 2 or blocks.shape[1] != BLOCK_VALUES or blocks.dtype != mx.uint16:
        raise ValueError(
            f"blocks must be [N, {BLOCK_VALUES}] uint16, got {blocks.shape} {blocks.dtype}"
        )
    n = blocks.shape[0]
    v = blocks.astype(mx.uint32)
    e = (v >> 7) & 0xFF
    s = v >> 15
    base = mx.min(e, axis=1) & 0xFE
    ok = (mx.max(e, axis=1) - base) <= 15
    d = ((e - base[:, None]) >> 1) & 7  # e >= base always, so no wrap-around
    s = s.reshape(n, 64, 8)
    d = d.reshape(n, 64, 8)
    code = (s[..., :4] << 7) | d[..., :4] | (s[..., 4:] << 6) | (d[..., 4:] << 3)
    code = code.astype(mx.uint8).reshape(n, CODE_BYTES)
    lows = (v & 0xFF).astype(mx.uint8)
    pad = mx.zeros((n, RAW_BLOCK_BYTES - ZIP_BLOCK_BYTES), mx.uint8)
    packed = _bytes_to_u16(mx.concatenate([code, lows, pad], axis=1))
    payload = mx.where(ok[:, None], packed, blocks)
    flags = mx.where(ok, base >> 1, RAW_FLAG).astype(mx.uint8)
    return flags, payload


def decode_blocks(flags: mx.array, payload: mx.array) -> mx.array:
    """Inverse of `encode_blocks`, with the kernel's two-add trick on 32-bit code words."""
    n = payload.shape[0]
    by = _u16_to_bytes(payload)
    c = by[:, :CODE_BYTES].astype(mx.uint32).reshape(n, 64, 4)
    w = c[..., 0] | (c[..., 1] << 8) | (c[..., 2] << 16) | (c[..., 3] << 24)  # [N, 64]
    rep = (flags.astype(mx.uint32) * 0x01010101)[:, None]
    hi_a = (w & 0x87878787) + rep  # values 0-3 of each group: sign|(b/2 + d), no carries
    hi_b = (((w << 1) & 0x80808080) | ((w >> 3) & 0x07070707)) + rep  # values 4-7
    shifts = mx.array([0, 8, 16, 24], dtype=mx.uint32)
    hi = mx.concatenate(
        [(hi_a[..., None] >> shifts) & 0xFF, (hi_b[..., None] >> shifts) & 0xFF], axis=-1
    )  # [N, 64, 8]
    lows = by[:, CODE_BYTES:ZIP_BLOCK_BYTES].astype(mx.uint32).reshape(n, 64, 8)
    vals = ((hi << 8) | lows).astype(mx.uint16).reshape(n, BLOCK_VALUES)
    return mx.where((flags == RAW_FLAG)[:, None], payload, vals)


def block_granules(flags: np.ndarray) -> np.ndarray:
    """Stored size of each block in 256-byte granules (3 compressed, 4 raw)."""
    return np.where(np.asarray(flags) == RAW_FLAG, 4, 3).astype(np.int64)


def pack_meta(offset_granules: int, flags) -> np.ndarray:
    """Metadata of one (page, head, K or V): uint32 offset (in granules) of the first block,
    then one byte per block (b/2 or 0xFF), padded with 0xFF."""
    flags = [int(f) for f in flags]
    words = 2 if len(flags) <= 4 else 4
    if not 0 <= offset_granules < 2**32:
        raise ValueError(f"offset {offset_granules} does not fit the 4-byte metadata field")
    raw = bytearray(b"\xff" * (4 * words))
    raw[0:4] = int(offset_granules).to_bytes(4, "little")
    raw[4 : 4 + len(flags)] = bytes(flags)
    return np.frombuffer(bytes(raw), dtype=np.uint32).copy()


def compressible_fraction(values: mx.array) -> float:
    """Fraction of 512-value blocks of `values` (any shape, size a multiple of 512) that compress."""
    bits = as_bits(values).reshape(-1, BLOCK_VALUES)
    e = (bits.astype(mx.uint32) >> 7) & 0xFF
    ok = (mx.max(e, axis=1) - (mx.min(e, axis=1) & 0xFE)) <= 15
    return float(mx.mean(ok.astype(mx.float32)).item())


def page_blocks_compressible(kv: mx.array) -> mx.array:
    """kv: [..., T, D] bf16 with T a multiple of 16 -> bool [..., T/16, D/32]: which of the
    page's blocks (16 tokens x 32 dims, the set a fragment-order block holds) compress."""
    *lead, t, d = kv.shape
    check_head_dim(d)
    if t % PAGE_TOKENS:
        raise ValueError(f"token count {t} is not a multiple of {PAGE_TOKENS}")
    e = (as_bits(kv).astype(mx.uint32) >> 7) & 0xFF
    e = e.reshape(*lead, t // PAGE_TOKENS, PAGE_TOKENS, d // 32, 32)
    e = mx.moveaxis(e, -3, -2).reshape(*lead, t // PAGE_TOKENS, d // 32, BLOCK_VALUES)
    return (mx.max(e, axis=-1) - (mx.min(e, axis=-1) & 0xFE)) <= 15
