"""Routed experts' gathered quantized matmuls at 2, 3, 4 and 8 bits (issue 39's prefill gap).

The engine runs Qwen3-30B-A3B's routed experts at 2 bits, stock mlx-lm at 4; at equal prefill
steps the engine prefilled at 0.72-0.77x stock on an H200. This times one MoE layer's three
expert projections (gate/up 2048 -> 768, down 768 -> 2048, 128 experts, top-8) as mlx-lm's
SwitchGLU runs them: prefill (2048 tokens, (token, expert) pairs sorted by expert) and decode
(1 token), each width side by side in one process, medians of alternating rounds. The
"widened" rows run the engine's prefill route (app/engine/expert_widen.py): 2-, 3- or 4-bit
codes repacked to 8 bits inside each call (the repack's cost included), then gather_qmm at 8.

    python benchmarks/gather_qmm_bits.py            # Qwen3-30B-A3B shapes (GPU)
    python benchmarks/gather_qmm_bits.py --tiny --out /tmp/g.json  # small shapes (a check)
Results: benchmarks/results/gather_qmm_bits.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from record import write_result  # noqa: E402

from app.engine.expert_widen import widen  # noqa: E402

BITS = (2, 3, 4, 8)
# (stored bits, bits the matmul runs at): stored widths as they are, then widened in the call
VARIANTS = [(b, b) for b in BITS] + [(2, 8), (3, 8), (4, 8)]


def label(v: tuple[int, int]) -> str:
    return str(v[0]) if v[0] == v[1] else f"{v[0]}->{v[1]} widened"


def layer(bits: int, experts: int, hidden: int, inter: int, dtype):
    """Random quantized gate/up/down weights of one layer: {name: (w, scales, biases)}."""
    out = {}
    for name, (o, i) in {
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
    }.items():
        w = (mx.random.normal((experts, o, i)) * i**-0.5).astype(dtype)
        out[name] = mx.quantize(w, group_size=64, bits=bits)
        mx.eval(out[name])
    return out


def run(weights, x, idx, variant: tuple[int, int], sort: bool):
    stored, bits = variant

    def proj(name, v):
        w, s, b = weights[name]
        if bits != stored:  # as the engine's prefill route: repacked inside the call
            w = widen(mx.depends(w, v), stored, bits)
        return mx.gather_qmm(
            v,
            w,
            s,
            b,
            rhs_indices=idx,
            transpose=True,
            group_size=64,
            bits=bits,
            sorted_indices=sort,
        )

    g = proj("gate", x)
    h = mx.sigmoid(g) * g * proj("up", x)
    return proj("down", h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="calls per timing")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of benchmarks/results/")
    args = ap.parse_args()
    experts, hidden, inter, tokens, k = (
        (8, 128, 64, 64, 2) if args.tiny else (128, 2048, 768, 2048, 8)
    )
    dtype = mx.float32 if args.tiny else mx.bfloat16
    mx.random.seed(0)
    weights = {b: layer(b, experts, hidden, inter, dtype) for b in BITS}
    cases = {}
    for name, n in (("prefill", tokens), ("decode", 1)):
        idx = mx.random.randint(0, experts, (n * k,)).astype(mx.uint32)
        sort = n * k >= 64  # mlx-lm sorts the pairs from 64 on
        if sort:
            idx = mx.sort(idx)
        x = mx.random.normal((n * k, 1, hidden)).astype(dtype)
        mx.eval(idx, x)
        cases[name] = (x, idx, sort)
    times = {(c, v): [] for c in cases for v in VARIANTS}
    for v in VARIANTS:  # warm-up: kernels built
        for x, idx, sort in cases.values():
            mx.eval(run(weights[v[0]], x, idx, v, sort))
    for rnd in range(args.rounds):
        for v in VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]:
            for c, (x, idx, sort) in cases.items():
                mx.synchronize()
                t = time.perf_counter()
                mx.eval([run(weights[v[0]], x, idx, v, sort) for _ in range(args.reps)])
                mx.synchronize()
                times[(c, v)].append((time.perf_counter() - t) / args.reps * 1e3)
    rows = []
    print(f"{'case':8s} {'bits':>14s} {'ms / layer':>11s} {'vs 4-bit':>9s}")
    for c in cases:
        ref = statistics.median(times[(c, (4, 4))])
        for v in VARIANTS:
            ms = statistics.median(times[(c, v)])
            rows.append(
                {
                    "case": c,
                    "bits": v[0],
                    **({"widened_to": v[1], "repack_included": True} if v[0] != v[1] else {}),
                    "ms_per_layer": round(ms, 4),
                    "rounds": [round(t, 4) for t in times[(c, v)]],
                    "vs_4bit": round(ms / ref, 3),
                }
            )
            print(f"{c:8s} {label(v):>14s} {ms:11.4f} {ms / ref:9.2f}")
    write_result(
        "gather_qmm_bits" + ("_tiny" if args.tiny else ""),
        {
            "shapes": {
                "experts": experts,
                "hidden": hidden,
                "intermediate": inter,
                "prefill_tokens": tokens,
                "top_k": k,
                "dtype": str(dtype),
            },
            "method": "gate, up and down gathered quantized matmuls (group 64) as SwitchGLU runs them, "
            f"median of {args.rounds} alternating rounds of {args.reps} calls; widened rows: the "
            "stored codes repacked to 8 bits in each call (expert_widen.widen), then gathered at 8",
            "runs": rows,
        },
        path=args.out,
    )


if __name__ == "__main__":
    main()
