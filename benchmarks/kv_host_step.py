"""Host time of one decode step (Python building the graph, without the device compute):
mlx-lm's float cache vs IsoQuant, on a model with Qwen3-30B-A3B's layer count and tiny widths.

The step's call `model(token, cache)` is timed alone (MLX is lazy: it only builds the graph);
the evaluation after it is timed apart. Medians over the steps, modes alternated per round.

    python benchmarks/kv_host_step.py [--layers 48] [--context 512] [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
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


def model_for(layers: int):
    args = qwen3.ModelArgs.from_dict(
        {
            "model_type": "qwen3",
            "hidden_size": 64,
            "num_hidden_layers": layers,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "rms_norm_eps": 1e-6,
            "vocab_size": 256,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
            "max_position_embeddings": 40960,
        }
    )
    m = qwen3.Model(args)
    mx.eval(m.parameters())
    return m


def one(model, mode: str, context: int, steps: int) -> dict:
    cache = kvcache.make_cache(model, mode)
    ids = mx.array([[(i * 7 + 1) % 250 for i in range(context)]])
    for i in range(0, context, 256):
        mx.eval(model(ids[:, i : i + 256], cache=cache))
    tok = mx.array([[3]])
    host, dev = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(tok, cache=cache)
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        dev.append((t2 - t1) * 1e3)
        tok = mx.argmax(logits[:, -1:], axis=-1)
    return {"mode": mode, "host_ms": statistics.median(host), "eval_ms": statistics.median(dev)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="kv_host_step")
    a = ap.parse_args()
    model = model_for(a.layers)
    runs = []
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            runs.append({**one(model, mode, a.context, a.steps), "round": r})
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
        a.name,
        {
            "model": f"random qwen3, {a.layers} layers, hidden 64, 2 KV heads x 64, float32",
            "context": a.context,
            "steps": a.steps,
            "runs": runs,
            "median_host_ms": med,
            "isoquant_extra_us_per_layer": per_layer,
        },
    )


if __name__ == "__main__":
    main()
