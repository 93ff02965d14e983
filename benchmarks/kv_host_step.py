"""Host time of one decode step (Python building the graph, without the device compute):
mlx-lm's float cache vs IsoQuant, on a model with Qwen3-30B-A3B's layer count and tiny widths.

The step's call `model(token, cache)` is timed alone (MLX is lazy: it only builds the graph);
the evaluation after it is timed apart. Medians over the steps, modes alternated per round.

    python benchmarks/kv_host_step.py [--layers 48] [--context 512] [--steps 40] [--rounds 3]
    python benchmarks/kv_host_step.py --batch 8     # a server's batch: 8 rows, merged caches

With --batch B each row prefills its own cache (rows 64 tokens apart in length), the caches are
merged as mlx-lm's BatchGenerator merges them (`merge`), and the steps decode all rows at once;
--profile N prints the N dearest functions of one IsoQuant round's steps (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import mlx.core as mx  # noqa: E402
from mlx_lm.models import qwen3  # noqa: E402
from record import write_result  # noqa: E402

from app.engine import kvcache  # noqa: E402

MODES = ("fp16", "isoquant3")


def model_for(layers: int, heads=4, kv_heads=2, head_dim=64, dtype: str = "float32"):
    args = qwen3.ModelArgs.from_dict(
        {
            "model_type": "qwen3",
            "hidden_size": 64,
            "num_hidden_layers": layers,
            "intermediate_size": 128,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-6,
            "vocab_size": 256,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
            "max_position_embeddings": 40960,
        }
    )
    m = qwen3.Model(args)
    if dtype != "float32":
        m.set_dtype(getattr(mx, dtype))
    mx.eval(m.parameters())
    return m


def _prefilled(model, mode: str, context: int):
    cache = kvcache.make_cache(model, mode)
    ids = mx.array([[(i * 7 + 1) % 250 for i in range(context)]])
    for i in range(0, context, 256):
        mx.eval(model(ids[:, i : i + 256], cache=cache))
    return cache


def one(model, mode: str, context: int, steps: int, batch: int = 1, profile: int = 0) -> dict:
    if batch == 1:
        cache = _prefilled(model, mode, context)
    else:  # rows of different lengths, merged layer by layer as BatchGenerator merges them
        rows = [_prefilled(model, mode, context + 64 * i) for i in range(batch)]
        cache = [type(layer[0]).merge(list(layer)) for layer in zip(*rows, strict=True)]
        mx.eval([c.state for c in cache])
    tok = mx.array([[3]] * batch)
    host, dev = [], []
    prof = cProfile.Profile() if profile else None
    for _ in range(steps):
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        logits = model(tok, cache=cache)
        if prof:
            prof.disable()
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        dev.append((t2 - t1) * 1e3)
        tok = mx.argmax(logits[:, -1:], axis=-1)
    if prof:
        print(f"-- {mode}, batch {batch}: the steps' graph building, dearest first")
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return {"mode": mode, "host_ms": statistics.median(host), "eval_ms": statistics.median(dev)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attention", default="4,2,64",
                    help="query heads, KV heads, head dim (32,4,128: Qwen3-30B-A3B's)")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together (merged caches)")
    ap.add_argument("--profile", type=int, default=0, help="print the N dearest functions")
    ap.add_argument("--name", help="result name (kv_host_step, or kv_host_step_batchB)")
    a = ap.parse_args()
    heads, kv_heads, head_dim = (int(x) for x in a.attention.split(","))
    model = model_for(a.layers, heads, kv_heads, head_dim, a.dtype)
    runs = []
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            prof = a.profile if r == a.rounds - 1 else 0
            runs.append({**one(model, mode, a.context, a.steps, a.batch, prof), "round": r})
            x = runs[-1]
            print(
                f"round {r} {mode:10s} host {x['host_ms']:7.2f} ms/step  eval {x['eval_ms']:7.2f} ms",
                flush=True,
            )
    med = {m: statistics.median(x["host_ms"] for x in runs if x["mode"] == m) for m in MODES}
    per_layer = (med["isoquant3"] - med["fp16"]) / a.layers * 1e3
    print(
        f"\nhost ms/step: fp16 {med['fp16']:.2f}, isoquant3 {med['isoquant3']:.2f} "
        f"(x{med['isoquant3'] / med['fp16']:.2f}; IsoQuant's extra {per_layer:.0f} µs a layer)"
    )
    write_result(
        a.name or ("kv_host_step" if a.batch == 1 else f"kv_host_step_batch{a.batch}"),
        {
            "model": f"random qwen3, {a.layers} layers, hidden 64, {heads} query heads, "
            f"{kv_heads} KV heads x {head_dim}, {a.dtype}",
            "context": a.context,
            "batch": a.batch,
            "steps": a.steps,
            "runs": runs,
            "median_host_ms": med,
            "isoquant_extra_us_per_layer": per_layer,
        },
    )


if __name__ == "__main__":
    main()
