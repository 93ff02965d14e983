"""IsoQuant attention kernels on the CPU: the per-kernel references against the cache's oracle,
the paper's identities, the dispatch switch, and the CUDA kernel bodies themselves run through
the CPU emulator (tests/cuda_emu) on awkward sizes. The GPU twin of the kernel tests is
tests/gpu/test_isoquant_gpu.py."""

from __future__ import annotations

import dataclasses
import importlib
import math

import mlx.core as mx
import numpy as np
import pytest

from app.engine.kvcache.isoquant import IsoQuantKVCache
from app.engine.kvcache.isoquant import kernel_path as kk
from app.engine.kvcache.isoquant import kernels as iq
from app.engine.kvcache.isoquant.attention import CacheView, IsoQuantTensor
from app.engine.kvcache.isoquant.packing import pack_codes, unpack_codes_tc16
from app.engine.testing.isoquant_problems import random_problem

cache_attention = importlib.import_module("app.engine.kvcache.isoquant.attention")

TOL = 1e-3  # the bound on ‖out − ref‖ / ‖ref‖ for every kernel path


def _scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


def _unfused_reference(q, keys, values, scale, mask=None, sinks=None, lens=None):
    """A -> B -> C -> D composed from the per-kernel references."""
    p = iq.Problem.of(q, keys, values, mask)
    s = iq.qk_dot_reference(q, keys, scale)
    if p.tf:
        qh = q.astype(mx.float32).reshape(p.b, p.hkv, p.rows, p.dim)
        sf = (qh * scale) @ keys.fp.astype(mx.float32).swapaxes(-1, -2)
        s = mx.concatenate([s, sf.reshape(p.b * p.hkv, p.rows, p.tf)], axis=-1)
    pr = iq.softmax_reference(s, p, lens, sinks)
    acc = iq.value_accum_reference(pr, values)
    add = None
    if p.tf:
        pf = pr[..., p.tc :].reshape(p.b, p.hkv, p.rows, p.tf)
        add = (pf @ values.fp.astype(mx.float32)).reshape(p.b, p.hq, p.length, p.dim)
    return iq.rotate_inverse_reference(acc, keys.rotation, p, add, q.dtype)


@pytest.mark.parametrize(
    "b,hkv,g,length,d,tc,tf,kind,sinks",
    [
        (1, 2, 4, 1, 64, 15, 0, "v3", False),
        (2, 1, 1, 1, 128, 33, 5, "dense", True),
        (1, 2, 2, 3, 64, 17, 6, "v2", False),
        (3, 1, 8, 1, 128, 9, 2, "v1", True),
    ],
)
def test_per_kernel_references_compose_to_the_oracle(b, hkv, g, length, d, tc, tf, kind, sinks):
    q, k, v = random_problem(b, hkv, g, length, d, tc, tf, kind=kind, dtype=mx.float32, seed=tc)
    sk = mx.random.normal((hkv * g,)) if sinks else None
    mask = "causal" if length > 1 else None
    ref = iq.attention_reference(q, k, v, _scale(d), mask, sk)
    out = _unfused_reference(q, k, v, _scale(d), mask, sk)
    assert iq.rel_error(out, ref) < 1e-5


def test_one_inverse_rotation_equals_rotating_every_value():
    # SPEC §4: õ = Σ α_j ŷ_j in rotated space, then o = Rᵀ õ once == Σ α_j (Rᵀ ŷ_j)
    q, k, v = random_problem(1, 2, 1, 1, 128, 40, dtype=mx.float32, seed=4)
    from app.engine.kvcache.isoquant.quantizer import decode

    p = iq.Problem.of(q, k, v, None)
    probs = iq.softmax_reference(iq.qk_dot_reference(q, k, _scale(128)), p)  # [B*Hkv, 1, T]
    once = iq.rotate_inverse_reference(iq.value_accum_reference(probs, v), v.rotation, p)
    every = probs.reshape(1, 2, 1, 40) @ decode(v.codes, v.norms, v.rotation, v.quantizer)
    assert iq.rel_error(once, every.reshape(once.shape)) < 1e-5


def test_ragged_lengths_reference_ignores_the_tail():
    q, k, v = random_problem(2, 1, 2, 1, 64, 20, dtype=mx.float32, seed=5)
    out = iq.attention_reference(q, k, v, 0.125, lens=[20, 7])
    # changed codes past token 7 matter to sequence 0 (length 20), not to sequence 1 (7)
    k2 = cache_attention.IsoQuantTensor(
        k.codes.at[:, :, 7:].add(mx.array(1, mx.uint8)), k.norms, None, k.quantizer, k.rotation
    )
    out2 = iq.attention_reference(q, k2, v, 0.125, lens=[20, 7])
    assert mx.array_equal(out[1], out2[1])
    assert not mx.array_equal(out[0], out2[0])


def test_dispatch_on_cpu_uses_the_reference_and_refuses_a_forced_kernel(monkeypatch):
    q, k, v = random_problem(1, 1, 2, 1, 64, 10, 2, dtype=mx.float32, seed=6)
    ref = iq.attention_reference(q, k, v, 0.125)
    assert mx.array_equal(kk.isoquant_attention(q, k, v, 0.125, use_kernel=False), ref)
    if kk.kernels_available():
        pytest.skip("this machine has a GPU backend: the CPU-only behaviour does not apply")
    assert mx.array_equal(kk.isoquant_attention(q, k, v, 0.125), ref)
    with pytest.raises(RuntimeError, match="Metal or CUDA"):
        kk.isoquant_attention(q, k, v, 0.125, use_kernel=True)
    monkeypatch.setenv(kk.SETTING_ENV, "kernel")
    with pytest.raises(RuntimeError):
        kk.isoquant_attention(q, k, v, 0.125)
    monkeypatch.setenv(kk.SETTING_ENV, "sometimes")
    with pytest.raises(ValueError, match="expected one of"):
        kk.isoquant_attention(q, k, v, 0.125)
    monkeypatch.setenv(kk.SETTING_ENV, "auto")
    assert kk.install() is False
    assert cache_attention._kernel is None


def test_problem_rejects_what_kernels_cannot_take():
    q, k, v = random_problem(1, 2, 2, 1, 64, 4, 0, dtype=mx.float32)
    with pytest.raises(iq.Unsupported, match="array masks"):
        iq.Problem.of(q, k, v, mx.ones((1, 4), mx.bool_))
    with pytest.raises(ValueError, match="unknown attention mask"):
        iq.Problem.of(q, k, v, "sliding")
    with pytest.raises(iq.Unsupported, match="float segment"):
        iq.Problem.of(mx.zeros((1, 4, 3, 64)), k, v, "causal")  # causal queries but Tf = 0
    with pytest.raises(iq.Unsupported, match="head dims"):
        iq.Problem(1, 2, 1, 1, 96, 4, 0, 3, 3, 0, False)


def test_split_plan_covers_every_token():
    for tc, tf, b in [(1, 0, 1), (513, 64, 3), (32768, 64, 8), (131072, 0, 32)]:
        p = iq.Problem(b, 32, 8, 1, 128, tc, tf, 3, 3, 0, False)
        plan = iq.split_plan(p, 16)
        assert plan["ncb"] * iq.NW * plan["sl"] >= tc > (plan["ncb"] - 1) * iq.NW * plan["sl"]
        assert plan["nfb"] * iq.NW * plan["slf"] >= tf
        assert plan["sl"] % 32 == 0 and plan["slf"] % 32 == 0


def test_combine_is_folded_in_unless_turned_off(monkeypatch):
    """The tensor-core kernel folds the combine in at every length by default; TC_FOLD off takes
    the iq_combine launch, and the plan follows (counter slots only when folded)."""

    def slots(p):
        return iq._launch(p, "tc", None, False, 0.1, iq.tc_options(), None).slots

    long = iq.Problem(2, 32, 8, 1, 128, 32768, 64, 3, 3, 0, False)
    short = long._replace(tc=8192)
    monkeypatch.setattr(iq, "TC_FOLD", True)
    assert slots(long) == slots(short) == 2 * 8  # B x KV heads
    monkeypatch.setattr(iq, "TC_FOLD", False)
    assert slots(long) == slots(short) == 0


def test_split_plan_aims_by_rows(monkeypatch):
    """Few (sequence, KV head) rows get longer splits (fewer threadgroups, less set-up), many
    rows keep enough threadgroups to fill the GPU; a set SPLIT_WARPS applies to every shape."""
    monkeypatch.setattr(iq, "SPLIT_WARPS", None)
    b1 = iq.Problem(1, 32, 8, 1, 128, 32768, 0, 3, 3, 0, False)  # 8 rows
    b32 = iq.Problem(32, 32, 8, 1, 128, 32768, 0, 3, 3, 0, False)  # 256 rows
    few, many = iq.split_plan(b1, iq.TC_RB), iq.split_plan(b32, iq.TC_RB)
    assert iq.split_warps(8, 32768) == 1024 and iq.split_warps(64, 131072) == 2048
    assert iq.split_warps(256, 32768) == 2048 and iq.split_warps(256, 32769) == 3072
    assert few["sl"] == 256 and 8 * few["ncb"] * iq.NW >= 1024 // 2
    # 256 rows of 32K: two threadgroups of four 4096-token splits each (512 in all)
    assert many["sl"] == 4096 and many["ncb"] == 2
    monkeypatch.setattr(iq, "SPLIT_WARPS", 3072)
    assert iq.split_warps(8) == 3072 and iq.split_plan(b1, iq.TC_RB)["sl"] == 96
    # at most 16K compressed tokens in all: 32-token splits for the tensor-core kernel only
    tiny = iq.Problem(1, 32, 8, 1, 128, 2048, 0, 3, 3, 0, False)
    more = iq.Problem(1, 32, 8, 1, 128, 8192, 0, 3, 3, 0, False)
    assert iq.split_plan(tiny, iq.TC_RB, merged=True)["sl"] == 32
    assert iq.split_plan(tiny, iq.TC_RB)["sl"] == 64
    assert iq.split_plan(more, iq.TC_RB, merged=True)["sl"] == 64
    # the same short context with a float window (decode at B1): 256 warps, 64-token splits for
    # the tensor-core kernel; not with more rows or more compressed tokens; the scalar kernel's
    # plan stays at its 64-token minimum
    monkeypatch.setattr(iq, "SPLIT_WARPS", None)
    assert iq.split_warps(8, 2048, 64) == 256 and iq.split_warps(8, 2048) == 1024
    assert iq.split_warps(8, 2049, 64) == 1024 and iq.split_warps(16, 2048, 64) == 2048
    window = iq.Problem(1, 32, 8, 1, 128, 2048, 64, 3, 3, 0, False)
    plan = iq.split_plan(window, iq.TC_RB, merged=True)
    assert plan["sl"] == 64 and plan["ncb"] == 8
    assert iq.split_plan(window, iq.TC_RB)["sl"] == iq.split_plan(tiny, iq.TC_RB)["sl"] == 64


def test_float_window_plan_spreads_the_decode_tail_when_rows_are_few():
    """The tensor-core kernel's float tokens: 16-token splits; a window of 64 in one threadgroup
    (four warps); the decode tail's 65-79 in two threadgroups when the rows are few (B1: 8 rows),
    in one (32-token splits) when they are many (B32: 256 rows); every token covered."""
    for b, tf, slf, nfb in [
        (1, 64, 16, 1),
        (1, 72, 16, 2),
        (1, 79, 16, 2),
        (32, 64, 16, 1),
        (32, 72, 32, 1),
        (32, 79, 32, 1),
        (1, 200, 32, 2),
    ]:
        p = iq.Problem(b, 32, 8, 1, 128, 2048, tf, 3, 3, 0, False)
        plan = iq.split_plan(p, iq.TC_RB, merged=True)
        assert (plan["slf"], plan["nfb"]) == (slf, nfb), (b, tf, plan)
        assert plan["nfb"] * iq.NW * plan["slf"] >= tf > (plan["nfb"] - 1) * iq.NW * plan["slf"]


def test_call_plans_are_cached_per_shape_and_setting(monkeypatch):
    """fused_attention's per-call plan (Problem, variant, launch) is looked up by shapes, dtypes
    and the module's settings: a changed setting or a grown cache gets a new plan."""
    q, k, v = random_problem(1, 2, 4, 1, 64, 40, 3, dtype=mx.float32, seed=1)
    monkeypatch.setattr(iq, "_PLANS", {})
    a = iq._plan(q, k, v, 0.125, None, None, "tc", None)
    assert iq._plan(q, k, v, 0.125, None, None, "tc", None) is a and len(iq._PLANS) == 1
    slots = 1 * 2 * 1  # folded combine: one counter per batch x KV head x row block
    fold = iq.TC_FOLD
    assert a[0] == iq.Problem.of(q, k, v, None) and a[2].slots == (slots if fold else 0)
    monkeypatch.setattr(iq, "TC_FOLD", not fold)
    b = iq._plan(q, k, v, 0.125, None, None, "tc", None)
    assert b is not a and b[2].slots == (0 if fold else slots)
    q2, k2, v2 = random_problem(1, 2, 4, 1, 64, 41, 3, dtype=mx.float32, seed=1)
    assert iq._plan(q2, k2, v2, 0.125, None, None, "tc", None)[0].tc == 41
    with pytest.raises(iq.Unsupported):
        iq._plan(*random_problem(1, 2, 4, 1, 64, 8, 0, kb=4), 0.125, None, None, "tc", None)
    monkeypatch.setattr(iq, "_PLANS_MAX", 3)
    iq._plan(*random_problem(1, 2, 4, 1, 64, 9, 0), 0.125, None, None, "tc", None)
    assert len(iq._PLANS) <= 3  # bounded: cleared when full


@pytest.mark.parametrize("variant", ["tc", "scalar"])
def test_a_launch_made_from_a_shared_base_has_its_own_lengths(variant):
    """Decode steps share one launch base per split plan (_launch_base) and patch their own
    compressed and float lengths in: every launch's parameters, grid and shapes equal what
    its own Problem gives when built from nothing."""
    opts = iq.tc_options()
    for tc, tf in [(2048, 64), (2049, 64), (2050, 63), (2051, 1), (4096, 80), (33, 0), (32, 17)]:
        p = iq.Problem(1, 32, 8, 1, 128, tc, tf, 3, 3, 0, False)
        run = iq._launch(p, variant, None, False, 0.1, opts, None)
        rb = iq.TC_RB if variant == "tc" else min(iq.SCALAR_RB[128], 4)
        plan = iq.split_plan(p, rb, None, None, merged=variant == "tc")
        words = iq._iparams_words(
            p,
            tuple(
                sorted(
                    {
                        **{k: plan[k] for k in ("sl", "ncb", "nsp", "nspc", "slf")},
                        "sinks": False,
                        **(
                            {"tab": iq._tc_tables(128, 3, 3, *_forms(run))}
                            if variant == "tc"
                            else {}
                        ),
                    }.items()
                )
            ),
        )
        assert run.ip.tolist() == words, (tc, tf)
        assert run.out_shapes[0] == (8, plan["nsp"], p.rows, 128), (tc, tf)
        got_rows = run.grid[1] if variant == "tc" else run.grid[0] // (32 * iq.NW)
        assert got_rows == plan["ncb"] + plan["nfb"], (tc, tf)


def _forms(run):
    t = dict(run.template)
    kform = "int8" if t["KI8"] else "fp16"
    vform = "int8" if t["PV8"] else "vsn" if t["VSN"] else "fp16"
    return kform, vform


def test_fp16_level_scale_tightens_the_table():
    from app.engine.kvcache.isoquant.quantizer import Quantizer

    lv = Quantizer.make(128, 3).levels
    s = iq._fp16_level_scale(tuple(lv.tolist()))
    plain = mx.max(mx.abs(lv.astype(mx.float16).astype(mx.float32) - lv) / mx.abs(lv)).item()
    scaled = mx.max(
        mx.abs((lv * s).astype(mx.float16).astype(mx.float32) - lv * s) / mx.abs(lv * s)
    )
    assert 1.0 <= s < 2.0 and scaled.item() < plain / 4


# -- the CUDA bodies on the CPU emulator -------------------------------------------------------


@pytest.fixture
def emulated(monkeypatch):
    """iq's kernels replaced by CPU-emulated CUDA kernels built from the same sources."""
    harness = pytest.importorskip("cuda_emu.harness")
    if harness.gxx() is None:
        pytest.skip("needs g++ to build the CUDA emulator")
    kernels = {}
    for name, (ins, outs) in iq.SPECS.items():
        hdr, body = iq.source(name, "cuda")
        for dt in iq.DTYPES:
            kernels[(name, dt)] = harness.EmuKernel(iq._kernel_name(name, dt), ins, outs, body, hdr)
    monkeypatch.setattr(iq, "_KERNELS", kernels)
    monkeypatch.setattr(iq, "BACKEND", "cuda")
    return iq


EMU_CASES = [
    # path, b, hkv, g, length, d, tc, tf, kb, vb, kind, lens, sinks, dtype
    ("tc", 3, 2, 4, 1, 64, 100, 3, 3, 3, "v3", [100, 37, 1], True, mx.float16),
    ("tc", 1, 1, 16, 1, 128, 513, 64, 3, 3, "v3", None, False, mx.bfloat16),
    ("tc", 1, 1, 4, 3, 128, 15, 9, 3, 3, "dense", None, False, mx.float32),
    ("tc", 1, 2, 2, 1, 64, 77, 0, 3, 3, "v2", None, False, mx.float16),  # SO(4) blocks only
    # full and partial streamed tiles, ragged: sequence 1 ends inside a split and a tile
    ("tc", 2, 2, 4, 1, 128, 1100, 0, 3, 3, "v3", [1100, 333], False, mx.float32),
    # 32-token tiles ending inside their second k-step (29, 17 tokens) or right after the first
    # (16), with and without a float tail
    ("tc", 3, 1, 4, 1, 128, 61, 0, 3, 3, "v3", [61, 48, 17], False, mx.float32),
    ("tc", 2, 1, 8, 1, 64, 90, 5, 3, 3, "v3", [90, 27], True, mx.float32),
    # 3 query rows of the block's 8 at D 64 (2 rows per warp pass of the query rotation): the
    # second pass holds one query row and one padded row, the other two passes only padding
    ("tc", 1, 2, 3, 1, 64, 77, 5, 3, 3, "v3", None, False, mx.float32),
    # the folded combine writing rows of several sequences and KV heads (out's row from b Hkv +
    # h), with a sink and ragged lengths
    ("tc", 2, 2, 4, 1, 64, 45, 3, 3, 3, "v3", [45, 20], True, mx.float32),
    ("scalar", 2, 2, 8, 1, 128, 511, 1, 3, 3, "v3", [511, 200], False, mx.bfloat16),
    ("scalar", 1, 1, 2, 4, 256, 33, 7, 4, 3, "v1", None, True, mx.float16),
    ("scalar", 1, 1, 3, 1, 512, 40, 0, 3, 4, "v2", None, False, mx.float32),
    ("word", 3, 1, 4, 1, 64, 15, 2, 3, 3, "v3", [15, 4, 1], True, mx.float16),
    ("dim", 1, 2, 1, 2, 128, 513, 5, 4, 3, "dense", None, False, mx.float32),
]


# every case with V codes as rows; the tensor-core cases again with them in the tc16 layout (read
# as they are by the int8 P V, at most 4 rows per KV head; repacked as rows for the other paths)
EMU_PARAMS = [(c, "rows") for c in EMU_CASES] + [(c, "tc16") for c in EMU_CASES if c[0] == "tc"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,layout",
    EMU_PARAMS,
    ids=lambda c: c if isinstance(c, str) else f"{c[0]}-d{c[5]}-t{c[6]}-g{c[3]}",
)
def test_emulated_cuda_kernels_match_the_reference(emulated, case, layout, monkeypatch):
    path, b, hkv, g, length, d, tc, tf, kb, vb, kind, lens, sinks, dtype = case
    monkeypatch.setattr(iq, "TC_FOLD", tc % 2 == 1)  # odd lengths: tc with its combine folded in
    q, k, v = random_problem(
        b, hkv, g, length, d, tc, tf, kb, vb, kind, dtype, seed=tc + d, v_layout=layout
    )
    sk = mx.random.normal((hkv * g,)) if sinks else None
    mask = "causal" if length > 1 else None
    ref = iq.attention_reference(q, k, v, _scale(d), mask, sk, lens)
    if path in ("tc", "scalar"):
        out = iq.fused_attention(q, k, v, _scale(d), mask, sk, lens, variant=path)
    else:
        out = iq.unfused_attention(q, k, v, _scale(d), mask, sk, lens, schedule=path)
    assert out.shape == q.shape and out.dtype == q.dtype
    # output dtype rounding alone is ~2e-4 (fp16) / 2e-3 (bf16): compare in that dtype's terms
    tol = 8e-3 if dtype == mx.bfloat16 else TOL
    assert iq.rel_error(out, ref) < tol


@pytest.mark.slow
def test_emulated_combine_merges_many_splits(emulated):
    """Short splits with a float segment and a sink. Scalar kernel: ~80 compressed partials per
    row, shared by the combine's 8 warps unevenly. Tensor-core kernel: each threadgroup merges
    its 4 warps first (~20 partials; the last threadgroup's tail warps see no tokens)."""
    q, k, v = random_problem(1, 2, 4, 1, 128, 2530, 5, dtype=mx.float32, seed=21)
    sk = mx.random.normal((8,))
    p = iq.Problem.of(q, k, v, None)
    plan = iq.split_plan(p, iq.TC_RB, 32)
    assert plan["nspc"] >= 80 and plan["nsp"] > plan["nspc"]
    merged = iq.split_plan(p, iq.TC_RB, 32, merged=True)
    assert merged["nspc"] == merged["ncb"] == plan["nspc"] // iq.NW
    ref = iq.attention_reference(q, k, v, _scale(128), None, sk)
    default = iq.TC_FOLD
    for variant, fold in (("scalar", False), ("tc", False), ("tc", True)):
        iq.TC_FOLD = fold  # tc: its combine folded in (the last threadgroup merges) or separate
        try:
            out = iq.fused_attention(q, k, v, _scale(128), None, sk, variant=variant, split_len=32)
        finally:
            iq.TC_FOLD = default
        assert iq.rel_error(out, ref) < TOL, (variant, fold)


@pytest.mark.slow
def test_emulated_tc_one_tile_splits(emulated):
    """Splits of one tile (one tile per warp; short contexts): ragged lengths end inside a
    split and inside a tile, a float tail and sinks, the merge and combine over many partials;
    a split length under a tile rounds up to one."""
    q, k, v = random_problem(2, 1, 4, 1, 128, 200, 3, dtype=mx.float32, seed=16)
    p = iq.Problem.of(q, k, v, None)
    assert iq.split_plan(p, iq.TC_RB, 16, merged=True)["sl"] == iq.TC_TILE
    sk = mx.random.normal((4,))
    ref = iq.attention_reference(q, k, v, _scale(128), None, sk, [200, 71])
    out = iq.fused_attention(q, k, v, _scale(128), None, sk, [200, 71], variant="tc", split_len=16)
    assert iq.rel_error(out, ref) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("d", (64, 128))
def test_emulated_tc_long_splits_stream_many_tiles(emulated, d):
    """Splits of many tiles, the cp.async stream's steady state (its stages refilled in turn
    while the tile before is read): 224-token splits, whose warps get 7 full tiles, 6 full and a
    partial one (1100 = 4 x 224 + 204), 3 full and a partial (333), exactly 2 full (288), one
    partial (240: 16 tokens in the second split) and a sequence shorter than a tile (20), over
    a float tail and sinks."""
    lens = [1100, 333, 288, 240, 20]
    q, k, v = random_problem(5, 2, 4, 1, d, 1100, 5, dtype=mx.float32, seed=d + 3)
    sk = mx.random.normal((8,))
    ref = iq.attention_reference(q, k, v, _scale(d), None, sk, lens)
    out = iq.fused_attention(q, k, v, _scale(d), None, sk, lens, variant="tc", split_len=224)
    assert iq.rel_error(out, ref) < TOL


@pytest.mark.slow
def test_emulated_tc_small_value_norms_keep_their_precision(emulated):
    """Values of small norm (x1e-3: ~0.01): the P V weights reach the fp16 mma as p |v|, and the
    factor rsqrt(D) x (V level scale) is applied in fp32 afterwards. Folded into the weights it
    put every one of them below fp16's smallest normal number (measured here: relative error
    3.2e-3 that way, 5.8e-5 now; the bound is 1e-3)."""
    q, k, v = random_problem(2, 2, 4, 1, 128, 300, 0, dtype=mx.float32, seed=11)
    v = IsoQuantTensor(v.codes, (v.norms * 1e-3).astype(mx.float16), v.fp, v.quantizer, v.rotation)
    ref = iq.attention_reference(q, k, v, _scale(128), None, None, [300, 171])
    out = iq.fused_attention(q, k, v, _scale(128), None, None, [300, 171], variant="tc")
    assert iq.rel_error(out, ref) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("misalign", (False, True))
def test_emulated_tc_float_window_aligned_or_not(emulated, misalign, monkeypatch):
    """The tensor-core kernel's float tokens: 16-byte aligned rows in vector loads, others
    element by element (the float rows passed one element past a 16-byte boundary); a window
    that spreads over all four warps of its threadgroup and one that ends inside a warp's walk."""
    harness = pytest.importorskip("cuda_emu.harness")
    names = frozenset({"k_fp", "v_fp"}) if misalign else frozenset()
    monkeypatch.setattr(harness.EmuKernel, "misalign", names)
    for d, tf, dtype in ((128, 64, mx.bfloat16), (64, 45, mx.float16), (128, 70, mx.float32)):
        q, k, v = random_problem(2, 2, 4, 1, d, 90, tf, dtype=dtype, seed=tf + d)
        ref = iq.attention_reference(q, k, v, _scale(d), None, None, [90, 33])
        out = iq.fused_attention(q, k, v, _scale(d), None, None, [90, 33], variant="tc")
        tol = 8e-3 if dtype == mx.bfloat16 else TOL
        assert iq.rel_error(out, ref) < tol, (d, tf, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("misalign", (False, True))
def test_emulated_tc_query_rows_in_vector_loads_or_not(emulated, misalign, monkeypatch):
    """The tensor-core kernel reads decode's query rows in 16-byte loads when they are 16-byte
    aligned, else element by element (q passed one element past a 16-byte boundary): both
    match the reference, with 4 query rows of 8 (padded rows zero), with 16 (two row blocks),
    at D 64 and 128 and in all three dtypes."""
    harness = pytest.importorskip("cuda_emu.harness")
    monkeypatch.setattr(harness.EmuKernel, "misalign", frozenset({"q"} if misalign else ()))
    for d, g, dtype in ((128, 4, mx.bfloat16), (64, 16, mx.float16), (128, 3, mx.float32)):
        q, k, v = random_problem(2, 2, g, 1, d, 70, 5, dtype=dtype, seed=g + d)
        ref = iq.attention_reference(q, k, v, _scale(d), None, None, [70, 41])
        out = iq.fused_attention(q, k, v, _scale(d), None, None, [70, 41], variant="tc")
        tol = 8e-3 if dtype == mx.bfloat16 else TOL
        assert iq.rel_error(out, ref) < tol, (d, g, dtype)


def test_tc_table_words_hold_the_levels():
    """The tensor-core kernel's level tables, built on the host (tc_table_words): each byte
    plane decodes back to the levels: int8 bytes, L + 128 bytes (VSN), fp16 bits in two planes."""

    def planes(words):
        return [(w >> (8 * i)) & 0xFF for w in words for i in range(4)]

    ints = [-113.0, -71.0, -40.0, -13.0, 13.0, 40.0, 71.0, 113.0]
    b = planes(iq.tc_table_words(ints, "int8"))
    assert [x - 256 if x > 127 else x for x in b[:8]] == ints and b[8:] == [0] * 8
    b = planes(iq.tc_table_words(ints, "vsn"))
    assert [x - 128 for x in b[:8]] == ints and all(x < 128 for x in b[:4])
    lv = [-2.152, -1.344, -0.756, -0.245, 0.245, 0.756, 1.344, 2.152]
    b = planes(iq.tc_table_words(lv, "fp16"))
    bits = np.array([lo | hi << 8 for lo, hi in zip(b[:8], b[8:], strict=True)], np.uint16)
    assert np.array_equal(bits.view(np.float16), np.asarray(lv, np.float32).astype(np.float16))
    assert all(0 <= w < 1 << 32 for w in iq.tc_table_words(lv, "fp16"))


@pytest.mark.slow
@pytest.mark.parametrize("d", (64, 128))
def test_emulated_tc_int8_and_fp16_qk_both_match_the_reference(emulated, d, monkeypatch):
    """The tensor-core kernel's Q K^T on int8 tensor cores (exact table of the int8-grid
    codebook, the query in two int8 parts with a per-row scale) and in fp16: both within the
    bound, on query rows of very different sizes (x8: scores ~30 in the log2 domain, where a
    coarse query part would show; a row of zeros, whose scale must not divide by zero; x1e-3),
    with a ragged tail tile."""
    q, k, v = random_problem(1, 2, 4, 1, d, 333, 4, dtype=mx.float32, seed=d)
    q = q * mx.array([8.0, 0.0, 1.0, 1e-3] * 2)[None, :, None, None]
    _tc_both_ways_match_the_reference(q, k, v, d, "TC_KI8", "KI8", monkeypatch)


def _tc_both_ways_match_the_reference(q, k, v, d, setting, switch, monkeypatch):
    """The tensor-core kernel with iq.<setting> on and off (its template switch following it):
    both within the bound, and different outputs (two paths ran)."""
    ref = iq.attention_reference(q, k, v, _scale(d))
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(iq, setting, on)
        _, variant, run = iq._plan(q, k, v, _scale(d), None, None, "tc", None)
        assert dict(run.template)[switch] is on
        outs[on] = iq.fused_attention(q, k, v, _scale(d), variant="tc")
        assert iq.rel_error(outs[on], ref) < TOL, (setting, on)
    assert not mx.array_equal(outs[True], outs[False])


@pytest.mark.slow
@pytest.mark.parametrize("d", (64, 128))
def test_emulated_tc_subnormal_and_table_pv_both_match_the_reference(emulated, d, monkeypatch):
    """P V with the V levels as fp16 subnormals (L + 128, the offset taken off at the end: one
    byte permute per A register) and from the fp16 level table: both within the bound. Values
    of one sign and similar size (a V mean far from 0: the output is then small against 128 sum
    P', the subtraction's worst case) over 1500 tokens with near-flat attention, and a
    ragged tail tile."""
    q, k, v = random_problem(1, 2, 4, 1, d, 1500, 5, dtype=mx.float32, seed=3 * d)
    q = q * 1e-2  # near-flat attention: every token's weight in the sum
    # V codes 5 or 6 (levels ~40 and ~71) everywhere: packed rows of those codes
    rows = pack_codes(mx.random.randint(5, 7, (1, 2, 1500, d)).astype(mx.uint8), 3)
    v = dataclasses.replace(v, codes=rows)
    monkeypatch.setattr(iq, "TC_PV8", False)  # (PV8, taken at 4 rows, supersedes VSN)
    _tc_both_ways_match_the_reference(q, k, v, d, "TC_VSN", "VSN", monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("d", (64, 128))
def test_emulated_tc_int8_pv_matches_the_reference_through_its_rescales(emulated, d, monkeypatch):
    """P V on the int8 tensor cores (PV8: P' in two int8 parts against kappa = 127 / nu, int32
    accumulators) and with the subnormal V table: both within the bound, where the accumulators
    are rescaled again and again: scores that keep growing along the tokens (a new maximum in
    most tiles), V norms of 0 for the first 40 tokens (nu unset: the sums kept in units of 1)
    that then grow ~1000x (nu doubling ~10 times), 2 and 4 query rows, a ragged tail tile."""
    for g in (4, 2):
        q, k, v = random_problem(1, 2, g, 1, d, 1500, 5, dtype=mx.float32, seed=5 * d + g)
        t = mx.arange(1500, dtype=mx.float32)
        ramp = mx.where(t < 40, 0.0, mx.power(2.0, (t - 40) / 146.0))[None, None, :]
        v = dataclasses.replace(v, norms=(v.norms.astype(mx.float32) * ramp).astype(mx.float16))
        # K norms rising along the tokens: later tiles keep raising the running maximum
        k = dataclasses.replace(
            k, norms=(k.norms.astype(mx.float32) * (1 + t / 300)[None, None, :]).astype(mx.float16)
        )
        q = q * 3.0
        _tc_both_ways_match_the_reference(q, k, v, d, "TC_PV8", "PV8", monkeypatch)


def test_pv8_is_taken_only_where_it_applies(monkeypatch):
    """PV8 needs int8 Q K^T, at most 4 rows per (sequence, KV head) and a warp-rotated query:
    decode with 4 query heads per KV head takes it; 8 query heads, the fp16 Q K^T path or the
    dense rotation fall back to the subnormal V table."""

    def template(g, kind="v3", length=1):
        q, k, v = random_problem(1, 2, g, length, 128, 300, 0, kind=kind, dtype=mx.float32)
        _, _, run = iq._plan(q, k, v, _scale(128), None, None, "tc", None)
        t = dict(run.template)
        return t["PV8"], t["VSN"]

    assert template(4) == (True, False) and template(1) == (True, False)
    assert template(8) == (False, True) and template(4, length=2) == (False, True)
    assert template(4, "dense")[0] is False
    monkeypatch.setattr(iq, "TC_KI8", False)
    assert template(4)[0] is False


def test_vsn_takes_only_symmetric_int8_tables():
    """VSN's sign trick needs codes 0-3 negative and 4-7 positive integers in [-127, 127]: the
    cache's 3-bit codebooks qualify (d 64, 128); others fall back to the fp16 table."""
    for d in (64, 128):
        lv, _scale_, int8 = iq._tc_levels_cached(d, 3)
        assert int8 and iq.vsn_table_ok(lv.tolist())
    assert not iq.vsn_table_ok([-113, -71, -40, -13, 13, 40, 71, 128])  # past int8
    assert not iq.vsn_table_ok([-113, -71, -40, 0.5, 13, 40, 71, 113])  # not integers
    assert not iq.vsn_table_ok([-113, -71, -40, 13, 20, 40, 71, 113])  # code 3 positive
    assert not iq.vsn_table_ok([-3, -2, -1, 1, 2, 3, 4])  # 7 levels


def _assert_codes_match(codes, norms, ref_codes, ref_norms, x, rot, qz):
    """Kernel codes equal the MLX-ops encoder's, except where float rounding puts the unit
    coordinate u within 1e-5 of a threshold (either side is then a right answer); norms equal
    up to one fp16 step."""
    from app.engine.kvcache.isoquant.packing import unpack_codes

    c, rc = unpack_codes(codes, qz.bits), unpack_codes(ref_codes, qz.bits)
    y = rot.forward(x)
    nrm = mx.sqrt(mx.sum(y * y, axis=-1, keepdims=True))
    u = y * (math.sqrt(qz.dim) / mx.maximum(nrm, 1e-30))
    near = mx.min(mx.abs(u[..., None] - qz.thresholds), axis=-1) < 1e-5
    assert mx.all((c == rc) | near).item()
    a, b = norms.astype(mx.float32), ref_norms.astype(mx.float32)
    assert mx.all(mx.abs(a - b) <= mx.abs(b) * 2.0**-10).item()


ENC_CASES = [
    # b, hkv, n, d, kb, vb, kind, dtype
    (1, 2, 5, 64, 3, 4, "v3", mx.bfloat16),
    (2, 3, 17, 128, 3, 3, "v2", mx.float32),
    (1, 1, 3, 256, 4, 3, "dense", mx.float16),
    (1, 2, 1, 512, 3, 3, "v1", mx.bfloat16),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", ENC_CASES, ids=lambda c: f"d{c[3]}-n{c[2]}-{c[6]}-{c[4]}{c[5]}")
def test_emulated_encoder_matches_the_mlx_encoder(emulated, case):
    from app.engine.kvcache.isoquant.quantizer import Quantizer, encode
    from app.engine.kvcache.isoquant.rotation import Rotation

    b, h, n, d, kb, vb, kind, dtype = case
    mx.random.seed(n + d)
    rot = Rotation.make(kind, d, h, seed=3, layer=2)
    kq, vq = Quantizer.make(d, kb), Quantizer.make(d, vb)
    # strided views, as the cache passes its float tail (and one huge row to hit the clamp)
    big_k = (mx.random.normal((b, h, n + 7, d)) * 3.0).astype(dtype)
    big_v = mx.random.normal((b, h, n + 7, d)).astype(dtype)
    xk, xv = big_k[:, :, 4 : 4 + n], big_v[:, :, 4 : 4 + n]
    kc, kn, vc, vn = emulated.encode_pair(xk, xv, rot, kq, vq)
    rkc, rkn = encode(xk, rot, kq)
    rvc, rvn = encode(xv, rot, vq)
    assert kc.shape == rkc.shape and vc.shape == rvc.shape and kn.dtype == mx.float16
    _assert_codes_match(kc, kn, rkc, rkn, xk.astype(mx.float32), rot, kq)
    _assert_codes_match(vc, vn, rvc, rvn, xv.astype(mx.float32), rot, vq)


@pytest.mark.slow
def test_emulated_encoder_splits_long_inputs_into_launches(emulated, monkeypatch):
    """A bulk compression longer than one launch's rows (grid y) goes in chunks, concatenated
    in order: the same codes as one launch."""
    from app.engine.kvcache.isoquant.quantizer import Quantizer
    from app.engine.kvcache.isoquant.rotation import Rotation

    rot = Rotation.make("v3", 64, 2, seed=4, layer=0)
    q3, q4 = Quantizer.make(64, 3), Quantizer.make(64, 4)
    mx.random.seed(9)
    xk, xv = (mx.random.normal((1, 2, 23, 64)) for _ in "kv")
    whole = emulated.encode_pair(xk, xv, rot, q3, q4)
    monkeypatch.setattr(emulated, "ENCODE_MAX_ROWS", 8)  # 23 rows: launches of 8, 8, 7
    parts = emulated.encode_pair(xk, xv, rot, q3, q4)
    for a, b in zip(whole, parts, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.mark.slow
def test_emulated_encoder_clamps_norms_and_declines_what_it_cannot_take(emulated):
    from app.engine.kvcache.isoquant.quantizer import Quantizer
    from app.engine.kvcache.isoquant.rotation import Rotation

    rot = Rotation.make("v3", 64, 1, seed=0, layer=0)
    q = Quantizer.make(64, 3)
    x = mx.full((1, 1, 2, 64), 3e4, mx.float32)  # |x| = 2.4e5 > fp16 max
    _, kn, _, vn = emulated.encode_pair(x, x * 1e-3, rot, q, q)
    assert kn.tolist() == [[[65504.0, 65504.0]]] and abs(vn[0, 0, 0].item() - 240.0) < 0.5
    assert emulated.encode_pair(x, x[..., :32], rot, q, Quantizer.make(32, 3)) is None
    assert emulated.encode_pair(x[:, :, :0], x[:, :, :0], rot, q, q) is None


@pytest.mark.slow
def test_emulated_cache_compresses_with_the_fused_encoder(emulated, monkeypatch):
    """Decode with batch compression: the cache calls the kernel (one call per batch) and
    stores what the MLX-ops encoder would have."""
    from app.engine.kvcache.isoquant import IsoQuantKVCache
    from app.engine.kvcache.isoquant import cache as cache_mod

    calls = []

    def counting(*a):
        calls.append(a[0].shape[2])
        return emulated.encode_pair(*a)

    def run(encoder):
        monkeypatch.setattr(cache_mod, "_ENCODER", encoder)
        c = IsoQuantKVCache("v3", 3, 3, window=8, layer=1, compress_every=16)
        mx.random.seed(5)
        c.update_and_fetch(*(mx.random.normal((1, 2, 20, 64)).astype(mx.bfloat16) for _ in "kv"))
        c.finish_prefill()
        for _ in range(40):
            c.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)).astype(mx.bfloat16) for _ in "kv"))
        return c

    fused, plain = run(counting), run(None)
    # the prompt chunk encodes what the first step reads compressed; decode then encodes ahead
    # of the exact window, as far as the float tokens it holds (window + 1) and <= 16 at once
    assert calls[0] == 13 and all(n <= 9 for n in calls[1:]) and len(calls) <= 1 + 40 // 8
    assert fused.compressed == plain.compressed == 52
    r = fused._n_rows
    for a, b in ((fused.k_codes, plain.k_codes), (fused.v_codes, plain.v_codes)):
        same = mx.mean((a[:, :, :r] == b[:, :, :r]).astype(mx.float32)).item()
        assert same > 0.999  # bytes; a code may differ only at a threshold (see above)
    for a, b in ((fused.k_norms, plain.k_norms), (fused.v_norms, plain.v_norms)):
        a, b = a[:, :, :r].astype(mx.float32), b[:, :, :r].astype(mx.float32)
        assert mx.all(mx.abs(a - b) <= mx.abs(b) * 2.0**-10).item()


@pytest.mark.slow
def test_emulated_kernels_one_by_one(emulated):
    q, k, v = random_problem(2, 2, 4, 1, 64, 47, 0, dtype=mx.float32, seed=7)
    p = iq.Problem.of(q, k, v, None)
    s = iq.qk_dot(q, k, 0.125, p)
    s_ref = iq.qk_dot_reference(q, k, 0.125)
    assert iq.rel_error(s, s_ref) < 1e-5
    pr = iq.softmax(s_ref, p, [47, 20])
    pr_ref = iq.softmax_reference(s_ref, p, [47, 20])
    assert iq.rel_error(pr, pr_ref) < 1e-5
    assert mx.all(pr[2:, :, 20:] == 0).item()  # sequence 1's tail is masked
    for schedule in ("word", "dim"):
        acc = iq.value_accum(pr_ref, v, p, schedule=schedule)
        assert iq.rel_error(acc, iq.value_accum_reference(pr_ref, v)) < 1e-5
    o = iq.rotate_inverse(acc, v.rotation, p)
    assert iq.rel_error(o, iq.rotate_inverse_reference(acc, v.rotation, p)) < 1e-5


@pytest.mark.slow
def test_emulated_dispatch_uses_the_kernel_and_falls_back(emulated, monkeypatch):
    q, k, v = random_problem(1, 1, 2, 1, 64, 20, 2, dtype=mx.float32, seed=8)
    calls = []
    real = iq._fused_call  # reached only once the inputs are accepted
    monkeypatch.setattr(iq, "_fused_call", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = kk.isoquant_attention(q, k, v, 0.125)
    assert calls and iq.rel_error(out, iq.attention_reference(q, k, v, 0.125)) < TOL
    calls.clear()
    array_mask = mx.ones((1, 22), mx.bool_)
    kk.isoquant_attention(q, k, v, 0.125, mask=array_mask)  # reference, no kernel call
    assert not calls
    with pytest.raises(iq.Unsupported):
        kk.isoquant_attention(q, k, v, 0.125, mask=array_mask, use_kernel=True)


def test_v_layout_is_tc16_where_the_tensor_core_kernel_reads_it(monkeypatch):
    """The layout the kernels ask new caches for: tc16 on CUDA for 3-bit V at D 64/128 while
    the tensor-core kernel's VSN path (which reads it at any number of rows) is on; rows
    everywhere else."""
    monkeypatch.setattr(iq, "BACKEND", "cuda")
    assert iq.v_layout(128, 3) == iq.v_layout(64, 3) == "tc16"
    assert iq.v_layout(256, 3) == iq.v_layout(128, 4) == "rows"
    monkeypatch.setattr(iq, "TC_VSN", False)
    assert iq.v_layout(128, 3) == "rows"  # PV8 alone: calls with > 4 rows would read rows
    monkeypatch.setattr(iq, "BACKEND", "metal")
    monkeypatch.setattr(iq, "TC_VSN", True)
    assert iq.v_layout(128, 3) == "rows"


@pytest.mark.slow
@pytest.mark.parametrize("g", [4, 8])  # 4: the int8 P V (PV8); 8 query rows: VSN
def test_emulated_tc16_cache_decodes_through_the_kernel_as_rows_do(emulated, g):
    """A cache storing V in the tc16 layout, filled in partial chunks (prefill of 37, then
    batches of 3), attends through the tensor-core kernel reading the layout as it is (VIL),
    bit for bit as the same cache with rows does, and within TOL of the reference."""
    caches = [
        IsoQuantKVCache("v3", 3, 3, window=5, layer=1, compress_every=3, v_layout=lay)
        for lay in ("rows", "tc16")
    ]
    mx.random.seed(11)
    kv = [mx.random.normal((1, 2, 37, 64)) for _ in "kv"]
    for c in caches:
        c.update_and_fetch(*kv)
        c.finish_prefill()
    ahead_seen = 0
    for step in range(14):
        kv = [mx.random.normal((1, 2, 1, 64)) for _ in "kv"]
        q = mx.random.normal((1, 2 * g, 1, 64))
        outs = []
        for c in caches:
            k, v = c.update_and_fetch(*kv)
            if c.v_layout == "tc16":
                assert v.layout == "tc16" and v.codes.shape[2] % 16 == 0
                assert iq._plan(q, k, v, 0.125, None, None, "tc", None)[2].tc16  # read as is
                pad = unpack_codes_tc16(v.codes)[:, :, v.compressed_len :]
                ahead_seen += bool(pad.size and pad.any().item())
            outs.append(iq.fused_attention(q, k, v, 0.125, variant="tc"))
        assert mx.array_equal(outs[0], outs[1]).item(), step
        ref = iq.attention_reference(q, k, v, 0.125)
        assert iq.rel_error(outs[1], ref) < TOL
        # the scalar kernel over the same views (unsliced buffers: rows past the split and
        # spare capacity are never read)
        assert isinstance(k, CacheView) and k.buffers()[0].shape[2] > k.compressed_len
        assert iq.rel_error(iq.fused_attention(q, k, v, 0.125, variant="scalar"), ref) < TOL
    assert ahead_seen  # the kernel masked codes encoded ahead of the split in the last chunk


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_emulated_tc16_pack_writes_what_the_mlx_ops_write(emulated, d):
    """The cache's fused tc16 write (iq_tc16_pack) against packing.py on random codes: new rows
    after 0, 5 or 15 rows of an old chunk (one chunk, two, three), the rest code 0."""
    from app.engine.kvcache.isoquant.packing import pack_codes_tc16

    mx.random.seed(d)
    for off, n in [(0, 16), (0, 3), (5, 16), (13, 3), (15, 20)]:
        old_codes = mx.random.randint(0, 8, (2, 3, 16, d)).astype(mx.uint8)
        new_codes = mx.random.randint(0, 8, (2, 3, n, d)).astype(mx.uint8)
        old = pack_codes_tc16(old_codes)
        out = iq.pack_tc16(pack_codes(new_codes, 3), old if off else None, off)
        nc = -(-(off + n) // 16)
        want = mx.concatenate(
            [old_codes[:, :, :off], new_codes, mx.zeros((2, 3, 16 * nc - off - n, d), mx.uint8)],
            axis=2,
        )
        assert out.shape == (2, 3, 16 * nc, 3 * d // 8)
        assert mx.array_equal(out, pack_codes_tc16(want)).item(), (off, n)
        assert mx.array_equal(unpack_codes_tc16(out)[:, :, off : off + n], new_codes).item()
    assert iq.pack_tc16(pack_codes(new_codes, 3), None, 3) is None  # no old chunk to keep


@pytest.mark.slow
def test_emulated_tc16_cache_writes_with_the_fused_pack(emulated, monkeypatch):
    """A tc16 cache compressing in batches that straddle chunks writes the same bytes through
    the registered packer as through MLX ops."""
    from app.engine.kvcache.isoquant import cache as cache_mod

    calls = []

    def counting(*a):
        calls.append(a[2])
        return emulated.pack_tc16(*a)

    def run(packer):
        monkeypatch.setattr(cache_mod, "_TC16_PACKER", packer)
        c = IsoQuantKVCache("v3", 3, 3, window=4, layer=1, compress_every=7, v_layout="tc16")
        mx.random.seed(3)
        c.update_and_fetch(*(mx.random.normal((1, 2, 21, 64)) for _ in "kv"))
        c.finish_prefill()
        for _ in range(30):
            c.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)) for _ in "kv"))
        return c

    fused, plain = run(counting), run(None)
    # tc16 encodes to the split only (zero codes past it in the chunk the kernel reads)
    assert calls and fused.compressed == plain.compressed == 47
    assert mx.array_equal(fused.v_codes, plain.v_codes).item()


# -- a decode step over the cache's buffers, read in place --------------------------------------


def _twin_caches(kb: int, n: int = 3, window: int = 5, every: int = 3, prompt: int = 37):
    caches = [
        IsoQuantKVCache("v3", kb, 3, window=window, layer=1, compress_every=every) for _ in range(n)
    ]
    mx.random.seed(kb + window)
    kv = [mx.random.normal((1, 2, prompt, 64)).astype(mx.float16) for _ in "kv"]
    for c in caches:
        c.update_and_fetch(*kv)
        c.finish_prefill()
    return caches


@pytest.mark.slow
@pytest.mark.parametrize("kb,g", [(3, 4), (3, 8), (4, 4)])  # tc (PV8, VSN), scalar (4-bit K)
def test_emulated_step_reads_the_window_in_place_as_the_views_do(emulated, kb, g, monkeypatch):
    """attend_step (the update and the fused kernel on the cache's unsliced buffers, the window
    at its row offset) against update_and_fetch and the same kernel on sliced views: bit for
    bit, step after step, across compressions (every 3 tokens), float-buffer reallocations and
    the launch plan shared by the layers of a step."""
    from app.engine.kvcache.isoquant import cache as cache_mod

    monkeypatch.setattr(cache_mod, "_STEP_KERNEL", emulated.window_attention)
    variant = "tc" if kb == 3 else "scalar"
    stepped, layer2, viewed = _twin_caches(kb)
    calls = []
    real = emulated._launch_words
    monkeypatch.setattr(emulated, "_launch_words", lambda *a: calls.append(1) or real(*a))
    offsets, planned, blocks, start = set(), 0, 0, None
    for step in range(20):
        kv = [mx.random.normal((1, 2, 1, 64)).astype(mx.float16) for _ in "kv"]
        q = mx.random.normal((1, 2 * g, 1, 64)).astype(mx.float16)
        n = len(calls)
        out = stepped.attend_step(q, *kv, 0.125)
        planned += len(calls) - n
        # a block: the next STEP_ROWS steps while the window's buffer stays where it is
        tc, fp_start = stepped.compressed, stepped.fp_start
        if start is None or start[1] != fp_start or tc - start[0] >= emulated.STEP_ROWS:
            blocks, start = blocks + 1, (tc, fp_start)
        k, v = viewed.update_and_fetch(*kv)
        ref = emulated.fused_attention(q, k, v, 0.125, variant=variant)  # sliced views
        assert mx.array_equal(out, ref).item(), step
        # another layer of the same step: the launch was planned for the step already
        n = len(calls)
        assert mx.array_equal(layer2.attend_step(q, *kv, 0.125), ref).item()
        assert len(calls) == n
        offsets.add(stepped.compressed - stepped.fp_start)
        assert (stepped.offset, stepped.compressed) == (viewed.offset, viewed.compressed)
    assert len(offsets) > 2  # the window sat at several rows of its buffer
    # the steps between compressions take their launches from one block planned at once
    assert 1 < blocks < 20 and planned == blocks * emulated.STEP_ROWS


def test_step_declines_before_touching_the_cache(monkeypatch):
    """attend_step returns None with the cache as it was where the general path must run (no
    step kernel, several tokens, a sink prefix, within the first window); where the kernel
    declines after the update, the general attention runs on the same update."""
    from app.engine.kvcache.isoquant import cache as cache_mod

    q = mx.random.normal((1, 4, 1, 64))
    kv = [mx.random.normal((1, 2, 1, 64)) for _ in "kv"]
    c = IsoQuantKVCache("v3", 3, 3, window=4, layer=1, compress_every=2)
    c.update_and_fetch(*(mx.random.normal((1, 2, 9, 64)) for _ in "kv"))
    assert c.attend_step(q, *kv, 0.125) is None and c.offset == 9  # no step kernel (CPU)
    monkeypatch.setattr(cache_mod, "_STEP_KERNEL", lambda *a: None)
    two = [mx.random.normal((1, 2, 2, 64)) for _ in "kv"]
    assert c.attend_step(mx.random.normal((1, 4, 2, 64)), *two, 0.125) is None
    sunk = IsoQuantKVCache("v3", 3, 3, window=4, layer=1, sink=2)
    sunk.update_and_fetch(*(mx.random.normal((1, 2, 9, 64)) for _ in "kv"))
    young = IsoQuantKVCache("v3", 3, 3, window=16, layer=1)
    young.update_and_fetch(*(mx.random.normal((1, 2, 9, 64)) for _ in "kv"))
    for cache in (sunk, young):
        assert cache.attend_step(q, *kv, 0.125) is None and cache.offset == 9
    assert c.offset == 9
    twin = IsoQuantKVCache("v3", 3, 3, window=4, layer=1, compress_every=2)
    twin.update_and_fetch(*(mx.random.normal((1, 2, 9, 64)) for _ in "kv"))
    twin.state, twin.offset = c.state, c.offset
    out = c.attend_step(q, *kv, 0.125)  # declined by the kernel: the general path, updated
    k, v = twin.update_and_fetch(*kv)
    assert c.offset == 10 and mx.array_equal(out, kk.isoquant_attention(q, k, v, 0.125)).item()
