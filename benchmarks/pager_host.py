"""The host's cost of a paged decode step on the CPU, by part: this tree beside a baseline
commit, in the same run.

Configurations (CPU, unified memory: the zero-copy path; warm page cache; 50% expert budget):
  super-records  Nemotron 3 Super's expert records (fc1 / fc2 2688x1024 at 2 bits: 1.72 MB,
                 512 experts, 22 a token) in 4 MoE layers with little compute: each layer
                 gathers its routed slots' fc1 scales (pager_speed.py's cpu mode)
  qwen3-tiny     Qwen3-30B-A3B's layer and expert counts (48 MoE layers, 128 experts, 8 a
                 token) at tiny widths (hidden 64, expert width 64): the whole model with the
                 pager's layer module, teacher-forced decode
Each (configuration, routing) runs the baseline's code and this tree's in alternating rounds,
each in its own process (`--worker`); a part's figure is its median over the rounds.

Parts (ms per token): the pager's `host_parts` (readback: waiting for the router's indices,
on the CPU the compute up to it; ids: which experts hit or miss; policy: the cache's
bookkeeping; reads: the misses' reads; scatter; index: the slot index array; graph: the
layer's expert graph), `eval`: the token's final eval, `other`: the rest (the model's own
graph building). Both runs compute the same state: the benchmark checks it is bit-identical.

    python benchmarks/pager_host.py --baseline e0762db   # -> benchmarks/results/pager_host.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
SUPER_RECORDS = {"fc1": (2688, 1024), "fc2": (1024, 2688)}
SUPER_EXPERTS, SUPER_K = 512, 22
PARTS = ("readback", "ids", "policy", "reads", "scatter", "index", "graph")


def qwen3_tiny() -> dict:
    sys.path.insert(0, str(ROOT))
    from app.engine.testing.shapes import QWEN3_30B_A3B

    cfg = dict(QWEN3_30B_A3B)
    cfg.update(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=512,
    )
    return cfg


def build(work: Path) -> dict:
    """The two configurations' folders (written once)."""
    sys.path.insert(0, str(ROOT))
    from app.engine.manifest import Manifest
    from app.engine.testing.synth import write_random_converted, write_random_experts

    rec = work / "super-records-4L"
    if not (rec / "experts.json").exists():
        write_random_experts(rec, 4, SUPER_EXPERTS, SUPER_RECORDS)
    q = work / "qwen3-tiny-48L"
    cfg = qwen3_tiny()
    man = Manifest.load(q) if q.exists() else None
    if man is None or man.extra.get("bench_config") != cfg:
        man = write_random_converted(cfg, q, seed=0)
        man.extra["bench_config"] = cfg
        man.save(q)
    return {"super-records": rec, "qwen3-tiny": q}


def baseline_tree(rev: str, work: Path) -> Path:
    """The baseline commit's `app` package, unpacked beside the workdir."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    out = work / f"tree-{sha}"
    if not (out / "app").exists():
        out.mkdir(parents=True, exist_ok=True)
        tar = out / "app.tar"
        subprocess.run(["git", "archive", "-o", str(tar), sha, "app"], cwd=ROOT, check=True)
        with tarfile.open(tar) as t:
            t.extractall(out, filter="data")
        tar.unlink()
    return out


# -- worker: one measurement in the tree on sys.path ---------------------------------------
def records_run(folder: Path, routing: str, tokens: int, warmup: int) -> dict:
    import mlx.core as mx
    from pager_routing import expert_stream

    from app.engine.offload.pager import ExpertPager
    from app.engine.offload.records import ExpertStore

    store = ExpertStore(folder, json.loads((folder / "experts.json").read_text()))
    pager = ExpertPager(store, store.expert_bytes() // 2)
    steps = tokens + warmup
    streams = {
        x: expert_stream(routing, SUPER_EXPERTS, SUPER_K, steps, 7 * x).astype("uint32")
        for x in store.layers
    }
    h = mx.zeros((1,), dtype=mx.float32)
    mx.eval(h)
    outs, wait = [], 0.0
    for t in range(steps):
        if t == warmup:
            pager.reset_stats()
            wait, t0 = 0.0, time.perf_counter()
        for layer in store.layers:
            idx = mx.array(streams[layer][t][None]) + (h > 1e30).astype(mx.uint32)
            r = pager.route(layer, idx)
            sc = pager.arrays(layer)["fc1.scales"][r.slot_idx]
            h = h + sc.astype(mx.float32).mean()
            pager.track(h)
        tw = time.perf_counter()
        mx.eval(h)
        wait += time.perf_counter() - tw
        outs.append(h.item())
    secs = time.perf_counter() - t0
    s = pager.stats()
    pager.close()
    return {"seconds": secs, "eval_s": wait, "stats": s, "state": outs}


def model_run(folder: Path, routing: str, tokens: int, warmup: int) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from pager_routing import force_routing

    from app.engine.manifest import Manifest
    from app.engine.offload import load_paged
    from app.engine.offload.records import ExpertStore

    man = Manifest.load(folder)
    store = ExpertStore(folder, man.experts)
    lm = load_paged(folder, store.expert_bytes() // 2)
    model, pager = lm.model, lm.model.rq_pager
    force_routing(model, man.experts, routing, steps=tokens + warmup + 8)
    toks = np.random.default_rng(1).integers(0, 500, tokens + warmup + 1).tolist()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([toks[:1]]), cache=cache))
    outs, wait = [], 0.0
    for i, t in enumerate(toks[1:]):
        if i == warmup:
            pager.reset_stats()
            wait, t0 = 0.0, time.perf_counter()
        y = model(mx.array([[t]]), cache=cache)[:, -1]
        tw = time.perf_counter()
        mx.eval(y)
        wait += time.perf_counter() - tw
        outs.append(np.array(y.astype(mx.float32)).tobytes().hex())
    secs = time.perf_counter() - t0
    s = pager.stats()
    pager.close()
    return {"seconds": secs, "eval_s": wait, "stats": s, "state": outs}


def worker(a) -> None:
    sys.path.insert(0, str(BENCH))
    sys.path.insert(0, a.tree)  # the tree measured: its `app` first
    folder = Path(a.folder)
    run = records_run if a.config == "super-records" else model_run
    r = run(folder, a.routing, a.tokens, a.warmup)
    s, n = r["stats"], a.tokens
    hp = s.get("host_parts") or {}
    scale = (s.get("tokens") or 0) / n  # the pager counts a pass when the next one starts
    ms = {k: hp.get(k, 0.0) * scale for k in PARTS}
    ms["eval"] = 1000 * r["eval_s"] / n
    ms["total"] = 1000 * r["seconds"] / n
    ms["other"] = ms["total"] - sum(ms[k] for k in (*PARTS, "eval"))
    print(
        "RESULT "
        + json.dumps(
            {
                "ms": ms,
                "hit_rate": s["hit_rate"],
                "misses_per_token": s["misses"] / n,
                "reads_per_token": s["reads"] / n,
                "readbacks_per_token": s["readbacks"] / n,
                "state": r["state"],
            }
        )
    )


def measure(tree: Path, folder: Path, config: str, routing: str, a) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--tree",
        str(tree),
        "--folder",
        str(folder),
        "--config",
        config,
        "--routing",
        routing,
        "--tokens",
        str(a.tokens),
        "--warmup",
        str(a.warmup),
    ]
    env = dict(os.environ, PYTHONPATH=str(tree))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not line:
        raise SystemExit(f"worker failed ({config} {routing} {tree}):\n{p.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT ") :])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="HEAD~1", help="the commit measured beside this tree")
    ap.add_argument("--configs", nargs="+", default=["qwen3-tiny", "super-records"])
    ap.add_argument("--routings", nargs="+", default=["trace", "random"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--workdir", default=os.environ.get("RQ_BENCH_DIR", "/tmp/rq-pager-host"))
    ap.add_argument("--out", default=None, help="default: benchmarks/results/pager_host.json")
    # worker
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--routing", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    sys.path.insert(0, str(BENCH))
    from record import RESULTS, commit, write_result

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    folders = build(work)
    base = baseline_tree(a.baseline, work)
    base_rev = base.name.removeprefix("tree-")
    cur = work / "tree-current"  # a copy: edits to the checkout during the run change nothing
    shutil.rmtree(cur, ignore_errors=True)
    shutil.copytree(ROOT / "app", cur / "app", ignore=shutil.ignore_patterns("__pycache__"))
    trees = {"baseline": base, "current": cur}
    rows = []
    t_start = time.perf_counter()
    for config in a.configs:
        for routing in a.routings:
            got: dict[str, list] = {k: [] for k in trees}
            for _ in range(a.rounds):
                for name, tree in trees.items():
                    got[name].append(measure(tree, folders[config], config, routing, a))
            same = all(r["state"] == got["baseline"][0]["state"] for rs in got.values() for r in rs)
            row = {"config": config, "routing": routing, "budget_fraction": 0.5, "identical": same}
            for name, rs in got.items():
                keys = rs[0]["ms"].keys()
                row[name] = {
                    "ms_per_token": {k: statistics.median(r["ms"][k] for r in rs) for k in keys},
                    "hit_rate": rs[0]["hit_rate"],
                    "misses_per_token": rs[0]["misses_per_token"],
                    "reads_per_token": rs[0]["reads_per_token"],
                    "readbacks_per_token": rs[0]["readbacks_per_token"],
                    "rounds_total_ms": [r["ms"]["total"] for r in rs],
                    "rounds_readback_ms": [r["ms"]["readback"] for r in rs],
                }
            rows.append(row)
            b, c = row["baseline"]["ms_per_token"], row["current"]["ms_per_token"]
            print(
                f"{config} {routing}: hit {row['current']['hit_rate']:.1%}, "
                f"{row['current']['misses_per_token']:.1f} misses/token, identical {same}"
            )
            for k in (*PARTS, "eval", "other", "total"):
                print(f"  {k:9s} {b[k]:8.2f} -> {c[k]:8.2f} ms/token")
            if not same:
                raise SystemExit("the baseline and this tree computed different states")
    write_result(
        "pager_host",
        {
            "baseline_commit": base_rev,
            "current_commit": commit(),
            "settings": {"tokens": a.tokens, "warmup": a.warmup, "rounds": a.rounds},
            "rows": rows,
        },
        path=Path(a.out) if a.out else RESULTS / "pager_host.json",
    )
    print(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
