"""Where a decode step's time goes with an IsoQuant cache, one layer's worth, on the GPU.

At Llama-3.1-8B's attention shapes (batch 1, 8 KV heads, d 128, a 64-token float window), each
component timed alone, one step at a time (evaluated before the next is built), median of
steps after warm-up, at 2K and 32K of context:
  cache_update     update_and_fetch (float append, the aged-out token rotated, coded, packed
                   and written) and evaluating its outputs
  encode_only      the per-token encoder of K and V alone (compiled or op by op)
  attention_only   the fused attention on fixed compressed K/V
  update+attention both, as a decode step does them
  fp16             mlx-lm's KVCache update + mx.fast SDPA, the same shapes
Run with ROTARYQUANT_KV_COMPILE=0/1 to compare the encoders.

    python benchmarks/isoquant_step_profile.py --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_decode_isoquant import random_isoquant_cache  # noqa: E402  (same folder)

from app.engine.kvcache import isoquant  # noqa: E402
from app.engine.kvcache.isoquant import kernel_path as kk  # noqa: E402

HQ, HKV, D = 32, 8, 128


def make_cache(ctx: int):
    c = random_isoquant_cache(ctx, HKV, D)
    mx.eval([a for a in c.state if a is not None])
    return c


def timed(fn, steps=40, warmup=6) -> float:
    out = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        r = fn()
        mx.eval(r)
        mx.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e6


def profile(ctx: int) -> dict:
    from mlx_lm.models.cache import KVCache

    scale = D**-0.5
    tok = [mx.random.normal((1, HKV, 1, D)).astype(mx.bfloat16) for _ in range(2)]
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    mx.eval(tok, q)
    res = {"context": ctx, "kv_compile": isoquant.cache.compile_encoders()}
    c = make_cache(ctx)

    def upd():
        k, v = c.update_and_fetch(tok[0], tok[1])
        return [k.codes, k.norms, k.fp, v.codes, v.norms, v.fp]

    def enc(x):
        if c._enc_k is not None:
            return list(c._enc_k(x))
        return list(isoquant.quantizer.encode(x, c.rotation, c.kq))

    res["cache_update_us"] = timed(upd)
    res["encode_only_us"] = timed(lambda: enc(tok[0]) + enc(tok[1]))
    k, v = c.update_and_fetch(tok[0], tok[1])
    mx.eval(k.codes, v.codes)
    res["attention_only_us"] = timed(lambda: kk.isoquant_attention(q, k, v, scale))

    def both():
        k, v = c.update_and_fetch(tok[0], tok[1])
        return kk.isoquant_attention(q, k, v, scale)

    res["update_plus_attention_us"] = timed(both)
    f = KVCache()
    f.update_and_fetch(*(mx.random.normal((1, HKV, ctx, D)).astype(mx.bfloat16) for _ in "kv"))
    mx.eval(f.keys, f.values)

    def fp16():
        kf, vf = f.update_and_fetch(tok[0], tok[1])
        return mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale)

    def sdpa():
        kf, vf = f.keys[:, :, : f.offset], f.values[:, :, : f.offset]
        return mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale)

    res["fp16_update_plus_sdpa_us"] = timed(fp16)
    res["fp16_sdpa_only_us"] = timed(sdpa)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/isoquant_step_profile.json")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768])
    a = ap.parse_args()
    kk.install()
    rows = []
    for ctx in a.contexts:
        rows.append(profile(ctx))
        print(json.dumps(rows[-1]), flush=True)
        mx.clear_cache()
    out = {"device": str(mx.default_device()), "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
