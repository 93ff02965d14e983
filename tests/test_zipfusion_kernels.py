"""ZipFusion's CUDA kernels: compile-only checks here (nvcc), kernel vs reference on a CUDA GPU.

The references (codec.encode_blocks, paged_attention_reference) are tested on every machine in
test_zipfusion_codec.py / test_zipfusion_cache.py; the kernel tests below need MLX's CUDA backend.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from app.engine.kvcache import zipfusion as zf
from app.engine.kvcache.zipfusion import codec
from app.engine.kvcache.zipfusion import kernels as zk

CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend (an NVIDIA GPU)")

ATTN_TYPES = ["__nv_bfloat16", "uint16_t", "uint32_t", "int32_t", "int32_t", "int32_t", "float"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize(
    "name,template,types",
    [
        ("zipfusion_attn", dict(D=128, G=4, NW=4, MW=2), (ATTN_TYPES, ["float", "float"])),
        (
            "zipfusion_attn_pipe",
            dict(D=128, G=4, NW=4, MW=2, STAGES=3),
            (ATTN_TYPES, ["float", "float"]),
        ),
        (
            "zipfusion_attn_pipe",
            dict(D=64, G=3, NW=4, MW=2, STAGES=3),
            (ATTN_TYPES, ["float", "float"]),
        ),
        (
            "zipfusion_attn_ring",
            dict(D=128, G=4, NW=4, MW=2, RING=16384, MAXQ=3),
            (ATTN_TYPES, ["float", "float"]),
        ),
        (
            "zipfusion_attn_ring",
            dict(D=64, G=3, NW=4, MW=2, RING=12288, MAXQ=5),
            (ATTN_TYPES, ["float", "float"]),
        ),
        (
            "zipfusion_attn_ring",
            dict(D=256, G=8, NW=2, MW=3, RING=16384, MAXQ=2),
            (ATTN_TYPES, ["float", "float"]),
        ),
        (
            "zipfusion_reduce",
            dict(D=128, G=4, RW=4),
            (["float", "float"] + ["__nv_bfloat16"] * 3 + ["int32_t", "float"], ["__nv_bfloat16"]),
        ),
        (
            "zipfusion_reduce",
            dict(D=64, G=3, RW=4),
            (["float", "float"] + ["__nv_bfloat16"] * 3 + ["int32_t", "float"], ["__nv_bfloat16"]),
        ),
        ("zipfusion_compress", {}, (["uint16_t"], ["uint8_t", "uint16_t"])),
    ],
)
def test_kernel_sources_compile_for_hopper(tmp_path, name, template, types):
    """The kernel bodies, wrapped the way mx.fast.cuda_kernel wraps them, compile for sm_90
    without register spills (a spill would put the decode in local memory)."""
    src = tmp_path / f"{name}.cu"
    src.write_text(zk.translation_unit(name, types[0], types[1], template))
    out = subprocess.run(
        ["nvcc", "-arch=sm_90", "-c", "-Xptxas", "-v", str(src), "-o", str(tmp_path / "k.o")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    assert spills and max(spills) == 0, out.stderr[-2000:]
    if name == "zipfusion_attn_ring" and template["D"] == 128:
        # ring_ctas_per_sm (the split count) assumes this many registers per thread at most
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", out.stderr)]
        assert regs and max(regs) <= zk.RING_REGS, out.stderr[-2000:]


def _bits(rng, shape, scale=1.0):
    x = rng.standard_normal(shape) * scale
    return mx.array(x.astype(np.float32)).astype(mx.bfloat16)


@needs_cuda
def test_compress_kernel_is_bit_exact():
    rng = np.random.default_rng(0)
    parts = [
        mx.array(rng.integers(0, 1 << 16, (100, 512), dtype=np.uint16)),
        _bits(rng, (300, 512)).view(mx.uint16),
        (_bits(rng, (60, 512)) * 1e-38).view(mx.uint16),  # subnormals
        mx.array(np.full((3, 512), 0x7FC0, np.uint16)),  # NaN
        mx.zeros((5, 512), mx.uint16),
    ]
    blocks = mx.concatenate(parts)
    f_ref, p_ref = codec.encode_blocks(blocks)
    f_k, p_k = zk.compress_blocks(blocks, use_kernel=True)
    assert bool(mx.all(f_ref == f_k)) and bool(mx.all(p_ref == p_k))
    fl = np.array(f_k)
    assert (fl == codec.RAW_FLAG).any() and (fl != codec.RAW_FLAG).any()


def build_stores(lengths, n_kv, head_dim, seed=0, poison=False):
    """A compressed and a raw store (one layer) holding the same random K/V per sequence."""
    rng = np.random.default_rng(seed)
    budget = (sum(-(-n // 16) for n in lengths) + 16 * 4) * n_kv * 2 * (head_dim // 32) * 1024 * 2
    stores = []
    kv = [
        (_bits(rng, (1, n_kv, n, head_dim), 2.0), _bits(rng, (1, n_kv, n, head_dim)))
        for n in lengths
    ]
    for compress in (True, False):
        cfg = zf.ZipConfig(
            1,
            n_kv,
            head_dim,
            budget,
            max_seqs=len(lengths),
            max_tokens_per_seq=max(lengths) + 32,
            compress=compress,
        )
        st = zf.ZipStore(cfg, use_kernel=True)
        if poison:  # stale NaN bytes where nothing was written yet
            st.pool = mx.full(st.pool.shape, 0x7FC0, mx.uint16)
            mx.eval(st.pool)
        for k, v in kv:
            sid = st.add_sequence()
            n = k.shape[2]
            cut = n - n % 16 if n % 16 else max(0, n - 16)
            for a, b in ((0, cut), (cut, n)):  # full pages compressed directly, then a tail
                if b > a:
                    st.begin([sid])
                    st.stage(0, k[:, :, a:b], v[:, :, a:b])
                    st.commit()
        stores.append(st)
    return stores


@needs_cuda
@pytest.mark.parametrize(
    "head_dim,n_q,n_kv,lengths",
    [
        (128, 32, 8, [1, 15, 16, 17, 511, 513, 4097]),
        (64, 9, 3, [33, 2, 700]),
        (128, 16, 2, [1024, 100]),
        (256, 4, 2, [300, 47]),
    ],
)
def test_attention_kernel_compressed_equals_raw_and_reference(head_dim, n_q, n_kv, lengths):
    zip_st, raw_st = build_stores(lengths, n_kv, head_dim, poison=True)
    rng = np.random.default_rng(1)
    b = len(lengths)
    q = _bits(rng, (b, n_q, head_dim))
    kn, vn = _bits(rng, (b, n_kv, head_dim)), _bits(rng, (b, n_kv, head_dim))
    outs = {}
    for st, tag in ((zip_st, "zip"), (raw_st, "raw")):
        st.begin(list(range(b)))
        for variant in ("simple", "pipe", "ring"):
            for splits in (1, 3, None):
                outs[tag, variant, splits] = zk.paged_decode_attention(
                    q,
                    st.pool,
                    st.meta,
                    st.page_table,
                    st.seq_len,
                    kn,
                    vn,
                    layer=0,
                    n_ids=st.n_ids,
                    scale=head_dim**-0.5,
                    n_splits=splits,
                    use_kernel=True,
                    variant=variant,
                )
        outs[tag, "ref"] = zk.paged_attention_reference(
            q, st.pool, st.meta, st.page_table, st.seq_len, kn, vn, 0, st.n_ids, head_dim**-0.5
        )
    mx.eval(list(outs.values()))
    ref = outs["raw", "ref"].astype(mx.float32)
    assert bool(mx.all(outs["zip", "ref"] == outs["raw", "ref"]))
    for splits in (1, 3, None):
        z = outs["zip", "pipe", splits]
        assert bool(mx.all(mx.isfinite(z.astype(mx.float32))))
        # lossless: the same kernel on compressed and on raw pages gives the same bits
        assert bool(mx.all(z == outs["raw", "pipe", splits])), splits
        assert bool(mx.all(outs["zip", "simple", splits] == outs["raw", "simple", splits]))
        # both variants accumulate in the same order
        assert bool(mx.all(z == outs["zip", "simple", splits]))
        err = float(mx.linalg.norm(z.astype(mx.float32) - ref) / mx.linalg.norm(ref))
        assert err < 1e-2, err
        # the ring variant (transposed mma, byte-packed ring; G > 8 falls back to pipe)
        r = outs["zip", "ring", splits]
        assert bool(mx.all(r == outs["raw", "ring", splits])), splits
        err = float(mx.linalg.norm(r.astype(mx.float32) - ref) / mx.linalg.norm(ref))
        assert err < 1e-2, err
    assert zip_st.stats["blocks_compressed"] > 0


@needs_cuda
@pytest.mark.parametrize("num_warps,ring_kb", [(4, 8), (4, 12), (2, 24), (8, 8)])
def test_ring_kernel_launch_settings_compressed_equals_raw(num_warps, ring_kb):
    """Every ring size / warp count the benchmark sweeps: lossless and close to the reference."""
    zip_st, raw_st = build_stores([700, 3, 2000], 8, 128, seed=5, poison=True)
    rng = np.random.default_rng(2)
    q = _bits(rng, (3, 32, 128))
    kn, vn = _bits(rng, (3, 8, 128)), _bits(rng, (3, 8, 128))
    outs = []
    for st in (zip_st, raw_st):
        st.begin([0, 1, 2])
        outs.append(
            zk.paged_decode_attention(
                q, st.pool, st.meta, st.page_table, st.seq_len, kn, vn, layer=0,
                n_ids=st.n_ids, scale=128**-0.5, use_kernel=True, variant="ring",
                num_warps=num_warps, ring_kb=ring_kb,
            )
        )  # fmt: skip
    ref = zk.paged_attention_reference(
        q, raw_st.pool, raw_st.meta, raw_st.page_table, raw_st.seq_len, kn, vn, 0,
        raw_st.n_ids, 128**-0.5,
    ).astype(mx.float32)  # fmt: skip
    assert bool(mx.all(outs[0] == outs[1]))
    err = float(mx.linalg.norm(outs[0].astype(mx.float32) - ref) / mx.linalg.norm(ref))
    assert err < 1e-2, err


def test_parameter_arrays_are_made_once_per_value(monkeypatch):
    """The kernels' small parameter arrays: one array per distinct value (ints and floats
    apart), 8 entries long, the values first; built per call when CACHE_PARAMS is off."""
    monkeypatch.setattr(zk, "CACHE_PARAMS", True)
    a = zk._params((1, 2, 3, 40000))
    assert zk._params([1, 2, 3, 40000]) is a
    assert a.shape == (8,) and a.dtype == mx.int32 and a.tolist() == [1, 2, 3, 40000, 0, 0, 0, 0]
    f = zk._params((0.125,), floats=True)
    assert f.dtype == mx.float32 and f.tolist()[0] == 0.125
    assert zk._params((0.125,), floats=True) is f and zk._params((0.126,), floats=True) is not f
    assert zk._params((1,)) is not zk._params((1,), floats=True)
    monkeypatch.setattr(zk, "CACHE_PARAMS", False)
    c = zk._params((1, 2, 3, 40000))
    assert c is not a and c.tolist() == [1, 2, 3, 40000]
