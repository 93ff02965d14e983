"""Pipeline and expert split over local ranks against one process, same model: decode tok/s,
bytes each rank sends per decoded token, and whether the greedy tokens are the single
process's; the pipeline's ranks also with the server's per-token agreement (serve.py), side by
side in the same launch. The expert split (experts.py) runs for the models it supports.

    .venv/bin/python benchmarks/distributed.py            # -> results/distributed.json
    .venv/bin/python benchmarks/distributed.py --tokens 32 --models qwen3_moe

Ranks are local processes started by mlx.launch (ring backend over loopback), so the link is
the loopback's and every rank shares this machine's cores: the figures say what the split
costs in messages and bytes, not what two machines gain (that is the projection's part,
benchmarks/distributed_projection.py, stored alongside). Each setting is a fresh launch; the
single process is the same rank program without a group (no transfers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from distributed_projection import projection  # noqa: E402
from record import write_result  # noqa: E402

from app.engine.distributed.launch import launch_argv  # noqa: E402
from app.engine.distributed.plan import EXPERT_SPLIT_ARCHS  # noqa: E402
from app.engine.testing.random_models import TINY_CONFIGS, make_random_model  # noqa: E402

# Small enough for a shared 2-core CPU, large enough that a step is not all overhead.
SHAPES = {
    "qwen3_moe": dict(
        TINY_CONFIGS["qwen3_moe"],
        hidden_size=512,
        num_hidden_layers=8,
        num_experts=16,
        moe_intermediate_size=256,
        intermediate_size=1024,
    ),
    "nemotron_h": dict(
        TINY_CONFIGS["nemotron_h"],
        hidden_size=512,
        hybrid_override_pattern="ME*EMEME",
        n_routed_experts=16,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=512,
    ),
}
PROMPT = list(range(3, 67))  # 64 tokens
CPU = False  # --cpu: the ring backend moves CPU arrays; on a GPU machine keep ranks there


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OPENBLAS_NUM_THREADS"] = "1"  # ranks share the cores: no spinning BLAS threads
    return env


def run(
    folder: Path, ranks: int, tokens: int, work: Path, agree: bool = False, split: str = "pipeline"
) -> list[dict]:
    """Each rank's results; with `agree`, runs alternate without and with the server's
    per-token agreement (one 4-byte all_sum a token), twice each, in one launch."""
    runs = [{"model": str(folder), "kv_mode": "fp16", "split": split}]
    if agree:
        runs = [dict(runs[0], agree_each_token=bool(i % 2)) for i in range(4)]
    spec = {
        "runs": runs,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "logprobs": False,
        "latency_probe": 50,  # one-element all_sums before the run: the link's latency here
    }
    out = work / f"{folder.name}-{ranks}-{split}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    args = ["x", "--check", str(out / "spec.json"), "--out", str(out), "--step-timeout", "300"]
    args += ["--cpu"] if CPU else []
    if ranks == 1:
        argv = [sys.executable, "-m", "app.engine.distributed.rank", *args]
    else:
        argv = launch_argv(args, ranks=ranks, backend="ring")
    p = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"{folder.name} x{ranks} failed:\n{p.stderr[-3000:]}")
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    if not agree:
        return [dict(r["runs"][0], message_seconds=r["message_seconds"]) for r in res]
    rows = []
    for r in res:  # per rank: the plain and the agreeing runs' decode seconds, averaged
        plain = [x for x, s in zip(r["runs"], runs, strict=True) if not s["agree_each_token"]]
        agreeing = [x for x, s in zip(r["runs"], runs, strict=True) if s["agree_each_token"]]
        for kind, group in (("plain", plain), ("agree", agreeing)):
            rows.append(
                dict(
                    group[0],
                    kind=kind,
                    decode_seconds=sum(x["decode_seconds"] for x in group) / len(group),
                    same_tokens=all(x["tokens"] == group[0]["tokens"] for x in r["runs"]),
                    message_seconds=r["message_seconds"],
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3_moe,nemotron_h")
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true", help="ranks on the CPU on a GPU machine (ring)")
    a = ap.parse_args()
    global CPU
    CPU = a.cpu
    from app.engine.bench import machine

    desc = machine()
    label = f"{desc.get('backend', '?')} {desc.get('device', '')}".strip()
    if CPU:
        label = f"CPU ranks ({desc.get('cpu_count', '?')} cores) on a {label} machine"
    rows = []
    with tempfile.TemporaryDirectory(prefix="rq-dist-bench-") as tmp:
        work = Path(tmp)
        for arch in a.models.split(","):
            folder = make_random_model(SHAPES[arch], work / f"{arch}-bench", seed=5, scale=0.05)
            single = run(folder, 1, a.tokens, work)[0]
            n_dec = len(single["tokens"]) - 1
            rows.append(
                {
                    "machine": label,
                    "model": f"random {arch} (hidden 512)",
                    "ranks": 1,
                    "split": "pipeline",
                    "tps": round(n_dec / single["decode_seconds"], 2),
                    "bytes_per_token": 0,
                    "tokens_equal_single": True,
                }
            )
            for n in map(int, a.ranks.split(",")):
                both = run(folder, n, a.tokens, work, agree=True)
                for kind in ("plain", "agree"):
                    res = [r for r in both if r["kind"] == kind]
                    dec = max(r["decode_seconds"] for r in res)
                    sent = sum(r["decode_bytes"] for r in res)  # all ranks' sends
                    same = all(r["tokens"] == single["tokens"] and r["same_tokens"] for r in res)
                    rows.append(
                        {
                            "machine": label,
                            "model": f"random {arch} (hidden 512)",
                            "ranks": n,
                            "split": "pipeline",
                            "tps": round(n_dec / dec, 2),
                            "bytes_per_token": int(sent / n_dec),
                            "tokens_equal_single": same,
                            "per_token_agreement": kind == "agree",
                            "layers": [r["stage"]["layers"] for r in res],
                            "message_ms": round(1e3 * max(r["message_seconds"] for r in res), 3),
                        }
                    )
                if arch not in EXPERT_SPLIT_ARCHS:
                    continue
                res = run(folder, n, a.tokens, work, split="experts")
                rows.append(
                    {
                        "machine": label,
                        "model": f"random {arch} (hidden 512)",
                        "ranks": n,
                        "split": "experts",
                        "tps": round(n_dec / max(r["decode_seconds"] for r in res), 2),
                        "bytes_per_token": int(sum(r["decode_bytes"] for r in res) / n_dec),
                        "tokens_equal_single": all(r["tokens"] == single["tokens"] for r in res),
                        "per_token_agreement": False,
                        "experts": [r["stage"]["experts"] for r in res],
                        "message_ms": round(1e3 * max(r["message_seconds"] for r in res), 3),
                    }
                )
    print(
        f"{'model':32s} {'ranks':>5s} {'split':>8s} {'agree':>5s} {'tok/s':>7s} {'vs 1':>6s} {'bytes/token':>12s} {'msg ms':>7s} {'tokens = 1':>10s}"
    )
    base = {}
    for r in rows:
        if r["ranks"] == 1:
            base[r["model"]] = r["tps"]
        print(
            f"{r['model']:32s} {r['ranks']:5d} {r['split']:>8s} "
            f"{'yes' if r.get('per_token_agreement') else '':>5s} "
            f"{r['tps']:7.2f} {r['tps'] / base[r['model']]:6.2f} "
            f"{r['bytes_per_token']:12d} {r.get('message_ms', 0):7.2f} "
            f"{str(r['tokens_equal_single']):>10s}"
        )
    proj = projection()
    for s in proj["settings"]:
        print(f"projection: {s['setting']}: {s['expected_tok_s']} tok/s")
    payload = {
        "runs": rows,
        "projection": proj,
        "notes": "ranks are local processes on one machine sharing its cores (loopback "
        "ring); tok/s are decode, after a 64-token prompt, greedy; bytes_per_token "
        "sums every rank's sends (pipeline: send + ring all_gather; experts: one ring all_sum "
        "of the hidden state per MoE layer, 2 (N-1)/N of it per rank); message_ms: median "
        "one-element all_sum between the local ranks, measured before the run; "
        "per_token_agreement: the ranks also run serve --hosts's one 4-byte all_sum per token "
        "(not counted in bytes_per_token), alternating with plain runs in the same launch, "
        "two of each averaged",
    }
    write_result("distributed", payload, path=Path(a.out) if a.out else None)


if __name__ == "__main__":
    main()
