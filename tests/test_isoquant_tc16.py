"""The tc16 layout of IsoQuant V codes (packing.py): the packing against its written spec, the
layout preference, and caches storing V in tc16 giving exactly what "rows" caches give."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from app.engine import kvcache
from app.engine.kvcache.isoquant import (
    IsoQuantKVCache,
    IsoQuantTensor,
    isoquant_attention_reference,
    packing,
)
from app.engine.kvcache.isoquant.packing import (
    TC16_CHUNK,
    V_LAYOUT_ENV,
    V_LAYOUTS,
    pack_codes,
    pack_codes_tc16,
    preferred_v_layout,
    register_v_layout,
    tc16_ok,
    unpack_codes,
    unpack_codes_tc16,
)


@pytest.fixture(autouse=True)
def no_layout_preference(monkeypatch):
    monkeypatch.delenv(V_LAYOUT_ENV, raising=False)
    register_v_layout(None)
    yield
    register_v_layout(None)


def _codes(shape, seed):
    return mx.random.randint(0, 8, shape, key=mx.random.key(seed)).astype(mx.uint8)


# ---- packing --------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("lead", [(), (5,), (2, 3)])
def test_round_trip(dim, lead):
    codes = _codes((*lead, 48, dim), dim + len(lead))
    packed = pack_codes_tc16(codes)
    assert packed.shape == (*lead, 48, dim * 3 // 8) and packed.dtype == mx.uint8
    assert mx.array_equal(unpack_codes_tc16(packed), codes).item()
    # a different arrangement of the same bits: not the rows format (unless by accident)
    assert not mx.array_equal(packed, pack_codes(codes, 3)).item()


def test_rejects_what_it_cannot_pack():
    assert tc16_ok(64, 3) and tc16_ok(128, 3) and tc16_ok(256, 3)
    assert not tc16_ok(96, 3) and not tc16_ok(32, 3) and not tc16_ok(128, 4)
    with pytest.raises(ValueError, match="16"):
        pack_codes_tc16(_codes((2, 20, 64), 0))
    with pytest.raises(ValueError, match="16"):
        unpack_codes_tc16(mx.zeros((2, 20, 24), mx.uint8))
    with pytest.raises(ValueError, match="D % 64"):
        pack_codes_tc16(_codes((16, 96), 0))
    with pytest.raises(ValueError, match="D % 64"):
        unpack_codes_tc16(mx.zeros((16, 36), mx.uint8))
    with pytest.raises(ValueError, match="4-bit"):
        pack_codes_tc16(_codes((16, 64), 0), bits=4)


def _spec_bits(p: int, d: int, dim: int, value: int) -> dict[int, int]:
    """{byte offset in the flat [N, 3D/8] array: byte} of code `value` at token p, coordinate d,
    written straight from the spec in packing.py's docstring."""
    chunk, pos = divmod(p, 16)
    i, s = (pos & 7) >> 1, (pos & 1) | ((pos >> 3) << 1)
    nbl = dim // 64
    lb, bb, cc = d // (dim // 8), (d % (dim // 8)) // 8, d % 8
    block = chunk * 6 * dim + 12 * ((lb * 4 + i) * nbl + bb)
    k = 4 * cc + s
    bits = []  # bit positions within the 12-byte block (words little endian)
    if k < 24:
        j, n = divmod(k, 8)
        bits += [(32 * j + 4 * n + t, (value >> t) & 1) for t in range(3)]
    else:
        n = k - 24
        bits += [(32 * j + 4 * n + 3, (value >> j) & 1) for j in range(3)]
    out: dict[int, int] = {}
    for pos_bit, bit in bits:
        if bit:
            off = block + pos_bit // 8
            out[off] = out.get(off, 0) | (1 << (pos_bit % 8))
    return out


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(
    "p,d",
    [(0, 0), (1, 7), (2, 6), (8, 3), (9, 31), (15, 63), (6, 14), (10, 38), (17, 7), (30, 62)],
)
@pytest.mark.parametrize("value", [7, 5, 2])
def test_a_single_code_lands_where_the_spec_says(dim, p, d, value):
    codes = np.zeros((32, dim), np.uint8)
    codes[p, d] = value
    packed = np.array(pack_codes_tc16(mx.array(codes))).reshape(-1)
    expected = np.zeros_like(packed)
    for off, byte in _spec_bits(p, d, dim, value).items():
        expected[off] = byte
    assert np.count_nonzero(expected) >= 1
    np.testing.assert_array_equal(packed, expected)
    assert np.array_equal(np.array(unpack_codes_tc16(mx.array(packed.reshape(32, -1)))), codes)


def test_random_codes_against_the_spec():
    """The packing is the OR of every code's bits placed by the spec."""
    dim, n = 128, 32
    codes = np.array(_codes((n, dim), 3))
    expected = np.zeros(n * dim * 3 // 8, np.uint8)
    for p in range(n):
        for d in range(dim):
            for off, byte in _spec_bits(p, d, dim, int(codes[p, d])).items():
                expected[off] |= byte
    packed = np.array(pack_codes_tc16(mx.array(codes))).reshape(-1)
    np.testing.assert_array_equal(packed, expected)


def test_group_slots_are_tokens_2i_2i1_2i8_2i9():
    """Block (lb=0, i, bb=0) of a chunk packs x[4cc + s] = code (token of slot s, coordinate cc)."""
    dim = 64
    codes = _codes((16, dim), 4)
    blocks = unpack_codes(pack_codes_tc16(codes).reshape(-1, 12), 3)  # [32 blocks, 32]
    for i in range(4):
        x = blocks[(0 * 4 + i) * 1 + 0].reshape(8, 4)  # [cc, s]
        for s, tok in enumerate((2 * i, 2 * i + 1, 2 * i + 8, 2 * i + 9)):
            assert mx.array_equal(x[:, s], codes[tok, :8]).item()


# ---- preference ---------------------------------------------------------------------------
def test_preferred_v_layout(monkeypatch):
    assert V_LAYOUTS == ("rows", "tc16") and TC16_CHUNK == 16
    assert preferred_v_layout(128, 3) == "rows"  # nothing registered, no env
    calls = []

    def prefer(dim, bits):
        calls.append((dim, bits))
        return "tc16"

    register_v_layout(prefer)
    assert preferred_v_layout(128, 3) == "tc16" and calls == [(128, 3)]
    assert preferred_v_layout(96, 3) == "rows" and preferred_v_layout(128, 4) == "rows"
    monkeypatch.setenv(V_LAYOUT_ENV, "rows")  # the environment overrides the registration
    assert preferred_v_layout(128, 3) == "rows"
    monkeypatch.setenv(V_LAYOUT_ENV, "tc16")
    register_v_layout(None)
    assert preferred_v_layout(64, 3) == "tc16" and preferred_v_layout(96, 3) == "rows"
    assert preferred_v_layout(64, 4) == "rows"
    monkeypatch.setenv(V_LAYOUT_ENV, "columns")
    with pytest.raises(ValueError, match="columns"):
        preferred_v_layout(64, 3)
    monkeypatch.delenv(V_LAYOUT_ENV)
    register_v_layout(lambda d, b: "bogus")
    with pytest.raises(ValueError, match="bogus"):
        preferred_v_layout(64, 3)
    register_v_layout(None)
    assert preferred_v_layout(64, 3) == "rows"


def test_caches_take_the_preference_or_their_argument(monkeypatch):
    kv = [mx.random.normal((1, 2, 4, 64), key=mx.random.key(s)) for s in (1, 2)]
    register_v_layout(lambda d, b: "tc16")
    c = IsoQuantKVCache()
    c.update_and_fetch(*kv)
    assert c.v_layout == "tc16"
    c = IsoQuantKVCache(key_bits=3, value_bits=4)
    c.update_and_fetch(*kv)
    assert c.v_layout == "rows"  # 4-bit V has no tc16 layout
    c = IsoQuantKVCache(v_layout="rows")
    c.update_and_fetch(*kv)
    assert c.v_layout == "rows"
    register_v_layout(None)
    monkeypatch.setenv(V_LAYOUT_ENV, "tc16")
    c = IsoQuantKVCache()
    c.update_and_fetch(*kv)
    assert c.v_layout == "tc16"
    with pytest.raises(ValueError, match="V layout"):
        IsoQuantKVCache(v_layout="cols")
    c = IsoQuantKVCache(v_layout="tc16")
    with pytest.raises(ValueError, match="tc16"):
        c.update_and_fetch(*[mx.zeros((1, 2, 4, 96)) for _ in "kv"])


# ---- caches ---------------------------------------------------------------------------------
D, HKV, HQ = 64, 2, 4


def _kv(t, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, HKV, t, D), key=k1), mx.random.normal((1, HKV, t, D), key=k2)


def _pair(**kw):
    return IsoQuantKVCache(v_layout="rows", **kw), IsoQuantKVCache(v_layout="tc16", **kw)


def _check_same(rows_out, tc_out, q, c_tc=None, c_rows=None):
    (kr, vr), (kt, vt) = rows_out, tc_out
    assert isinstance(vt, IsoQuantTensor) and vt.layout == "tc16" and vr.layout == "rows"
    assert kt.layout == "rows" and mx.array_equal(kt.codes, kr.codes).item()
    tc = vr.compressed_len
    assert vt.compressed_len == kt.compressed_len == tc and vt.shape == vr.shape
    assert vt.codes.shape[2] == -(-tc // 16) * 16 and vr.codes.shape[2] == tc
    assert mx.array_equal(vt.norms, vr.norms).item()
    assert mx.array_equal(vt.levels(), vr.levels()).item()
    assert mx.array_equal(vt.as_rows().codes, vr.codes).item() and vr.as_rows() is vr
    if vt.decoded is None and c_tc is not None:
        # the last chunk's rows past the split: codes encoded ahead, then zero codes
        pad = unpack_codes_tc16(vt.codes)[:, :, tc:]
        ahead = min(c_tc._enc_rows - tc, pad.shape[2])
        assert ahead >= 0 and not pad[:, :, ahead:].any().item()
        if ahead and c_rows is not None:  # the same codes the rows cache wrote ahead
            assert c_rows._enc_rows == c_tc._enc_rows
            want = unpack_codes(c_rows.v_codes[:, :, tc : tc + ahead], 3)
            assert mx.array_equal(pad[:, :, :ahead], want).item()
    for sinks in (None, mx.array([0.5, -1.0, 0.0, 2.0])):
        a = isoquant_attention_reference(q, kr, vr, scale=0.125, sinks=sinks)
        b = isoquant_attention_reference(q, kt, vt, scale=0.125, sinks=sinks)
        assert mx.array_equal(a, b).item()
    if c_tc is not None:  # the cache's buffer holds the same chunks as the view
        n = vt.codes.shape[2]
        assert mx.array_equal(c_tc.v_codes[:, :, :n], vt.codes).item()


@pytest.mark.parametrize(
    "sink,shadow,compress_every", [(0, False, 3), (3, False, 3), (0, True, 5), (2, False, 1)]
)
def test_tc16_cache_equals_rows_cache(sink, shadow, compress_every):
    k, v = _kv(37 + 40 + 30, 11)
    rows, tc = _pair(window=5, sink=sink, decoded_shadow=shadow, compress_every=compress_every)
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(5))
    for c in (rows, tc):
        c.update_and_fetch(k[:, :, :37], v[:, :, :37])
    seen = set()
    for t in range(37, 77):
        a = rows.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        b = tc.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        seen.add(tc._n_rows % 16)
        if t % 4 == 0 or t == 76:
            _check_same(a, b, q, tc, rows)
    assert len(seen) > 4  # chunks filled partially, then repacked with more tokens
    # both encode ahead (compress_every); tc16 holds V codes in whole chunks
    assert rows.encoded == tc.encoded
    assert rows.used_nbytes <= tc.used_nbytes < rows.used_nbytes + 16 * HKV * D * 3 // 8 + 1

    # trim back into the compressed region (mid-chunk), then decode other tokens
    for c in (rows, tc):
        c.trim(12)
    assert tc.compressed == rows.compressed and tc.compressed < 77 - 5
    assert tc._enc_rows % 16  # a partial chunk: its dead rows went back to zero codes
    assert not unpack_codes_tc16(tc.v_codes)[:, :, tc._enc_rows :].any().item()
    for t in range(65, 95):
        a = rows.update_and_fetch(k[:, :, t + 12 : t + 13], v[:, :, t + 12 : t + 13])
        b = tc.update_and_fetch(k[:, :, t + 12 : t + 13], v[:, :, t + 12 : t + 13])
        if t % 5 == 0:
            _check_same(a, b, q, tc, rows)
    _check_same(a, b, q, tc, rows)
    # the same bytes as a cache that saw the surviving tokens without a trim
    ref = IsoQuantKVCache(v_layout="tc16", window=5, sink=sink, compress_every=compress_every)
    ref.update_and_fetch(k[:, :, :65], v[:, :, :65])
    for t in range(65, 95):
        ref.update_and_fetch(k[:, :, t + 12 : t + 13], v[:, :, t + 12 : t + 13])
    for c in (ref, tc):
        c.finish_prefill()
    assert ref.offset == tc.offset == 95 and ref.compressed == tc.compressed == 90
    (rk, rv), (tk, tv) = ref._fetch(), tc._fetch()
    assert mx.array_equal(rk.codes, tk.codes).item()
    # what attention reads (codes ahead of it depend on the batches' phase)
    assert mx.array_equal(rv.codes_unpacked(), tv.codes_unpacked()).item()
    for c in (ref, tc):  # and past what each encoded, zero codes
        assert not unpack_codes_tc16(c.v_codes)[:, :, c._enc_rows :].any().item()


def test_bulk_prefill_of_whole_and_partial_chunks():
    for n in (16, 32, 33, 47, 1, 300):
        k, v = _kv(n + 1, n)
        rows, tc = _pair(window=0)
        for c in (rows, tc):
            c.update_and_fetch(k[:, :, :n], v[:, :, :n])
            c.finish_prefill()
        q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(n))
        _check_same(rows._fetch(), tc._fetch(), q, tc, rows)
        a = rows.update_and_fetch(k[:, :, n:], v[:, :, n:])
        b = tc.update_and_fetch(k[:, :, n:], v[:, :, n:])
        _check_same(a, b, q, tc, rows)
        assert tc.v_codes.shape[2] % 16 == 0 and tc.v_codes.shape[2] >= tc._n_rows


def test_state_round_trip_keeps_the_layout_where_it_is_read(tmp_path):
    k, v = _kv(60, 21)
    rows, tc = _pair(window=4, compress_every=3)
    for c in (rows, tc):
        c.update_and_fetch(k[:, :, :30], v[:, :, :30])
        for t in range(30, 53):
            c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert tc._enc_rows % 16
    st = tc.state
    assert st[2].shape[2] == -(-tc._enc_rows // 16) * 16 and st[0].shape[2] == tc._enc_rows
    assert json.loads(tc.meta_state)["v_layout"] == "tc16"
    assert json.loads(rows.meta_state)["v_layout"] == "rows"
    register_v_layout(lambda d, b: "tc16")  # loaded where tc16 is read: kept as it is
    c2 = IsoQuantKVCache.from_state(st, tc.meta_state)
    path = tmp_path / "cache.safetensors"
    kvcache.save_cache(path, [tc, rows])
    (c3, r3), _ = kvcache.load_cache(path)
    register_v_layout(None)
    assert r3.v_layout == "tc16"  # (a rows state loaded there is repacked)
    (c3b, r3), _ = kvcache.load_cache(path)  # where rows are read: the tc16 one is repacked
    assert c3b.v_layout == "rows" and r3.v_layout == "rows"
    shadow = IsoQuantKVCache(window=4, compress_every=3, decoded_shadow=True, v_layout="tc16")
    shadow._setup(HKV, D, D)
    shadow.state = st  # levels rebuilt from the tc16 codes
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(8))
    assert c2.v_layout == c3.v_layout == shadow.v_layout == "tc16" and r3.v_layout == "rows"
    _check_same(rows._fetch(), c2._fetch(), q)
    _check_same(rows._fetch(), c3._fetch(), q)
    _check_same(r3._fetch(), shadow._fetch(), q)
    assert shadow._fetch()[1].decoded is not None
    assert mx.array_equal(rows._fetch()[1].levels(), c3b._fetch()[1].levels()).item()
    for t in range(50, 60):  # all continue identically
        a = rows.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        for c in (tc, c2, c3):
            b = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            _check_same(a, b, q, c)
        b = c3b.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert b[1].layout == "rows" and mx.array_equal(b[1].codes, a[1].codes).item()
    # a state saved before the layout existed (no "v_layout" in its meta) is read as rows
    old = json.loads(rows.meta_state)
    del old["v_layout"]
    r4 = IsoQuantKVCache.from_state(rows.state, json.dumps(old))
    assert r4.v_layout == "rows"
    _check_same(r4._fetch(), c2._fetch(), q)
    # a tc16 state is not taken for a rows cache's
    with pytest.raises(ValueError, match="layout"):
        r4.state = c2.state
    # a cache never set up learns the layout from the state's shapes
    c5 = IsoQuantKVCache(window=4)
    c5.state = c2.state
    assert c5.v_layout == "tc16"


def test_tensor_layout_is_checked():
    k, v = _kv(20, 41)
    c = IsoQuantKVCache(v_layout="tc16", window=0)
    c.update_and_fetch(k, v)
    c.finish_prefill()
    vt = c._fetch()[1]
    with pytest.raises(ValueError, match="layout"):
        IsoQuantTensor(vt.codes, vt.norms, None, vt.quantizer, vt.rotation, layout="cols")
    rows = vt.as_rows()
    assert rows.layout == "rows" and rows.codes.shape[2] == 20 == vt.compressed_len
    assert rows.norms is vt.norms and rows.rotation is vt.rotation
    assert mx.array_equal(rows.levels(), vt.levels()).item()


@pytest.mark.parametrize("src,dst", [("rows", "tc16"), ("tc16", "rows")])
def test_a_loaded_state_takes_the_layout_this_backend_reads(src, dst, monkeypatch):
    """A state saved in one layout and loaded where the other is preferred is repacked once on
    load: the same levels and attention, decoding on writes the same codes as a cache that was
    in `dst` all along."""
    monkeypatch.delenv(packing.V_LAYOUT_ENV, raising=False)
    mx.random.seed(4)
    kv = [mx.random.normal((1, 2, 41, 64)) for _ in "kv"]
    steps = [[mx.random.normal((1, 2, 1, 64)) for _ in "kv"] for _ in range(9)]

    def make(layout):
        c = IsoQuantKVCache("v3", 3, 3, window=4, layer=2, compress_every=3, v_layout=layout)
        c.update_and_fetch(*kv)
        c.finish_prefill()
        for s in steps[:4]:
            c.update_and_fetch(*s)
        return c

    saved, native = make(src), make(dst)
    packing.register_v_layout(lambda dim, bits: dst)
    try:
        loaded = IsoQuantKVCache.from_state(saved.state, saved.meta_state)
    finally:
        packing.register_v_layout(None)
    assert loaded.v_layout == dst
    for s in steps[4:]:
        (_, v1), (_, v2) = loaded.update_and_fetch(*s), native.update_and_fetch(*s)
        assert v1.layout == v2.layout == dst
        assert mx.array_equal(v1.levels(), v2.levels()).item()
    r = native._v_rows(native._n_rows)
    assert mx.array_equal(loaded.v_codes[:, :, :r], native.v_codes[:, :, :r]).item()
