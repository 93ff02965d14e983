"""Host (CPU) time per decode step of the IsoQuant attention path, on this machine: building
the graph only, nothing evaluated. Parts: a pure-Python yardstick (to compare machines), the
cache's update_and_fetch, fused_attention with the MLX kernel calls replaced by stubs (our
Python alone) and with the real kernels, the cache's one-token step (attend_step: the update
and the kernel on its buffers) against update_and_fetch and the attention call, and mlx-lm's
KVCache + mx.fast SDPA for comparison.
32 q / 8 KV heads, d 128, batch 1, 2K context.

    python benchmarks/isoquant_host.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from app.engine.kvcache import isoquant  # noqa: E402
from app.engine.kvcache.isoquant import kernels as iq  # noqa: E402
from app.engine.testing.isoquant_problems import random_problem  # noqa: E402


def per_call_us(fn, n=2000) -> float:
    fn()
    t = time.perf_counter()
    keep = [fn() for _ in range(n)]
    dt = (time.perf_counter() - t) / n * 1e6
    del keep
    return dt


def build_and_encode_us(fn, calls=32, reps=60) -> tuple[float, float]:
    """Host µs per call to build `calls` independent calls' graph, and to encode them for the GPU
    (mx.async_eval: MLX's eval_gpu of each node, graph nodes, the launch), medians over reps; the
    GPU work of one batch finishes before the next is built."""
    build, enc = [], []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.synchronize()
        if i >= 5:
            build.append((t1 - t0) / calls * 1e6)
            enc.append((t2 - t1) / calls * 1e6)
    return statistics.median(build), statistics.median(enc)


def _layer_us(q, scale) -> float:
    """One layer's attention step as a model runs it, kernels stubbed (host Python only): the
    cache's update_and_fetch, then the model module's attention (the installed dispatch)."""
    from app.engine.kvcache.isoquant import kernel_path as kk
    from app.engine.kvcache.isoquant.dispatch import make_dispatch

    kk.install()
    c = isoquant.IsoQuantKVCache("v3", 3, 3, window=64, layer=0)
    c.update_and_fetch(*(mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16) for _ in "kv"))
    c.finish_prefill()
    tok = [mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16) for _ in "kv"]
    mx.eval(tok, *[x for x in c.state if x is not None])
    c.compress_every = 10**9
    sdpa = make_dispatch(lambda *a, **kw: None)

    def layer():
        k, v = c.update_and_fetch(*tok)
        c.offset -= 1
        return sdpa(q, k, v, cache=c, scale=scale, mask=None)

    return per_call_us(layer, 3000)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/isoquant_host.json")
    a = ap.parse_args()
    res = {"python_loop_us": timeit.timeit("sum(range(1000))", number=2000) / 2000 * 1e6}
    scale = 1 / math.sqrt(128)
    q, k, v = random_problem(1, 8, 4, 1, 128, 2048, 64, encoded=False)
    mx.eval(q, k.codes, k.norms, k.fp, v.codes, v.norms, v.fp)
    if iq.kernels_available():
        res["fused_attention_us"] = per_call_us(lambda: iq.fused_attention(q, k, v, scale))
        b, e = build_and_encode_us(lambda: iq.fused_attention(q, k, v, scale))
        res["fused_attention_build_us"], res["fused_attention_encode_us"] = b, e
        kf, vf = (mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16) for _ in "kv")
        mx.eval(kf, vf)
        b, e = build_and_encode_us(
            lambda: mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale)
        )
        res["mx_sdpa_build_us"], res["mx_sdpa_encode_us"] = b, e

    class Stub:
        def __call__(self, inputs, output_shapes, output_dtypes, **kw):
            if output_dtypes[0] == mx.uint8:  # the encoder: codes and norms of the right shapes
                return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
            return [inputs[0]] * len(output_shapes)

    real, backend = dict(iq._KERNELS), iq.BACKEND
    iq._KERNELS.update({(n, dt): Stub() for n in iq.SPECS for dt in iq.DTYPES})
    iq.BACKEND = "cuda"
    res["fused_attention_stub_kernels_us"] = per_call_us(lambda: iq.fused_attention(q, k, v, scale))
    res["layer_stub_kernels_us"] = _layer_us(q, scale)
    iq._KERNELS.clear()
    iq._KERNELS.update(real)
    iq.BACKEND = backend
    c = isoquant.IsoQuantKVCache("v3", 3, 3, window=64, layer=0)
    c.update_and_fetch(*(mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16) for _ in "kv"))
    c.finish_prefill()
    tok = [mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16) for _ in "kv"]
    mx.eval(tok, *[x for x in c.state if x is not None])
    c.compress_every = 10**9  # no compression inside the timed calls

    def upd():
        out = c.update_and_fetch(*tok)
        c.offset -= 1  # stay at the same length
        return out

    res["cache_update_and_fetch_us"] = per_call_us(upd, 500)
    if iq.kernels_available():
        from app.engine.kvcache.isoquant import kernel_path as kk

        kk.install()

        def step():  # the cache's one-token step: update and the kernel on its buffers
            out = c.attend_step(q, *tok, scale)
            c.offset -= 1
            return out

        res["cache_attend_step_us"] = per_call_us(step, 500)

        def general():  # the same step through update_and_fetch and the dispatch
            out = kk.isoquant_attention(q, *upd(), scale)
            return out

        res["cache_update_plus_attention_us"] = per_call_us(general, 500)
    from mlx_lm.models.cache import KVCache

    f = KVCache()
    f.update_and_fetch(*(mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16) for _ in "kv"))

    def fp16():
        kf, vf = f.update_and_fetch(*tok)
        f.offset -= 1
        return mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale)

    res["fp16_update_plus_sdpa_us"] = per_call_us(fp16, 500)
    print(json.dumps(res, indent=1))
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("isoquant_host", res, path=Path(a.out))  # machine: app.engine.bench's description


if __name__ == "__main__":
    main()
