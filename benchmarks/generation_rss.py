"""Whether repeated generations leak: the worker process's RSS over many requests.

The real worker process serves N generations (chat messages through the template, short
answers) with a tiny random llama (default: fast enough for 200 requests in a minute or two on
a busy CPU) or the built-in SmolLM2 (`--model embedded`); RSS is sampled from its Stats after
each request. Growth is
reported from the end of a warm-up (allocator and caches settled) to the last request.
Memory is measured here, not asserted in the test suite.

    python benchmarks/generation_rss.py [--model tiny|embedded|DIR] [--generations 200]
                                        [--warmup 20] [--tokens 8]

Writes benchmarks/results/generation_rss.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("ROTARYQUANT_HOME", tempfile.mkdtemp(prefix="rq-bench-rss-"))

from record import write_result  # noqa: E402

from app.engine import messages as M  # noqa: E402
from app.engine.generate import DEFAULT_MODEL_REF  # noqa: E402
from app.engine.worker import WorkerClient  # noqa: E402

MiB = 1 << 20
FLAT_MIB = 16  # target: warm-up to last request grows less than this (one KV cache step or so)


def model_ref(name: str) -> str:
    if name == "embedded":
        return DEFAULT_MODEL_REF
    if name != "tiny":
        return name
    from app.engine.testing.random_models import make_random_model

    folder = Path(os.environ["ROTARYQUANT_HOME"]) / "tiny-llama"
    if not (folder / "model.safetensors").exists():
        make_random_model("llama", folder, seed=0)
    return str(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny | embedded | a model folder")
    ap.add_argument("--generations", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    rss = []
    with WorkerClient() as c:
        c.load(model_ref(args.model))
        for i in range(args.generations):
            msgs = [{"role": "user", "content": f"Say a word about the number {i}."}]
            stats = [
                m
                for m in c.generate(
                    msgs, {"max_tokens": args.tokens, "seed": i, "temperature": 0.7}
                )
                if isinstance(m, M.Stats)
            ]
            if not stats:  # the worker sends one after every request; ask if it was missed
                c.send(M.GetStats(req_id=0))
                stats = [c._wait(lambda m: isinstance(m, M.Stats), 30)]
            rss.append(stats[-1].rss)
    base = rss[args.warmup - 1]
    growth = rss[-1] - base
    print(
        f"worker RSS over {args.generations} generations ({args.model}, {args.tokens} tokens each)"
    )
    print(f"{'after':>6} {'RSS MiB':>9}")
    for n in sorted({1, args.warmup, args.generations // 2, args.generations}):
        print(f"{n:>6} {rss[n - 1] / MiB:>9.1f}")
    print(
        f"growth after warm-up: {growth / MiB:+.1f} MiB "
        f"({'flat' if growth < FLAT_MIB * MiB else 'GROWS'}; target < {FLAT_MIB} MiB)"
    )
    write_result(
        "generation_rss",
        {
            "model": args.model,
            "generations": args.generations,
            "warmup": args.warmup,
            "max_tokens": args.tokens,
            "rss_bytes": rss,
            "growth_after_warmup_bytes": growth,
            "flat_target_bytes": FLAT_MIB * MiB,
            "flat": growth < FLAT_MIB * MiB,
        },
    )


if __name__ == "__main__":
    main()
