"""Peak memory of a long prompt's chunked prefill: mlx-lm's float cache vs IsoQuant, which
compresses the prompt's KV as prefill goes (kvcache/isoquant/cache.py).

A tiny random llama with KV-heavy shapes (all heads KV heads) so the KV, not the weights or
activations, sets the peak; the prompt runs through mlx-lm's generate_step with the app's
chunking, then one token is decoded. Same process, alternating modes.

    python benchmarks/kv_prefill_peak.py [--tokens 8192] [--chunk 256] [--layers 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from record import write_result  # noqa: E402

from app.engine import kvcache  # noqa: E402

MODES = ("fp16", "isoquant3")


def model_for(layers: int, dtype):
    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 256,
            "num_hidden_layers": layers,
            "intermediate_size": 512,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 32,
            "rms_norm_eps": 1e-5,
            "vocab_size": 512,
            "tie_word_embeddings": True,
        }
    )
    m = llama.Model(args)
    m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m


def one(model, mode: str, tokens: int, chunk: int) -> dict:
    cache = kvcache.make_cache(model, mode)
    prompt = mx.array([(i * 7 + 1) % 500 for i in range(tokens)])
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    tok, _ = next(
        generate_step(prompt, model, max_tokens=1, prompt_cache=cache, prefill_step_size=chunk)
    )
    mx.eval(*[a for c in cache for a in c.state if isinstance(a, mx.array)])
    peak = mx.get_peak_memory() - base
    return {
        "mode": mode,
        "peak_mb": peak / 2**20,
        "kv_held_mb": kvcache.cache_nbytes(cache) / 2**20,
        "kv_capacity_mb": kvcache.cache_capacity_nbytes(cache) / 2**20,
        "token": int(tok),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="float32" if mx.default_device() == mx.cpu else "float16")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    model = model_for(a.layers, getattr(mx, a.dtype))
    runs = []
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            runs.append({**one(model, mode, a.tokens, a.chunk), "round": r})
            x = runs[-1]
            print(
                f"round {r} {mode:10s} peak {x['peak_mb']:8.1f} MB  KV held {x['kv_held_mb']:7.1f} MB"
                f"  KV buffers {x['kv_capacity_mb']:7.1f} MB",
                flush=True,
            )
    best = {m: min(x["peak_mb"] for x in runs if x["mode"] == m) for m in MODES}
    print(
        f"\npeak isoquant3 / fp16 = {best['isoquant3'] / best['fp16']:.2f} "
        f"({best['fp16'] - best['isoquant3']:.0f} MB lower)"
    )
    write_result(
        "kv_prefill_peak",
        {
            "model": f"random llama, {a.layers} layers, 8 KV heads x 32, hidden 256, {a.dtype}",
            "context": a.tokens,
            "prefill_chunk": a.chunk,
            "runs": runs,
            "min_peak_mb": best,
        },
    )


if __name__ == "__main__":
    main()
