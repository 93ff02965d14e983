"""IsoQuant attention kernels on a GPU backend (run on the H200 with MLX's CUDA backend; the same
file runs the Metal build on a Mac). Every kernel path against the MLX-ops reference on fresh
random inputs over the issue's sizes: T in {1, 15, 511, 512, 513, 4097, 32768}, head dims
64/128/256/512, GQA ratios 1/4/8, batch 1 and 3 with ragged lengths, the float segment,
causal chunks and sinks. Relative error of the output < 1e-3 on the same codes (float32
queries, so the bound measures the kernels, not the output dtype)."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from app.engine.kvcache import isoquant
from app.engine.kvcache.isoquant import kernel_path as kk
from app.engine.kvcache.isoquant import kernels as iq
from app.engine.testing.isoquant_problems import random_problem

pytestmark = pytest.mark.skipif(
    not iq.kernels_available(), reason="needs MLX's Metal or CUDA backend (a GPU)"
)

TOL = 1e-3
# tc16: the tensor-core kernel with the V codes in packing.py's tc16 layout
FUSED = ["tc", "tc16", "scalar"] if iq.BACKEND == "cuda" else ["scalar"]


def _run(path, q, k, v, mask=None, sinks=None, lens=None):
    s = 1.0 / math.sqrt(q.shape[-1])
    if path in FUSED:
        variant = "tc" if path == "tc16" else path
        return iq.fused_attention(q, k, v, s, mask, sinks, lens, variant=variant)
    return iq.unfused_attention(q, k, v, s, mask, sinks, lens, schedule=path)


def _check(
    path, b, hkv, g, length, d, tc, tf, kb=3, vb=3, kind="v3", lens=None, sinks=False, seed=0
):
    tcp = path in ("tc", "tc16")
    if tcp and (kb, vb) != (3, 3) or tcp and d not in iq.TC_HEAD_DIMS:
        pytest.skip("the tensor-core kernel takes 3-bit codes and head dims 64/128")
    layout = "tc16" if path == "tc16" else "rows"
    q, k, v = random_problem(
        b, hkv, g, length, d, tc, tf, kb, vb, kind, mx.float32, seed, v_layout=layout
    )
    sk = mx.random.normal((hkv * g,)) if sinks else None
    mask = "causal" if length > 1 else None
    with mx.stream(mx.cpu):  # MLX's CUDA matmuls run float32 as TF32 (~1e-3): not a reference
        ref = iq.attention_reference(q, k, v, 1.0 / math.sqrt(d), mask, sk, lens)
    out = _run(path, q, k, v, mask, sk, lens)
    err = iq.rel_error(out, ref)
    assert err < TOL, f"{path} rel error {err:.2e}"


@pytest.mark.parametrize("path", FUSED + ["word", "dim"])
@pytest.mark.parametrize("t", [1, 15, 511, 512, 513, 4097, 32768])
def test_lengths(path, t):
    _check(path, 1, 2, 4, 1, 128, t, 0, seed=t)


@pytest.mark.parametrize("path", FUSED + ["word", "dim"])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("t", [1, 513, 4097])
def test_head_dims(path, d, t):
    _check(path, 1, 2, 4, 1, d, t, 7, seed=d + t)


@pytest.mark.parametrize("path", FUSED)
@pytest.mark.parametrize("g", [1, 4, 8, 16])
def test_gqa_ratios(path, g):
    _check(path, 1, 8 // min(g, 8), g, 1, 128, 4097, 64, seed=g)


@pytest.mark.parametrize("path", FUSED + ["word", "dim"])
def test_batch_with_ragged_lengths_and_sinks(path):
    _check(path, 3, 2, 4, 1, 64, 4097, 64, lens=[4097, 1500, 1], sinks=True, seed=3)


@pytest.mark.parametrize("path", FUSED + ["word"])
@pytest.mark.parametrize("kind", ["v3", "v2", "v1", "dense"])
def test_causal_chunk_over_a_compressed_prefix(path, kind):
    _check(path, 1, 2, 4, 5, 128, 2000, 37, kind=kind, seed=11)


@pytest.mark.parametrize("kb,vb", [(4, 4), (4, 3), (3, 4)])
def test_four_bit_codes(kb, vb):
    _check("scalar", 2, 2, 4, 1, 128, 3000, 10, kb, vb, seed=kb * 10 + vb)


def test_bf16_queries_and_views_of_a_grown_cache():
    # The cache hands out slices of larger buffers: the kernels read them through strides.
    q, k, v = random_problem(2, 8, 4, 1, 128, 700, 64, dtype=mx.bfloat16, seed=5)

    def pad(a):
        return mx.concatenate([a, mx.zeros_like(a)[:, :, :100]], axis=2)[:, :, : a.shape[2]]

    def grown(t):
        return isoquant.IsoQuantTensor(
            pad(t.codes), pad(t.norms), pad(t.fp), t.quantizer, t.rotation
        )

    with mx.stream(mx.cpu):
        ref = iq.attention_reference(q, k, v, 1 / math.sqrt(128))
    for path in FUSED:
        out = iq.fused_attention(q, grown(k), grown(v), 1 / math.sqrt(128), variant=path)
        assert out.dtype == mx.bfloat16
        assert iq.rel_error(out, ref) < 8e-3  # bf16 output rounding is ~4e-3 by itself


def test_each_kernel_against_its_reference():
    q, k, v = random_problem(2, 2, 4, 1, 128, 1500, 0, dtype=mx.float32, seed=6)
    p = iq.Problem.of(q, k, v, None)
    with mx.stream(mx.cpu):  # float32 references (the GPU's float32 matmuls are TF32)
        s_ref = iq.qk_dot_reference(q, k, 0.1)
        pr_ref = iq.softmax_reference(s_ref, p, [1500, 333])
        acc_ref = iq.value_accum_reference(pr_ref, v)
        o_ref = iq.rotate_inverse_reference(acc_ref, v.rotation, p)
    assert iq.rel_error(iq.qk_dot(q, k, 0.1, p), s_ref) < 1e-5
    assert iq.rel_error(iq.softmax(s_ref, p, [1500, 333]), pr_ref) < 1e-5
    for schedule in ("word", "dim"):
        assert iq.rel_error(iq.value_accum(pr_ref, v, p, [1500, 333], schedule), acc_ref) < 1e-5
    assert iq.rel_error(iq.rotate_inverse(acc_ref, v.rotation, p), o_ref) < 1e-5


def test_the_cache_attention_uses_the_kernel_and_the_setting_forces_the_reference(monkeypatch):
    assert kk.install()
    cache = isoquant.IsoQuantKVCache("v3", 3, 3, window=16)
    mx.random.seed(0)
    for _ in range(3):
        cache.update_and_fetch(mx.random.normal((1, 2, 100, 64)), mx.random.normal((1, 2, 100, 64)))
    keys, values = cache.update_and_fetch(
        mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64))
    )
    assert isinstance(keys, isoquant.IsoQuantTensor) and keys.compressed_len == 301 - 16
    q = mx.random.normal((1, 8, 1, 64))
    calls = []
    real = iq._kernel  # every launch looks its kernel up
    monkeypatch.setattr(iq, "_kernel", lambda *a: calls.append(1) or real(*a))
    out = isoquant.isoquant_attention(q, keys, values, 0.125)
    with mx.stream(mx.cpu):
        ref = isoquant.isoquant_attention(q, keys, values, 0.125, use_kernel=False)
    assert calls and iq.rel_error(out, ref) < TOL
    monkeypatch.setenv(kk.SETTING_ENV, "reference")
    assert not kk.install()
    calls.clear()
    isoquant.isoquant_attention(q, keys, values, 0.125)
    assert not calls
    monkeypatch.setenv(kk.SETTING_ENV, "auto")
    assert kk.install()


def test_a_batch_of_rows_of_different_lengths_runs_on_the_kernel(monkeypatch):
    """The batched cache's rows of different lengths reach the fused kernel with their code
    counts and no mask, through decode-time compressions, and equal each row's attention alone
    (the reference, on the CPU stream)."""
    from app.engine.kvcache.isoquant.batch import BatchIsoQuantKVCache

    assert kk.install()
    mx.random.seed(1)
    singles = []
    for n in (300, 170, 41):
        c = isoquant.IsoQuantKVCache("v3", 3, 3, window=16)
        c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        for _ in range(3):
            c.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
        singles.append(c)
    batch = BatchIsoQuantKVCache.merge(singles)
    calls = []
    real = iq._fused_call
    monkeypatch.setattr(iq, "_fused_call", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for step in range(20):  # crosses a compression (every 16 tokens)
        mask = batch.make_mask(1)
        keys, values = batch.update_and_fetch(
            mx.random.normal((3, 2, 1, 64)), mx.random.normal((3, 2, 1, 64))
        )
        assert mask is None and keys.lens is not None and keys.fp_start is None
        q = mx.random.normal((3, 8, 1, 64))
        calls.clear()
        out = isoquant.isoquant_attention(q, keys, values, 0.125, mask=mask)
        assert calls, step
        for i in range(3):
            rk, rv = batch.extract(i)._fetch()
            with mx.stream(mx.cpu):
                ref = isoquant.isoquant_attention(q[i : i + 1], rk, rv, 0.125, use_kernel=False)
            assert iq.rel_error(out[i : i + 1], ref) < TOL, (step, i)


@pytest.mark.parametrize(
    "d,kb,vb,kind", [(64, 3, 4, "v3"), (128, 3, 3, "v3"), (256, 4, 3, "dense")]
)
@pytest.mark.parametrize("n", [1, 16, 300])
def test_fused_encoder_matches_the_mlx_encoder(d, kb, vb, kind, n):
    """The cache's one-launch K/V encoder against quantizer.encode on strided bf16 rows: codes
    equal except within 1e-5 of a threshold, norms within one fp16 step."""
    from app.engine.kvcache.isoquant.packing import unpack_codes
    from app.engine.kvcache.isoquant.quantizer import Quantizer, encode
    from app.engine.kvcache.isoquant.rotation import Rotation

    mx.random.seed(d + n)
    rot = Rotation.make(kind, d, 8, seed=1, layer=3)
    qk, qv = Quantizer.make(d, kb), Quantizer.make(d, vb)
    xk = (mx.random.normal((2, 8, n + 9, d)) * 4).astype(mx.bfloat16)[:, :, 5 : 5 + n]
    xv = mx.random.normal((2, 8, n + 9, d)).astype(mx.bfloat16)[:, :, 5 : 5 + n]
    out = iq.encode_pair(xk, xv, rot, qk, qv)
    for (c, nm), x, qz in (((out[0], out[1]), xk, qk), ((out[2], out[3]), xv, qv)):
        with mx.stream(mx.cpu):
            rc, rn = encode(x, rot, qz)
            y = rot.forward(x.astype(mx.float32))
            nrm = mx.sqrt(mx.sum(y * y, axis=-1, keepdims=True))
            u = y * (math.sqrt(d) / mx.maximum(nrm, 1e-30))
            near = mx.min(mx.abs(u[..., None] - qz.thresholds), axis=-1) < 1e-5
        same = unpack_codes(c, qz.bits) == unpack_codes(rc, qz.bits)
        assert mx.all(same | near).item()
        a, b = nm.astype(mx.float32), rn.astype(mx.float32)
        assert mx.all(mx.abs(a - b) <= mx.abs(b) * 2.0**-10).item()


@pytest.mark.skipif(
    iq.BACKEND != "cuda", reason="the folded combine is the CUDA tensor-core kernel's"
)
def test_folded_combine_reuses_counter_slots_and_survives_concurrent_calls(monkeypatch):
    """The last threadgroup of each row block merges (ticket counters): slots drawn from a
    tiny ring come round every other call and must have been reset to 0; independent calls
    queued in one graph (which may run concurrently) each draw their own slots."""
    probs = [
        random_problem(2, 2, 4, 1, 128, 700 + 97 * i, 5, dtype=mx.float32, seed=i) for i in range(6)
    ]
    s = 1.0 / math.sqrt(128)
    with mx.stream(mx.cpu):
        refs = [iq.attention_reference(q, k, v, s) for q, k, v in probs]
    monkeypatch.setattr(iq, "TC_FOLD", True)
    slots = iq._launch(iq.Problem.of(*probs[0], None), "tc", None, False, s, iq.tc_options(),
                       iq.SPLIT_WARPS, mx.float32).slots  # fmt: skip
    monkeypatch.setattr(iq, "COUNTER_RING", 2 * slots)
    monkeypatch.setattr(iq, "_ring", [None, 0])
    for (q, k, v), ref in zip(probs, refs, strict=True):  # one at a time: slots reused
        out = iq.fused_attention(q, k, v, s, variant="tc")
        mx.eval(out)
        assert iq.rel_error(out, ref) < TOL
    monkeypatch.setattr(iq, "COUNTER_RING", 1 << 20)
    outs = [iq.fused_attention(q, k, v, s, variant="tc") for q, k, v in probs]
    mx.eval(outs)  # queued together
    for out, ref in zip(outs, refs, strict=True):
        assert iq.rel_error(out, ref) < TOL


@pytest.mark.skipif(iq.BACKEND != "cuda", reason="the tc16 layout is read by the CUDA kernel")
@pytest.mark.parametrize("d", [64, 128])
def test_tc16_pack_matches_packing(d):
    """The cache's fused tc16 write (iq_tc16_pack) against packing.py, bit for bit."""
    from app.engine.kvcache.isoquant.packing import pack_codes, pack_codes_tc16

    mx.random.seed(d)
    for off, n in [(0, 16), (5, 16), (15, 300), (3, 1)]:
        old_codes = mx.random.randint(0, 8, (2, 8, 16, d)).astype(mx.uint8)
        new_codes = mx.random.randint(0, 8, (2, 8, n, d)).astype(mx.uint8)
        out = iq.pack_tc16(
            pack_codes(new_codes, 3), pack_codes_tc16(old_codes) if off else None, off
        )
        pad = -(off + n) % 16
        want = mx.concatenate(
            [old_codes[:, :, :off], new_codes, mx.zeros((2, 8, pad, d), mx.uint8)], axis=2
        )
        assert mx.array_equal(out, pack_codes_tc16(want)).item(), (off, n)


@pytest.mark.parametrize("kb,g,dtype", [(3, 4, "bfloat16"), (3, 8, "float16"), (4, 4, "bfloat16")])
def test_a_decode_step_reads_the_cache_in_place_as_its_views_do(kb, g, dtype):
    """The cache's one-token step (attend_step: the update and the fused kernel over its
    unsliced buffers, the float window at its row offset, the launch planned once per step)
    against update_and_fetch and the same kernel on sliced views, bit for bit, over 40 steps
    that cross compressions; and within TOL of the reference."""
    assert kk.install()
    dt = getattr(mx, dtype)
    caches = [isoquant.IsoQuantKVCache("v3", kb, 3, window=64, layer=1) for _ in range(2)]
    mx.random.seed(kb + g)
    kv = [mx.random.normal((1, 4, 700, 128)).astype(dt) for _ in "kv"]
    for c in caches:
        c.update_and_fetch(*kv)
        c.finish_prefill()
    variant = "tc" if kb == 3 else "scalar"
    s = 1 / math.sqrt(128)
    for step in range(40):
        kv = [mx.random.normal((1, 4, 1, 128)).astype(dt) for _ in "kv"]
        q = mx.random.normal((1, 4 * g, 1, 128)).astype(dt)
        out = caches[0].attend_step(q, *kv, s)
        k, v = caches[1].update_and_fetch(*kv)
        ref = iq.fused_attention(q, k, v, s, variant=variant)  # variant given: sliced views
        mx.eval(out, ref)
        assert mx.array_equal(out, ref).item(), step
    assert caches[0].compressed - caches[0].fp_start > 0  # the window sat past the buffer's row 0
    with mx.stream(mx.cpu):
        exact = iq.attention_reference(q.astype(mx.float32), k, v, s)
    assert iq.rel_error(out, exact) < 8e-3
