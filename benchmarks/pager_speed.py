"""Paged decode speed against resident, with the per-token breakdown and the pread bound.

Every row: one model shape, routing (trace | random), expert budget, page cache (warm |
cold), paged and resident tok/s side by side in one process, hit rate, ms per token by part,
the pager's read GB/s and the parallel-pread bound of the same record files in the same run.

Breakdown (ms per token; the parts sum to the paged step):
    reads      host stalled reading misses (preadv, CRC on a record's first read, copies)
    readbacks  host blocked on the router's indices and on the token's output, less `compute`
    host       the rest of the host's time: Python building the graph, pager bookkeeping
    compute    device time of the same step, from the resident model run unpipelined
               (graph built first, then one eval: the eval's wait)

Modes:
  --mode cpu (default; CPU, unified memory): Nemotron 3 Super's expert records (fc1/fc2
      2688x1024 at 2-bit: 1.72 MB, 512 experts, 22 a token) in 4 MoE layers, and little
      compute: each layer's step gathers its experts' fc1 scales from the slots (the pager's
      whole path: read-back, pins, reads, slot remap, a gather from slot memory), so host
      costs show. Budgets 10/25/50% x trace/random, warm; 25% cold; the landed pager
      (CRC on every read) beside the current one.
  --mode gpu (the H200; ~7 min): Qwen3-30B-A3B shapes (48 layers, real vocab) at 50% and 100%
      budget, warm; Nemotron 3 Super shapes with 22 of its 88 layers (the real pattern's first
      22: 10 MoE layers x 512 experts, the same per-layer shapes) at 17 GB x 10/40 = 4.25 GB
      (the same 48% of experts), warm and cold; trace and random routing; the resident model
      run twice (its own run-to-run spread) beside the paged one. A Super row's
      `full_model_tps_est` scales its step time by 88/22 layers.
  --small: the gpu mode's rows at tiny shapes (to test it on a CPU).

    python benchmarks/pager_speed.py                    # -> benchmarks/results/pager_speed.json
    python benchmarks/pager_speed.py --mode gpu --workdir /var/tmp/rq-speed --out $OUT/pager_speed_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from app.engine.testing.shapes import QWEN3_30B_A3B  # noqa: E402

SUPER = "nemotron-3-super-120b-a12b"
SUPER_RECORDS = {"fc1": (2688, 1024), "fc2": (1024, 2688)}  # (out, in): latent 1024 -> 2688
SUPER_K, SUPER_EXPERTS, SUPER_MOE_LAYERS, SUPER_LAYERS = 22, 512, 40, 88
SUPER_BUDGET = 17e9
QWEN3 = QWEN3_30B_A3B
PROMPT = 4
T0 = time.perf_counter()
READ_PATH: dict = {}  # cpu mode: the read path's variants side by side
SAVE: list = [lambda: None]  # writes the JSON (after the read path, before any row)
COMMIT = "unknown"  # of this run: every row carries it (merged rows carry theirs)
DROPPED = [False]  # a cold row dropped the record files from the page cache since
VARIANTS: list = [("current", {})]  # gpu mode: (name, load_paged options) of paged rows


def machine_name() -> str:
    import mlx.core as mx

    if mx.cuda.is_available() or mx.metal.is_available():
        try:
            return str(mx.device_info().get("device_name", "gpu"))
        except Exception:
            return "gpu"
    return f"cpu {platform.machine()} x{os.cpu_count()}"


# -- rows ---------------------------------------------------------------------------------
# a row's identity: one current row per key in the JSON (older runs live in git history)
KEY = ("machine", "model", "routing", "budget_fraction", "cache")
# what a row keeps of another read-path variant measured beside it in the same run
VARIANT_FIELDS = (
    "paged_tps",
    "hit_rate",
    "ms_per_token",
    "read_GBps",
    "misses_per_token",
    "MB_read_per_token",
    "host_parts_ms_per_token",
    "full_model_tps_est",
    "zero_copy",
    "device_copy",
    "invalid",
    "commit",
)


def row_key(r: dict) -> tuple:
    return tuple(r[k] for k in KEY)


def add_row(rows: list[dict], r: dict) -> None:
    """Add `r` to one run's rows: a second variant of a key already there (the same run's
    other read path) goes under that row's `variants`; the same variant again replaces it."""
    for i, x in enumerate(rows):
        if row_key(x) != row_key(r):
            continue
        if x.get("variant", "current") == r.get("variant", "current"):
            rows[i] = {**r, **({"variants": x["variants"]} if "variants" in x else {})}
        else:
            v = x.setdefault("variants", {})
            v[r.get("variant", "current")] = {k: r[k] for k in VARIANT_FIELDS if k in r}
        return
    rows.append(r)


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """`new` rows replace the `old` rows of the same key (never appended beside them)."""
    mine = {row_key(x) for x in new}
    return [x for x in old if row_key(x) not in mine] + new


# -- disk ---------------------------------------------------------------------------------
def drop_page_cache(store) -> None:
    """Drop the record files' pages from the OS page cache (cold runs)."""
    DROPPED[0] = True
    for layer in store.layers:
        fd = os.open(store.folder / store.layout(layer).file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(store) -> None:
    """Read the record files through once so a warm row after a cold one starts warm (only
    after a cold row dropped them: written or read just before, they are in the cache)."""
    from concurrent.futures import ThreadPoolExecutor

    if not DROPPED[0]:
        return
    DROPPED[0] = False

    def read(layer):
        path = store.folder / store.layout(layer).file
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(64 << 20)
            while f.readinto(buf):
                pass

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(read, store.layers))


def pread_bound(
    store, cold: bool, records: int, threads=(1, 2, 4, 8, 16), seed: int = 5, ring: int = 64
) -> dict:
    """GB/s of parallel preadv of whole random records of these files, no CRC: what the disk
    or page cache gives this process. Destinations rotate over `ring` records' worth of
    touched memory (like slots: one buffer reused would stay in the CPU cache)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    rng = np.random.default_rng(seed)
    layers = store.layers
    lays = {x: store.layout(x) for x in layers}
    fds = {x: os.open(store.folder / lays[x].file, os.O_RDONLY) for x in layers}
    picks = [
        (int(rng.choice(layers)), int(rng.integers(lays[layers[0]].num_experts)))
        for _ in range(records)
    ]
    size = max(lay.record_size for lay in lays.values())
    dst = np.ones((max(ring, max(threads)), size), np.uint8)  # touched: no first-write faults
    views = [memoryview(d) for d in dst]
    out = {}

    def read(i):
        x, e = picks[i]
        lay = lays[x]
        os.preadv(fds[x], [views[i % len(views)][: lay.record_size]], lay.record_offset(e))
        if cold:
            os.posix_fadvise(fds[x], lay.record_offset(e), lay.stride, os.POSIX_FADV_DONTNEED)

    try:
        for n in threads:
            if cold:
                drop_page_cache(store)
            else:  # warm: the records are in the page cache first
                for i in range(records):
                    read(i)
            t = time.perf_counter()
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(read, range(records)))  # i % ring: no two in flight share one
            secs = time.perf_counter() - t
            out[n] = sum(lays[x].record_size for x, _ in picks) / secs / 1e9
    finally:
        for fd in fds.values():
            os.close(fd)
    best = max(out, key=out.get)
    return {"GBps": out[best], "threads": best, "by_threads": out, "records": records}


# -- records alone, little compute (cpu mode) ---------------------------------------------
def records_store(workdir: Path, layers: int):
    from app.engine.offload.records import ExpertStore
    from app.engine.testing.synth import write_random_experts

    folder = workdir / f"super-records-{layers}L"
    meta = folder / "experts.json"
    if not meta.exists():
        t = time.perf_counter()
        write_random_experts(folder, layers, SUPER_EXPERTS, SUPER_RECORDS)
        print(f"wrote {layers} layers of Super records in {time.perf_counter() - t:.0f} s")
    return ExpertStore(folder, json.loads(meta.read_text()))


def records_decode(pager, streams: dict, n: int, warmup: int) -> dict:
    """Each layer: indices (depending on the last layer's output) -> route -> a gather of the
    routed slots' fc1 scales, reduced into the running state; one eval a token."""
    import mlx.core as mx

    layers = pager.store.layers
    h = mx.zeros((1,), dtype=mx.float32)
    mx.eval(h)
    wait = 0.0
    t0 = time.perf_counter()
    for t in range(warmup + n):
        if t == warmup:
            pager.reset_stats()
            wait, t0 = 0.0, time.perf_counter()
        for layer in layers:
            idx = mx.array(streams[layer][t][None].astype("uint32")) + (h > 1e30).astype(mx.uint32)
            r = pager.route(layer, idx)
            sc = pager.arrays(layer)["fc1.scales"][r.slot_idx]  # [1, k, 2688, 16]
            h = h + sc.astype(mx.float32).mean()
            pager.track(h)
        tw = time.perf_counter()
        mx.eval(h)
        wait += time.perf_counter() - tw
    return {
        "seconds": time.perf_counter() - t0,
        "wait_s": wait,
        "n": n,
        "stats": pager.stats(),
        "out": h.item(),
        "threads": pager.options.read_threads,
    }


def streams_for(store, mode: str, steps: int, seed: int = 0) -> dict:
    from pager_routing import expert_stream

    return {
        x: expert_stream(mode, store.layout(x).num_experts, SUPER_K, steps, seed * 7 + x)
        for x in store.layers
    }


def breakdown(n: int, seconds: float, stats: dict, wait_s: float, compute_s: float) -> dict:
    """ms per token: reads, readbacks (beyond compute), host, compute (see the docstring)."""
    reads = stats["read_s"] / n
    blocked = (stats["readback_s"] + wait_s) / n
    c = compute_s / n
    return {
        "reads": 1000 * reads,
        "readbacks": 1000 * max(0.0, blocked - c),
        "host": 1000 * (seconds / n - reads - blocked),
        "compute": 1000 * c,
    }


def row(
    machine: str,
    model: str,
    routing: str,
    frac: float,
    cache: str,
    paged: dict,
    resident_tps: float | None,
    compute_s: float,
    bound: dict,
    **extra,
) -> dict:
    s, n = paged["stats"], paged["n"]
    return {
        "machine": machine,
        "model": model,
        "routing": routing,
        "budget_fraction": frac,
        "cache": cache,
        "paged_tps": n / paged["seconds"],
        "resident_tps": resident_tps,
        "hit_rate": s["hit_rate"],
        "ms_per_token": breakdown(n, paged["seconds"], s, paged["wait_s"], compute_s),
        # None on the device route: its copies run inside the kernel (miss_ms_per_token)
        "read_GBps": s["bytes_read"] / s["read_s"] / 1e9 if s["read_s"] else None,
        "pread_bound_GBps": bound["GBps"],
        "pread_bound_threads": bound["threads"],
        "read_threads": paged["threads"],
        "misses_per_token": s["misses"] / n,
        "MB_read_per_token": s["bytes_read"] / n / 1e6,
        "pager_ms_per_token": s.get("ms_per_token"),  # the pager's own clock (stats.per_token)
        "host_parts_ms_per_token": s.get("host_parts"),  # the host's work by part (pager timers)
        "read_path": s.get("read_path"),
        **extra,
    }


def read_path(
    store,
    bound: dict,
    threads: int,
    reps: int = 3,
    calls: int = 8,
    zero_copy: bool = False,
    device_copy: bool = False,
) -> dict:
    """GB/s of the pager's own read path (preadv into slots, CRC, bookkeeping of a call's
    misses: 22 records at a time), warm page cache, interleaved: the landed path (CRC on every
    read) vs the current one once records were checked (CRC only on a first read) vs no CRC."""
    import mlx.core as mx
    import numpy as np

    from app.engine.offload.pager import ExpertPager, PagerOptions

    variants = {
        "crc_every_read": PagerOptions(read_threads=threads, verify_every_read=True),
        "crc_first_read_only": PagerOptions(read_threads=threads),
        "no_crc": PagerOptions(read_threads=threads, verify=False),
    }
    if zero_copy:  # CUDA: preadv into the slots' memory, beside host staging
        variants["zero_copy_first_read_only"] = PagerOptions(read_threads=threads, zero_copy=True)
    if device_copy:  # CUDA: pinned staging copied by the driver (beside MLX's copy + scatter)
        variants["crc_first_read_only"] = PagerOptions(read_threads=threads, device_copy=False)
        variants["crc_every_read"] = PagerOptions(
            read_threads=threads, device_copy=False, verify_every_read=True
        )
        variants["no_crc"] = PagerOptions(read_threads=threads, verify=False, device_copy=False)
        variants["device_copy_first_read_only"] = PagerOptions(
            read_threads=threads, pin_records=False
        )
        variants["pinned_first_read_only"] = PagerOptions(read_threads=threads, pin_records=True)
    pagers = {k: ExpertPager(store, store.expert_bytes() // 4, o) for k, o in variants.items()}
    rng = np.random.default_rng(3)
    layer = store.layers[0]
    lay = store.layout(layer)
    todo = [
        [(int(e), s) for s, e in enumerate(rng.choice(lay.num_experts, SUPER_K, replace=False))]
        for _ in range(calls)
    ]
    for batch in todo:  # every record read (and checked) once: page cache warm, CRCs known
        for p in pagers.values():
            p._read_into(p.pool_of[layer], layer, batch)
    mx.eval([a for p in pagers.values() for a in p.pool_of[layer].storage.values()])
    fd = os.open(store.folder / lay.file, os.O_RDONLY)
    ring = np.ones((calls * SUPER_K, lay.record_size), np.uint8)  # touched, like slots
    views = [memoryview(r) for r in ring]

    def raw(batch, base):  # the same records, bare preadv on the same thread count
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads) as ex:
            list(
                ex.map(
                    lambda i: os.preadv(fd, [views[base + i]], lay.record_offset(batch[i][0])),
                    range(len(batch)),
                )
            )

    secs = {k: [] for k in variants}
    secs["raw_preadv"] = []
    for _ in range(reps):
        t = time.perf_counter()
        for c, batch in enumerate(todo):
            raw(batch, c * SUPER_K)
        secs["raw_preadv"].append(time.perf_counter() - t)
        for k, p in pagers.items():
            t = time.perf_counter()
            for batch in todo:
                p._read_into(p.pool_of[layer], layer, batch)
            mx.eval(list(p.pool_of[layer].storage.values()))  # staged copies land (lazy scatter)
            secs[k].append(time.perf_counter() - t)
    for p in pagers.values():
        p.close()
    os.close(fd)
    nbytes = calls * SUPER_K * lay.record_size
    out = {k: nbytes / min(v) / 1e9 for k, v in secs.items()}
    out["bound_GBps"] = bound["GBps"]
    out["read_threads"] = threads
    return out


def cpu_mode(a, emit) -> None:
    from app.engine.offload.pager import ExpertPager, PagerOptions

    store = records_store(Path(a.workdir), a.layers)
    machine = machine_name()
    steps = a.warmup + a.tokens
    eb = store.expert_bytes()
    bounds = {
        "warm": pread_bound(store, False, a.bound_records),
        "cold": pread_bound(store, True, a.bound_records),
    }
    print(
        "pread bound: "
        + ", ".join(f"{k} {v['GBps']:.2f} GB/s ({v['threads']} threads)" for k, v in bounds.items())
    )
    # the reader count that reads fastest here (0: the warm bound's best)
    current = PagerOptions(read_threads=a.threads or bounds["warm"]["threads"])
    landed = PagerOptions(read_threads=4, verify_every_read=True, policy="lru")
    rp = read_path(store, bounds["warm"], current.read_threads)
    print(
        "read path GB/s (warm): "
        + ", ".join(f"{k} {v:.2f}" for k, v in rp.items() if k.endswith(("read", "only", "crc"))),
        flush=True,
    )
    READ_PATH.update(rp)
    model = f"{SUPER}-records"
    for routing in ("trace", "random"):
        streams = streams_for(store, routing, steps)
        res = ExpertPager(store, eb, current)  # every record resident: no read-back
        r_res = records_decode(res, streams, a.tokens, a.warmup)
        res.close()
        del res
        resident_tps = a.tokens / r_res["seconds"]
        compute_s = r_res["wait_s"]
        for frac in a.fractions:
            caches = ["warm"] + (["cold"] if frac in a.cold else [])
            for cache in caches:
                variants = {"current": current}
                if cache == "warm":
                    variants["landed"] = landed
                for name, opts in variants.items():
                    if cache == "cold":
                        opts = replace(opts, drop_page_cache=True)
                        drop_page_cache(store)
                    else:
                        warm_page_cache(store)
                    pager = ExpertPager(store, int(eb * frac), opts)
                    r = records_decode(pager, streams, a.tokens, a.warmup)
                    pager.close()
                    assert r["out"] == r_res["out"], "paged state differs from resident"
                    emit(
                        row(
                            machine,
                            model,
                            routing,
                            frac,
                            cache,
                            r,
                            resident_tps,
                            compute_s,
                            bounds[cache],
                            variant=name,
                            layers=a.layers,
                            compute="stand-in: gather of the routed slots' fc1 scales",
                        )
                    )


# -- whole models (gpu mode) --------------------------------------------------------------
def super_config(small: bool) -> dict:
    from app.engine.sizes import load_config

    cfg, _, _ = load_config(SUPER)
    cfg = {k: v for k, v in cfg.items() if k not in ("auto_map", "architectures")}
    pat = cfg["hybrid_override_pattern"][:22]  # the real pattern's first 22 layers
    cfg.update(hybrid_override_pattern=pat, num_hidden_layers=len(pat))
    if small:
        cfg.update(
            hybrid_override_pattern="MEM*EME",
            num_hidden_layers=7,
            hidden_size=256,
            n_routed_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=128,
            moe_latent_size=64,
            moe_shared_expert_intermediate_size=256,
            intermediate_size=128,
            mamba_num_heads=8,
            mamba_head_dim=32,
            num_attention_heads=4,
            vocab_size=2048,
            n_groups=2,
            ssm_state_size=16,
        )
    return cfg


def qwen3_config(small: bool) -> dict:
    cfg = dict(QWEN3)
    if small:
        cfg.update(
            num_hidden_layers=3,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_experts=32,
            num_experts_per_tok=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=2048,
        )
    return cfg


def build(folder: Path, cfg: dict):
    from app.engine.manifest import Manifest
    from app.engine.testing.synth import write_random_converted

    man = Manifest.load(folder) if folder.exists() else None
    if man is None or man.extra.get("bench_config") != cfg:
        t = time.perf_counter()
        man = write_random_converted(cfg, folder, seed=0)
        man.extra["bench_config"] = cfg
        man.save(folder)
        print(
            f"built {folder.name} in {time.perf_counter() - t:.0f} s "
            f"({man.total_bytes / 1e9:.1f} GB)",
            flush=True,
        )
    return man


def model_decode(model, n: int, warmup: int, pipelined: bool, logits: bool = False) -> dict:
    """Teacher-forced decode of a fixed random token stream. pipelined: like mlx-lm's
    generate_step (the next step's graph is built while this one computes); else each step
    is built, then evaluated (`wait_s`: the evals' waits = device time)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    toks = np.random.default_rng(1).integers(0, 1000, PROMPT + warmup + n).tolist()
    pager = getattr(model, "rq_pager", None)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([toks[:PROMPT]]), cache=cache)[:, -1])
    out, lg, prev, wait, t0 = [], [], None, 0.0, time.perf_counter()
    for i, t in enumerate(toks[PROMPT:]):
        if i == warmup:
            if prev is not None:
                out.append(prev[0].item())
                prev = None
            if pager is not None:
                pager.reset_stats()
            wait, t0, out, lg = 0.0, time.perf_counter(), [], []
        last = model(mx.array([[t]]), cache=cache)[:, -1]
        y = (mx.argmax(last, axis=-1), last)
        if pipelined:
            mx.async_eval(y)
            if prev is not None:
                tw = time.perf_counter()
                out.append(prev[0].item())
                wait += time.perf_counter() - tw
                if logits:
                    lg.append(np.array(prev[1].astype(mx.float32)))
            prev = y
        else:
            tw = time.perf_counter()
            mx.eval(y)
            wait += time.perf_counter() - tw
            out.append(y[0].item())
            if logits:
                lg.append(np.array(y[1].astype(mx.float32)))
    if prev is not None:
        tw = time.perf_counter()
        out.append(prev[0].item())
        wait += time.perf_counter() - tw
        if logits:
            lg.append(np.array(prev[1].astype(mx.float32)))
    secs = time.perf_counter() - t0
    return {
        "seconds": secs,
        "wait_s": wait,
        "n": n,
        "tokens": out,
        "logits": np.concatenate(lg) if logits else None,
        "stats": pager.stats() if pager is not None else None,
        "threads": pager.options.read_threads if pager is not None else None,
    }


ZERO_COPY_PROBE = r"""
import mlx.core as mx, numpy as np
a = mx.zeros((4, 1 << 20), dtype=mx.uint8)
mx.eval(a)
assert mx.sum(a.astype(mx.uint32)).item() == 0  # used on the device first
mv = memoryview(a).cast("B")
mv[1 << 20:2 << 20] = np.full(1 << 20, 7, np.uint8).tobytes()
ok = mx.sum(a[1].astype(mx.uint32)).item() == 7 << 20 and mx.sum(a[0].astype(mx.uint32)).item() == 0
print("zero-copy-ok" if ok else "zero-copy-wrong")
"""


def zero_copy_works() -> bool:
    """Do host writes through an MLX array's buffer reach the device's computations? Tried
    in a subprocess (a device pointer written from the host would crash this one)."""
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", ZERO_COPY_PROBE], capture_output=True, text=True, timeout=120
    )
    ok = r.returncode == 0 and "zero-copy-ok" in r.stdout
    print(
        f"zero-copy probe: {'ok' if ok else 'no'} (rc {r.returncode}, "
        f"{(r.stdout + r.stderr).strip()[-200:]})",
        flush=True,
    )
    return ok


def spread(a: dict, b: dict) -> dict:
    import numpy as np

    diff = [i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True)) if x != y]
    d = np.abs(a["logits"] - b["logits"])
    return {
        "first_token_diff": diff[0] if diff else None,
        "tokens_equal": len(diff) == 0,
        "max_abs_logit_diff": float(d.max()),
    }


def model_rows(
    a, emit, name: str, folder: Path, fracs: list[float], caches: dict, scale: float | None
) -> None:
    """Resident (twice per routing) and paged rows of one model; `caches`: frac -> caches."""
    import gc

    import mlx.core as mx
    from pager_routing import force_routing

    from app.engine.loader import load as load_converted
    from app.engine.manifest import Manifest
    from app.engine.offload import load_paged
    from app.engine.offload.records import ExpertStore

    man = Manifest.load(folder)
    store = ExpertStore(folder, man.experts)
    eb = store.expert_bytes()
    machine = machine_name()
    bounds = {
        "warm": pread_bound(store, False, a.bound_records),
        "cold": pread_bound(store, True, a.bound_records)
        if any("cold" in c for c in caches.values())
        else None,
    }
    print(f"{name}: pread bound warm {bounds['warm']['GBps']:.2f} GB/s", flush=True)
    resident = {}
    lm = load_converted(folder)

    def run(model, routing, pipelined=True, seed=0):
        force_routing(model, man.experts, routing, steps=steps, seed=seed)
        return model_decode(model, a.tokens, a.warmup, pipelined, logits=pipelined)

    steps = PROMPT + a.warmup + a.tokens + 8
    for routing in a.routings:
        res = [run(lm.model, routing) for _ in range(2)]
        comp = run(lm.model, routing, pipelined=False)
        best = min(res, key=lambda r: r["seconds"])
        resident[routing] = {
            "tps": a.tokens / best["seconds"],
            "runs": res,
            "compute_s": comp["wait_s"],
            "spread": spread(res[0], res[1]),
            "unpipelined_tps": a.tokens / comp["seconds"],
        }
        print(
            f"  resident {routing}: {resident[routing]['tps']:.2f} tok/s, run-to-run "
            f"{resident[routing]['spread']}",
            flush=True,
        )
    del lm
    gc.collect()
    mx.clear_cache()
    runs = [(f, v) for f in fracs for v in (VARIANTS if f < 1 else VARIANTS[:1])]
    for frac, (variant, kw) in runs:
        if time.perf_counter() - T0 > a.deadline:
            print(f"  skipped {name} {frac:.0%} {variant}: past the deadline", flush=True)
            continue
        budget = eb if frac >= 1 else int(eb * frac)
        kw = dict(kw)
        first_reads = kw.pop("first_reads", False)
        lm = load_paged(folder, budget, read_threads=a.threads or 8, **kw)
        pager = lm.model.rq_pager
        if not first_reads:  # steady state: every record's one CRC check already done
            pager.verify_records()
        opts = pager.options
        for routing in a.routings:
            for cache in caches[frac]:
                if cache == "cold" and pager.read_path in ("pinned", "device_route"):
                    continue  # page-locked files: no miss goes to the disk; the unpinned row has it
                pager.options = replace(opts, drop_page_cache=cache == "cold")
                if cache == "cold":
                    drop_page_cache(store)
                else:
                    warm_page_cache(store)
                # a cold row gets another stream: the warm row's experts are in the pool
                r = run(lm.model, routing, seed=1 if cache == "cold" else 0)
                ref = resident[routing]
                vs = spread(ref["runs"][0], r)
                extra = {
                    "variant": variant,
                    "zero_copy": pager.zero_copy,
                    "device_copy": pager._copier is not None,
                    "resident_spread": ref["spread"],
                    "paged_vs_resident": vs,
                    "resident_unpipelined_tps": ref["unpipelined_tps"],
                    "within_resident_spread": vs["max_abs_logit_diff"]
                    <= ref["spread"]["max_abs_logit_diff"],
                }
                if pager.read_path == "device_route":
                    # the kernel's copies are not timed apart from the step: what the misses
                    # cost is the time the paged step takes beyond the resident one
                    extra["miss_ms_per_token"] = 1e3 * (r["seconds"] / r["n"] - 1 / ref["tps"])
                if scale:
                    extra["layers_scale"] = scale
                    extra["full_model_tps_est"] = a.tokens / r["seconds"] * scale
                emit(
                    row(
                        machine,
                        name,
                        routing,
                        frac,
                        cache,
                        r,
                        ref["tps"],
                        ref["compute_s"],
                        bounds[cache],
                        **extra,
                    )
                )
        pager.close()
        del lm, pager
        gc.collect()
        mx.clear_cache()


def gpu_mode(a, emit) -> None:
    import mlx.core as mx

    # device_copy: pinned staging copied into the slots by the CUDA driver (the default where
    # its self-test passes); staging: one MLX copy a call, scattered on the device; zero_copy
    # (--zero-copy): preadv into the slots' managed memory (page migrations: slow on the H200)
    # first_reads: the same without the up-front check, so each record's first read in the
    # process pays its CRC (~1 GB/s a core) on the decode path: a start-up's figure
    if mx.cuda.is_available():
        pinned = {"zero_copy": False, "pin_records": True, "device_route": "off"}
        VARIANTS[:] = [("pinned", pinned)]  # the host path over the pinned files
        if a.device_route:  # misses resolved by a kernel on the device: no read-backs
            dev = {"zero_copy": False, "pin_records": True, "device_route": "cuda"}
            VARIANTS.insert(0, ("device_route", dev))
        if not a.pinned_only:
            VARIANTS.append(("device_copy", {"zero_copy": False, "pin_records": False}))
        if a.first_reads:
            VARIANTS.append(("first_reads", {"zero_copy": False, "first_reads": True}))
        if a.staging:
            VARIANTS.append(("staging", {"zero_copy": False, "device_copy": False}))
        if a.zero_copy and zero_copy_works():
            VARIANTS.append(("zero_copy", {"zero_copy": True}))
    else:
        VARIANTS[:] = [("current", {})]
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tag = "small" if a.small else "full"
    if "qwen3" in a.models:
        build(work / f"qwen3-30b-a3b-{tag}", qwen3_config(a.small))
    if "super" in a.models:
        build(work / f"super-22L-{tag}", super_config(a.small))
    from app.engine.offload.records import ExpertStore

    if "super" not in a.models:
        qwen3_rows(a, emit, work, tag)
        return

    # Super first (the headline), then Qwen3: the deadline skips whatever is left
    eb = ExpertStore(work / f"super-22L-{tag}").expert_bytes()
    moe = sum(c == "E" for c in super_config(a.small)["hybrid_override_pattern"])
    frac = (
        round(SUPER_BUDGET * moe / SUPER_MOE_LAYERS / (SUPER_EXPERTS * 1720320 * moe), 3)
        if not a.small
        else 0.48
    )
    print(f"super: {moe} MoE layers, {eb / 1e9:.1f} GB of experts, budget {frac:.1%}", flush=True)
    store = ExpertStore(work / f"super-22L-{tag}")
    READ_PATH.update(
        read_path(
            store,
            pread_bound(store, False, a.bound_records),
            a.threads or 8,
            zero_copy=any(v[0] == "zero_copy" for v in VARIANTS),
            device_copy=any(v[0] == "device_copy" for v in VARIANTS),
        )
    )
    print(f"read path GB/s (warm): {READ_PATH}", flush=True)
    SAVE[0]()
    model_rows(
        a,
        emit,
        SUPER,
        work / f"super-22L-{tag}",
        [frac],
        {frac: ["warm", "cold"]},
        None if a.small else 22 / SUPER_LAYERS,
    )
    if "qwen3" in a.models:
        qwen3_rows(a, emit, work, tag)


def qwen3_rows(a, emit, work: Path, tag: str) -> None:
    fracs = [0.5] + ([] if a.skip_full else [1.0])
    model_rows(
        a,
        emit,
        "qwen3-30b-a3b",
        work / f"qwen3-30b-a3b-{tag}",
        fracs,
        {0.5: ["warm"], 1.0: ["warm"]},
        None,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--small", action="store_true", help="gpu mode at tiny shapes")
    ap.add_argument("--layers", type=int, default=4, help="cpu mode: MoE layers of records")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--cold", type=float, nargs="*", default=[0.25])
    ap.add_argument("--routings", nargs="+", default=["trace", "random"])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="the pager's read threads (0: the pread bound's best; gpu mode: 8)",
    )
    ap.add_argument("--bound-records", type=int, default=256)
    ap.add_argument(
        "--zero-copy",
        action="store_true",
        help="gpu mode: also the zero-copy rows (where the probe passes)",
    )
    ap.add_argument(
        "--first-reads",
        action="store_true",
        help="gpu mode: also the rows without the up-front CRC check (a start-up's figure)",
    )
    ap.add_argument(
        "--staging",
        action="store_true",
        help="gpu mode: also the MLX staging + scatter rows (no device copier)",
    )
    ap.add_argument(
        "--models",
        nargs="+",
        choices=("super", "qwen3"),
        default=["super", "qwen3"],
        help="gpu mode: which models' rows (Super first)",
    )
    ap.add_argument(
        "--device-route",
        action="store_true",
        help="gpu mode: also (first) the rows with misses resolved on the device",
    )
    ap.add_argument(
        "--pinned-only",
        action="store_true",
        help="gpu mode: only the pinned record files' rows (not also preadv into staging)",
    )
    ap.add_argument(
        "--skip-full",
        action="store_true",
        help="gpu mode: no 100%% budget rows (the all-resident path)",
    )
    ap.add_argument("--deadline", type=float, default=500.0, help="seconds: later rows skipped")
    ap.add_argument("--workdir", default=os.environ.get("RQ_BENCH_DIR", "/tmp/rq-pager-speed"))
    ap.add_argument("--out", default=None, help="default: benchmarks/results/pager_speed.json")
    ap.add_argument(
        "--merge-commit",
        default=None,
        help="the commit the merged rows ran "
        "(where the other machine's copy of the tree recorded none)",
    )
    ap.add_argument(
        "--merge",
        default=None,
        help="a JSON from another machine (the H200 "
        "run): its rows replace the same rows of --out, with their commit and date",
    )
    a = ap.parse_args()
    from record import RESULTS, commit, write_result

    global COMMIT
    COMMIT = commit()

    out = Path(a.out) if a.out else RESULTS / "pager_speed.json"
    prev_doc = json.loads(out.read_text()) if out.exists() else {}
    old = prev_doc.get("runs", [])
    runs: list[dict] = []

    def emit(r):
        r.setdefault("commit", COMMIT)
        add_row(runs, r)
        ms = r["ms_per_token"]
        print(
            f"  {r['model'][:22]:22} {r['routing']:6} {r['budget_fraction']:5.0%} "
            f"{r['cache']:4} {r.get('variant', ''):8} paged {r['paged_tps']:7.2f} "
            f"resident {r['resident_tps'] or 0:7.2f} tok/s  hit {r['hit_rate']:.1%}  "
            f"ms/tok reads {ms['reads']:.1f} readbacks {ms['readbacks']:.1f} host "
            f"{ms['host']:.1f} compute {ms['compute']:.1f}  read "
            f"{r['read_GBps'] or 0:.2f} / bound {r['pread_bound_GBps']:.2f} GB/s",
            flush=True,
        )
        if r.get("host_parts_ms_per_token"):
            hp = r["host_parts_ms_per_token"]
            print("    host parts ms/tok: " + " ".join(f"{k} {v:.1f}" for k, v in hp.items()))
        save()

    def save():
        keep = {
            k: v
            for k, v in prev_doc.items()
            if k not in ("machine", "date", "commit", "runs", "settings", "read_path")
        }
        write_result(
            "pager_speed",
            {
                **keep,
                "runs": merge_rows(old, runs),
                "settings": {"tokens": a.tokens, "warmup": a.warmup, "batch": 1},
                **({"read_path": READ_PATH} if READ_PATH else {}),
            },
            path=out,
        )

    if a.merge:
        other = json.loads(Path(a.merge).read_text())
        commit = a.merge_commit or other.get("commit")
        rows: list[dict] = []
        for r in other["runs"]:
            r = dict(r, commit=r.get("commit", commit), date=r.get("date", other.get("date")))
            if r.get("layers_scale"):  # step time x 88/22 layers
                r["full_model_tps_est"] = r["paged_tps"] * r["layers_scale"]
            add_row(rows, r)
        prev = json.loads(out.read_text()) if out.exists() else {}
        extra = {"read_path_gpu": other["read_path"]} if "read_path" in other else {}
        write_result(
            "pager_speed",
            {
                **{k: v for k, v in prev.items() if k not in ("machine", "date", "commit", "runs")},
                **extra,
                "runs": merge_rows(old, rows),
            },
            path=out,
        )
        return
    SAVE[0] = save
    (cpu_mode if a.mode == "cpu" else gpu_mode)(a, emit)
    print(f"done in {time.perf_counter() - T0:.0f} s")


if __name__ == "__main__":
    main()
