"""Where a fused IsoQuant decode-attention call spends its time at short contexts (issue 3's
"never slower than mx.fast SDPA at 2K"): per call, side by side in one run —

  noop        one trivial MLX op on q (the per-op floor of a lazily built, batched graph)
  sdpa        bf16 mx.fast.scaled_dot_product_attention on the same shape
  partials    the split kernel alone (iq_fused_tc)
  combine     the separate combine kernel alone, on precomputed partials (the tensor-core
              kernel no longer needs it: its last threadgroup per row block merges)
  full        fused_attention (both)
  python      building the graph of one call without evaluating it (host time only)

Shapes: 32 q / 8 KV heads, d 128, 3-bit codes, one query token; B in {1, 8, 32}, T in
{2K, 8K, 32K}. Each time is the median over trials of (n calls queued, evaluated together) / n,
as in attention_decode.py. Needs MLX's CUDA (or Metal) backend.

    python benchmarks/isoquant_overhead.py --out benchmarks/results/isoquant_overhead.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from app.engine.kvcache import jit  # noqa: E402
from app.engine.kvcache.isoquant import kernels as iq  # noqa: E402

HQ, HKV, D = 32, 8, 128


def time_calls(fn, trials=7, n=40) -> float:
    mx.eval([fn() for _ in range(4)])
    mx.synchronize()
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        mx.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def time_host(fn, n=200) -> float:
    t0 = time.perf_counter()
    outs = [fn() for _ in range(n)]
    dt = (time.perf_counter() - t0) / n * 1e6
    del outs
    return dt


def shape(b: int, t: int, warps: list[int]) -> list[dict]:
    scale = 1 / math.sqrt(D)
    q, k, v = iq.random_problem(b, HKV, HQ // HKV, 1, D, t, 0, seed=1, encoded=False)
    mx.eval(q, k.codes, k.norms, v.codes, v.norms)
    p = iq.Problem.of(q, k, v, None)
    rows = []
    for w in warps:
        iq.SPLIT_WARPS = w
        _, variant, run = iq._plan(q, k, v, scale, None, None, None, None)
        part = iq._fused_call(q, k, v, p, run, variant, None, None)[:3]  # tc: + the output
        mx.eval(part)
        plan = iq.split_plan(p, iq.TC_RB, None, w)
        r = dict(B=b, T=t, warps=w, nsp=plan["nsp"], split_len=plan["sl"])
        r["noop_us"] = time_calls(lambda: q * 2)
        r["partials_us"] = time_calls(
            lambda run=run, variant=variant: iq._fused_call(q, k, v, p, run, variant, None, None)[0]
        )
        r["combine_us"] = time_calls(
            lambda part=part, run=run: iq.combine(part, k.rotation, p, run, q.dtype)
        )
        r["full_us"] = time_calls(lambda: iq.fused_attention(q, k, v, scale))
        r["python_us"] = time_host(lambda: iq.fused_attention(q, k, v, scale))
        rows.append(r)
    iq.SPLIT_WARPS = DEFAULT_WARPS
    kf = mx.random.normal((b, HKV, t, D)).astype(mx.bfloat16)
    vf = mx.random.normal((b, HKV, t, D)).astype(mx.bfloat16)
    mx.eval(kf, vf)
    sd = time_calls(lambda: mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale))
    sdh = time_host(lambda: mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale))
    for r in rows:
        r["sdpa_us"], r["sdpa_python_us"] = sd, sdh
    for r in rows:
        print(
            f"B={b:<3d} T={t:<6d} warps={r['warps']:<5d} nsp={r['nsp']:<4d} "
            + " ".join(
                f"{key[:-3]}={r[key]:7.1f}"
                for key in (
                    "noop_us",
                    "sdpa_us",
                    "partials_us",
                    "combine_us",
                    "full_us",
                    "python_us",
                    "sdpa_python_us",
                )
            )  # fmt: skip
        )
    return rows


DEFAULT_WARPS = iq.SPLIT_WARPS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "isoquant_overhead.json")
    )
    ap.add_argument("--warps", default=f"{DEFAULT_WARPS}")
    ap.add_argument("--shapes", default="1x2048,1x8192,1x32768,8x2048,8x8192,32x2048")
    args = ap.parse_args()
    if not iq.kernels_available():
        sys.exit("needs MLX's CUDA or Metal backend")
    warps = [int(w) for w in args.warps.split(",")]
    q, k, v = iq.random_problem(2, HKV, HQ // HKV, 1, D, 2049, 0, dtype=mx.float32, seed=3)
    with mx.stream(mx.cpu):  # float32 reference (MLX's CUDA float32 matmuls are TF32)
        ref = iq.attention_reference(q, k, v, 1 / math.sqrt(D))
    err = iq.rel_error(iq.fused_attention(q, k, v, 1 / math.sqrt(D)), ref)
    print(f"rel. error vs reference (B=2, T=2049, fp32 q): {err:.1e}")
    if not err < 1e-3:
        sys.exit("the fused kernel disagrees with the reference")
    rows = []
    for s in args.shapes.split(","):
        b, t = (int(x) for x in s.split("x"))
        rows += shape(b, t, warps)
    info = {}
    try:
        info = {k: str(v) for k, v in mx.device_info().items()}
    except Exception:
        pass
    mode = "inline header" if jit.inline() else "header included from a file"
    out = dict(device=info, header=mode, rel_error=err, records=rows)
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("isoquant_overhead", out, {"device": info.get("device_name", "?")}, Path(args.out))


if __name__ == "__main__":
    main()
