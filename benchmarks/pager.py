"""Expert pager: decode speed against the fraction of experts resident.

Model: Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of width 768, top-8; attention
32 q / 4 kv heads of 128) with 4 layers and a 32K vocabulary (the lm_head is not what is
measured), random weights written directly in the converted format (`testing.synth`) at the
default role widths (dense 4-bit, routed 2-bit: 1.47 MB per expert record). The decode feeds
a random token stream (teacher forcing, pipelined like mlx-lm's generate_step), so routing is
random: the pager's hard case.

1. Side by side in one process, interleaved trials: the plain resident model
   (`loader.load`), the pager with every expert resident (no index read-back), and the same
   pager with the read-back forced on every MoE layer (`always_resolve`): the overhead at 100%
   residency and the cost of reading indices back to the host.
2. One fresh subprocess per resident fraction (100% ... 10%): decode tok/s, hit rate, bytes
   read per token, host time stalled on reads and on read-backs, peak RSS (psutil, sampled),
   and whether every step's argmax equals the plain model's. Reads come from the OS page
   cache (the file fits in RAM) unless `cold`: then each record's pages are dropped after it
   is read (posix_fadvise DONTNEED), so every miss goes to the disk.

MLX's CPU quantized matmuls are slow (a 2048x4096 4-bit matvec ~60 ms on this 2-core VM), so
with the default widths compute hides the reads; the float32 variant (BLAS matmuls, 18.9 MB
expert records) is where reads show on a CPU:

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    .venv/bin/python benchmarks/pager.py                       # -> results/pager.json
    .venv/bin/python benchmarks/pager.py --layers 2 --dtype float32 \
        --widths dense=float,routed=float,shared=float --out benchmarks/results/pager_float32.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from app.engine.testing.shapes import QWEN3_30B_A3B  # noqa: E402

QWEN3_30B_SHAPE = QWEN3_30B_A3B
FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.1)
COLD = (0.5, 0.1)
PROMPT_LEN = 4  # short: CPU quantized matmuls over many (token, expert) pairs are slow
WARMUP = 6  # decode steps before timing (--warmup): longer reaches the LRU's steady state
ROUTING = "model"  # --routing: trace | random force the experts (pager_routing.py)
EXPERTS: list = []  # the model's manifest `experts` section, once known


def machine() -> dict:
    import mlx.core as mx
    import psutil

    return {
        "platform": platform.platform(),
        "cpu": platform.machine(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "mlx": mx.__version__,
        "backend": "cpu" if not (mx.metal.is_available() or mx.cuda.is_available()) else "gpu",
    }


def config(layers: int, vocab: int) -> dict:
    return dict(QWEN3_30B_SHAPE, num_hidden_layers=layers, vocab_size=vocab)


def build(folder: Path, cfg: dict, widths: str, dtype: str):
    from app.engine.manifest import Manifest
    from app.engine.quant.widths import RoleWidths
    from app.engine.testing.synth import write_random_converted

    man = Manifest.load(folder) if folder.exists() else None
    want = {"config": cfg, "widths": widths, "dtype": dtype}
    if man is None or man.extra.get("bench_config") != want:
        t = time.perf_counter()
        man = write_random_converted(cfg, folder, RoleWidths.parse(widths), seed=0, dtype=dtype)
        man.extra["bench_config"] = want
        man.extra["build_seconds"] = round(time.perf_counter() - t, 1)
        man.save(folder)
    return man


def expert_bytes(folder: Path) -> int:
    from app.engine.offload.records import ExpertStore

    with ExpertStore(folder) as st:
        return st.expert_bytes()


def stream(n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(1).integers(0, 1000, PROMPT_LEN + WARMUP + n).tolist()


def decode(model, n: int) -> tuple[list[int], float]:
    """Teacher-forced decode of a random token stream (random routing: a random model's own
    greedy output soon repeats a few tokens, and so its experts), pipelined like mlx-lm's
    generate_step (step i+1's graph is built while step i computes). Returns each step's
    argmax and the seconds of the n steps after the prompt and WARMUP steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    toks = stream(n)
    if ROUTING != "model":  # the same forced experts from the start of every run
        from pager_routing import force_routing

        force_routing(model, EXPERTS[0], ROUTING)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([toks[:PROMPT_LEN]]), cache=cache)[:, -1])
    out, prev, t0 = [], None, None
    for i, t in enumerate(toks[PROMPT_LEN:]):
        if i == WARMUP:
            if prev is not None:
                out.append(prev.item())
                prev = None
            if hasattr(model, "rq_pager"):
                model.rq_pager.reset_stats()
            t0 = time.perf_counter()
        y = mx.argmax(model(mx.array([[t]]), cache=cache)[:, -1], axis=-1)
        mx.async_eval(y)
        if prev is not None:
            out.append(prev.item())
        prev = y
    out.append(prev.item())
    return out, time.perf_counter() - t0


class PeakRSS:
    """Samples this process's RSS every 2 ms on a thread (psutil)."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def child(folder: Path, frac: float, n: int, cold: bool) -> dict:
    import mlx.core as mx
    import psutil

    from app.engine.offload import load_paged

    base_rss = psutil.Process().memory_info().rss
    eb = expert_bytes(folder)
    with PeakRSS() as peak:
        t = time.perf_counter()
        lm = load_paged(folder, int(eb * frac), drop_page_cache=cold)
        load_s = time.perf_counter() - t
        rss_loaded = psutil.Process().memory_info().rss
        toks, secs = decode(lm.model, n)
    s = lm.model.rq_pager.stats()
    dense = sum(
        v.nbytes
        for _, v in __import__("mlx.utils", fromlist=["x"]).tree_flatten(lm.model.parameters())
    )
    return {
        "fraction": frac,
        "cold": cold,
        "tokens": toks,
        "decode_tps": n / secs,
        "ms_per_token": 1000 * secs / n,
        "hit_rate": s["hit_rate"],
        "bytes_read_per_token": s["bytes_read"] / n,
        "reads_per_token": s["reads"] / n,
        "read_ms_per_token": 1000 * s["read_s"] / n,
        "readback_ms_per_token": 1000 * s["readback_s"] / n,
        "read_GBps": s["bytes_read"] / s["read_s"] / 1e9 if s["read_s"] else None,
        "readbacks_per_token": s["readbacks"] / n,
        "evictions_per_token": s["evictions"] / n,
        "slots": s["slots"],
        "pool_bytes": s["pool_bytes"],
        "budget_bytes": s["budget_bytes"],
        "dense_bytes": dense,
        "load_s": load_s,
        "base_rss": base_rss,
        "rss_after_load": rss_loaded,
        "peak_rss": peak.peak,
        "overhead_rss": peak.peak - base_rss - dense - s["pool_bytes"],
        "mlx_peak": mx.get_peak_memory(),
    }


def side_by_side(folder: Path, n: int, trials: int) -> dict:
    """Plain vs all-resident pager vs all-resident with read-back, interleaved."""
    from app.engine.loader import load
    from app.engine.offload import load_paged

    eb = expert_bytes(folder)
    plain, paged = load(folder).model, load_paged(folder, eb).model
    opts = paged.rq_pager.options
    # one paged model, its read-back switched per run (the pool is full either way)
    models = {
        "plain": (plain, None),
        "paged_full": (paged, False),
        "paged_full_readback": (paged, True),
    }

    def run(k, count):
        m, readback = models[k]
        if readback is not None:
            m.rq_pager.options = replace(opts, always_resolve=readback)
        return decode(m, count)

    times = {k: [] for k in models}
    tokens = {}
    for k in models:  # warm-up
        tokens[k] = run(k, 4)[0]
    for _ in range(trials):
        for k in models:
            toks, secs = run(k, n)
            times[k].append(secs / n)
            tokens[k] = toks
    best = {k: min(v) for k, v in times.items()}
    return {
        "ms_per_token": {k: [1000 * x for x in v] for k, v in times.items()},
        "best_ms_per_token": {k: 1000 * v for k, v in best.items()},
        "identical_tokens": all(tokens[k] == tokens["plain"] for k in tokens),
        "overhead_full_residency_pct": 100 * (best["paged_full"] / best["plain"] - 1),
        "overhead_readback_pct": 100 * (best["paged_full_readback"] / best["plain"] - 1),
        "plain_tokens": tokens["plain"],
    }


def main():
    global WARMUP, ROUTING
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--vocab",
        type=int,
        default=32768,
        help="smaller than Qwen3's 151,936: the lm_head is not what is measured",
    )
    ap.add_argument(
        "--widths",
        default="",
        help="role widths, e.g. routed=float (default: the app's: dense 4, routed 2, shared 8)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="float dtype (float32: CPU BLAS)")
    ap.add_argument(
        "--part",
        choices=("all", "side", "sweep"),
        default="all",
        help="side by side only / sweep only (merged into an existing --out)",
    )
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--workdir", default=os.environ.get("RQ_BENCH_DIR", "/tmp/rq-pager-bench"))
    ap.add_argument("--child", type=float, default=None)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument(
        "--routing",
        choices=("model", "trace", "random"),
        default="model",
        help="model: the random model's own router on random tokens; trace / "
        "random: forced expert choices (benchmarks/pager_routing.py)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pager.json"))
    a = ap.parse_args()
    WARMUP, ROUTING = a.warmup, a.routing
    cfg = config(a.layers, a.vocab)
    tag = a.widths.replace("=", "").replace(",", "-").replace("/", "g") or "default"
    folder = Path(a.workdir) / f"qwen3-30b-shape-{a.layers}L-{a.vocab}v-{tag}-{a.dtype}"
    if a.child is not None:
        from app.engine.manifest import Manifest

        EXPERTS.append(Manifest.load(folder).experts)
        print(json.dumps(child(folder, a.child, a.tokens, a.cold)))
        return
    t = time.perf_counter()
    man = build(folder, cfg, a.widths, a.dtype)
    EXPERTS.append(man.experts)
    print(
        f"model: {folder} ({man.total_bytes / 1e9:.2f} GB, experts "
        f"{expert_bytes(folder) / 1e9:.2f} GB; built in {time.perf_counter() - t:.0f} s)"
    )
    prev = json.loads(Path(a.out).read_text()) if a.part != "all" and Path(a.out).exists() else {}
    if a.part == "sweep":
        sbs = prev["side_by_side"]
    else:
        sbs = side_by_side(folder, a.tokens, a.trials)
    print(
        f"side by side ({a.trials} trials, {a.tokens} tokens, best): "
        + ", ".join(f"{k} {v:.1f} ms/tok" for k, v in sbs["best_ms_per_token"].items())
    )
    print(
        f"overhead at 100% residency: {sbs['overhead_full_residency_pct']:+.2f}%  "
        f"(with index read-back: {sbs['overhead_readback_pct']:+.2f}%)  "
        f"identical tokens: {sbs['identical_tokens']}"
    )
    runs = prev.get("fractions", []) if a.part == "side" else []
    for frac, cold in (
        [] if a.part == "side" else ([(f, False) for f in FRACTIONS] + [(f, True) for f in COLD])
    ):
        cmd = [
            sys.executable,
            __file__,
            "--layers",
            str(a.layers),
            "--tokens",
            str(a.tokens),
            "--vocab",
            str(a.vocab),
            "--widths",
            a.widths,
            "--workdir",
            a.workdir,
            "--dtype",
            a.dtype,
            "--warmup",
            str(a.warmup),
            "--routing",
            a.routing,
            "--child",
            str(frac),
        ] + (["--cold"] if cold else [])
        r = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            .stdout.strip()
            .splitlines()[-1]
        )
        r["identical_to_plain"] = r.pop("tokens") == sbs["plain_tokens"]
        runs.append(r)
    hdr = (
        f"{'resident':>8} {'cold':>5} {'tok/s':>7} {'hit':>6} {'MB read/tok':>11} "
        f"{'read ms/tok':>11} {'sync ms/tok':>11} {'GB/s':>6} {'peak RSS':>9} "
        f"{'over':>8} {'same':>5}"
    )
    print(hdr)
    for r in runs:
        gbps = f"{r['read_GBps']:.2f}" if r["read_GBps"] else "-"
        print(
            f"{r['fraction']:>8.0%} {str(r['cold']):>5} {r['decode_tps']:>7.2f} "
            f"{r['hit_rate']:>6.1%} {r['bytes_read_per_token'] / 1e6:>11.1f} "
            f"{r['read_ms_per_token']:>11.1f} {r['readback_ms_per_token']:>11.1f} "
            f"{gbps:>6} {r['peak_rss'] / 2**30:>8.2f}G "
            f"{r['overhead_rss'] / 2**20:>7.0f}M {str(r['identical_to_plain']):>5}"
        )
    result = {
        "machine": machine(),
        "model": {
            "shape": "Qwen3-30B-A3B dims",
            "layers": a.layers,
            "vocab": a.vocab,
            "total_bytes": man.total_bytes,
            "expert_bytes": expert_bytes(folder),
            "widths": man.extra.get("widths"),
            "dtype": a.dtype,
            "weights": "random (synth)",
        },
        "settings": {
            "prompt_tokens": PROMPT_LEN,
            "warmup_tokens": WARMUP,
            "routing": ROUTING,
            "timed_tokens": a.tokens,
            "trials": a.trials,
            "batch": 1,
            "driver": "teacher-forced random tokens, pipelined like generate_step",
        },
        "overhead_full_residency_pct": sbs["overhead_full_residency_pct"],
        "side_by_side": sbs,
        "fractions": runs,
        "notes": [
            "Reads with cold=false come from the OS page cache (the expert file fits in RAM);"
            " cold=true drops each record's pages after reading it (posix_fadvise), so every"
            " miss reads the disk.",
            "overhead_rss = peak RSS - RSS before load - dense weights - slot pool: the "
            "pager's fixed overhead plus MLX activations, KV cache and allocator slack.",
            "Routing: a random token stream is fed (teacher forcing), so routing is random; "
            "real routers have locality and hit more. tokens compared = per-step argmax.",
            "read ms/tok: host time stalled on reads; sync ms/tok: host time blocked reading "
            "indices back, which includes waiting for the computation up to each router (not "
            "overhead by itself: see side_by_side.overhead_readback_pct).",
        ],
    }
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
