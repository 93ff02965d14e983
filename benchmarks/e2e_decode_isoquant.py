"""End-to-end decode speed: FP16 (bf16) KV cache vs IsoQuant 3-bit with the fused kernels (and
the MLX-ops reference), batch 1, at 2K and 32K tokens of context (issue 3: the paper's IsoQuant
decoded 5.3x slower than FP16).

Model: Llama-3.1-8B's shapes (32 layers, 32 q / 8 kv heads, d 128) with random weights
quantized to 4-bit g64 (timing only; no checkpoint needed). The caches are filled directly with
random K/V (IsoQuant: random code bytes and norms, a 64-token float window) so no prefill is
timed; then greedy decode steps are timed after warm-up.

    python benchmarks/e2e_decode_isoquant.py [--contexts 2048 32768] [--steps 32] [--out FILE]
Results: benchmarks/results/e2e_decode_isoquant.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import kvcache  # noqa: E402
from app.engine.kvcache import isoquant  # noqa: E402
from app.engine.kvcache.isoquant import kernel_path as kk  # noqa: E402  (registers the kernels)
from app.engine.kvcache.isoquant import kernels as iq  # noqa: E402
from app.engine.kvcache.isoquant.packing import V_LAYOUT_ENV  # noqa: E402

CFG = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}
WINDOW = 64
# Warm-up steps: past five decode compression batches (16 tokens each) and the first growth of
# the code buffers (the pre-filled caches hold exactly their tokens), so neither first-use kernel
# compilation nor MLX's first instantiation of each CUDA-graph topology a step can have is timed.
# Measured one step at a time on an H200: the first compression steps and the
# first growth each took 10-17 ms more to evaluate; from the fifth compression on, a compression
# step evaluates within ~0.3 ms of a plain one. The timed steps are then the steady state of a
# long decode; the spikes are a one-time cost per process and topology.
WARMUP = 84


def build_model():
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(CFG)
    model = model_class(args_class.from_dict(CFG))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    isoquant.install(model)
    return model


def make_caches(mode: str, ctx: int):
    from mlx_lm.models.cache import KVCache

    hkv, d, n = CFG["num_key_value_heads"], 128, CFG["num_hidden_layers"]
    caches = []
    for layer in range(n):
        mx.random.seed(layer)
        if mode == "fp16":
            c = KVCache()
            k = mx.random.normal((1, hkv, ctx, d)).astype(mx.bfloat16)
            c.update_and_fetch(k, mx.random.normal((1, hkv, ctx, d)).astype(mx.bfloat16))
        else:
            c = random_isoquant_cache(ctx, hkv, d, layer)
        mx.eval([a for a in c.state if a is not None])
        caches.append(c)
    return caches


def random_isoquant_cache(ctx: int, hkv: int = 8, d: int = 128, layer: int = 0):
    """A 3-bit IsoQuant cache holding ctx tokens: random code bytes and norms for all but the
    WINDOW newest, which are random bf16 (not evaluated)."""
    c = isoquant.IsoQuantKVCache("v3", 3, 3, window=WINDOW, layer=layer)
    c._setup(hkv, d, d)
    tc, row = ctx - WINDOW, 3 * d // 8
    c.state = (
        mx.random.randint(0, 256, (1, hkv, tc, row)).astype(mx.uint8),
        mx.random.uniform(10, 30, (1, hkv, tc)).astype(mx.float16),
        mx.random.randint(0, 256, (1, hkv, tc, row)).astype(mx.uint8),
        mx.random.uniform(5, 15, (1, hkv, tc)).astype(mx.float16),
        mx.random.normal((1, hkv, WINDOW, d)).astype(mx.bfloat16),
        mx.random.normal((1, hkv, WINDOW, d)).astype(mx.bfloat16),
    )
    return c


def decode_tok_s_pipelined(model, caches, steps: int, warmup: int = WARMUP) -> float:
    """As the app decodes: mlx-lm's generate_step, which builds step n+1's graph while the GPU
    runs step n (async_eval), greedy."""
    from mlx_lm.generate import generate_step

    t0 = None
    for i, _ in enumerate(generate_step(mx.array([1]), model, max_tokens=warmup + steps + 1,
                                        prompt_cache=caches)):  # fmt: skip
        if i == warmup:
            t0 = time.perf_counter()
    return steps / (time.perf_counter() - t0)


def decode_tok_s(model, caches, steps: int, warmup: int = WARMUP):
    """One step at a time, each evaluated before the next is built (no overlap): (tok/s,
    median ms to build a step's graph on the host, median ms to evaluate it, slowest step ms:
    a step that compresses a batch of 16 tokens in every layer)."""
    tok = mx.array([[1]])
    for _ in range(warmup):
        tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
        mx.eval(tok)
    build, run = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
        t1 = time.perf_counter()
        mx.eval(tok)
        build.append(t1 - t)
        run.append(time.perf_counter() - t1)
    tps = steps / (time.perf_counter() - t0)
    steps_ms = [(a + b) * 1e3 for a, b in zip(build, run, strict=True)]
    return tps, statistics.median(build) * 1e3, statistics.median(run) * 1e3, max(steps_ms)


def _set_mode(mode: str, fold_default: bool) -> None:
    kk.install()  # registered: the kernels run whenever the backend has them
    if mode == "isoquant_reference":  # MLX ops throughout: attention and encoder
        isoquant.attention.register_kernel(None)
        isoquant.cache.register_encoder(None)
    if mode == "isoquant_fused_mlx_encoder":  # fused attention, MLX-ops compression
        isoquant.cache.register_encoder(None)
    iq.TC_FOLD = fold_default if mode != "isoquant_fused_fold" else True
    os.environ.pop(isoquant.cache.COMPILE_ENV, None)
    if mode == "isoquant_fused_compiled_encoder":
        os.environ[isoquant.cache.COMPILE_ENV] = "1"
    os.environ.pop(V_LAYOUT_ENV, None)  # the caches' V layout: the backend's (packing.py)
    if mode == "isoquant_fused_rows":
        os.environ[V_LAYOUT_ENV] = "rows"


def _record(mode: str, ctx: int, tps_rounds: list, unpiped: tuple, caches) -> dict:
    tps = statistics.median(tps_rounds)
    sync, build_ms, eval_ms, max_ms = unpiped
    kv = sum(kvcache.cache_nbytes([c]) for c in caches)
    layout = next((c.v_layout for c in caches if isinstance(c, isoquant.IsoQuantKVCache)), None)
    print(
        f"ctx {ctx:6d} {mode:20s} {tps:7.1f} tok/s (median of {len(tps_rounds)})  "
        f"{1e3 / tps:7.2f} ms/token  (one step at a time: {sync:7.1f} tok/s; build "
        f"{build_ms:5.2f} ms, eval {eval_ms:5.2f} ms, slowest {max_ms:6.1f} ms)  KV {kv / 1e9:5.2f} GB"
    )
    return dict(mode=mode, context=ctx, tok_s=round(tps, 2), ms_per_token=round(1e3 / tps, 3),
                tok_s_rounds=[round(x, 2) for x in tps_rounds],
                tok_s_unpipelined=round(sync, 2), build_ms=round(build_ms, 3),
                eval_ms=round(eval_ms, 3), slowest_step_ms=round(max_ms, 2), kv_bytes=int(kv),
                peak_bytes=int(mx.get_peak_memory()), v_layout=layout)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps first")
    ap.add_argument(
        "--rounds", type=int, default=3, help="pipelined runs per mode, alternating (median)"
    )
    ap.add_argument("--reference", action="store_true", help="also time the MLX-ops reference")
    ap.add_argument("--compare-compile", action="store_true", help="also compiled encoders")
    ap.add_argument(
        "--compare-encoder", action="store_true", help="also the MLX-ops encoder (no fused one)"
    )
    ap.add_argument(
        "--compare-fold", action="store_true", help="also the combine folded into the kernel"
    )
    ap.add_argument(
        "--compare-layout", action="store_true", help="also V codes as rows (not the backend's)"
    )
    ap.add_argument("--tiny", action="store_true", help="2 layers, small vocab: a smoke test")
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "e2e_decode_isoquant.json")
    )
    args = ap.parse_args()
    if args.tiny:
        CFG.update(num_hidden_layers=2, vocab_size=1000, hidden_size=1024, intermediate_size=2048)
    model = build_model()
    rows = []
    modes = ["fp16", "isoquant_fused"] + (["isoquant_reference"] if args.reference else [])
    if args.compare_encoder:  # the MLX-ops encoder in the cache's compression, side by side
        modes.insert(2, "isoquant_fused_mlx_encoder")
    if args.compare_fold:  # the tensor-core kernel with its combine folded in, side by side
        modes.insert(2, "isoquant_fused_fold")
    if args.compare_layout:  # V codes as rows where the backend's caches store tc16
        modes.insert(2, "isoquant_fused_rows")
    fold_default = iq.TC_FOLD
    if args.compare_compile:  # the compiled decode-time encoders, side by side
        modes.insert(2, "isoquant_fused_compiled_encoder")
    os.environ.pop(V_LAYOUT_ENV, None)
    for ctx in args.contexts:
        rounds = {m: [] for m in modes}
        for rnd in range(args.rounds):
            # the modes alternate in order round by round (the host's speed drifts)
            for mode in modes if rnd % 2 == 0 else modes[::-1]:
                _set_mode(mode, fold_default)
                caches = make_caches("fp16" if mode == "fp16" else "isoquant", ctx)
                tps = decode_tok_s_pipelined(model, caches, args.steps, args.warmup)
                rounds[mode].append(tps)
                print(f"ctx {ctx:6d} round {rnd} {mode:20s} {tps:7.1f} tok/s", flush=True)
                if rnd == args.rounds - 1:
                    unpiped = decode_tok_s(model, caches, args.steps, args.warmup)
                    rows.append(_record(mode, ctx, rounds[mode], unpiped, caches))
                del caches
                mx.clear_cache()
    rows.sort(key=lambda r: (args.contexts.index(r["context"]), modes.index(r["mode"])))
    iq.TC_FOLD = fold_default
    kk.install()
    info = {}
    try:
        info = {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # older MLX: the device name is optional
        pass
    machine = dict(
        platform=platform.platform(), device=info.get("device_name", "?"), mlx=mx.__version__
    )
    out = dict(
        model="Llama-3.1-8B shapes, random weights, 4-bit g64; batch 1; greedy decode",
        method=f"{args.steps} timed steps after {args.warmup} warm-up steps; caches pre-filled with random KV; "
        "tok_s: mlx-lm generate_step (next step built while the GPU runs this one, as the app "
        f"decodes), the median of {args.rounds} runs per mode (fresh caches each; the modes' order "
        "alternates run by run), tok_s_rounds: each run's; tok_s_unpipelined: each step evaluated before the next is built; build_ms / eval_ms: "
        "median host time to build one step's graph / to evaluate it, in that mode; "
        "isoquant_fused_mlx_encoder: fused attention, compression by MLX ops (no fused encoder); "
        "isoquant_fused_fold: the tensor-core kernel with its combine folded in (one launch); "
        "isoquant_fused_rows: V codes stored as rows where the backend's caches store tc16 "
        "(v_layout: the caches' V layout, packing.py)",
        kv_compile=isoquant.cache.compile_encoders(),
        records=rows,
    )
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("e2e_decode_isoquant", out, machine, Path(args.out))
    by = {(r["mode"], r["context"]): r for r in rows}
    for ctx in args.contexts:
        f, i = by.get(("fp16", ctx)), by.get(("isoquant_fused", ctx))
        if f and i:
            per = [b / a for a, b in zip(f["tok_s_rounds"], i["tok_s_rounds"], strict=True)]
            print(
                f"ctx {ctx}: IsoQuant fused / FP16 decode speed = {i['tok_s'] / f['tok_s']:.2f}x "
                f"(medians; round by round {', '.join(f'{x:.2f}' for x in per)})"
            )


if __name__ == "__main__":
    main()
