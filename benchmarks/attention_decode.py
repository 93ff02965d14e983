"""Decode attention: IsoQuant fused kernels vs bf16 mx.fast SDPA vs torch SDPA (issue 3).

One query token, 32 query heads, 8 KV heads, d = 128, B in {1, 8, 32}, T in {2K, 8K, 32K,
128K}. IsoQuant reads 3-bit packed K and V (48 B + a 2-byte norm per token, head and tensor);
bf16 reads 256 B each. Effective GB/s = bytes of KV (plus q and out) / time, against the card's
~4.3 TB/s. Every method rotates over enough input sets that its KV is several times the L2, and
is timed as a queue of calls evaluated at once (MLX, host time included: `time_us`) or between
CUDA events (torch); median of trials after warm-up. MLX calls are also timed on the GPU's own
clock (`gpu_us`, benchmarks/gpu_clock.py: each call bracketed by %globaltimer stamps), the
like-for-like figure against torch's events. Also: the split-K variants side by side (tensor-core, scalar, the
four-kernel path) and the tensor-core precision options, on a few shapes.

    python benchmarks/attention_decode.py [--quick] [--out FILE]
Results: benchmarks/results/attention_decode.json
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_clock  # noqa: E402
import mlx.core as mx  # noqa: E402
from record import write_result  # noqa: E402

from app.engine.kvcache.isoquant import kernels as iq  # noqa: E402
from app.engine.testing.isoquant_problems import random_problem  # noqa: E402

HQ, HKV, D = 32, 8, 128
WINDOW = 64  # float tokens of the cache's recent window (kvcache default W)
BS = (1, 8, 32)
TS = (2048, 8192, 32768, 131072)
L2_BYTES = 60 << 20
CARD_GB_S = 4300.0
V_LAYOUT = iq.v_layout(D, 3)  # the V codes' layout the app's cache stores here (packing.py)


def _sets(bytes_per_set: int) -> int:
    return max(1, min(160, math.ceil(4 * L2_BYTES / max(1, bytes_per_set))))


def time_mlx(fn, sets, trials=7, min_calls=20) -> float:
    """Median µs per call: `n` calls queued lazily then evaluated together."""
    n = max(min_calls, len(sets))
    mx.eval([fn(*sets[i % len(sets)]) for i in range(len(sets))])  # warm-up, JIT compile
    mx.synchronize()
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        mx.eval([fn(*sets[i % len(sets)]) for i in range(n)])
        mx.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def time_torch(fn, sets, trials=7, min_calls=20) -> float:
    import torch

    n = max(min_calls, len(sets))
    for i in range(len(sets)):
        fn(*sets[i])
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(n):
            fn(*sets[i % len(sets)])
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / n * 1e3)
    return statistics.median(out)


def isoquant_sets(b: int, t: int, dtype=mx.bfloat16, tf: int = 0, v_layout: str | None = None):
    """Input sets of t compressed tokens (+ tf float ones, the cache's recent window), V codes in
    `v_layout` (default: the layout the app's cache stores on this backend, iq.v_layout)."""
    per = b * HKV * (t * 2 * (3 * D // 8 + 2) + tf * 2 * D * 2)
    layout = v_layout or V_LAYOUT
    sets = []
    for s in range(_sets(per)):
        q, k, v = random_problem(
            b, HKV, HQ // HKV, 1, D, t, tf, dtype=dtype, seed=s, encoded=False, v_layout=layout
        )
        mx.eval(q, k.codes, k.norms, v.codes, v.norms)
        sets.append((q, k, v))
    return sets, per


def record(rows, backend, kernel, b, t, us, nbytes, gpu_us=None, **extra):
    gbs = nbytes / (us * 1e-6) / 1e9
    if gpu_us is not None:
        extra.update(gpu_us=round(gpu_us, 2), gpu_gb_s=round(nbytes / (gpu_us * 1e-6) / 1e9, 1))
    rows.append(dict(backend=backend, kernel=kernel, B=b, T=t, d=D, time_us=round(us, 2),
                     gb_s=round(gbs, 1), bytes=nbytes, **extra))  # fmt: skip
    g = f"  gpu {gpu_us:8.1f} us" if gpu_us is not None else ""
    print(
        f"  {kernel:28s} B={b:<3d} T={t:<7d} {us:9.1f} us  {gbs:7.0f} GB/s ({gbs / CARD_GB_S:4.0%}){g}"
    )


def time_gpu(fn, sets) -> float | None:
    """GPU µs per call (gpu_clock): fn(q, k, v) with q made to wait for the bracket's stamp."""
    if not gpu_clock.available():
        return None

    def call(i, q):
        _, k, v = sets[i % len(sets)]
        return fn(q, k, v)

    return gpu_clock.gpu_us(call, [s[0] for s in sets], n=max(24, len(sets)))


def time_both(fn, sets) -> dict:
    """record()'s timings of fn(q, k, v): host-inclusive queued `us` and GPU-clock `gpu_us`."""
    return dict(us=time_mlx(fn, sets), gpu_us=time_gpu(fn, sets))


def bench_shape(rows, b, t, with_torch, variants):
    scale = 1 / math.sqrt(D)
    qo = 2 * b * HQ * D * 2  # q in, out back (bf16)
    sets, per = isoquant_sets(b, t)
    for name, fn in variants.items():
        f = lambda q, k, v, fn=fn: fn(q, k, v, scale)  # noqa: E731
        record(rows, "mlx-cuda", name, b, t, nbytes=per + qo, v_layout=V_LAYOUT,
               **time_both(f, sets))  # fmt: skip
    del sets
    mx.clear_cache()
    if V_LAYOUT != "rows":  # the same call with the V codes as rows (the layout before tc16)
        sets, per = isoquant_sets(b, t, v_layout="rows")
        f = lambda q, k, v: iq.fused_attention(q, k, v, scale)  # noqa: E731
        record(rows, "mlx-cuda", "isoquant_fused_rows", b, t, nbytes=per + qo, v_layout="rows",
               **time_both(f, sets))  # fmt: skip
        del sets
        mx.clear_cache()
    if t <= 8192:  # as the app's cache holds it: + a recent window of 64 float tokens
        sets, per_w = isoquant_sets(b, t, tf=WINDOW)
        f = lambda q, k, v: iq.fused_attention(q, k, v, scale)  # noqa: E731
        record(rows, "mlx-cuda", f"isoquant_fused_w{WINDOW}", b, t, nbytes=per_w + qo,
               tf=WINDOW, v_layout=V_LAYOUT, **time_both(f, sets))  # fmt: skip
        del sets
        mx.clear_cache()
    per = b * HKV * t * D * 2 * 2
    try:
        sets = []
        for s in range(_sets(per)):
            mx.random.seed(100 + s)
            q = mx.random.normal((b, HQ, 1, D)).astype(mx.bfloat16)
            k = mx.random.normal((b, HKV, t, D)).astype(mx.bfloat16)
            v = mx.random.normal((b, HKV, t, D)).astype(mx.bfloat16)
            mx.eval(q, k, v)
            sets.append((q, k, v))

        def sdpa(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

        record(rows, "mlx-cuda", "mx_sdpa_bf16", b, t, nbytes=per + qo, **time_both(sdpa, sets))
    except RuntimeError as e:  # seen at B=32, T=128K (17 GB of KV): a CUDA-graph launch error
        rows.append(
            dict(backend="mlx-cuda", kernel="mx_sdpa_bf16", B=b, T=t, d=D, error=str(e)[:200])
        )
        print(f"  mx_sdpa_bf16 B={b} T={t}: {e}")
    sets = None
    mx.clear_cache()
    if with_torch:
        import torch
        import torch.nn.functional as F

        def randn(shape, gen):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

        tsets = []
        for s in range(_sets(per)):
            gen = torch.Generator(device="cuda").manual_seed(200 + s)
            tsets.append(
                tuple(randn(sh, gen) for sh in ((b, HQ, 1, D), (b, HKV, t, D), (b, HKV, t, D)))
            )
        us = time_torch(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), tsets
        )
        record(rows, "torch-cuda", "torch_sdpa_bf16", b, t, us, per + qo)
        del tsets
        torch.cuda.empty_cache()


# the library's settings a benchmark variant may change
SETTINGS = ("TC_QS", "TC_FOLD", "TC_PREFETCH", "TC_KI8", "TC_VSN", "TC_PV8", "SPLIT_WARPS")


@contextlib.contextmanager
def settings(**changed):
    """iq's settings (SETTINGS names) set for the duration, the loaded values restored after;
    None leaves one as it is."""
    saved = {k: getattr(iq, k) for k in SETTINGS}
    for name, value in changed.items():
        if value is not None:
            setattr(iq, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(iq, name, value)


def check_accuracy() -> dict:
    """Fused output vs the MLX-ops reference on the same codes (bench-like shape)."""
    q, k, v = random_problem(
        2, HKV, HQ // HKV, 1, D, 4097, 64, dtype=mx.float32, seed=9, v_layout=V_LAYOUT
    )
    with mx.stream(mx.cpu):  # float32 reference: MLX's CUDA float32 matmuls are TF32
        ref = iq.attention_reference(q, k, v, 1 / math.sqrt(D))
    res = {}
    if V_LAYOUT != "rows":  # the same codes as rows
        res["tc_rows"] = iq.rel_error(
            iq.fused_attention(q, k, v.as_rows(), 1 / math.sqrt(D), variant="tc"), ref
        )
    for variant in ("tc", "scalar"):
        res[variant] = iq.rel_error(
            iq.fused_attention(q, k, v, 1 / math.sqrt(D), variant=variant), ref
        )
    ki8 = iq.TC_KI8
    with settings(TC_KI8=not ki8):  # the tensor-core kernel's other Q K^T path
        other = iq.fused_attention(q, k, v, 1 / math.sqrt(D), variant="tc")
    res["tc_qk_" + ("fp16" if ki8 else "int8")] = iq.rel_error(other, ref)
    pv8 = iq.TC_PV8
    with settings(TC_PV8=not pv8):  # the tensor-core kernel's other P V path
        other = iq.fused_attention(q, k, v, 1 / math.sqrt(D), variant="tc")
    res["tc_pv_" + ("subnormal" if pv8 else "int8")] = iq.rel_error(other, ref)
    vsn = iq.TC_VSN
    with settings(TC_VSN=not vsn, TC_PV8=False):  # the fp16 P V path's other V lookup
        other = iq.fused_attention(q, k, v, 1 / math.sqrt(D), variant="tc")
    res["tc_pv_" + ("fp16_table" if vsn else "subnormal")] = iq.rel_error(other, ref)
    res["unfused"] = iq.rel_error(iq.unfused_attention(q, k, v, 1 / math.sqrt(D)), ref)
    print(
        "  rel. error vs reference (B=2, T=4097+64, fp32 q):",
        {a: f"{e:.1e}" for a, e in res.items()},
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="B=8, T=32K only")
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "attention_decode.json")
    )
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="only the variant sweep")
    ap.add_argument("--no-sweep", action="store_true", help="only the table")
    ap.add_argument(
        "--defaults-only",
        action="store_true",
        help="the table's default call (and its float window), mx.fast and torch only: no "
        "variant columns (all twelve shapes take ~84 s on an H200)",
    )
    ap.add_argument(
        "--shapes", nargs="*", metavar="BxT", help="table shapes (default: every B x T)"
    )
    args = ap.parse_args()
    if not iq.kernels_available():
        sys.exit("needs MLX's CUDA or Metal backend")
    rows: list[dict] = []
    acc = check_accuracy()

    def with_opts(
        qs: bool | None = None,
        warps: int | None = None,
        variant=None,
        split_len=None,
        fold=None,
        prefetch=None,
        ki8=None,
        vsn=None,
        pv8=None,
    ):
        changed = dict(
            TC_QS=qs, TC_FOLD=fold, TC_PREFETCH=prefetch, TC_KI8=ki8, TC_VSN=vsn, TC_PV8=pv8,
            SPLIT_WARPS=warps,
        )  # fmt: skip

        def fn(q, k, v, s):
            with settings(**changed):
                return iq.fused_attention(q, k, v, s, variant=variant, split_len=split_len)

        return fn

    # the defaults, then each option flipped: Q fragments in registers instead of shared
    # memory, the combine folded into the split kernel and as its own launch, the first
    # tiles' loads issued after the query rotation instead of before, Q K^T on fp16 tensor cores
    # instead of int8 ones (or the other way round), P V on fp16 tensor cores with the V levels as
    # subnormals instead of on int8 ones (or the other way round), and there from the fp16 table
    # instead of as subnormals (or the other way round); at short contexts also
    # fixed splits of 16 and 32 tokens (1 and 2 tiles per warp) instead of the plan's
    fused = {
        "isoquant_fused": with_opts(),
        "isoquant_fused_qregs": with_opts(qs=not iq.TC_QS),
        "isoquant_fused_fold": with_opts(fold=True),
        "isoquant_fused_combine": with_opts(fold=False),
        "isoquant_fused_prefetch" + ("_off" if iq.TC_PREFETCH else "_on"): with_opts(
            prefetch=not iq.TC_PREFETCH
        ),
        "isoquant_fused_qk_" + ("fp16" if iq.TC_KI8 else "int8"): with_opts(ki8=not iq.TC_KI8),
        "isoquant_fused_pv_" + ("subnormal" if iq.TC_PV8 else "int8"): with_opts(pv8=not iq.TC_PV8),
        "isoquant_fused_pv_" + ("fp16_table" if iq.TC_VSN else "subnormal_vsn"): with_opts(
            vsn=not iq.TC_VSN, pv8=False
        ),
    }
    short = {
        "isoquant_fused_split64": with_opts(split_len=64),
        "isoquant_fused_split32": with_opts(split_len=32),
    }
    if args.defaults_only:
        fused, short = {"isoquant_fused": fused["isoquant_fused"]}, {}
    shapes = [(8, 32768)] if args.quick else [(b, t) for b in BS for t in TS]
    if args.shapes:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    shapes = [] if args.sweep_only else shapes

    def save():
        info = {}
        try:
            info = {k: str(v) for k, v in mx.device_info().items()}
        except Exception:  # older MLX: the device name is optional
            pass
        machine = dict(
            platform=platform.platform(), device=info.get("device_name", "?"), mlx=mx.__version__
        )
        out = dict(
            shape=dict(hq=HQ, hkv=HKV, d=D, query_tokens=1, isoquant_bits=3, dtype="bfloat16"),
            method="time_us: median of 7 trials; each trial queues >= 20 calls over rotating "
            "input sets (KV >= 4x the 60 MB L2 where memory allows) and evaluates them at once "
            "(MLX: host time included) or times them with CUDA events (torch: GPU stream time). "
            "gpu_us (MLX only): GPU time per call from %globaltimer stamps around each call "
            "(benchmarks/gpu_clock.py), median of 3 runs of >= 24 calls, the empty bracket "
            "subtracted; like torch's events it includes launch gaps, not host time",
            kernel_options=dict(
                qsmem=iq.TC_QS,
                fold=iq.TC_FOLD,
                prefetch=iq.TC_PREFETCH,
                qk_int8=iq.TC_KI8,
                pv_subnormal=iq.TC_VSN,
                pv_int8=iq.TC_PV8,
                split_warps=iq.SPLIT_WARPS,
                precision=list(iq.TC_PRECISION),
                v_layout=V_LAYOUT,
            ),  # fmt: skip
            accuracy_rel_error=acc,
            records=rows,
        )
        write_result("attention_decode", out, machine, Path(args.out))

    for b, t in shapes:
        print(f"B={b} T={t}", flush=True)
        bench_shape(rows, b, t, not args.no_torch, {**fused, **(short if t <= 8192 else {})})
        save()
    # variants side by side on a few shapes: which path and split plan wins where
    sweep = (
        []
        if args.quick or args.no_sweep
        else [(1, 2048), (1, 32768), (8, 8192), (8, 32768), (8, 131072), (32, 8192), (32, 32768)]
    )
    for b, t in sweep:
        variants = {}
        if t <= 8192:
            variants["isoquant_fused_scalar"] = with_opts(False, variant="scalar")
            variants["isoquant_unfused"] = lambda q, k, v, s: iq.unfused_attention(q, k, v, s)
        for qs in (False, True):
            # around one full wave (132 SMs x 4 threadgroups x 4 warps = 2112) and beyond
            for w in (1024, 1536, 2112, 2640, 3072, 4224, 6144) if qs else (3072,):
                variants[f"isoquant_fused_qs{int(qs)}_warps{w}"] = with_opts(qs, w)
        sets, per = isoquant_sets(b, t)
        for name, fn in variants.items():
            f = lambda q, k, v, fn=fn: fn(q, k, v, 1 / math.sqrt(D))  # noqa: E731
            record(rows, "mlx-cuda", name, b, t, nbytes=per + 4 * b * HQ * D, **time_both(f, sets))
        del sets
        mx.clear_cache()
        save()
    save()
    print_summary(rows)


def print_summary(rows) -> None:
    def by(field):
        return {(r["kernel"], r["B"], r["T"]): r.get(field) for r in rows if "time_us" in r}

    host, gpu = by("time_us"), by("gpu_us")
    names = ("isoquant_fused", "isoquant_fused_rows", "isoquant_fused_qregs", "mx_sdpa_bf16")
    print("\n GPU time per call (µs; torch: CUDA events); host-inclusive queued time in brackets")
    print(
        " B    T       iq default      iq V rows      iq qregs       mx_sdpa         torch"
        "    vs mx (gpu/host)  vs torch (gpu/host)"
    )
    for b in BS:
        for t in TS:
            if host.get(("isoquant_fused", b, t)) is None:
                continue
            cells = [
                f"{gpu.get((k, b, t)) or 0:6.1f} ({host[(k, b, t)]:6.1f})"
                if host.get((k, b, t))
                else "-"  # not timed (--defaults-only)
                for k in names
            ]
            tt = host.get(("torch_sdpa_bf16", b, t))
            d_g, d_h = gpu.get(("isoquant_fused", b, t)), host[("isoquant_fused", b, t)]
            m_g, m_h = gpu.get(("mx_sdpa_bf16", b, t)), host.get(("mx_sdpa_bf16", b, t))

            def ratio(x, y):
                return f"{x / y:5.2f}" if x and y else "  -  "

            print(
                f" {b:<4d} {t:<7d}" + "".join(f"{c:>16s}" for c in cells) + f"{tt or 0:9.1f}"
                f"     {ratio(m_g, d_g)}/{ratio(m_h, d_h)}      {ratio(tt, d_g)}/{ratio(tt, d_h)}"
            )


if __name__ == "__main__":
    main()
