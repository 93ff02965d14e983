"""Peak memory of a long prompt's chunked prefill: mlx-lm's float cache vs IsoQuant, which
compresses the prompt's KV as prefill goes (kvcache/isoquant/cache.py).

A tiny random llama with KV-heavy shapes (all heads KV heads) so the KV, not the weights or
activations, sets the peak; the prompt runs through mlx-lm's generate_step with the app's
chunking, then one token is decoded. Same process, alternating modes.

    python benchmarks/kv_prefill_peak.py [--tokens 8192] [--chunk 256] [--layers 16]

It also measures one part of the kernel path's prefill (Metal/CUDA) that runs anywhere: a
layer's compressed K and V dequantized for mx.fast's attention (kernel_path._dequantized), at
Qwen3-30B-A3B's KV shapes (4 heads x 128) and --dequant-tokens contexts, in one piece against
pieces of kernel_path.DEQUANT_CHUNK tokens: the peak above the cache, and the output's size.
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


def dequant_peak(tokens: int, chunk: int, heads: int = 4, dim: int = 128) -> dict:
    """Peak bytes above the cache while one layer's K and V are dequantized to bfloat16."""
    from app.engine.kvcache.isoquant import IsoQuantKVCache, kernel_path

    c = IsoQuantKVCache("v3", 3, 3, window=64)
    k1, k2 = mx.random.split(mx.random.key(tokens))
    shape = (1, heads, tokens, dim)
    c.update_and_fetch(mx.random.normal(shape, key=k1).astype(mx.bfloat16),
                       mx.random.normal(shape, key=k2).astype(mx.bfloat16))  # fmt: skip
    keys, values = c.update_and_fetch(mx.zeros((1, heads, 1, dim), mx.bfloat16),
                                      mx.zeros((1, heads, 1, dim), mx.bfloat16))  # fmt: skip
    mx.eval(keys.codes, keys.norms, values.codes, values.norms, keys.fp, values.fp)
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = [kernel_path._dequantized(t, mx.bfloat16, chunk=chunk) for t in (keys, values)]
    mx.eval(*out)
    return {
        "tokens": tokens,
        "chunk": chunk,
        "peak_mb": (mx.get_peak_memory() - base) / 2**20,
        "output_mb": sum(a.nbytes for a in out) / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="float32" if mx.default_device() == mx.cpu else "float16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dequant-tokens", type=int, nargs="*", default=[8192, 32768])
    a = ap.parse_args()
    from app.engine.kvcache.isoquant import kernel_path

    dequant = []
    for t in a.dequant_tokens:
        for chunk in (0, kernel_path.DEQUANT_CHUNK):
            dequant.append(dequant_peak(t, chunk))
            x = dequant[-1]
            print(
                f"dequantized K+V, {t:6d} tokens, {'one piece' if not chunk else f'pieces of {chunk}':16s}"
                f" peak {x['peak_mb']:7.1f} MB  output {x['output_mb']:6.1f} MB",
                flush=True,
            )
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
            "dequant_kv_heads_dim": [4, 128],
            "dequant": dequant,
        },
    )


if __name__ == "__main__":
    main()
