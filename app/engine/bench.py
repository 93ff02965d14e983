"""Generation benchmark shared by `rotaryquant bench` and benchmarks/generate.py."""

from __future__ import annotations

import platform
import statistics
import time

import mlx.core as mx

from .generate import Engine, Finished, GenerationSettings

FILLER = (
    "The history of the printing press begins in the fifteenth century, when movable type made "
    "books cheaper and faster to produce than ever before. "
)


def machine() -> dict:
    import psutil

    from .backend import detect

    b = detect()
    return {
        "backend": b.name,
        "device": b.device,
        "cpu_count": psutil.cpu_count(logical=True),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "mlx": mx.__version__,
    }


def bench_generate(
    engine: Engine,
    prompt_tokens: int = 256,
    gen_tokens: int = 64,
    trials: int = 3,
    kv_mode: str = "fp16",
    progress=None,
) -> dict:
    """Prompt and decode tok/s and peak memory, median over `trials` after one warm-up.
    `progress(run, runs)` is called before each run (run 0 is the warm-up)."""
    ids = engine.encode_text(FILLER * (prompt_tokens // 20 + 2))[:prompt_tokens]
    settings = GenerationSettings(max_tokens=gen_tokens, kv_mode=kv_mode)
    # Force exactly gen_tokens decode steps: mask end-of-sequence out of the sampler's reach
    # by benchmarking the raw token stream (eos still stops, which the record reports).
    runs = []
    pager = getattr(engine.loaded.model, "rq_pager", None) if engine.loaded else None
    for i in range(trials + 1):
        if progress is not None:
            progress(i, trials)
        fin = None
        if pager is not None:  # the last trial's paging figures are reported
            pager.reset_stats()
        for ev in engine.generate(ids, settings):
            if isinstance(ev, Finished):
                fin = ev
        if i > 0:  # the first run warms up kernels and allocations
            runs.append(fin)
    return {
        "kv_mode": kv_mode,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": statistics.median(r.generated_tokens for r in runs),
        "prompt_tps": statistics.median(r.prompt_tps for r in runs),
        "decode_tps": statistics.median(r.decode_tps for r in runs),
        "peak_memory_bytes": max(r.peak_memory for r in runs),
        "kv_bytes": max(r.kv_bytes for r in runs),
        "trials": trials,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **({"pager": pager_summary(pager.stats())} if pager is not None else {}),
    }


def pager_summary(s: dict) -> dict:
    """Hit rate, read MB/s and ms per token by part of one run (the pager's stats)."""
    n = s.get("tokens") or 0
    return {
        "hit_rate": s["hit_rate"],
        "read_path": s.get("read_path"),  # how misses reach the slots (ExpertPager.read_path)
        "read_MBps": s.get("read_MBps"),
        "ms_per_token": s.get("ms_per_token"),
        "host_ms_per_token": s.get("host_parts"),  # the pager's host work by part
        "MB_read_per_token": s["bytes_read"] / n / 1e6 if n else None,
    }
