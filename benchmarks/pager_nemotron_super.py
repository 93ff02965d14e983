"""Nemotron 3 Super 120B-A12B shapes, experts paged under a 17 GB budget vs fully resident.

For the NVIDIA machine (MLX's CUDA backend); `--small` runs a scaled-down copy anywhere.

build: random weights at the default role widths (dense 4-bit, routed 2-bit, shared 8-bit),
    written directly in the converted format on local disk, streaming (the real config from
    tests/data/configs; 88 layers, 40 MoE layers x 512 experts of 1.72 MB: 35.2 GB of
    experts, 40.7 GB in all).
run: greedy decode of the same prompt
    1. paged, page cache warm (the expert files were just written and fit in RAM),
    2. paged, cold: every record's pages dropped before the run and after each read
       (posix_fadvise DONTNEED), so every miss reads the disk,
    3. paged, warm, with `async_eval` (each layer's experts start computing at once),
    4. fully resident (`loader.load`),
    reporting tok/s, hit rate, bytes read per token, read bandwidth (bytes / time stalled
    on reads), host time on index read-backs, peak GPU memory (mx.get_peak_memory) and RSS,
    and whether the paged tokens equal the resident ones (the token lists are kept, with the
    index of the first differing token and the length of the equal prefix).

    python benchmarks/pager_nemotron_super.py build --workdir /var/tmp/rq-super
    python benchmarks/pager_nemotron_super.py run --workdir /var/tmp/rq-super --out $OUT/x.json

On the H200 machine (no network, 64 GiB disk, nothing of MLX installed): the MLX CUDA wheel
(mlx-cuda-13 0.32.4, 90 MB) is over one call's 64 MiB, so it travels in two halves (`split
-b 46M`) in two back-to-back calls while the machine stays warm, then mlx, mlx-cuda-13 and
mlx-lm install with `pip --target /tmp/site`; the image has their other dependencies. Disk:
40.7 GB for the model. Time: build ~3-6 min, run ~4-5 min (estimates).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = "nemotron-3-super-120b-a12b"
BUDGET_GB = 17.0
PROMPT_LEN = 16
WARMUP = 4


def config(small: bool) -> dict:
    from app.engine.sizes import load_config

    cfg, _, _ = load_config(CONFIG)
    cfg = {k: v for k, v in cfg.items() if k not in ("auto_map", "architectures")}
    if small:  # same kinds of layers, a few of each, 64 experts: runs on a laptop CPU
        cfg.update(
            hybrid_override_pattern="MEM*EMEME",
            num_hidden_layers=9,
            hidden_size=512,
            n_routed_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=256,
            moe_latent_size=128,
            moe_shared_expert_intermediate_size=512,
            intermediate_size=256,
            mamba_num_heads=16,
            mamba_head_dim=32,
            num_attention_heads=8,
            vocab_size=4096,
            n_groups=2,
            ssm_state_size=32,
        )
    return cfg


def machine() -> dict:
    import mlx.core as mx
    import psutil

    d = {
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "mlx": mx.__version__,
        "cuda": bool(mx.cuda.is_available()),
        "metal": bool(mx.metal.is_available()),
    }
    if d["cuda"] or d["metal"]:
        try:
            d["device"] = mx.device_info()
        except Exception:  # older MLX: no device_info
            pass
    return json.loads(json.dumps(d, default=str))


def probe() -> None:
    """2-bit gather_qmm on this backend equals the CPU's: fail fast, before building."""
    import mlx.core as mx

    w = mx.random.normal((8, 256, 512), key=mx.random.key(0))
    q, s, b = mx.quantize(w, 64, 2)
    x = mx.random.normal((3, 1, 1, 512), key=mx.random.key(1))
    idx = mx.array([[1, 5], [0, 7], [3, 3]], dtype=mx.uint32)
    args = dict(rhs_indices=idx, transpose=True, group_size=64, bits=2)
    gpu = mx.gather_qmm(x, q, s, b, **args)
    cpu = mx.gather_qmm(x, q, s, b, stream=mx.cpu, **args)
    err = (mx.abs(gpu - cpu).max() / mx.abs(cpu).max()).item()
    print(f"probe: 2-bit gather_qmm on {mx.default_device()} vs cpu, max rel err {err:.2e}")
    if err > 1e-2:
        raise SystemExit("2-bit gather_qmm disagrees with the CPU on this backend")


def fstype(path: Path) -> str:
    """Filesystem type under `path` (tmpfs would make the cold-cache run meaningless)."""
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            mnt, fs = line.split()[1], line.split()[2]
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fs
    except OSError:
        pass
    return kind


def build(folder: Path, small: bool) -> dict:
    from app.engine.sizes import sizes_for
    from app.engine.testing.synth import write_random_converted

    cfg = config(small)
    if not small:
        need = sizes_for(ROOT / "tests" / "data" / "configs" / f"{CONFIG}.json").total_bytes
        free = shutil.disk_usage(folder.parent if folder.parent.exists() else "/").free
        print(f"need {need / 1e9:.1f} GB on disk, {free / 1e9:.1f} GB free")
        if free < need * 1.02 + (1 << 30):
            raise SystemExit(
                f"not enough disk at {folder.parent}: {free / 1e9:.1f} GB free, "
                f"{need / 1e9:.1f} GB needed"
            )
    folder.parent.mkdir(parents=True, exist_ok=True)
    fs = fstype(folder.parent.resolve())
    print(
        f"workdir {folder.parent} on {fs}"
        + ("  (RAM-backed: the cold run reads no disk)" if fs == "tmpfs" else "")
    )
    t0, last = time.perf_counter(), [0.0]

    def progress(item, done, total):
        if done / total - last[0] >= 0.05 or done == total:
            last[0] = done / total
            el = time.perf_counter() - t0
            print(
                f"  {done / 1e9:6.1f} / {total / 1e9:.1f} GB  {el:6.0f} s  "
                f"{done / max(el, 1e-9) / 1e9:.2f} GB/s  {item}",
                flush=True,
            )

    man = write_random_converted(cfg, folder, seed=0, progress=progress)
    secs = time.perf_counter() - t0
    print(f"built {folder} ({man.total_bytes / 1e9:.1f} GB) in {secs:.0f} s")
    return {"seconds": secs, "bytes": man.total_bytes, "filesystem": fs}


def _prompt():
    import mlx.core as mx
    import numpy as np

    return mx.array(np.random.default_rng(3).integers(3, 4000, PROMPT_LEN).tolist())


def _decode(model, n: int) -> dict:
    """Greedy decode: prompt time, then WARMUP tokens, then n timed tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    toks, t0, t_first = [], time.perf_counter(), None
    pager = getattr(model, "rq_pager", None)
    prefill = None
    for tok, _ in generate_step(_prompt(), model, max_tokens=WARMUP + n):
        toks.append(int(tok))
        if len(toks) == 1:
            t_first = time.perf_counter() - t0
            prefill = pager.stats() if pager is not None else None
        if len(toks) == WARMUP:
            if pager is not None:
                pager.reset_stats()
            t0 = time.perf_counter()
    secs = time.perf_counter() - t0
    mx.synchronize()
    out = {
        "tokens": toks,
        "first_token_s": t_first,
        "decode_tps": n / secs,
        "ms_per_token": 1000 * secs / n,
    }
    if pager is not None:
        s = pager.stats()
        out.update(
            hit_rate=s["hit_rate"],
            bytes_read_per_token=s["bytes_read"] / n,
            reads_per_token=s["reads"] / n,
            read_ms_per_token=1000 * s["read_s"] / n,
            readback_ms_per_token=1000 * s["readback_s"] / n,
            read_GBps=s["bytes_read"] / s["read_s"] / 1e9 if s["read_s"] else None,
            evictions_per_token=s["evictions"] / n,
            slots=s["slots"],
            pool_bytes=s["pool_bytes"],
            budget_bytes=s["budget_bytes"],
            expert_bytes=s["expert_bytes"],
            prefill_bytes_read=prefill["bytes_read"] if prefill else None,
            prefill_read_s=prefill["read_s"] if prefill else None,
        )
    return out


def _drop_cache(folder: Path) -> None:
    for f in sorted((folder / "experts").glob("*.bin")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _measure(fn) -> dict:
    import mlx.core as mx
    import psutil

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    t = time.perf_counter()
    out = fn()
    out["peak_memory"] = mx.get_peak_memory()
    out["rss"] = psutil.Process().memory_info().rss
    out["total_s"] = time.perf_counter() - t
    return out


def run(folder: Path, budget: float, n: int, small: bool, save=lambda part: None) -> dict:
    """The four runs; `save(partial)` after each, so a run cut short keeps what it measured."""
    from app.engine.loader import load
    from app.engine.offload import load_paged
    from app.engine.offload.records import ExpertStore

    with ExpertStore(folder) as st:
        eb = st.expert_bytes()
    budget_bytes = int(budget * 1e9) if not small else eb // 2
    res = {}

    def paged(cold: bool, async_eval: bool = False):
        def go():
            if cold:
                _drop_cache(folder)
            t = time.perf_counter()
            lm = load_paged(
                folder, budget_bytes, drop_page_cache=cold, read_threads=8, async_eval=async_eval
            )
            load_s = time.perf_counter() - t
            d = _decode(lm.model, n)
            d["load_s"] = load_s
            lm.model.rq_pager.close()
            return d

        return go

    for name, fn in (
        ("paged_warm_cache", paged(False)),
        ("paged_cold", paged(True)),
        ("paged_warm_cache_async_eval", paged(False, async_eval=True)),
    ):
        res[name] = _measure(fn)
        r = res[name]
        print(
            f"{name}: {r['decode_tps']:.2f} tok/s, hit {r['hit_rate']:.1%}, "
            f"{r['bytes_read_per_token'] / 1e6:.0f} MB read/tok at "
            f"{(r['read_GBps'] or 0):.2f} GB/s, read-back {r['readback_ms_per_token']:.1f} "
            f"ms/tok, peak {r['peak_memory'] / 1e9:.1f} GB, load {r['load_s']:.0f} s",
            flush=True,
        )
        save(res)

    def resident():
        t = time.perf_counter()
        lm = load(folder)
        load_s = time.perf_counter() - t
        d = _decode(lm.model, n)
        d["load_s"] = load_s
        return d

    res["resident"] = _measure(resident)
    r = res["resident"]
    print(
        f"resident: {r['decode_tps']:.2f} tok/s, peak {r['peak_memory'] / 1e9:.1f} GB, "
        f"load {r['load_s']:.0f} s",
        flush=True,
    )
    ref = res["resident"]["tokens"]
    for k in ("paged_warm_cache", "paged_cold", "paged_warm_cache_async_eval"):
        res[k].update(compare_tokens(res[k]["tokens"], ref))
        res[k]["speed_vs_resident"] = res[k]["decode_tps"] / r["decode_tps"]
        print(
            f"{k}: first mismatch {res[k]['first_mismatch']}, "
            f"{res[k]['tokens_matching']} / {len(ref)} tokens equal"
        )
    return {"expert_bytes": eb, "budget_bytes": budget_bytes, **res}


def compare_tokens(got: list[int], ref: list[int]) -> dict:
    """Where `got` leaves `ref`: index of the first differing token (None: equal)."""
    n = 0
    while n < min(len(got), len(ref)) and got[n] == ref[n]:
        n += 1
    same = n == len(got) == len(ref)
    return {
        "identical_to_resident": same,
        "first_mismatch": None if same else n,
        "tokens_matching": n,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("phase", choices=("build", "run", "all"))
    ap.add_argument("--workdir", default="/var/tmp/rq-super")
    ap.add_argument("--budget-gb", type=float, default=BUDGET_GB)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="scaled-down shapes (CPU check)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    folder = Path(a.workdir) / ("nemotron-super-small" if a.small else "nemotron-super")
    result = {
        "machine": machine(),
        "model": CONFIG + (" (small)" if a.small else ""),
        "settings": {
            "prompt_tokens": PROMPT_LEN,
            "warmup_tokens": WARMUP,
            "timed_tokens": a.tokens,
            "budget_gb": a.budget_gb,
            "batch": 1,
            "sampler": "greedy",
            "widths": "dense 4, routed 2, shared 8",
        },
    }
    if a.phase in ("build", "all"):
        import mlx.core as mx

        if mx.cuda.is_available() or mx.metal.is_available():
            probe()
        result["build"] = build(folder, a.small)
    if a.phase in ("run", "all"):
        result["filesystem"] = fstype(folder.resolve())
        out = (
            Path(a.out)
            if a.out
            else (
                ROOT
                / "benchmarks"
                / "results"
                / (
                    "pager_nemotron_super_small.json"
                    if a.small
                    else "pager_nemotron_super_h200.json"
                )
            )
        )

        def save(part, done=False):
            result["run"] = part if done else {"partial": True, **part}
            out.write_text(json.dumps(result, indent=2, default=str) + "\n")

        save(run(folder, a.budget_gb, a.tokens, a.small, save=save), done=True)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
