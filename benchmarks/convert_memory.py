"""Peak memory of the streaming converter on a synthetic multi-GB Hugging Face checkpoint.

Builds a Qwen3-30B-A3B-shaped checkpoint (real hidden 2048, 128 experts of width 768, real
151,936-token embeddings; fewer layers), BF16, sharded, per-expert tensors as in the real
release, then converts it in a fresh subprocess while a thread samples its RSS with psutil
every 5 ms. The converter's stated bound (see app/engine/quant/convert.py):

    peak RSS <= baseline + 6 x max(chunk_bytes, one expert's source bytes,
                                   largest tensor that sanitize transforms) + 64 MiB

where baseline is the child's RSS after imports, just before `convert`. The +64 MiB covers
the model built from config and the lazy arrays' bookkeeping.

    LD_PRELOAD=...libopenblas.so.0 .venv/bin/python benchmarks/convert_memory.py
    (--layers 4 --trials 2 by default; --small for the quick version the slow test runs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from app.engine.testing.shapes import QWEN3_30B_A3B  # noqa: E402

QWEN3_30B_SHAPE = {**QWEN3_30B_A3B, "torch_dtype": "bfloat16"}
SMALL_SHAPE = {
    **QWEN3_30B_SHAPE,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 64,
    "moe_intermediate_size": 256,
    "vocab_size": 32768,
}
HEADROOM = 64 << 20
FACTOR = 6


def make_synthetic_checkpoint(
    folder: Path, config: dict, shard_bytes: int = 1 << 30, seed: int = 0
) -> int:
    """Write a random BF16 HF checkpoint for `config`, a block of rows at a time (never the
    whole model in memory). Returns its size in bytes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from app.engine.quant.safetensors_io import OutTensor, ShardedWriter
    from app.engine.testing.random_models import write_tiny_tokenizer

    cls, args = _get_classes(config)
    model = cls(args.from_dict(config))  # lazy: shapes only
    plan = []
    for name, p in tree_flatten(model.parameters()):
        if ".switch_mlp." in name:  # HF layout: one tensor per expert
            pre, proj = name.split(".switch_mlp.")
            proj = proj.rsplit(".", 1)[0]
            for e in range(p.shape[0]):
                plan.append(
                    OutTensor(f"{pre}.experts.{e}.{proj}.weight", "bfloat16", tuple(p.shape[1:]))
                )
        else:
            plan.append(OutTensor(name, "bfloat16", tuple(p.shape)))
    folder.mkdir(parents=True, exist_ok=True)
    w = ShardedWriter(folder, plan, max_shard_bytes=shard_bytes)
    for i, t in enumerate(plan):
        rows = t.shape[0]
        step = max(1, (16 << 20) // max(1, t.nbytes // rows))
        for r in range(0, rows, step):
            shape = (min(step, rows - r), *t.shape[1:])
            if "norm" in t.name:
                a = mx.ones(shape, dtype=mx.bfloat16)
            else:
                k = mx.random.key(seed * 1_000_003 + i * 4099 + r)
                a = (0.02 * mx.random.normal(shape, key=k)).astype(mx.bfloat16)
            w.write(t.name, a, r)
    w.close()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tiny_tokenizer(folder)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _child(src: str, dst: str, chunk_bytes: int) -> None:
    """Convert in this fresh process, sampling RSS; print one JSON line."""
    import psutil
    from mlx_lm.utils import _get_classes

    from app.engine.quant.convert import convert

    # The baseline includes what any app process that converts has imported: mlx, mlx-lm and
    # the architecture's module.
    _get_classes(json.loads((Path(src) / "config.json").read_text()))
    proc = psutil.Process()
    baseline = proc.memory_info().rss
    peak = [baseline]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    man = convert(src, dst, chunk_bytes=chunk_bytes)
    secs = time.perf_counter() - t0
    stop.set()
    th.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    print(
        json.dumps(
            {
                "baseline_rss": baseline,
                "peak_rss": peak[0],
                "seconds": secs,
                "converter_peak_rss": man.extra["conversion"]["peak_rss_bytes"],
                "output_bytes": man.total_bytes,
                "roles": man.roles,
            }
        )
    )


def bound_for(config: dict, chunk_bytes: int) -> dict:
    expert = 3 * config["moe_intermediate_size"] * config["hidden_size"] * 2  # bf16 source
    group = max(chunk_bytes, expert, 0)  # qwen3_moe's sanitize transforms no dense tensor
    return {
        "chunk_bytes": chunk_bytes,
        "expert_bytes": expert,
        "group_bytes": group,
        "factor": FACTOR,
        "headroom": HEADROOM,
        "above_baseline": FACTOR * group + HEADROOM,
    }


def run(config: dict, layers: int, trials: int, chunk_bytes: int, workdir: Path) -> dict:
    config = {**config, "num_hidden_layers": layers}
    src = workdir / "src"
    t0 = time.perf_counter()
    size = make_synthetic_checkpoint(src, config)
    gen_s = time.perf_counter() - t0
    bound = bound_for(config, chunk_bytes)
    env = dict(os.environ)
    res = []
    for t in range(trials):
        dst = workdir / f"dst{t}"
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(src), str(dst), str(chunk_bytes)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["above_baseline"] = r["peak_rss"] - r["baseline_rss"]
        r["within_bound"] = r["above_baseline"] <= bound["above_baseline"]
        res.append(r)
        shutil.rmtree(dst, ignore_errors=True)
    import psutil

    return {
        "machine": {
            "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "ram_bytes": psutil.virtual_memory().total,
        },
        "checkpoint": {
            "shape": "Qwen3-30B-A3B dims" if config["hidden_size"] == 2048 else "small",
            "layers": layers,
            "bytes": size,
            "dtype": "bfloat16",
            "generate_seconds": round(gen_s, 1),
        },
        "bound": bound,
        "trials": [{k: v for k, v in r.items() if k != "roles"} for r in res],
        "roles": res[0]["roles"],
        "peak_above_baseline_max": max(r["above_baseline"] for r in res),
        "within_bound": all(r["within_bound"] for r in res),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=3, metavar=("SRC", "DST", "CHUNK"), help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--small", action="store_true", help="a ~0.3 GB checkpoint (slow test)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/convert_memory.json"))
    ap.add_argument("--workdir", help="where to build the checkpoint (default: a temp dir)")
    a = ap.parse_args(argv)
    if a.child:
        _child(a.child[0], a.child[1], int(a.child[2]))
        return 0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="rq-convmem-"))
    try:
        r = run(
            SMALL_SHAPE if a.small else QWEN3_30B_SHAPE, a.layers, a.trials, a.chunk_mib << 20, work
        )
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    mib = 2**20
    print(
        f"checkpoint {r['checkpoint']['bytes'] / 2**30:.2f} GiB ({r['checkpoint']['shape']}, "
        f"{r['checkpoint']['layers']} layers, bf16) on {r['machine']['cores']} cores"
    )
    print(
        f"bound above baseline: {r['bound']['above_baseline'] / mib:.0f} MiB "
        f"({FACTOR} x {r['bound']['group_bytes'] / mib:.0f} MiB + {HEADROOM // mib} MiB)"
    )
    print(
        f"{'trial':>5s} {'baseline MiB':>12s} {'peak MiB':>9s} {'above MiB':>9s} "
        f"{'seconds':>8s} {'ok':>3s}"
    )
    for i, t in enumerate(r["trials"]):
        print(
            f"{i:5d} {t['baseline_rss'] / mib:12.0f} {t['peak_rss'] / mib:9.0f} "
            f"{t['above_baseline'] / mib:9.0f} {t['seconds']:8.1f} "
            f"{'yes' if t['within_bound'] else 'NO':>3s}"
        )
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("convert_memory", r, r.pop("machine"), Path(a.json))
    return 0 if r["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
