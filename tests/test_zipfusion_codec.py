"""ZipFusion's block codec (reference in MLX ops): bit-exact round trips and the exact format."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from app.engine.kvcache.zipfusion import codec


def _bf16_bits(x: np.ndarray) -> mx.array:
    return mx.array(x.astype(np.float32)).astype(mx.bfloat16).view(mx.uint16)


def _roundtrip(bits: mx.array) -> tuple[np.ndarray, mx.array]:
    flags, payload = codec.encode_blocks(bits)
    back = codec.decode_blocks(flags, payload)
    assert bool(mx.all(back == bits)), "round trip changed bits"
    return np.array(flags), payload


def test_random_bit_patterns_round_trip():
    rng = np.random.default_rng(1)
    bits = mx.array(rng.integers(0, 1 << 16, (257, 512), dtype=np.uint16))
    flags, _ = _roundtrip(bits)
    assert (flags == codec.RAW_FLAG).all()  # random exponents span far more than 16


def test_random_bf16_round_trip_and_mostly_compresses():
    rng = np.random.default_rng(2)
    bits = _bf16_bits(rng.standard_normal((300, 512)) * rng.uniform(1e-3, 1e3, (300, 1)))
    flags, _ = _roundtrip(bits)
    assert 0.5 < (flags != codec.RAW_FLAG).mean() <= 1.0


def test_special_values_round_trip():
    rng = np.random.default_rng(3)
    specials = np.array(
        [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F7F], np.uint16
    )
    blocks = []
    # zeros and subnormals only: all exponents 0 -> compresses with b = 0
    blocks.append(rng.choice(specials[:5], 512))
    # inf/nan with large normals: exponents 240..255 -> compresses, bits kept exactly
    near = (
        (rng.integers(240, 255, 512) << 7)
        | rng.integers(0, 128, 512)
        | (rng.integers(0, 2, 512) << 15)
    )
    near[:6] = specials[5:9].tolist() + [0x7FFF, 0xFFFF]
    blocks.append(near)
    # everything mixed: spans > 16 exponents -> raw
    blocks.append(rng.choice(specials, 512))
    bits = mx.array(np.stack(blocks).astype(np.uint16))
    flags, _ = _roundtrip(bits)
    assert flags[0] == 0 and flags[1] == 120 and flags[2] == codec.RAW_FLAG


@pytest.mark.parametrize("span,compressed", [(14, True), (15, True), (16, False), (17, False)])
def test_window_edge(span, compressed):
    """Exponents [b, b+15] compress; one more exponent above (or an odd minimum) does not."""
    lo = 100  # even: b = 100
    e = np.full(512, lo, np.uint16)
    e[7] = lo + span
    bits = mx.array(((e << 7) | np.uint16(0x55))[None])
    flags, payload = _roundtrip(bits)
    assert (flags[0] != codec.RAW_FLAG) == compressed
    # an odd minimum rounds b down: 101..116 spans 16 values above b = 100 -> raw
    e2 = np.full(512, 101, np.uint16)
    e2[3] = 116
    flags2, _ = _roundtrip(mx.array((e2 << 7)[None]))
    assert flags2[0] == codec.RAW_FLAG


def test_format_matches_spec_bytes():
    """The paper's example: code byte 0xD0 with b/2 = 63 gives high bytes 0xBF and 0xC1."""
    vals = np.zeros(512, np.uint16)
    # group 0: value 0 = sign 1, e = 126 (d 0, b 126); value 4 = sign 1, e = 130 (d 2)
    vals[:8] = (126 << 7) | 0x8000
    vals[0] |= 0x12
    vals[4] = 0x8000 | (130 << 7) | 0x34
    vals[8:] = 127 << 7
    flags, payload = codec.encode_blocks(mx.array(vals[None]))
    assert int(flags[0]) == 63
    by = np.array(payload).view(np.uint8)[0]
    assert by[0] == 0xD0  # sign0<<7 | d0 | sign4<<6 | d4<<3 = 0x80|0|0x40|0x10
    assert by[256] == (vals[0] & 0xFF) and by[260] == 0x34
    assert (by[768:] == 0).all()
    hi_a = (by[0] & 0x87) + 63
    hi_b = (((by[0] << 1) & 0x80) | ((by[0] >> 3) & 0x07)) + 63
    assert (hi_a, hi_b) == (0xBF, 0xC1)


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_layouts_are_permutations_and_invert(d):
    for kind in ("k", "v"):
        p = codec.perm(kind, d)
        assert sorted(p.tolist()) == list(range(16 * d))
        rng = np.random.default_rng(d)
        page = mx.array(rng.standard_normal((3, 16, d)).astype(np.float32)).astype(mx.bfloat16)
        blocks = codec.to_fragment_order(page, kind)
        assert blocks.shape == (3, d // 32, 512)
        back = codec.from_fragment_order(blocks, kind)
        assert bool(mx.all(back.view(mx.uint16) == page.view(mx.uint16)))
        # every block holds 16 tokens x 32 consecutive dims
        tok, dim = np.divmod(p.reshape(d // 32, 512), d)
        for j in range(d // 32):
            assert set(dim[j] // 32) == {j} and set(tok[j]) == set(range(16))


def _byte_perm(x: int, y: int, s: int) -> int:
    by = list(int(x).to_bytes(4, "little")) + list(int(y).to_bytes(4, "little"))
    return int.from_bytes(bytes(by[(s >> (4 * i)) & 7] for i in range(4)), "little")


def _lane_regs(block: bytes, flag: int, lane: int, g: int) -> list[int]:
    """What the kernel's zf_load_block + zf_group produce for one lane (Python transliteration)."""
    w32 = lambda off: int.from_bytes(block[off : off + 4], "little")  # noqa: E731
    gi = 32 * g + lane
    if flag == codec.RAW_FLAG:
        return [w32(16 * gi + 4 * i) for i in range(4)]
    w = w32(4 * gi)
    lo0, lo1 = w32(256 + 8 * gi), w32(256 + 8 * gi + 4)
    rep = flag * 0x01010101
    hi_a = ((w & 0x87878787) + rep) & 0xFFFFFFFF
    hi_b = ((((w << 1) & 0x80808080) | ((w >> 3) & 0x07070707)) + rep) & 0xFFFFFFFF
    return [
        _byte_perm(lo0, hi_a, 0x5140),
        _byte_perm(lo0, hi_a, 0x7362),
        _byte_perm(lo1, hi_b, 0x5140),
        _byte_perm(lo1, hi_b, 0x7362),
    ]


@pytest.mark.parametrize("d", [64, 128])
def test_lane_registers_are_mma_b_fragments(d):
    """The kernel's per-lane decode of fragment-order pages yields exactly the m16n8k16 B
    fragments it feeds: K (k = dim, n = token) for Q.K^T and V (k = token, n = dim) for P.V."""
    rng = np.random.default_rng(7)
    k = rng.standard_normal((16, d)) * 0.3
    v = rng.standard_normal((16, d)) * 3.0
    v[:, 5] = 1e4  # one dim forces some V blocks raw
    kb16 = np.array(mx.array(k.astype(np.float32)).astype(mx.bfloat16).view(mx.uint16))
    vb16 = np.array(mx.array(v.astype(np.float32)).astype(mx.bfloat16).view(mx.uint16))
    for kind, page in (("k", kb16), ("v", vb16)):
        blocks = codec.to_fragment_order(mx.array(page), kind)  # [nb, 512]
        flags, payload = codec.encode_blocks(blocks)
        flags = np.array(flags)
        raw_bytes = np.array(payload).view(np.uint8)
        got = np.full((16, d), -1, np.int64)
        for j in range(d // 32):
            blk = raw_bytes[j].tobytes()
            for lane in range(32):
                gid, tig = lane >> 2, lane & 3
                for g in range(2):
                    regs = _lane_regs(blk, int(flags[j]), lane, g)
                    halves = [(r >> (16 * h)) & 0xFFFF for r in regs for h in range(2)]
                    for i, val in enumerate(halves):
                        reg, e = divmod(i, 2)
                        if kind == "k":  # k-tile 2j (regs 0,1) and 2j+1 (regs 2,3); b0b1/b2b3
                            kt = 2 * j + (reg >> 1)
                            dim = 16 * kt + 2 * tig + e + 8 * (reg & 1)
                            token = 8 * g + gid
                        else:  # n-tile 4j+2g (regs 0,1) and 4j+2g+1 (regs 2,3)
                            nt = 4 * j + 2 * g + (reg >> 1)
                            dim = 8 * nt + gid
                            token = 2 * tig + e + 8 * (reg & 1)
                        assert got[token, dim] == -1
                        got[token, dim] = val
        assert (got == page).all(), kind
    assert (flags == codec.RAW_FLAG).any() and (flags != codec.RAW_FLAG).any()


def test_meta_packing():
    m = codec.pack_meta(0x01020304, [63, 0xFF, 1, 120])
    assert m.dtype == np.uint32 and m.tolist() == [0x01020304, 0x7801FF3F]
    m8 = codec.pack_meta(5, list(range(8)))
    assert m8.shape == (4,) and m8[3] == 0xFFFFFFFF
    with pytest.raises(ValueError, match="4-byte"):
        codec.pack_meta(1 << 32, [0])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="multiple of 32"):
        codec.check_head_dim(80)
    with pytest.raises(ValueError, match="uint16"):
        codec.encode_blocks(mx.zeros((2, 512), mx.float32))
    with pytest.raises(TypeError, match="BF16"):
        codec.as_bits(mx.zeros((4,), mx.float16))


def test_page_blocks_compressible_matches_encoder():
    rng = np.random.default_rng(5)
    kv = rng.standard_normal((2, 48, 64)) * rng.uniform(0.01, 100, (2, 48, 1))
    kv = mx.array(kv.astype(np.float32)).astype(mx.bfloat16)
    ok = np.array(codec.page_blocks_compressible(kv))  # [2, 3, 2]
    pages = kv.reshape(2, 3, 16, 64)
    flags, _ = codec.encode_blocks(codec.to_fragment_order(pages, "k").reshape(-1, 512))
    assert (ok.reshape(-1) == (np.array(flags) != codec.RAW_FLAG)).all()
    assert ok.any() and not ok.all()
