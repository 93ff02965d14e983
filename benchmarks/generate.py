"""Prompt and decode tok/s and peak memory of the embedded default model on this machine.

    python benchmarks/generate.py [--prompt-tokens 256] [--gen-tokens 64] [--trials 3]

Writes benchmarks/results/generate.json. Absolute figures are for this machine only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from app.engine.bench import bench_generate, machine
from app.engine.embedded import ensure_default_model
from app.engine.generate import Engine

OUT = Path(__file__).parent / "results" / "generate.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    records = []
    # The CPU backend dequantizes small dense models to float32 at load (app/engine/cpu_weights.py);
    # measure that against the quantized weights side by side. Elsewhere only one variant exists.
    variants = [("as loaded", {})]
    if machine()["backend"] == "cpu":
        variants = [
            ("float32 dense (CPU default)", {}),
            ("4-bit quantized", {"cpu_float_weights": False}),
        ]
    for label, opts in variants:
        eng = Engine()
        info = eng.load(ensure_default_model(), opts)
        for p in args.prompt_tokens:
            r = bench_generate(eng, p, args.gen_tokens, args.trials)
            r.update(weights=label, weight_bytes=info.weight_bytes)
            records.append(r)
    print(f"{info.name} on {machine()['device']} ({machine()['backend']}), batch 1, float KV")
    print(
        f"{'weights':>28} {'prompt':>7} {'gen':>5} {'prompt tok/s':>13} {'decode tok/s':>13} {'peak MiB':>9}"
    )
    for r in records:
        print(
            f"{r['weights']:>28} {r['prompt_tokens']:>7} {r['generated_tokens']:>5} {r['prompt_tps']:>13.1f} "
            f"{r['decode_tps']:>13.1f} {r['peak_memory_bytes'] / 2**20:>9.0f}"
        )
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("generate", {"model": info.name, "records": records}, machine(), OUT)


if __name__ == "__main__":
    main()
