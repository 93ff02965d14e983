"""ZipFusion (SPEC §5): compressible fraction of real KV, kernel times, admission at equal memory.

cpu     SmolLM2-135M's KV over Shakespeare (blocks that compress, per layer and K/V) and the
        batched scheduler's admission at equal memory on that real KV, with the MLX-ops
        reference -> benchmarks/results/zipfusion_cpu.json
          LD_PRELOAD=...libopenblas.so.0 .venv/bin/python benchmarks/zipfusion.py cpu
device  on an NVIDIA GPU (MLX CUDA): kernel tests, compressible fraction of a random-weight
        Llama-3.1-8B's KV, decode-attention times at 8K (compressed pages vs the same kernel on
        raw pages vs mx.fast SDPA vs torch SDPA, batch 8-64), admission + decode tokens/s at
        one KV budget -> $OUT/zipfusion.json
          PYTHONUNBUFFERED=1 python3 benchmarks/zipfusion.py device --out $OUT
        Quick kernel run (~4 min: sweep incl. the previous "pipe" kernel as baseline, table at
        batch 8-64 side by side with raw pages / mx.fast / torch SDPA, then the GPU tests):
          PYTHONUNBUFFERED=1 python3 benchmarks/zipfusion.py device --out $OUT --skip-admission \
            --tests-after --tests-reserve-s 0 --budget-s 225 --tests tests/test_zipfusion_kernels.py
merge   benchmarks/results/zipfusion.json from the two
          .venv/bin/python benchmarks/zipfusion.py merge <device zipfusion.json>
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results"

# Llama-3.1-8B (../shared/configs/llama-3.1-8b.json). Qwen3-8B's attention has the same shape
# (32 query heads, 8 KV heads, head dim 128), so one kernel timing covers both.
LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
ATTN_SHAPES = {"llama-3.1-8b / qwen3-8b": {"n_q": 32, "n_kv": 8, "head_dim": 128}}

# Public-domain Shakespeare: sonnets 18, 29, 73, 116, 130 and two speeches.
SHAKESPEARE = """
Shall I compare thee to a summer's day? Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May, And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines, And often is his gold complexion dimm'd;
And every fair from fair sometime declines, By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade, Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade, When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see, So long lives this, and this gives life to thee.
When, in disgrace with fortune and men's eyes, I all alone beweep my outcast state,
And trouble deaf heaven with my bootless cries, And look upon myself and curse my fate,
Wishing me like to one more rich in hope, Featured like him, like him with friends possess'd,
Desiring this man's art and that man's scope, With what I most enjoy contented least;
Yet in these thoughts myself almost despising, Haply I think on thee, and then my state,
Like to the lark at break of day arising From sullen earth, sings hymns at heaven's gate;
For thy sweet love remember'd such wealth brings That then I scorn to change my state with kings.
That time of year thou mayst in me behold When yellow leaves, or none, or few, do hang
Upon those boughs which shake against the cold, Bare ruin'd choirs, where late the sweet birds sang.
In me thou see'st the twilight of such day As after sunset fadeth in the west,
Which by and by black night doth take away, Death's second self, that seals up all in rest.
In me thou see'st the glowing of such fire That on the ashes of his youth doth lie,
As the death-bed whereon it must expire, Consumed with that which it was nourish'd by.
This thou perceivest, which makes thy love more strong, To love that well which thou must leave ere long.
Let me not to the marriage of true minds Admit impediments. Love is not love
Which alters when it alteration finds, Or bends with the remover to remove:
O no! it is an ever-fixed mark That looks on tempests and is never shaken;
It is the star to every wandering bark, Whose worth's unknown, although his height be taken.
Love's not Time's fool, though rosy lips and cheeks Within his bending sickle's compass come;
Love alters not with his brief hours and weeks, But bears it out even to the edge of doom.
If this be error and upon me proved, I never writ, nor no man ever loved.
My mistress' eyes are nothing like the sun; Coral is far more red than her lips' red;
If snow be white, why then her breasts are dun; If hairs be wires, black wires grow on her head.
I have seen roses damask'd, red and white, But no such roses see I in her cheeks;
And in some perfumes is there more delight Than in the breath that from my mistress reeks.
I love to hear her speak, yet well I know That music hath a far more pleasing sound;
I grant I never saw a goddess go; My mistress, when she walks, treads on the ground:
And yet, by heaven, I think my love as rare As any she belied with false compare.
To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep; No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep; To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come When we have shuffled off this mortal coil,
Must give us pause: there's the respect That makes calamity of so long life;
For who would bear the whips and scorns of time, The oppressor's wrong, the proud man's contumely,
The pangs of despised love, the law's delay, The insolence of office and the spurns
That patient merit of the unworthy takes, When he himself might his quietus make
With a bare bodkin? who would fardels bear, To grunt and sweat under a weary life,
But that the dread of something after death, The undiscover'd country from whose bourn
No traveller returns, puzzles the will And makes us rather bear those ills we have
Than fly to others that we know not of? Thus conscience does make cowards of us all;
And thus the native hue of resolution Is sicklied o'er with the pale cast of thought,
And enterprises of great pith and moment With this regard their currents turn awry,
And lose the name of action.
All the world's a stage, And all the men and women merely players;
They have their exits and their entrances; And one man in his time plays many parts,
His acts being seven ages. At first the infant, Mewling and puking in the nurse's arms;
And then the whining school-boy, with his satchel And shining morning face, creeping like snail
Unwillingly to school. And then the lover, Sighing like furnace, with a woeful ballad
Made to his mistress' eyebrow. Then a soldier, Full of strange oaths, and bearded like the pard,
Jealous in honour, sudden and quick in quarrel, Seeking the bubble reputation
Even in the cannon's mouth. And then the justice, In fair round belly with good capon lined,
With eyes severe and beard of formal cut, Full of wise saws and modern instances;
And so he plays his part. The sixth age shifts Into the lean and slipper'd pantaloon,
With spectacles on nose and pouch on side, His youthful hose, well saved, a world too wide
For his shrunk shank; and his big manly voice, Turning again toward childish treble, pipes
And whistles in his sound. Last scene of all, That ends this strange eventful history,
Is second childishness and mere oblivion, Sans teeth, sans eyes, sans taste, sans everything.
"""


def log(*a):
    print(*a, flush=True)


def machine() -> dict:
    import mlx.core as mx

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
    }
    try:
        info["device"] = {
            k: (v if isinstance(v, (int, float, str)) else str(v))
            for k, v in mx.device_info().items()
        }
    except Exception as e:  # older MLX: optional
        info["device"] = str(e)
    return info


# -- compressible fraction ------------------------------------------------------------------


def kv_fraction(keys, values) -> dict:
    """Per-layer fraction of 512-value blocks (16 tokens x 32 dims of one head) that compress,
    for K and V, and the stored size relative to raw (a compressed block is 75%)."""
    import mlx.core as mx

    from app.engine.kvcache.zipfusion import codec

    rows = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        t = k.shape[-2] // 16 * 16
        fk = float(
            codec.page_blocks_compressible(k[..., :t, :].astype(mx.bfloat16))
            .astype(mx.float32)
            .mean()
        )
        fv = float(
            codec.page_blocks_compressible(v[..., :t, :].astype(mx.bfloat16))
            .astype(mx.float32)
            .mean()
        )
        rows.append({"layer": i, "k": round(fk, 4), "v": round(fv, 4)})
    fk = statistics.mean(r["k"] for r in rows)
    fv = statistics.mean(r["v"] for r in rows)
    return {
        "per_layer": rows,
        "k_mean": round(fk, 4),
        "v_mean": round(fv, 4),
        "stored_fraction_of_raw": round(1 - 0.25 * (fk + fv) / 2, 4),
    }


def cpu_main(args) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from app.engine.embedded import ensure_default_model
    from app.engine.loader import load

    out: dict = {"machine": machine()}
    lm = load(ensure_default_model())
    ids = lm.tokenizer.encode(SHAKESPEARE.strip())
    log(f"SmolLM2-135M: {len(ids)} tokens of Shakespeare")
    cache = make_prompt_cache(lm.model)
    lm.model(mx.array(ids)[None], cache=cache)
    keys = [c.keys[:, :, : c.offset] for c in cache]
    values = [c.values[:, :, : c.offset] for c in cache]
    frac = kv_fraction(keys, values)
    frac.update(
        model="SmolLM2-135M-Instruct (4-bit weights; KV cast to BF16)",
        tokens=len(ids),
        text="Shakespeare: sonnets 18, 29, 73, 116, 130; Hamlet III.1; As You Like It II.7",
        kv_dtype=str(keys[0].dtype),
    )
    out["compressible_smollm2"] = frac
    log(
        f"  blocks that compress: K {frac['k_mean']:.3f}  V {frac['v_mean']:.3f}  "
        f"stored/raw {frac['stored_fraction_of_raw']:.3f}"
    )
    for r in frac["per_layer"]:
        log(f"  layer {r['layer']:2d}  K {r['k']:.3f}  V {r['v']:.3f}")

    # Admission at equal memory on this real KV (the prompt's KV staged as in the paper's
    # setup; the scheduler, memory manager and commit path are the real ones, reference kernels).
    t = len(ids) // 16 * 16
    adm = admission(
        lm.model,
        ([k[:, :, :t] for k in keys], [v[:, :, :t] for v in values]),
        raw_batch=args.cpu_raw_batch,
        prompt=t,
        new=32,
        steps=0,
        use_kernel=False,
    )
    adm["model"] = "SmolLM2-135M-Instruct, its own KV over the Shakespeare text"
    out["admission_smollm2_cpu"] = adm
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("zipfusion_cpu", out, out.pop("machine"))
    return out


# -- device -----------------------------------------------------------------------------------


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def time_mlx(make_calls, trials: int = 5) -> float:
    """Median seconds per call: `make_calls()` builds a list of independent calls (one graph)."""
    import mlx.core as mx

    for _ in range(2):
        mx.eval(make_calls())
    ts = []
    for _ in range(trials):
        outs = make_calls()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        ts.append((time.perf_counter() - t0) / len(outs))
    return statistics.median(ts)


def time_torch(fn, n_calls: int = 20, trials: int = 5) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n_calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e-3 / n_calls)
    return statistics.median(ts)


# --dry-run: the device path on this CPU with tiny shapes and the reference kernels, to check
# the script itself before spending device time.
TINY_LLAMA = {
    **LLAMA_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "head_dim": 128,
}


def random_llama(cfg: dict):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    cfg = dict(cfg)
    mc, ac = _get_classes(cfg)
    model = mc(ac.from_dict(cfg))  # mlx-lm's own random init
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def model_kv(model, n_tokens: int, seed: int = 0):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.random.randint(0, model.args.vocab_size, (1, n_tokens), key=mx.random.key(seed))
    cache = make_prompt_cache(model)
    for i in range(0, n_tokens, 1024):
        model(ids[:, i : i + 1024], cache=cache)
        mx.eval([c.keys for c in cache])
    return [c.keys[:, :, :n_tokens] for c in cache], [c.values[:, :, :n_tokens] for c in cache]


def build_timing_stores(kv_src, batch: int, ctx: int, n_kv: int, d: int):
    """One-layer stores (compressed, raw) with `batch` sequences of `ctx` tokens; sequence i
    holds source KV `i % len(kv_src)` tiled to ctx tokens."""
    import mlx.core as mx

    from app.engine.kvcache import zipfusion as zf

    pages = batch * math.ceil(ctx / 16)
    cfg_kw = dict(max_seqs=batch, max_tokens_per_seq=ctx + 64)
    raw_page = n_kv * 2 * (d // 32) * 1024
    budget = (math.ceil(pages / 16) + 4) * 16 * raw_page
    stores = []
    for compress in (True, False):
        st = zf.ZipStore(
            zf.ZipConfig(1, n_kv, d, budget, compress=compress, **cfg_kw), use_kernel=True
        )
        for i in range(batch):
            k, v = kv_src[i % len(kv_src)]
            reps = math.ceil(ctx / k.shape[2])
            kt = mx.concatenate([k] * reps, axis=2)[:, :, :ctx]
            vt = mx.concatenate([v] * reps, axis=2)[:, :, :ctx]
            sid = st.add_sequence()
            st.begin([sid])
            st.stage(0, kt, vt)
            st.commit()
        stores.append(st)
    return stores


def _launch_kw(zk, st, kn, d, cfg) -> dict:
    """paged_decode_attention's keywords for a (variant, warps, depth, split scale) setting."""
    variant, nw, depth, split_scale = cfg
    splits = zk.launch_splits(
        variant, kn.shape[0], kn.shape[1], st.page_table.shape[1], d, nw, depth, split_scale
    )
    return dict(
        layer=0,
        n_ids=st.n_ids,
        scale=d**-0.5,
        use_kernel=True,
        variant=variant,
        num_warps=nw,
        stages=(depth or None) if variant == "pipe" else None,
        ring_kb=(depth or None) if variant == "ring" else None,
        n_splits=splits,
    )


def _paged_calls(zk, st, qs, kn, vn, d, cfg, partials_only=False):
    kw = _launch_kw(zk, st, kn, d, cfg)
    return [
        zk.paged_decode_attention(
            q, st.pool, st.meta, st.page_table, st.seq_len, kn, vn, partials_only=partials_only,
            **kw,
        )
        for q in qs
    ]  # fmt: skip


# (variant, warps per CTA, depth, split scale) tried at batch 8 and 64 before the table; depth
# is the pipe variant's stages or the ring variant's KiB of ring per warp. The ring's split
# scale is in waves of resident CTAs. The first entry is the previous kernel, kept as baseline.
BASELINE = ("pipe", 4, 3, 1.0)
SWEEP = [
    BASELINE,
    ("pipe", 8, 3, 1.0),
    ("simple", 8, 0, 2.0),
    ("ring", 4, 16, 1.0),
    ("ring", 4, 12, 1.0),
    ("ring", 4, 24, 1.0),
    ("ring", 2, 24, 1.0),
    ("ring", 4, 16, 2.0),
    ("ring", 8, 8, 1.0),
]


def _mx_sdpa_us(qs, b, n_kv, ctx, d) -> tuple[float, float | None]:
    """bf16 mx.fast SDPA on dense KV: (queued µs per call, GPU-clock µs per call or None)."""
    import gpu_clock
    import mlx.core as mx

    kd = mx.random.normal((b, n_kv, ctx, d)).astype(mx.bfloat16)
    vd = mx.random.normal((b, n_kv, ctx, d)).astype(mx.bfloat16)
    mx.eval(kd, vd)

    def sdpa(q):
        return mx.fast.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=d**-0.5)

    t = time_mlx(lambda: [sdpa(q) for q in qs])
    g = None
    if gpu_clock.available():
        g = gpu_clock.gpu_us(lambda i, q: sdpa(q), qs)
    return round(t * 1e6, 1), (None if g is None else round(g, 1))


def _torch_sdpa_us(b, n_q, n_kv, ctx, d) -> float:
    import torch
    import torch.nn.functional as F

    tq = torch.randn(b, n_q, 1, d, device="cuda", dtype=torch.bfloat16)
    tk = torch.randn(b, n_kv, ctx, d, device="cuda", dtype=torch.bfloat16)
    tv = torch.randn(b, n_kv, ctx, d, device="cuda", dtype=torch.bfloat16)
    t = time_torch(
        lambda: F.scaled_dot_product_attention(tq, tk, tv, scale=d**-0.5, enable_gqa=True)
    )
    return round(t * 1e6, 1)


def device_kernel_times(out, kv_src, dl: Deadline, batches=(8, 16, 32, 64), ctx=8192):
    import mlx.core as mx
    import numpy as np

    from app.engine.kvcache.zipfusion import kernels as zk

    res, sweep = [], []
    name, shp = next(iter(ATTN_SHAPES.items()))  # Llama-3.1-8B and Qwen3-8B share it
    n_q, n_kv, d = shp["n_q"], shp["n_kv"], shp["head_dim"]
    t0 = time.perf_counter()
    zst, rst = build_timing_stores(kv_src, max(batches), ctx, n_kv, d)
    log(
        f"  built stores in {time.perf_counter() - t0:.1f}s; compressed blocks "
        f"{zst.stats['blocks_compressed']}/{zst.stats['blocks']}"
    )
    rng = np.random.default_rng(0)

    def bf16(shape, rng=rng):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    def inputs(b):
        qs = [bf16((b, n_q, d)) for _ in range(16)]  # 16 independent calls per timed graph
        return qs, bf16((b, n_kv, d)), bf16((b, n_kv, d))

    def on_store(st, b, timer):
        """timer() with the store's `b` sequences begun for a decode step, then reset."""
        st.begin(list(range(b)))
        try:
            return timer()
        finally:
            st.staged = [None]

    def time_cfg(st, b, cfg, ins):
        a = (zk, st, ins[0], ins[1], ins[2], d, cfg)
        return round(on_store(st, b, lambda: time_mlx(lambda: _paged_calls(*a))) * 1e6, 1)

    def gpu_cfg(st, b, cfg, ins):
        """GPU-clock µs per call (benchmarks/gpu_clock.py), or None off CUDA."""
        import gpu_clock

        if not gpu_clock.available():
            return None

        def call(i, q):
            return _paged_calls(zk, st, [q], ins[1], ins[2], d, cfg)[0]

        return round(on_store(st, b, lambda: gpu_clock.gpu_us(call, ins[0])), 1)

    def reduce_gpu(st, b, cfg, ins):
        """GPU-clock µs of the reduce kernel alone (the attention kernel's partials computed
        and evaluated first), or None off CUDA."""
        import gpu_clock

        if not gpu_clock.available():
            return None

        def timer():
            parts = _paged_calls(zk, st, ins[0], ins[1], ins[2], d, cfg, partials_only=True)
            mx.eval(parts)

            def call(i, q):
                o, ml = parts[i % len(parts)]
                return zk.reduce_partials(o, ml, q, ins[1], ins[2], scale=d**-0.5)

            return gpu_clock.gpu_us(call, ins[0])

        return round(on_store(st, b, timer), 1)

    def check_cfg(b, cfg, ins):
        """Compressed == raw pages bit for bit, and close to the reference, for this setting."""
        outs = []
        for st in (zst, rst):
            st.begin(list(range(b)))
            outs.append(_paged_calls(zk, st, ins[0][:1], ins[1], ins[2], d, cfg)[0])
        ref = zk.paged_attention_reference(
            ins[0][0],
            rst.pool,
            rst.meta,
            rst.page_table,
            rst.seq_len,
            ins[1],
            ins[2],
            0,
            rst.n_ids,
            d**-0.5,
        ).astype(mx.float32)
        err = float(mx.linalg.norm(outs[0].astype(mx.float32) - ref) / mx.linalg.norm(ref))
        for st in (zst, rst):
            st.staged = [None]
        return bool(mx.all(outs[0] == outs[1])) and err < 1e-2, err

    # 1. sweep launch settings at the smallest and largest batch
    for b in (min(batches), max(batches)):
        ins = inputs(b)
        for cfg in SWEEP:
            if dl.left() < 70:
                log("  (sweep cut short: device time)")
                break
            try:
                good, err = check_cfg(b, cfg, ins)
                row = {
                    "batch": b,
                    "config": list(cfg),
                    "ok": good,
                    "rel_err": err,
                    "compressed_us": time_cfg(zst, b, cfg, ins),
                    "raw_pages_us": time_cfg(rst, b, cfg, ins),
                    "compressed_gpu_us": gpu_cfg(zst, b, cfg, ins),
                    "raw_pages_gpu_us": gpu_cfg(rst, b, cfg, ins),
                }
            except Exception as e:  # a setting that does not launch (shared memory) is skipped
                row = {
                    "batch": b,
                    "config": list(cfg),
                    "error": f"{type(e).__name__}: {e}"[:300],
                }
            sweep.append(row)
            log(f"  sweep B={b:3d} {cfg}: {row}")
    ok = [r for r in sweep if "error" not in r and r["ok"]]

    def best(key):
        """The setting with the least time summed over the swept batches: GPU-clock time where
        there is one (host time is not the kernel's), else queued time."""
        if ok and all(r.get(key.replace("_us", "_gpu_us")) for r in ok):
            key = key.replace("_us", "_gpu_us")
        by = {}
        for r in ok:
            by.setdefault(tuple(r["config"]), []).append(r[key])
        full = {c: sum(v) for c, v in by.items() if len(v) == 2}
        return min(full, key=full.get) if full else SWEEP[0]

    best_zip, best_raw = best("compressed_us"), best("raw_pages_us")
    out["kernel_config"] = {"compressed": list(best_zip), "raw_pages": list(best_raw)}
    log(f"  best settings: compressed {best_zip}, raw pages {best_raw}")

    # 2. the table: compressed and raw with the compressed pages' best settings, raw with
    #    its own best settings, mx.fast SDPA and torch SDPA on dense BF16
    for b in batches:
        if dl.left() < 30:
            log("  (skipping larger batches: device time)")
            break
        ins = inputs(b)
        # the library's own settings for this batch (what the engine launches)
        cfg = ("ring", zk.RING_NUM_WARPS, zk.RING_KB, 1.0)
        row = {"shape": name, "batch": b, "context": ctx, "config": list(cfg)}
        row["compressed_us"] = time_cfg(zst, b, cfg, ins)
        row["raw_pages_same_config_us"] = time_cfg(rst, b, cfg, ins)
        if cfg != BASELINE:  # the previous kernel, side by side
            try:
                row["baseline_config"] = list(BASELINE)
                row["baseline_compressed_us"] = time_cfg(zst, b, BASELINE, ins)
                row["baseline_raw_pages_us"] = time_cfg(rst, b, BASELINE, ins)
            except Exception as e:
                row["baseline_error"] = f"{type(e).__name__}: {e}"[:300]
        row["raw_pages_us"] = (
            row["raw_pages_same_config_us"] if best_raw == cfg else time_cfg(rst, b, best_raw, ins)
        )
        row["raw_pages_us"] = min(row["raw_pages_us"], row["raw_pages_same_config_us"])
        row["compressed_gpu_us"] = gpu_cfg(zst, b, cfg, ins)
        row["raw_pages_gpu_us"] = gpu_cfg(rst, b, cfg, ins)
        row["reduce_gpu_us"] = reduce_gpu(zst, b, cfg, ins)  # inside both figures above
        # side by side: the parameter arrays built per call (the previous library) vs cached
        cached, zk.CACHE_PARAMS = zk.CACHE_PARAMS, False
        try:
            row["compressed_fresh_params_gpu_us"] = gpu_cfg(zst, b, cfg, ins)
            row["reduce_fresh_params_gpu_us"] = reduce_gpu(zst, b, cfg, ins)
        finally:
            zk.CACHE_PARAMS = cached
        if tuple(best_zip) != cfg:  # the sweep's best setting over all batches, for reference
            row["sweep_best_config"] = list(best_zip)
            row["sweep_best_compressed_gpu_us"] = gpu_cfg(zst, b, best_zip, ins)
        if best_raw != cfg:
            other = gpu_cfg(rst, b, best_raw, ins)
            if other is not None and row["raw_pages_gpu_us"] is not None:
                row["raw_pages_gpu_us"] = min(row["raw_pages_gpu_us"], other)
        for st, tag in ((zst, "compressed"), (rst, "raw_pages")):
            row[f"{tag}_kv_bytes"] = sum(st.seq_kv_bytes(s) for s in range(b))
        row["mx_sdpa_us"], row["mx_sdpa_gpu_us"] = _mx_sdpa_us(ins[0], b, n_kv, ctx, d)
        mx.clear_cache()
        try:
            row["torch_sdpa_us"] = _torch_sdpa_us(b, n_q, n_kv, ctx, d)
            import torch

            torch.cuda.empty_cache()
        except Exception as e:  # torch missing or too old: the row says so
            row["torch_sdpa_error"] = f"{type(e).__name__}: {e}"
        zt, rt = row["compressed_us"], row["raw_pages_us"]
        row["speedup_vs_raw"] = round(rt / zt, 3)
        row["speedup_vs_raw_same_config"] = round(row["raw_pages_same_config_us"] / zt, 3)
        row["byte_ratio"] = round(row["raw_pages_kv_bytes"] / row["compressed_kv_bytes"], 3)
        row["compressed_gbps"] = round(row["compressed_kv_bytes"] / zt / 1e3, 1)
        row["raw_pages_gbps"] = round(row["raw_pages_kv_bytes"] / rt / 1e3, 1)
        if "torch_sdpa_us" in row:
            row["speedup_vs_torch"] = round(row["torch_sdpa_us"] / zt, 3)
        row["speedup_vs_mx_sdpa"] = round(row["mx_sdpa_us"] / zt, 3)
        zg, rg, mg = row["compressed_gpu_us"], row["raw_pages_gpu_us"], row["mx_sdpa_gpu_us"]
        if zg:  # GPU clock: like torch's CUDA events, no host time
            row["speedup_vs_raw_gpu"] = round(rg / zg, 3) if rg else None
            row["speedup_vs_mx_sdpa_gpu"] = round(mg / zg, 3) if mg else None
            row["compressed_gpu_gbps"] = round(row["compressed_kv_bytes"] / zg / 1e3, 1)
            if "torch_sdpa_us" in row:
                row["speedup_vs_torch_gpu"] = round(row["torch_sdpa_us"] / zg, 3)
        res.append(row)
        if "baseline_compressed_us" in row:
            row["speedup_vs_baseline"] = round(row["baseline_compressed_us"] / zt, 3)
        log(
            f"  B={b:3d}  zip {zt:7.1f}  raw {rt:7.1f} (same cfg {row['raw_pages_same_config_us']:7.1f})  "
            f"baseline zip {row.get('baseline_compressed_us', float('nan')):7.1f} "
            f"raw {row.get('baseline_raw_pages_us', float('nan')):7.1f}  "
            f"mx {row['mx_sdpa_us']:7.1f}  torch {row.get('torch_sdpa_us', float('nan')):7.1f} us  "
            f"x{row['speedup_vs_raw']:.2f} vs raw (bytes x{row['byte_ratio']:.2f})  "
            f"{row['compressed_gbps']:.0f} / {row['raw_pages_gbps']:.0f} GB/s\n"
            f"         GPU clock: zip {zg or float('nan'):7.1f}  raw {rg or float('nan'):7.1f}  "
            f"mx {mg or float('nan'):7.1f} us (reduce alone {row['reduce_gpu_us'] or float('nan'):.1f}; "
            f"params per call: zip {row['compressed_fresh_params_gpu_us'] or float('nan'):.1f} "
            f"reduce {row['reduce_fresh_params_gpu_us'] or float('nan'):.1f})  "
            f"x{row.get('speedup_vs_raw_gpu') or float('nan'):.2f} "
            f"vs raw  x{row.get('speedup_vs_torch_gpu') or float('nan'):.2f} vs torch"
        )
    out["kernel_sweep"] = sweep
    out["kernel_times"] = res


def kv_budget(model, raw_batch: int, prompt: int, new: int) -> int:
    """A pool that holds `raw_batch` sequences of prompt+new tokens at raw size, plus the
    per-layer chunks the memory manager keeps aside (partial raw chunk, reserves)."""
    from app.engine.kvcache import zipfusion as zf

    n_layers, n_kv, d = zf.model_kv_shape(model)
    probe = zf.ZipConfig(n_layers, n_kv, d, 1 << 40)
    chunks = math.ceil(raw_batch * math.ceil((prompt + new) / 16) / probe.pages_per_chunk) + 3
    return n_layers * chunks * probe.pages_per_chunk * probe.raw_page_bytes


def admission(model, kv_layers, *, raw_batch, prompt, new, steps, use_kernel=None, dl=None) -> dict:
    """One KV budget (what holds `raw_batch` sequences uncompressed): how many prompt+new
    sequences the scheduler admits with and without compression, then decode tokens/s at that
    batch through the model. Prompts arrive as KV (the paper's setup: prompt pre-computed,
    timing excludes prefill) and are paged and compressed by the same commit path as prefill."""
    import mlx.core as mx

    from app.engine.kvcache import zipfusion as zf
    from app.engine.kvcache.zipfusion.scheduler import Request, ZipScheduler, _Running

    n_layers = zf.model_kv_shape(model)[0]
    budget = kv_budget(model, raw_batch, prompt, new)
    keys, values = kv_layers
    reps = math.ceil(prompt / keys[0].shape[2])
    kt = [mx.concatenate([k] * reps, axis=2)[:, :, :prompt] for k in keys]
    vt = [mx.concatenate([v] * reps, axis=2)[:, :, :prompt] for v in values]
    mx.eval(kt, vt)

    class PrefilledScheduler(ZipScheduler):
        def _prefill(self, req):
            sid = self.store.add_sequence()
            self.store.begin([sid])
            for layer in range(n_layers):
                self.store.stage(layer, kt[layer], vt[layer])
            self.store.commit()
            run = _Running(req, sid)
            run.tokens.append(req.prompt[-1])
            return run

    adm = {
        "prompt_tokens": prompt,
        "max_new_tokens": new,
        "kv_budget_bytes": budget,
        "kv_budget_gb": round(budget / 1e9, 3),
        "raw_batch_target": raw_batch,
    }
    for compress in (False, True):
        key = "zipfusion" if compress else "raw_pages"
        if dl is not None and dl.left() < 90:
            adm[key] = "skipped: device time"
            break
        mx.reset_peak_memory()
        st = zf.make_zipfusion_store(
            model,
            budget,
            max_seqs=4 * raw_batch,
            max_tokens_per_seq=prompt + new + 32,
            compress=compress,
            use_kernel=use_kernel,
        )
        sched = PrefilledScheduler(model, st)
        for i in range(3 * raw_batch):
            sched.submit(Request([1000 + i] * prompt, new))  # the prompt's length is what counts
        t0 = time.perf_counter()
        sched._admit()
        t_admit = time.perf_counter() - t0
        b = len(sched.running)
        log(
            f"  {key}: admitted {b} sequences of {prompt}+{new} in {t_admit:.1f}s; KV used "
            f"{st.used_bytes() / 1e9:.3f} GB of {budget / 1e9:.3f}"
        )
        times = []
        for _ in range(steps):
            if dl is not None and dl.left() < 45:
                break
            times.append(sched.step().decode_s)
        timed = times[2:] if len(times) > 4 else times
        row = {
            "max_concurrent": b,
            "admit_s": round(t_admit, 1),
            "kv_used_bytes": st.used_bytes(),
            "pool_bytes": st.pool.nbytes,
            "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 2),
            "blocks_compressed_fraction": round(
                st.stats["blocks_compressed"] / max(1, st.stats["blocks"]), 4
            ),
        }
        if timed:
            step_s = statistics.median(timed)
            row.update(
                decode_steps_timed=len(timed),
                decode_step_ms_median=round(step_s * 1e3, 2),
                decode_step_ms_mean=round(statistics.mean(timed) * 1e3, 2),
                decode_tok_s=round(b / step_s, 1),
                decode_tok_s_mean_steps=round(b / statistics.mean(timed), 1),
            )
            log(
                f"  {key}: batch {b}, decode step {step_s * 1e3:.1f} ms (median of {len(timed)}) -> "
                f"{row['decode_tok_s']} tok/s; peak {row['peak_memory_gb']} GB"
            )
        adm[key] = row
        del sched, st
        mx.clear_cache()
    z, r = adm.get("zipfusion"), adm.get("raw_pages")
    if isinstance(z, dict) and isinstance(r, dict):
        adm["admission_gain_pct"] = round(100 * (z["max_concurrent"] / r["max_concurrent"] - 1), 1)
        if z.get("decode_tok_s") and r.get("decode_tok_s"):
            adm["decode_tok_s_gain_pct"] = round(
                100 * (z["decode_tok_s"] / r["decode_tok_s"] - 1), 1
            )
    return adm


def device_main(args) -> dict:
    dl = Deadline(args.budget_s)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    out: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def save():
        (outdir / "zipfusion.json").write_text(json.dumps(out, indent=2, default=str))

    import mlx.core as mx

    out["machine"] = machine()
    try:
        import torch

        out["machine"]["torch"] = torch.__version__
        out["machine"]["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:
        out["machine"]["torch"] = f"unavailable: {e}"
    log(json.dumps(out["machine"]))
    if args.dry_run:
        from app.engine.kvcache.zipfusion import kernels as zk_

        zk_._use_kernel = lambda use_kernel: False  # reference path everywhere
        ATTN_SHAPES.clear()
        ATTN_SHAPES["tiny"] = {"n_q": 8, "n_kv": 2, "head_dim": 128}
    elif not mx.cuda.is_available():
        out["error"] = "mx.cuda.is_available() is false"
        save()
        return out
    save()

    if args.gen_check:
        out["generation_check"] = generation_check()
        log("generation check:", out["generation_check"])
        save()

    def run_tests():
        t0 = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore::DeprecationWarning",
            *args.tests,
            "-m",
            "not slow",
        ]
        try:
            r = subprocess.run(
                cmd,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=max(20, min(240, dl.left() - args.tests_reserve_s)),
            )
        except subprocess.TimeoutExpired as e:
            out["tests"] = {"error": f"timed out after {e.timeout:.0f}s"}
            log("tests:", out["tests"])
            save()
            return
        (outdir / "tests.log").write_text(r.stdout + r.stderr)
        tail = (r.stdout + r.stderr).strip().splitlines()[-12:]
        out["tests"] = {
            "returncode": r.returncode,
            "summary": tail[-1] if tail else "",
            "seconds": round(time.perf_counter() - t0, 1),
        }
        log("tests:", out["tests"])
        if r.returncode != 0:
            log("\n".join((r.stdout + r.stderr).splitlines()[-60:]))
        save()

    if not args.skip_tests and not args.tests_after:
        run_tests()

    from app.engine.kvcache.zipfusion import kernels as zk

    out["variant_ok"] = quick_check(zk)
    log("variant check (kernel vs reference):", out["variant_ok"])
    save()

    # Model KV (random weights, Llama-3.1-8B shape): compressible fraction + timing/admission data.
    kv_layers = None
    model = None
    try:
        t0 = time.perf_counter()
        model = random_llama(TINY_LLAMA if args.dry_run else LLAMA_8B)
        keys, values = model_kv(model, args.model_tokens)
        mx.eval(keys, values)
        kv_layers = (keys, values)
        frac = kv_fraction(keys, values)
        frac.update(
            model="Llama-3.1-8B shape, random weights (mlx-lm init), BF16",
            tokens=args.model_tokens,
            prompt="random token ids",
            seconds=round(time.perf_counter() - t0, 1),
        )
        out["compressible_random_llama8b"] = frac
        log(
            f"random Llama-8B KV: K {frac['k_mean']:.3f}  V {frac['v_mean']:.3f} compress "
            f"(stored/raw {frac['stored_fraction_of_raw']:.3f}); {frac['seconds']}s"
        )
    except Exception as e:
        out["compressible_random_llama8b"] = f"failed: {type(e).__name__}: {e}"
        log("model KV failed:", e)
    save()

    try:
        if kv_layers is not None:
            src = [(kv_layers[0][i], kv_layers[1][i]) for i in range(len(kv_layers[0]))]
            kv_note = (
                "random-weight Llama-8B KV (sequence i uses layer i's KV, tiled to the context)"
            )
        else:
            g = mx.random.normal((1, 8, 1024, 128)) * mx.exp(mx.random.normal((1, 8, 1, 128)))
            src = [(g.astype(mx.bfloat16), mx.random.normal((1, 8, 1024, 128)).astype(mx.bfloat16))]
            kv_note = "synthetic Gaussian KV with log-normal channel scales"
        out["kernel_kv_data"] = kv_note
        log("kernel times (us): compressed pipe/simple, raw pipe/simple, mx.fast SDPA, torch SDPA")
        device_kernel_times(out, src, dl, batches=tuple(args.batches), ctx=args.ctx)
        mx.clear_cache()  # the timing stores are gone with the call
    except Exception:
        import traceback

        out["kernel_times_error"] = traceback.format_exc()[-3000:]
        log(out["kernel_times_error"])
    save()

    if not args.skip_tests and args.tests_after:
        run_tests()

    if model is not None and kv_layers is not None and not args.skip_admission:
        try:
            cfg = (out.get("kernel_config") or {}).get("compressed") or ["pipe", 4, 3, 1.0]
            zk.DEFAULT_VARIANT = args.variant or cfg[0]
            if cfg[0] == "ring":
                zk.RING_NUM_WARPS, zk.RING_KB = cfg[1], cfg[2] or zk.RING_KB
            else:
                zk.NUM_WARPS = cfg[1]
                zk.PIPE_STAGES = cfg[2] or zk.PIPE_STAGES
                zk.CTA_TARGET = int(zk.CTA_TARGET * cfg[3])
            if not out.get("variant_ok", {}).get(zk.DEFAULT_VARIANT, True):
                zk.DEFAULT_VARIANT = "pipe" if zk.DEFAULT_VARIANT != "pipe" else "simple"
            out["admission_kernel"] = [
                zk.DEFAULT_VARIANT,
                zk.NUM_WARPS,
                zk.PIPE_STAGES,
                zk.CTA_TARGET,
            ]
            log(f"admission at equal memory (variant {zk.DEFAULT_VARIANT})")
            adm = admission(
                model,
                kv_layers,
                raw_batch=args.raw_batch,
                prompt=args.ctx,
                new=args.new_tokens,
                steps=args.steps,
                dl=dl,
            )
            adm["model"] = (
                "Llama-3.1-8B shape, random weights (mlx-lm init), BF16; its own KV, tiled"
            )
            out["admission"] = adm
        except Exception:
            import traceback

            out["admission_error"] = traceback.format_exc()[-3000:]
            log(out["admission_error"])
    headline(out)
    save()
    log(
        json.dumps(
            {
                k: out.get(k)
                for k in (
                    "speedup_vs_raw",
                    "speedup_vs_torch",
                    "admission_gain_pct",
                    "decode_tok_s_gain_pct",
                )
            }
        )
    )
    return out


def generation_check() -> dict:
    """tests/gpu's generation tests in process: compressed vs raw pages through the kernel
    (bit-exact logits) and vs mlx-lm's KVCache + mx.fast SDPA (tokens)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from mlx_lm.utils import _get_classes

    import tests.gpu.test_zipfusion_gpu as T
    from app.engine.kvcache import zipfusion as zf
    from app.engine.random_models import _randomize

    mc, ac = _get_classes(T.CFG)
    m = mc(ac.from_dict(T.CFG))
    m.set_dtype(mx.bfloat16)
    _randomize(m, 11, 0.08)
    prompt = T._prompt(150, 0)
    runs = {}
    for compress in (True, False):
        caches = zf.make_zipfusion_cache(m, max_tokens=512, compress=compress, use_kernel=True)
        runs[compress] = T._generate(m, caches, prompt, 48)
    ref_t, ref_lp = T._generate(
        m, [KVCache() for _ in range(T.CFG["num_hidden_layers"])], prompt, 48
    )
    same = [a == b for a, b in zip(runs[True][0], ref_t, strict=True)]
    return {
        "compressed_equals_raw_bits": runs[True][0] == runs[False][0]
        and all((a == b).all() for a, b in zip(runs[True][1], runs[False][1], strict=True)),
        "tokens": len(ref_t),
        "tokens_equal_to_kvcache": all(same),
        "first_divergence": same.index(False) if not all(same) else None,
        "max_logprob_diff_before_divergence": float(
            max(
                abs(a - b).max() for a, b, ok in zip(runs[True][1], ref_lp, same, strict=True) if ok
            )
        ),
    }


def quick_check(zk) -> dict:
    """Each attention variant vs the reference on a small mixed-length batch (in process, so a
    broken variant is not used for the admission run even if the pytest run was skipped)."""
    import mlx.core as mx
    import numpy as np

    from tests.test_zipfusion_kernels import build_stores

    ok = {}
    zst, rst = build_stores([5, 16, 300, 1025], 8, 128, seed=3, poison=True)
    rng = np.random.default_rng(3)
    q = mx.array(rng.standard_normal((4, 32, 128)).astype(np.float32)).astype(mx.bfloat16)
    kn = mx.array(rng.standard_normal((4, 8, 128)).astype(np.float32)).astype(mx.bfloat16)
    vn = mx.array(rng.standard_normal((4, 8, 128)).astype(np.float32)).astype(mx.bfloat16)
    for st in (zst, rst):
        st.begin([0, 1, 2, 3])
    ref = zk.paged_attention_reference(
        q, rst.pool, rst.meta, rst.page_table, rst.seq_len, kn, vn, 0, rst.n_ids, 128**-0.5
    ).astype(mx.float32)
    for variant in ("ring", "pipe", "simple"):
        try:
            outs = [
                zk.paged_decode_attention(
                    q,
                    st.pool,
                    st.meta,
                    st.page_table,
                    st.seq_len,
                    kn,
                    vn,
                    layer=0,
                    n_ids=st.n_ids,
                    scale=128**-0.5,
                    use_kernel=True,
                    variant=variant,
                )
                for st in (zst, rst)
            ]
            err = float(mx.linalg.norm(outs[0].astype(mx.float32) - ref) / mx.linalg.norm(ref))
            ok[variant] = bool(mx.all(outs[0] == outs[1])) and err < 1e-2
            ok[variant + "_rel_err"] = err
        except Exception as e:
            ok[variant] = False
            ok[variant + "_error"] = f"{type(e).__name__}: {e}"
    return ok


def headline(out) -> None:
    rows = [r for r in out.get("kernel_times") or [] if r.get("context") == 8192]
    if rows:
        out["speedup_vs_raw"] = round(statistics.median(r["speedup_vs_raw"] for r in rows), 3)
        tv = [r["speedup_vs_torch"] for r in rows if "speedup_vs_torch" in r]
        if tv:
            out["speedup_vs_torch"] = round(statistics.median(tv), 3)
        for k in ("speedup_vs_raw_gpu", "speedup_vs_torch_gpu"):
            v = [r[k] for r in rows if r.get(k)]
            if v:
                out[k] = round(statistics.median(v), 3)
    adm = out.get("admission") or {}
    for k in ("admission_gain_pct", "decode_tok_s_gain_pct"):
        if k in adm:
            out[k] = adm[k]


def merge_main(args) -> None:
    dev = json.loads(Path(args.device_json).read_text())
    cpu_path = RESULTS / "zipfusion_cpu.json"
    cpu = json.loads(cpu_path.read_text()) if cpu_path.exists() else {}
    from record import header  # benchmarks/ is the script's folder, first on sys.path

    merged = {
        **header(dev.get("machine")),
        "what": "ZipFusion (SPEC §5): lossless BF16 KV compression decoded inside decode attention",
        "commands": {
            "cpu": "LD_PRELOAD=...libopenblas.so.0 .venv/bin/python benchmarks/zipfusion.py cpu",
            "device": "PYTHONUNBUFFERED=1 python3 benchmarks/zipfusion.py device --out $OUT",
        },
        "targets": {
            "speedup_vs_raw": ">= 1.2 (byte bound 1.33)",
            "speedup_vs_torch": ">= 1.0",
            "paper": "batch 46 -> 57, +26.3% decode tok/s (H100, 8K + 256)",
        },
        "device": dev,
        "cpu": cpu,
    }
    for extra in args.also or []:
        label, path = extra.split("=", 1)
        merged[label] = json.loads(Path(path).read_text())
    if args.note:
        merged["notes"] = args.note
    for k in (
        "speedup_vs_raw",
        "speedup_vs_torch",
        "speedup_vs_raw_gpu",
        "speedup_vs_torch_gpu",
        "admission_gain_pct",
        "decode_tok_s_gain_pct",
    ):
        if k in dev:
            merged[k] = dev[k]
    merged["compressible_fraction"] = {
        "smollm2_135m_shakespeare": cpu.get("compressible_smollm2"),
        "random_llama_3_1_8b": dev.get("compressible_random_llama8b"),
    }
    (RESULTS / "zipfusion.json").write_text(json.dumps(merged, indent=2, default=str))
    log(f"wrote {RESULTS / 'zipfusion.json'}")


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu")
    c.add_argument("--cpu-raw-batch", type=int, default=16)
    d = sub.add_parser("device")
    d.add_argument("--out", default=os.environ.get("OUT", "/tmp/zipfusion_out"))
    d.add_argument("--budget-s", type=float, default=480.0)
    d.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64])
    d.add_argument("--ctx", type=int, default=8192)
    d.add_argument("--model-tokens", type=int, default=1024)
    d.add_argument(
        "--raw-batch", type=int, default=46, help="sequences the KV budget holds at raw size"
    )
    d.add_argument("--new-tokens", type=int, default=256)
    d.add_argument("--steps", type=int, default=36)
    d.add_argument("--variant", choices=["ring", "pipe", "simple"], default=None)
    d.add_argument("--skip-tests", action="store_true")
    d.add_argument("--gen-check", action="store_true", help="in-process generation check")
    d.add_argument("--sweep", nargs="+", default=None, help="variant,warps,stages,split_scale ...")
    d.add_argument(
        "--tests",
        nargs="+",
        default=["tests/test_zipfusion_kernels.py", "tests/gpu/test_zipfusion_gpu.py"],
    )
    d.add_argument("--skip-admission", action="store_true")
    d.add_argument(
        "--tests-after", action="store_true", help="run the tests after the kernel timings"
    )
    d.add_argument(
        "--tests-reserve-s", type=float, default=200.0, help="device time kept for what follows"
    )
    d.add_argument("--dry-run", action="store_true", help="tiny shapes, reference kernels, no GPU")
    m = sub.add_parser("merge")
    m.add_argument("device_json")
    m.add_argument("--also", nargs="*", help="label=path of other device runs to keep")
    m.add_argument("--note", nargs="*", help="notes for the reader")
    args = p.parse_args(argv)
    if getattr(args, "sweep", None):
        SWEEP[:] = [
            (v, int(w), int(st), float(sc)) for v, w, st, sc in (x.split(",") for x in args.sweep)
        ]
    {"cpu": cpu_main, "device": device_main, "merge": merge_main}[args.cmd](args)


if __name__ == "__main__":
    main()
