"""Needle in a haystack: passkey retrieval over a compressed KV cache (SmolLM2-135M).

A 5-digit passkey sentence is placed at N evenly spaced depths of filler text of --context
tokens, followed by the question. The prompt (all but its last token) is prefilled once with a
float cache; each treatment then builds its cache from that KV, compresses it (IsoQuant:
finish_prefill; the needle is then in the compressed part except at the very end), and decodes
greedily. Retrieved = the passkey's digits appear in the first --new-tokens tokens.
The target: IsoQuant retrieves exactly where the float cache does.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/needle.py [--context 8000] [--positions 20]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from kv_quality import build_cache, load_model, machine  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "needle.json"
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
TREATMENTS = {
    "fp16": ("float",),
    "isoquant3_w64": ("isoquant", "v3", 3, 3, 64),
    "isoquant3_w0": ("isoquant", "v3", 3, 3, 0),
    "isoquant3_w64_s4": ("isoquant", "v3", 3, 3, 64, 4),
    "isoquant4_w0": ("isoquant", "v3", 4, 4, 0),
    "turboquant3_w0": ("isoquant", "dense", 3, 3, 0),
    "mlx_q4": ("mlx", 4),
}


def build_prompt(tokenizer, context: int, depth: float, passkey: str) -> list[int]:
    intro = tokenizer.encode(
        "There is an important pass key hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the pass key.\n\n"
    )
    needle = tokenizer.encode(
        f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    )
    question = tokenizer.encode("\n\nWhat is the pass key? The pass key is")
    filler_ids = tokenizer.encode(FILLER)
    n_fill = context - len(intro) - len(needle) - len(question)
    hay = (filler_ids * (n_fill // len(filler_ids) + 1))[:n_fill]
    cut = int(round(depth * n_fill))
    # snap the needle to a sentence boundary of the filler so it reads naturally
    period = tokenizer.encode(".")[-1]
    while 0 < cut < n_fill and hay[cut - 1] != period:
        cut -= 1
    return intro + hay[:cut] + needle + hay[cut:] + question


def prefill(model, prompt: list[int]) -> list:
    cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]


def answer(model, tokenizer, prompt: list[int], caches: list, new_tokens: int) -> str:
    tok = mx.array([[prompt[-1]]])
    out = []
    for _ in range(new_tokens):
        logits = model(tok, cache=caches)[:, -1]
        tok = mx.argmax(logits, axis=-1, keepdims=True)
        out.append(tok.item())
    return tokenizer.decode(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=8000, help="prompt tokens (model max 8192)")
    ap.add_argument("--positions", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--treatments", default=",".join(TREATMENTS))
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--keep-quantized", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    names = [n for n in args.treatments.split(",") if n]
    lm, model = load_model(args.model, args.dtype, dequantize=not args.keep_quantized)
    tok = lm.tokenizer
    rng = random.Random(args.seed)
    depths = [(i + 0.5) / args.positions for i in range(args.positions)]
    rows = []
    t0 = time.perf_counter()
    for depth in depths:
        passkey = str(rng.randrange(10000, 100000))
        prompt = build_prompt(tok, args.context, depth, passkey)
        kv = prefill(model, prompt)
        row = {"depth": round(depth, 4), "passkey": passkey, "prompt_tokens": len(prompt)}
        for name in names:
            text = answer(
                model, tok, prompt, build_cache(TREATMENTS[name], kv, args.seed), args.new_tokens
            )
            row[name] = {"retrieved": passkey in text.replace(" ", ""), "text": text}
        rows.append(row)
        print(depth, passkey, {n: (row[n]["retrieved"], row[n]["text"]) for n in names}, flush=True)

    summary = {}
    for n in names:
        hits = [r[n]["retrieved"] for r in rows]
        summary[n] = {
            "retrieved": sum(hits),
            "of": len(rows),
            "same_as_fp16_at_every_position": all(
                r[n]["retrieved"] == r["fp16"]["retrieved"] for r in rows
            )
            if "fp16" in names
            else None,
        }
    doc = {
        "benchmark": "needle",
        "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF"
        + (", 4-bit weights as shipped)" if args.keep_quantized else ", weights dequantized)"),
        "dtype": args.dtype,
        "context_tokens": args.context,
        "positions": args.positions,
        "new_tokens": args.new_tokens,
        "protocol": "prompt[:-1] prefilled with a float cache; each treatment's cache built from "
        "that KV and compressed (finish_prefill), then greedy decoding from the last prompt token",
        "machine": machine(),
        "seconds": round(time.perf_counter() - t0, 1),
        "summary": summary,
        "rows": rows,
    }
    from record import write_result

    write_result("needle", doc, doc.pop("machine"), Path(args.out))
    for n, s in summary.items():
        print(
            f"{n:18s} {s['retrieved']}/{s['of']}  same as fp16: {s['same_as_fp16_at_every_position']}"
        )


if __name__ == "__main__":
    main()
