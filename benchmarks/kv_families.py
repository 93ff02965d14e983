"""Every model family mlx-lm ships, with IsoQuant on: compressed, float fallback, or crash.

For each module of mlx_lm.models, a tiny random model is built from its ModelArgs
(app/engine/tiny_families.py) and fed a 100-token prompt in chunks of 32 (as the app's chunked
prefill does) and 4 decode steps, once with mlx-lm's float cache and once with `--mode`.
Families whose tiny config cannot be built, or whose float model does not run on token ids
alone, are listed apart under "not_built" (not a cache result).

    python benchmarks/kv_families.py [--mode isoquant3] [--only llama,gemma2]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import mlx.core as mx  # noqa: E402
from record import write_result  # noqa: E402

from app.engine import kvcache  # noqa: E402
from app.engine.kvcache.isoquant import IsoQuantKVCache  # noqa: E402
from app.engine.testing import tiny_families  # noqa: E402

PROMPT, CHUNK, DECODE = 100, 32, 4
LIMIT_S = 40  # one family's budget in the child (some default configs build huge tensors)
STAGE = "stage:"  # the child prints how far it got, so a native abort is placed


def run(model, cache) -> list[int]:
    """Chunked prefill then greedy decode; the greedy tokens."""
    ids = mx.array([[(7 * i + 3) % tiny_families.VOCAB for i in range(PROMPT)]])
    for i in range(0, PROMPT, CHUNK):
        logits = model(ids[:, i : i + CHUNK], cache=cache)
    toks = []
    for _ in range(DECODE):
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        toks.append(int(tok.item()))
        logits = model(tok[:, None], cache=cache)
    mx.eval(logits)
    return toks


def family(model_type: str, kv_mode: str) -> dict:
    try:
        model, _ = tiny_families.build(model_type)
    except Exception as e:
        return {
            "model_type": model_type,
            "built": False,
            "reason": f"tiny config: {type(e).__name__}: {e}"[:200],
        }
    print(STAGE, model_type, "float", flush=True)
    try:
        ref = run(model, kvcache.make_cache(model, "fp16"))
    except Exception as e:
        return {
            "model_type": model_type,
            "built": False,
            "reason": f"float model on token ids: {type(e).__name__}: {e}"[:200],
        }
    out = {"model_type": model_type, "kv_mode": kv_mode}
    print(STAGE, model_type, "compressed", flush=True)
    try:
        cache = kvcache.make_cache(model, kv_mode)
        got = run(model, cache)
    except Exception as e:
        return {**out, "result": "crash", "reason": f"{type(e).__name__}: {e}"[:300]}
    coded = [c for c in cache if isinstance(c, IsoQuantKVCache) and c.fallback_reason is None]
    falls = kvcache.fallbacks(cache)
    why = sorted({f["reason"] for f in falls})
    if any(c.compressed > 0 for c in coded):
        reason = "; ".join(
            f"{len([f for f in falls if f['reason'] == r])} layer(s) float: {r}" for r in why
        )
        res = {"result": "compressed", "reason": reason}
    else:
        kinds = sorted({type(c).__name__ for c in cache})
        res = {
            "result": "float_fallback",
            "reason": "; ".join(why) or f"no growing full-attention KV cache ({', '.join(kinds)})",
        }
    agree = sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref)
    return {
        **out,
        **res,
        "top1_agree_decode": agree,
        "coded_layers": len(coded),
        "caches": len(cache),
    }


class FamilyTimeout(BaseException):  # not an Exception: family()'s handlers must not take it
    pass


def _alarm(*_):
    raise FamilyTimeout(f"no result within {LIMIT_S} s (tiny config too large or too slow here)")


def _float_crashes(model_type: str, tries: int = 2) -> bool:
    """Whether the float model alone (float cache in both runs) ends its process abnormally."""
    cmd = [sys.executable, __file__, "--one", model_type, "--mode", "fp16"]
    return any(subprocess.run(cmd, capture_output=True).returncode != 0 for _ in range(tries))


def isolated(types: list[str], kv_mode: str):
    """family() over `types` in child processes, one after another in each: a native abort
    (some families' float model corrupts the heap on MLX's CPU backend) or a hang is placed by
    the last stage the child reached, and a new child goes on with the rest."""
    todo = list(types)
    while todo:
        cmd = [sys.executable, __file__, "--one", ",".join(todo), "--mode", kv_mode]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stage, current = "build", todo[0]
        for line in p.stdout:
            if line.startswith(STAGE):
                _, current, stage = line.split()
            elif line.startswith("{"):
                r = json.loads(line)
                todo.remove(r["model_type"])
                yield r
        rc = p.wait()
        err = p.stderr.read().strip().splitlines()
        if current in todo:
            todo.remove(current)
            why = f"process ended ({rc}) in the {stage} run: {(err or [''])[-1][:200]}"
            if stage == "compressed" and not _float_crashes(current):
                yield {"model_type": current, "kv_mode": kv_mode, "result": "crash", "reason": why}
            else:
                yield {"model_type": current, "built": False, "reason": why}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="isoquant3")
    ap.add_argument("--only", default="")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument(
        "--part",
        default="",
        help="i/n: the i-th of n slices of the families, "
        "written to kv_families_part<i>.json (--merge joins them)",
    )
    ap.add_argument("--merge", type=int, default=0, help="join n part files into kv_families.json")
    a = ap.parse_args()
    if a.one:
        signal.signal(signal.SIGALRM, _alarm)
        for mt in a.one.split(","):
            print(STAGE, mt, "build", flush=True)
            signal.alarm(LIMIT_S)
            try:
                r = family(mt, a.mode)
            except FamilyTimeout as e:
                r = {"model_type": mt, "built": False, "reason": str(e)}
            signal.alarm(0)
            print(json.dumps(r), flush=True)
        return
    if a.merge:
        return merge(a.merge)
    types = a.only.split(",") if a.only else tiny_families.model_types()
    name = "kv_families"
    if a.part:
        i, n = map(int, a.part.split("/"))
        types, name = types[i - 1 :: n], f"kv_families_part{i}"
    rows, skipped = [], []
    t0 = time.time()
    for r in isolated(types, a.mode):
        mt = r["model_type"]
        (skipped if r.get("built") is False else rows).append(r)
        mark = r.get("result", "not built")
        print(f"{mt:24s} {mark:15s} {r.get('reason', '')[:90]}", flush=True)
        write(name, rows, skipped)  # after every family: an interrupted run keeps what it has
    counts = {
        k: sum(r["result"] == k for r in rows) for k in ("compressed", "float_fallback", "crash")
    }
    print(
        f"\n{len(rows)} families run in {time.time() - t0:.0f} s: {counts}; {len(skipped)} not built"
    )


def write(name: str, rows: list, skipped: list) -> None:
    counts = {
        k: sum(r["result"] == k for r in rows) for k in ("compressed", "float_fallback", "crash")
    }
    write_result(
        name,
        {
            "protocol": f"tiny random float32 models from each ModelArgs; {PROMPT}-token prompt in "
            f"chunks of {CHUNK}, {DECODE} greedy decode steps; mlx-lm "
            f"{__import__('mlx_lm').__version__}",
            "counts": counts,
            "families": rows,
            "not_built": skipped,
        },
    )


def merge(n: int) -> None:
    from record import RESULTS

    parts = [
        json.loads((RESULTS / f"kv_families_part{i}.json").read_text()) for i in range(1, n + 1)
    ]
    rows = sorted((r for p in parts for r in p["families"]), key=lambda r: r["model_type"])
    skipped = sorted((r for p in parts for r in p["not_built"]), key=lambda r: r["model_type"])
    write("kv_families", rows, skipped)
    for i in range(1, n + 1):
        (RESULTS / f"kv_families_part{i}.json").unlink()


if __name__ == "__main__":
    main()
