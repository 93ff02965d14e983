"""Expert pager: decode speed against the fraction of experts resident.

Model: Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of width 768, top-8, 151,936-token
vocabulary) with fewer layers, random weights written directly in the converted format at the
default role widths (dense 4-bit, routed 2-bit: 1.47 MB per expert record). Random routers
route nearly uniformly: no temporal locality, so this is the pager's hard case.

1. Side by side in one process, interleaved trials: the plain resident model
   (`load_converted`), the pager with every expert resident (no index read-back), and the same
   with the read-back forced on every MoE layer (`always_resolve`): the overhead at 100%
   residency and the cost of reading indices back to the host.
2. One fresh subprocess per resident fraction (100% ... 10%): decode tok/s, hit rate, bytes
   read per token, host time stalled on reads and on read-backs, peak RSS (psutil, sampled),
   and whether the tokens equal the plain model's. Reads come from the OS page cache (the
   file fits in RAM) unless `cold`: then each record's pages are dropped after it is read
   (posix_fadvise DONTNEED), so every miss goes to the disk.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/pager.py            # --layers 8 --tokens 48 --trials 3
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_30B_SHAPE = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "rms_norm_eps": 1e-6, "vocab_size": 151936,
    "rope_theta": 1e6, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "norm_topk_prob": True,
}
FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.1)
COLD = (0.5, 0.1)
PROMPT_LEN = 4  # short: CPU quantized matmuls over many (token, expert) pairs are slow
WARMUP = 6  # decode tokens before timing: the LRU reaches its steady state


def machine() -> dict:
    import mlx.core as mx
    import psutil

    return {"platform": platform.platform(), "cpu": platform.machine(),
            "cores": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "mlx": mx.__version__, "backend": "cpu" if not (
                mx.metal.is_available() or mx.cuda.is_available()) else "gpu"}


def config(layers: int, vocab: int) -> dict:
    return dict(QWEN3_30B_SHAPE, num_hidden_layers=layers, vocab_size=vocab)


def build(folder: Path, cfg: dict, widths: str):
    from app.engine.manifest import Manifest
    from app.engine.offload.synth import write_random_converted
    from app.engine.quant.widths import RoleWidths

    man = Manifest.load(folder) if folder.exists() else None
    want = {"config": cfg, "widths": widths}
    if man is None or man.extra.get("bench_config") != want:
        t = time.perf_counter()
        man = write_random_converted(cfg, folder, RoleWidths.parse(widths), seed=0)
        man.extra["bench_config"] = want
        man.extra["build_seconds"] = round(time.perf_counter() - t, 1)
        man.save(folder)
    return man


def expert_bytes(folder: Path) -> int:
    from app.engine.offload.records import ExpertStore

    with ExpertStore(folder) as st:
        return sum(sum(t.nbytes for t in st.layout(x).tensors) * st.layout(x).num_experts
                   for x in st.layers)


def prompt():
    import mlx.core as mx
    import numpy as np

    return mx.array(np.random.default_rng(1).integers(0, 1000, PROMPT_LEN).tolist())


def decode(model, n: int) -> tuple[list[int], float]:
    """Greedy tokens and the seconds of decode after WARMUP tokens (prefill excluded)."""
    from mlx_lm.generate import generate_step

    toks, t0 = [], None
    for tok, _ in generate_step(prompt(), model, max_tokens=WARMUP + n):
        toks.append(int(tok))
        if len(toks) == WARMUP:
            if hasattr(model, "rq_pager"):
                model.rq_pager.reset_stats()
            t0 = time.perf_counter()
    return toks, time.perf_counter() - t0


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
    dense = sum(v.nbytes for _, v in __import__("mlx.utils", fromlist=["x"]).tree_flatten(
        lm.model.parameters()))
    return {
        "fraction": frac, "cold": cold, "tokens": toks, "decode_tps": n / secs,
        "ms_per_token": 1000 * secs / n,
        "hit_rate": s["hit_rate"], "bytes_read_per_token": s["bytes_read"] / n,
        "reads_per_token": s["reads"] / n,
        "read_ms_per_token": 1000 * s["read_s"] / n,
        "readback_ms_per_token": 1000 * s["readback_s"] / n,
        "read_GBps": s["bytes_read"] / s["read_s"] / 1e9 if s["read_s"] else None,
        "readbacks_per_token": s["readbacks"] / n, "evictions_per_token": s["evictions"] / n,
        "slots": s["slots"], "pool_bytes": s["pool_bytes"], "budget_bytes": s["budget_bytes"],
        "dense_bytes": dense, "load_s": load_s, "base_rss": base_rss,
        "rss_after_load": rss_loaded, "peak_rss": peak.peak,
        "overhead_rss": peak.peak - base_rss - dense - s["pool_bytes"],
        "mlx_peak": mx.get_peak_memory(),
    }


def side_by_side(folder: Path, n: int, trials: int) -> dict:
    """Plain vs all-resident pager vs all-resident with read-back, interleaved."""
    from app.engine.offload import load_paged
    from app.engine.quant.converted import load_converted

    eb = expert_bytes(folder)
    models = {"plain": load_converted(folder).model,
              "paged_full": load_paged(folder, eb).model,
              "paged_full_readback": load_paged(folder, eb, always_resolve=True).model}
    times = {k: [] for k in models}
    tokens = {}
    for k, m in models.items():  # warm-up
        tokens[k] = decode(m, 4)[0]
    for _ in range(trials):
        for k, m in models.items():
            toks, secs = decode(m, n)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768,
                    help="smaller than Qwen3's 151,936: the lm_head is not what is measured")
    ap.add_argument("--widths", default="", help="role widths, e.g. routed=float (default: "
                    "the app's: dense 4, routed 2, shared 8)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--workdir", default=os.environ.get("RQ_BENCH_DIR", "/tmp/rq-pager-bench"))
    ap.add_argument("--child", type=float, default=None)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pager.json"))
    a = ap.parse_args()
    cfg = config(a.layers, a.vocab)
    tag = a.widths.replace("=", "").replace(",", "-").replace("/", "g") or "default"
    folder = Path(a.workdir) / f"qwen3-30b-shape-{a.layers}L-{a.vocab}v-{tag}"
    if a.child is not None:
        print(json.dumps(child(folder, a.child, a.tokens, a.cold)))
        return
    t = time.perf_counter()
    man = build(folder, cfg, a.widths)
    print(f"model: {folder} ({man.total_bytes / 1e9:.2f} GB, experts "
          f"{expert_bytes(folder) / 1e9:.2f} GB; built in {time.perf_counter() - t:.0f} s)")
    sbs = side_by_side(folder, a.tokens, a.trials)
    print(f"side by side ({a.trials} trials, {a.tokens} tokens, best): " + ", ".join(
        f"{k} {v:.1f} ms/tok" for k, v in sbs["best_ms_per_token"].items()))
    print(f"overhead at 100% residency: {sbs['overhead_full_residency_pct']:+.2f}%  "
          f"(with index read-back: {sbs['overhead_readback_pct']:+.2f}%)  "
          f"identical tokens: {sbs['identical_tokens']}")
    runs = []
    for frac, cold in [(f, False) for f in FRACTIONS] + [(f, True) for f in COLD]:
        cmd = [sys.executable, __file__, "--layers", str(a.layers), "--tokens", str(a.tokens),
               "--vocab", str(a.vocab), "--widths", a.widths, "--workdir", a.workdir,
               "--child", str(frac)] + (["--cold"] if cold else [])
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1])
        r["identical_to_plain"] = r.pop("tokens") == sbs["plain_tokens"][:WARMUP + a.tokens]
        runs.append(r)
    hdr = (f"{'resident':>8} {'cold':>5} {'tok/s':>7} {'hit':>6} {'MB read/tok':>11} "
           f"{'read ms/tok':>11} {'sync ms/tok':>11} {'GB/s':>6} {'peak RSS':>9} "
           f"{'over':>8} {'same':>5}")
    print(hdr)
    for r in runs:
        gbps = f"{r['read_GBps']:.2f}" if r["read_GBps"] else "-"
        print(f"{r['fraction']:>8.0%} {str(r['cold']):>5} {r['decode_tps']:>7.2f} "
              f"{r['hit_rate']:>6.1%} {r['bytes_read_per_token'] / 1e6:>11.1f} "
              f"{r['read_ms_per_token']:>11.1f} {r['readback_ms_per_token']:>11.1f} "
              f"{gbps:>6} {r['peak_rss'] / 2**30:>8.2f}G "
              f"{r['overhead_rss'] / 2**20:>7.0f}M {str(r['identical_to_plain']):>5}")
    sbs.pop("plain_tokens")
    result = {
        "machine": machine(),
        "model": {"shape": "Qwen3-30B-A3B dims", "layers": a.layers, "vocab": a.vocab,
                  "total_bytes": man.total_bytes, "expert_bytes": expert_bytes(folder),
                  "widths": man.extra.get("widths"), "weights": "random (synth)"},
        "settings": {"prompt_tokens": PROMPT_LEN, "warmup_tokens": WARMUP,
                     "timed_tokens": a.tokens, "trials": a.trials, "batch": 1,
                     "sampler": "greedy"},
        "overhead_full_residency_pct": sbs["overhead_full_residency_pct"],
        "side_by_side": sbs,
        "fractions": runs,
        "notes": [
            "Reads with cold=false come from the OS page cache (the expert file fits in RAM);"
            " cold=true drops each record's pages after reading it (posix_fadvise), so every"
            " miss reads the disk.",
            "overhead_rss = peak RSS - RSS before load - dense weights - slot pool: the "
            "pager's fixed overhead plus MLX activations, KV cache and allocator slack.",
            "Random routers route uniformly: hit rate ~ resident fraction; real routers have "
            "locality.",
        ],
    }
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
