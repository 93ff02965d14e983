"""IsoQuant numerics: rotations, codebooks, packing, and compressed-space attention against
dense attention on the dequantized K/V (same codes)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from app.engine.kvcache.isoquant.attention import IsoQuantTensor, isoquant_attention_reference
from app.engine.kvcache.isoquant.codebook import (
    Codebook,
    code_gain,
    int8_lloyd_max,
    kv_codebook,
    lloyd_max,
)
from app.engine.kvcache.isoquant.packing import pack_codes, packed_row_bytes, unpack_codes
from app.engine.kvcache.isoquant.quantizer import Quantizer, decode, encode
from app.engine.kvcache.isoquant.rotation import KINDS, Rotation, quat_conj

DIMS = (64, 128, 256, 512)


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


# ---- rotation -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", DIMS)
def test_rotation_is_orthogonal_and_inverse_matches(kind, dim):
    rot = Rotation.make(kind, dim, n_heads=2, seed=3, layer=5)
    m = _np(rot.matrix()).astype(np.float64)  # [H, D, D]
    eye = np.eye(dim)
    assert np.abs(m @ m.transpose(0, 2, 1) - eye).max() < 1e-5
    assert np.abs(m.transpose(0, 2, 1) @ m - eye).max() < 1e-5
    x = mx.random.normal((1, 2, 7, dim), key=mx.random.key(1))
    np.testing.assert_allclose(_np(rot.inverse(rot.forward(x))), _np(x), atol=1e-5)
    # forward agrees with the explicit matrix
    np.testing.assert_allclose(
        _np(rot.forward(x)), np.einsum("hij,bhnj->bhni", m, _np(x)), atol=1e-4
    )


@pytest.mark.parametrize("kind", KINDS)
def test_rotation_preserves_inner_products_and_is_linear(kind):
    dim = 128
    rot = Rotation.make(kind, dim, n_heads=3, seed=0, layer=1)
    k = mx.random.key(7)
    q, kk = (
        mx.random.normal((2, 1, 3, 5, dim), key=k),
        mx.random.normal((2, 3, 9, dim), key=mx.random.key(8)),
    )
    q = q[:, 0]  # [2, 3, 5, D]
    ip = _np(q) @ _np(kk).transpose(0, 1, 3, 2)
    ip_rot = _np(rot.forward(q)) @ _np(rot.forward(kk)).transpose(0, 1, 3, 2)
    np.testing.assert_allclose(ip_rot, ip, atol=2e-4, rtol=1e-5)
    # Σ a_j R v_j = R Σ a_j v_j
    a = mx.random.normal((2, 3, 1, 9), key=mx.random.key(9))
    lhs = a @ rot.forward(kk)
    rhs = rot.forward(a @ kk)
    np.testing.assert_allclose(_np(lhs), _np(rhs), atol=1e-4, rtol=1e-5)


def test_v3_is_mx_hadamard_then_quaternion_blocks():
    dim = 64
    rot = Rotation.make("v3", dim, n_heads=1, seed=11, layer=0)
    x = mx.random.normal((1, 1, 4, dim), key=mx.random.key(2))
    h = _np(mx.hadamard_transform(x, scale=1 / math.sqrt(dim)))[0, 0]  # [4, D]
    blocks = _np(rot.blocks)[0]  # [D/4, 4, 4]
    expect = np.einsum("bij,nbj->nbi", blocks, h.reshape(4, dim // 4, 4)).reshape(4, dim)
    np.testing.assert_allclose(_np(rot.forward(x))[0, 0], expect, atol=1e-5)


def _hamilton(p, q):
    a1, b1, c1, d1 = p
    a2, b2, c2, d2 = q
    return np.array(
        [
            a1 * a2 - b1 * b2 - c1 * c2 - d1 * d2,
            a1 * b2 + b1 * a2 + c1 * d2 - d1 * c2,
            a1 * c2 - b1 * d2 + c1 * a2 + d1 * b2,
            a1 * d2 + b1 * c2 - c1 * b2 + d1 * a2,
        ]
    )


def test_block_matrix_is_the_quaternion_sandwich():
    from app.engine.kvcache.isoquant.rotation import quat_left, quat_right

    rng = np.random.default_rng(0)
    ql, qr, v = rng.standard_normal((3, 4))
    ql, qr = ql / np.linalg.norm(ql), qr / np.linalg.norm(qr)
    expect = _hamilton(_hamilton(ql, v), quat_conj(qr))
    np.testing.assert_allclose(quat_left(ql) @ quat_right(quat_conj(qr)) @ v, expect, atol=1e-12)


def test_v1_leaves_one_axis_per_block_unrotated():
    rot = Rotation.make("v1", 64, n_heads=1, seed=0, layer=0)
    blocks = _np(rot.blocks)[0]
    np.testing.assert_allclose(blocks[:, 0, 0], 1.0, atol=1e-6)  # real axis fixed: SO(3) only
    v3 = Rotation.make("v3", 64, n_heads=1, seed=0, layer=0)
    assert np.abs(_np(v3.blocks)[0][:, 0, 0] - 1.0).max() > 1e-2


def test_rotation_is_seeded_per_layer():
    a = _np(Rotation.make("v3", 64, 2, seed=0, layer=0).blocks)
    assert np.array_equal(a, _np(Rotation.make("v3", 64, 2, seed=0, layer=0).blocks))
    assert not np.allclose(a, _np(Rotation.make("v3", 64, 2, seed=0, layer=1).blocks))
    assert not np.allclose(a, _np(Rotation.make("v3", 64, 2, seed=1, layer=0).blocks))


def test_bad_head_dims_raise():
    with pytest.raises(ValueError, match="multiple of 4"):
        Rotation.make("v3", 66, 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        packed_row_bytes(68, 3)


def is_int8_grid(levels, scale: float) -> bool:
    """Whether every level / scale is an integer in [-127, 127] (to float32 rounding)."""
    g = np.asarray(levels, np.float64) / scale
    return bool(np.all(np.abs(g - np.rint(g)) <= 1e-5 * np.maximum(1.0, np.abs(g)))) and bool(
        np.all(np.abs(np.rint(g)) <= 127)
    )


# ---- codebook --------------------------------------------------------------------------------
@pytest.mark.parametrize("dim,bits", [(64, 3), (128, 3), (64, 4)])
def test_codebook_matches_monte_carlo_lloyd_max(dim, bits):
    """Lloyd's algorithm on samples of √d·x for random unit vectors lands on our levels."""
    rng = np.random.default_rng(dim + bits)
    g = rng.standard_normal((8000, dim))
    t = (math.sqrt(dim) * g / np.linalg.norm(g, axis=1, keepdims=True)).ravel()
    t = np.sort(np.concatenate([t, -t]))  # symmetrized samples: no sampling bias in the mean
    csum = np.concatenate([[0.0], np.cumsum(t)])
    n = 2**bits
    levels = np.quantile(t, (np.arange(n) + 0.5) / n)
    for _ in range(3000):  # Lloyd: cells at midpoints, levels at cell means
        edges = np.concatenate(
            [[0], np.searchsorted(t, 0.5 * (levels[1:] + levels[:-1])), [t.size]]
        )
        levels = (csum[edges[1:]] - csum[edges[:-1]]) / np.diff(edges)
    cb = lloyd_max(dim, bits)
    np.testing.assert_allclose(cb.levels, levels, atol=0.01)
    assert cb.levels == tuple(-x for x in reversed(cb.levels))  # symmetric
    # 3-bit Gaussian Lloyd–Max MSE is 0.03455; the sphere coordinate is slightly lighter-tailed
    assert cb.mse() < (0.0346 if bits == 3 else 0.0096)


def test_codebook_approaches_gaussian_lloyd_max():
    outer, inner = lloyd_max(4096, 3).levels[-2:], lloyd_max(4096, 3).levels[4]
    assert abs(outer[1] - 2.152) < 0.005 and abs(outer[0] - 1.344) < 0.005
    assert abs(inner - 0.2451) < 0.002


@pytest.mark.parametrize("dim", DIMS)
def test_int8_grid_codebook_is_exact_in_int8_and_nearly_lloyd_max(dim):
    cb, plain = int8_lloyd_max(dim, 3), lloyd_max(dim, 3)
    g = np.asarray(cb.levels) / cb.scale
    assert np.allclose(g, np.rint(g), atol=1e-9) and 0 < np.abs(g).min() and np.abs(g).max() <= 127
    assert cb.levels == tuple(-x for x in reversed(cb.levels))
    assert cb.thresholds == tuple(
        0.5 * (a + b) for a, b in zip(cb.levels[:-1], cb.levels[1:], strict=True)
    )
    # the restriction costs < 0.01% of MSE (measured 0.002-0.003%), less than rounding the
    # Lloyd-Max levels on the plain 127-step grid of the largest level
    assert plain.mse() < cb.mse() < 1.0001 * plain.mse()
    s = plain.levels[-1] / 127
    naive = [s * round(x / s) for x in plain.levels]
    naive_cb = Codebook(
        dim,
        3,
        tuple(naive),
        tuple(0.5 * (a + b) for a, b in zip(naive[:-1], naive[1:], strict=True)),
    )
    assert cb.mse() <= naive_cb.mse()
    assert is_int8_grid(cb.levels, cb.scale) and not is_int8_grid(plain.levels, s)


def test_the_cache_encodes_3_bits_on_the_int8_grid_and_4_bits_plain():
    assert kv_codebook(128, 3) == int8_lloyd_max(128, 3) and kv_codebook(128, 3).scale
    assert kv_codebook(128, 4) == lloyd_max(128, 4) and kv_codebook(128, 4).scale is None
    q = Quantizer.make(128, 3)
    assert np.allclose(np.array(q.levels), int8_lloyd_max(128, 3).levels, rtol=1e-6)


def test_level_lookup_is_the_gather_bit_for_bit_at_every_size_and_in_a_shapeless_trace():
    """Quantizer.lookup (a tree of selects up to 8 levels, else the gather) gives levels[codes]
    exactly: 2-, 3- and 4-bit tables in turn (each tree size its own trace), awkward shapes,
    inside a caller's shapeless compiled graph as the token count changes."""
    from app.engine.kvcache.isoquant.quantizer import lookup

    four = mx.array([-1.5, -0.5, 0.5, 1.5], mx.float32)
    for bits in (3, 4, 3, 2):
        if bits == 2:  # no 2-bit codebook: a 4-level table of its own through lookup()
            codes = mx.random.randint(0, 4, (3, 1, 33, 17), key=mx.random.key(2)).astype(mx.uint8)
            assert mx.array_equal(lookup(four, codes), four[codes]).item()
            continue
        q = Quantizer.make(64, bits)
        for shape in ((7,), (2, 3, 5, 64), (1, 1, 1, 1), (3, 1, 33, 17)):
            codes = mx.random.randint(0, 2**bits, shape, key=mx.random.key(len(shape) + bits))
            codes = codes.astype(mx.uint8)
            got, want = q.lookup(codes), q.levels[codes]
            assert got.dtype == mx.float32 and got.shape == shape
            assert mx.array_equal(got, want).item(), (bits, shape)
    levels = mx.array([-3.5, -1.25, -0.5, -0.125, 0.125, 0.5, 1.25, 3.5], mx.float32)
    outer = mx.compile(lambda c, s: lookup(levels, c) * s, shapeless=True)
    for t in (1, 9, 40):
        codes = mx.random.randint(0, 8, (2, 3, t, 64), key=mx.random.key(t)).astype(mx.uint8)
        s = mx.random.normal((2, 3, t, 1), key=mx.random.key(t + 1))
        assert mx.array_equal(outer(codes, s), levels[codes] * s).item(), t


def test_lookup_by_word_is_unpack_and_gather_bit_for_bit():
    """3-bit codes of D % 32 == 0 are looked up by word (Quantizer.lookup_words over
    packing.code_words): levels[unpack_codes(..)] exactly at every such head dim, from rows
    that are a strided slice of a larger buffer, inside a caller's shapeless compiled graph as
    the token count changes; the levels are the grid's float32 products, within an ulp of the
    codebook's. Other dims and 4 bits have no byte table."""
    from app.engine.kvcache.isoquant.attention import IsoQuantTensor, _word_columns
    from app.engine.kvcache.isoquant.packing import code_words

    for dim in (32, 64, 96, 128, 256, 512):
        q, cb = Quantizer.make(dim, 3), kv_codebook(dim, 3)
        g = np.rint(np.asarray(cb.levels) / cb.scale)
        assert np.array_equal(np.array(q.levels), g.astype(np.float32) * np.float32(cb.scale))
        np.testing.assert_allclose(np.array(q.levels), cb.levels, rtol=2**-23)
        codes = mx.random.randint(0, 8, (2, 3, 41, dim), key=mx.random.key(dim))
        packed = pack_codes(codes.astype(mx.uint8), 3)
        buf = mx.concatenate([packed, packed[:, :, :7]], axis=2)[:, 1:, 3:38]  # strided rows
        for p, c in ((packed, codes), (buf, codes[:, 1:, 3:38])):
            got = q.lookup_words(*_word_columns(code_words(p)))
            assert got.dtype == mx.float32 and got.shape == c.shape
            assert mx.array_equal(got, q.levels[c]).item(), dim
        t = IsoQuantTensor(buf, mx.ones(buf.shape[:3], mx.float16), None, q, None)
        assert t.code_words() is not None and mx.array_equal(t.levels(), q.levels[c]).item()
    outer = mx.compile(lambda s, *w: q.lookup_words(*w) * s, shapeless=True)
    for t in (1, 9, 40):
        codes = mx.random.randint(0, 8, (2, 3, t, 512), key=mx.random.key(t)).astype(mx.uint8)
        s = mx.random.normal((2, 3, t, 1), key=mx.random.key(t + 1))
        words = _word_columns(code_words(pack_codes(codes, 3)))
        assert mx.array_equal(outer(s, *words), q.levels[codes] * s).item(), t
    for dim, bits in ((80, 3), (64, 4), (8, 3)):
        q = Quantizer.make(dim, bits)
        assert q.grid is None
        with pytest.raises(ValueError, match="no byte table"):
            q.lookup_words(None, None, None, None)


# ---- packing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", (3, 4))
@pytest.mark.parametrize("dim", (8, 64, 128, 520))
def test_pack_unpack_round_trip(bits, dim):
    codes = mx.random.randint(0, 2**bits, (2, 3, 5, dim), key=mx.random.key(dim)).astype(mx.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == mx.uint8 and packed.shape == (2, 3, 5, dim * bits // 8)
    assert mx.array_equal(unpack_codes(packed, bits), codes)


def test_packed_bit_order_is_little_endian():
    codes = mx.array([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=mx.uint8)
    w = sum(c << (3 * i) for i, c in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert pack_codes(codes, 3).tolist() == [[w & 255, (w >> 8) & 255, (w >> 16) & 255]]
    four = pack_codes(mx.array([[3, 12, 0, 15, 1, 2, 4, 8]], dtype=mx.uint8), 4).tolist()
    assert four == [[3 | (12 << 4), 15 << 4, 1 | (2 << 4), 4 | (8 << 4)]]
    assert packed_row_bytes(128, 3) == 48


def test_3_bit_rows_of_32_code_blocks_are_nibble_words():
    """D a multiple of 32: block b is three little-endian words whose nibbles hold codes 0-23 in
    their low 3 bits and bit j of code 24+k in the top bit of nibble k of word j (packing.py)."""
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 8, (3, 64)).astype(np.uint8)
    packed = np.array(pack_codes(mx.array(codes), 3))
    assert packed.shape == (3, 24)
    words = packed.reshape(3, 2, 3, 4).astype(np.uint32)
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
    for r in range(3):
        for b in range(2):
            c = codes[r, 32 * b : 32 * b + 32].astype(np.uint32)
            w0, w1, w2 = (int(x) for x in words[r, b])
            for j, w in enumerate((w0, w1, w2)):
                assert [(w >> 4 * k) & 7 for k in range(8)] == list(c[8 * j : 8 * j + 8])
            top = ((w0 >> 3) & 0x11111111) | ((w1 >> 2) & 0x22222222) | ((w2 >> 1) & 0x44444444)
            assert [(top >> 4 * k) & 15 for k in range(8)] == list(c[24:])
    assert mx.array_equal(unpack_codes(mx.array(packed), 3), mx.array(codes))


# ---- quantizer -------------------------------------------------------------------------------
def test_encode_decode_error_is_lloyd_max_error():
    dim, rot = 128, Rotation.make("v3", 128, 2, seed=0, layer=0)
    q = Quantizer.make(dim, 3)
    x = mx.random.normal((1, 2, 512, dim), key=mx.random.key(4)) * 3.0
    codes, norms = encode(x, rot, q)
    assert codes.shape == (1, 2, 512, 48) and norms.dtype == mx.float16
    xh = decode(codes, norms, rot, q)
    rel = float(mx.sum((xh - x) ** 2) / mx.sum(x * x))
    assert abs(rel - lloyd_max(dim, 3).mse()) < 0.004  # ≈ 0.034: the codebook's own MSE


@pytest.mark.parametrize("bits", [3, 4])
def test_code_gain_is_the_centroid_shrink_and_predicts_the_score_noise(bits):
    dim = 64
    a, noise = code_gain(dim, bits)
    mse = kv_codebook(dim, bits).mse()
    # Lloyd–Max levels are centroids: E[u c] = E[c²] = 1 − MSE (the int8 grid nearly so)
    assert abs(a - (1 - mse)) < 2e-4 and abs(noise - mse * (1 - mse)) < 2e-4
    # coded keys' scores: ŝ = a·s + ε, Var(ε) = noise·|q|²|k|²/D (Monte Carlo over keys)
    rot = Rotation.make("v3", dim, 1, seed=0, layer=0)
    k = mx.random.normal((1, 1, 20000, dim), key=mx.random.key(5)) * 2.0
    q = mx.random.normal((dim,), key=mx.random.key(6))
    kh = decode(*encode(k, rot, Quantizer.make(dim, bits)), rot, Quantizer.make(dim, bits))
    s, sh = np.asarray(k @ q).ravel(), np.asarray(kh @ q).ravel()
    pred = noise * float(mx.sum(q * q)) * np.asarray(mx.sum(k * k, -1)).ravel() / dim
    assert abs(np.sum(sh * s) / np.sum(s * s) - a) < 0.004
    assert abs(np.mean((sh - a * s) ** 2) / np.mean(pred) - 1) < 0.02  # MSE alone: 3.4% off


# ---- attention -------------------------------------------------------------------------------
def _dense_attention(q, k, v, scale, mask=None, sinks=None):
    # q: [B, Hq, L, D]; k, v: [B, Hkv, T, D] float32 -> [B, Hq, L, D], plain float64 numpy
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    if sinks is not None:
        sink = np.broadcast_to(
            np.asarray(sinks, np.float64)[None, :, None, None], (*s.shape[:-1], 1)
        )
        s = np.concatenate([s, sink], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


def _make_kv(kind, b, hkv, tc, tf, dim, kbits, vbits, seed=0):
    rot = Rotation.make(kind, dim, hkv, seed=seed, layer=2)
    kq, vq = Quantizer.make(dim, kbits), Quantizer.make(dim, vbits)
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    kc, kn = encode(mx.random.normal((b, hkv, tc, dim), key=k1) * 2, rot, kq)
    vc, vn = encode(mx.random.normal((b, hkv, tc, dim), key=k2), rot, vq)
    kf = mx.random.normal((b, hkv, tf, dim), key=k3) * 2 if tf else None
    vf = mx.random.normal((b, hkv, tf, dim), key=k4) if tf else None
    keys, values = IsoQuantTensor(kc, kn, kf, kq, rot), IsoQuantTensor(vc, vn, vf, vq, rot)
    dense_k = decode(kc, kn, rot, kq)
    dense_v = decode(vc, vn, rot, vq)
    if tf:
        dense_k, dense_v = mx.concatenate([dense_k, kf], 2), mx.concatenate([dense_v, vf], 2)
    return keys, values, _np(dense_k), _np(dense_v)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    "kind,dim,hq,hkv,tc,tf,qlen,kbits,vbits",
    [
        ("v3", 64, 9, 3, 37, 5, 1, 3, 3),  # SmolLM2's GQA ratio
        ("v3", 128, 8, 1, 15, 0, 1, 3, 3),  # MQA, no float window
        ("v3", 128, 4, 4, 1, 1, 1, 4, 3),
        ("v2", 64, 8, 2, 29, 3, 4, 3, 3),  # several queries, causal
        ("v1", 256, 2, 2, 7, 2, 1, 4, 4),
        ("dense", 64, 4, 2, 33, 0, 3, 3, 3),
        ("v3", 512, 2, 1, 9, 4, 2, 3, 3),
    ],
)
def test_compressed_attention_equals_dense_on_dequantized_kv(
    kind, dim, hq, hkv, tc, tf, qlen, kbits, vbits
):
    b = 2
    keys, values, dk, dv = _make_kv(kind, b, hkv, tc, tf, dim, kbits, vbits, seed=dim + tc)
    q = mx.random.normal((b, hq, qlen, dim), key=mx.random.key(99))
    scale = 1 / math.sqrt(dim)
    mask = "causal" if qlen > 1 else None
    out = isoquant_attention_reference(q, keys, values, scale=scale, mask=mask)
    assert out.shape == (b, hq, qlen, dim) and out.dtype == q.dtype
    t = tc + tf
    np_mask = None
    if qlen > 1:
        np_mask = np.arange(t - qlen, t)[:, None] >= np.arange(t)[None]
    ref = _dense_attention(_np(q), dk, dv, scale, np_mask)
    assert _rel(_np(out), ref) < 1e-5
    # and mlx's own fused attention on the dequantized K/V agrees too
    fast = mx.fast.scaled_dot_product_attention(
        q, mx.array(dk), mx.array(dv), scale=scale, mask=mask
    )
    assert _rel(_np(out), _np(fast)) < 1e-5


def test_attention_masks_sinks_and_dtype():
    b, hq, hkv, dim, tc, tf, qlen = 1, 4, 2, 64, 20, 6, 3
    keys, values, dk, dv = _make_kv("v3", b, hkv, tc, tf, dim, 3, 3, seed=5)
    q = mx.random.normal((b, hq, qlen, dim), key=mx.random.key(3))
    scale = 0.125
    rng = np.random.default_rng(0)
    bool_mask = rng.random((b, 1, qlen, tc + tf)) > 0.3
    bool_mask[..., 0] = True
    add_mask = rng.standard_normal((b, hq, qlen, tc + tf)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    for m in (bool_mask, add_mask):
        out = isoquant_attention_reference(q, keys, values, scale, mask=mx.array(m))
        assert _rel(_np(out), _dense_attention(_np(q), dk, dv, scale, m)) < 1e-5
    out = isoquant_attention_reference(q, keys, values, scale, mask="causal", sinks=mx.array(sinks))
    causal = np.arange(tc + tf - qlen, tc + tf)[:, None] >= np.arange(tc + tf)[None]
    assert _rel(_np(out), _dense_attention(_np(q), dk, dv, scale, causal, sinks)) < 1e-5
    q16 = q.astype(mx.float16)
    assert isoquant_attention_reference(q16, keys, values, scale).dtype == mx.float16


@pytest.mark.parametrize("form", ["causal", "bool", "additive", "one_row", "sinks"])
def test_long_prompt_chunks_attend_in_query_blocks_with_the_same_numbers(form, monkeypatch):
    """A prompt chunk over SCORE_BLOCK scores runs in blocks of queries; each row's output is
    what the one-block computation gives up to float rounding (BLAS blocking), and dense
    attention on the dequantized K/V."""
    import app.engine.kvcache.isoquant.attention as att

    b, hq, hkv, dim, tc, tf, qlen = 2, 6, 2, 64, 40, 23, 23
    keys, values, dk, dv = _make_kv("v3", b, hkv, tc, tf, dim, 3, 3, seed=11)
    q = mx.random.normal((b, hq, qlen, dim), key=mx.random.key(4))
    t = tc + tf
    rng = np.random.default_rng(1)
    causal = np.arange(t - qlen, t)[:, None] >= np.arange(t)[None]
    mask, np_mask, sinks = "causal", causal, None
    if form == "bool":
        np_mask = (rng.random((b, 1, qlen, t)) > 0.3) | (np.arange(t) == 0)
        mask = mx.array(np_mask)
    elif form == "additive":
        np_mask = rng.standard_normal((b, hq, qlen, t)).astype(np.float32)
        mask = mx.array(np_mask)
    elif form == "one_row":
        np_mask = rng.standard_normal((1, t)).astype(np.float32)
        mask = mx.array(np_mask)
    elif form == "sinks":
        sinks = mx.array(rng.standard_normal(hq).astype(np.float32))
    whole = isoquant_attention_reference(q, keys, values, 0.125, mask=mask, sinks=sinks)
    monkeypatch.setattr(att, "SCORE_BLOCK", b * hq * t * 5)  # blocks of 5 query rows
    blocks = isoquant_attention_reference(q, keys, values, 0.125, mask=mask, sinks=sinks)
    assert blocks.shape == whole.shape
    np.testing.assert_allclose(_np(blocks), _np(whole), rtol=1e-5, atol=1e-5)
    ref = _dense_attention(_np(q), dk, dv, 0.125, np_mask, None if sinks is None else _np(sinks))
    assert _rel(_np(blocks), ref) < 1e-5


def test_float_prefix_segment_is_merged_in_position_order():
    b, hq, hkv, dim, tc, tf, tp, qlen = 1, 6, 2, 64, 12, 3, 4, 2
    keys, values, dk, dv = _make_kv("v3", b, hkv, tc, tf, dim, 3, 3, seed=8)
    pk = mx.random.normal((b, hkv, tp, dim), key=mx.random.key(20)) * 2
    pv = mx.random.normal((b, hkv, tp, dim), key=mx.random.key(21))
    keys = IsoQuantTensor(keys.codes, keys.norms, keys.fp, keys.quantizer, keys.rotation, None, pk)
    values = IsoQuantTensor(
        values.codes, values.norms, values.fp, values.quantizer, values.rotation, None, pv
    )
    dk, dv = np.concatenate([_np(pk), dk], 2), np.concatenate([_np(pv), dv], 2)
    q = mx.random.normal((b, hq, qlen, dim), key=mx.random.key(22))
    out = isoquant_attention_reference(q, keys, values, 0.125, mask="causal")
    t = tp + tc + tf
    causal = np.arange(t - qlen, t)[:, None] >= np.arange(t)[None]
    assert keys.shape == (b, hkv, t, dim)
    assert _rel(_np(out), _dense_attention(_np(q), dk, dv, 0.125, causal)) < 1e-5


def test_decoded_shadow_gives_identical_attention():
    keys, values, _, _ = _make_kv("v3", 1, 2, 40, 3, 64, 3, 3, seed=1)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    shadow_k = IsoQuantTensor(
        keys.codes, keys.norms, keys.fp, keys.quantizer, keys.rotation, keys.levels()
    )
    shadow_v = IsoQuantTensor(
        values.codes, values.norms, values.fp, values.quantizer, values.rotation, values.levels()
    )
    a = isoquant_attention_reference(q, keys, values, 0.1)
    b = isoquant_attention_reference(q, shadow_k, shadow_v, 0.1)
    assert mx.array_equal(a, b)


def test_registered_kernel_is_used_but_not_for_a_sink_prefix():
    import importlib

    mod = importlib.import_module(
        "app.engine.kvcache.isoquant.attention"
    )  # the module, not the function

    keys, values, _, _ = _make_kv("v3", 1, 2, 10, 2, 64, 3, 3, seed=4)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(1))
    calls = []
    previous = mod._kernel
    try:
        mod.register_kernel(
            lambda *a, **k: calls.append(1) or mod.isoquant_attention_reference(*a, **k)
        )
        mod.isoquant_attention(q, keys, values, 0.1)
        assert calls == [1]
        pk = mx.zeros((1, 2, 3, 64))
        kp = IsoQuantTensor(
            keys.codes, keys.norms, keys.fp, keys.quantizer, keys.rotation, None, pk
        )
        vp = IsoQuantTensor(
            values.codes, values.norms, values.fp, values.quantizer, values.rotation, None, pk
        )
        mod.isoquant_attention(q, kp, vp, 0.1)
        assert calls == [1]
        with pytest.raises(RuntimeError, match="sink prefix"):
            mod.isoquant_attention(q, kp, vp, 0.1, use_kernel=True)
    finally:
        mod.register_kernel(previous)
