"""Stock mlx-lm against RotaryQuant on the same model shapes, one process (issue 39).

Configs: `stock` (mlx-lm: every linear 4-bit g64 by its own quantize_model, its KVCache, its
generate_step with its 2048-token prefill), `fp16` and `isoquant3` (the engine: role widths,
the engine's model preparation and generation loop, fp16 / IsoQuant 3-bit KV). Qwen3-30B-A3B's
shapes with random weights, batch 1, greedy. Per context: each config prefills a fresh cache
(prefill tok/s, peak), then decode rounds alternate between configs (decode tok/s: median of
rounds, each round a fresh generate loop continuing the cache); more prefill rounds follow
while the time budget lasts. Host ms per step: one step at a time, the thread's CPU time to
build the step's graph (model call and sampler), nothing evaluated meanwhile.

    # GPU: Qwen3-30B-A3B shapes, 2K / 16K / 32K, the full table (~8 min on an H200)
    python benchmarks/engine_vs_mlxlm.py
    # CPU: the layer count and heads of Qwen3-30B-A3B at tiny widths; host ms per decode step,
    # with the blocks left uncompiled ("_uncompiled") side by side
    python benchmarks/engine_vs_mlxlm.py --tiny --contexts 64 --before
    # prefill with the experts' prefill widening (expert_widen.py) on and off, side by side
    python benchmarks/engine_vs_mlxlm.py --prefill-ab

`--prefill-ab` adds a prefill-only config `fp16_widen_off`: the fp16 config's model and chunk
with ROTARYQUANT_EXPERT_PREFILL_BITS=off (its own compiled traces), timed right after fp16's
prefill (widening as this process's env/backend sets it: 8 bits on CUDA) and in the same
alternating extra rounds.

Results: benchmarks/results/engine_vs_mlxlm.json (runs of other machines are kept).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from record import RESULTS, write_result  # noqa: E402

from app.engine import compiled, expert_widen  # noqa: E402
from app.engine.generate import prepare_model, token_stream  # noqa: E402
from app.engine.planner import prefill_chunk_for  # noqa: E402
from app.engine.testing.shapes import QWEN3_30B_A3B  # noqa: E402

TINY = {
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "intermediate_size": 256,
    "vocab_size": 1000,
}
CONFIGS = ("stock", "fp16", "isoquant3")
WIDEN_OFF = "fp16_widen_off"  # --prefill-ab: fp16's prefill with the expert widening off
PAIRED_WITH = {"fp16": ("stock",), "isoquant3": ("stock", "fp16")}  # decode ratios per round
WARM_STEPS = 8  # decode steps before a round's timing starts


class Runner:
    """One config: its model, its cache at the current context, its step and stream."""

    def __init__(self, name: str, model, stock: bool, kv_mode: str, chunk: int):
        self.name, self.model, self.stock, self.kv_mode, self.chunk = (
            name,
            model,
            stock,
            kv_mode,
            chunk,
        )
        self.cache = None
        self.last = 1

    def new_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        if self.stock or self.kv_mode == "fp16":
            return make_prompt_cache(self.model)
        from app.engine import kvcache

        return kvcache.make_cache(self.model, self.kv_mode)

    def stream(self, ids, cache, max_tokens: int):
        if self.stock:
            from mlx_lm.generate import generate_step

            return (
                int(t)
                for t, _ in generate_step(
                    mx.array(ids), self.model, max_tokens=max_tokens, prompt_cache=cache
                )
            )
        return token_stream(self.model, ids, cache, max_tokens=max_tokens, prefill_chunk=self.chunk)

    def step(self, tok):
        """One decode step's graph, as each loop builds it (lazy)."""
        if self.stock:
            logits = self.model(tok[None], cache=self.cache)[:, -1, :]
            return mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)
        from app.engine.generate import decode_step

        return decode_step(self.model, tok, self.cache)


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def build(config: dict, stock: bool, seed: int, dtype: str = "bfloat16"):
    """The model with mlx-lm's random init, quantized (stock: mlx-lm's 4-bit g64 everywhere;
    ours: role widths), evaluated a layer at a time so the float weights never all exist.
    The CPU runs float32 (its bf16 quantized matmuls are ~30x slower; graph building is not)."""
    from mlx_lm.utils import _get_classes, quantize_model

    from app.engine.quant.roles import role_predicate

    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    if stock:
        quantize_model(model, config, 64, 4)
    else:
        nn.quantize(model, class_predicate=role_predicate(config["model_type"]))
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    if not stock:
        prepare_model(model)
    return model


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    mx.random.seed(seed)
    return mx.random.randint(0, vocab, (n,)).tolist()


def prefill(r: Runner, ids: list[int], keep: bool) -> tuple[float, int]:
    """Prefill into a fresh cache up to the first token: (tok/s, peak bytes of this config)."""
    mx.synchronize()
    mx.clear_cache()
    others = (
        mx.get_active_memory()
        - weight_bytes(r.model)
        - (sum(c.nbytes for c in r.cache) if r.cache else 0)
    )
    cache = r.new_cache()
    mx.reset_peak_memory()
    t = time.perf_counter()
    gen = r.stream(ids, cache, 2)
    tok = next(gen)
    dt = time.perf_counter() - t
    gen.close()
    peak = mx.get_peak_memory() - others
    if keep:
        r.cache, r.last = cache, tok
    return len(ids) / dt, peak


@contextlib.contextmanager
def widening_off(model):
    """The experts' prefill widening off (env override) with its own compiled traces; the
    process's setting and traces back on exit."""
    old = os.environ.get(expert_widen.ENV)
    os.environ[expert_widen.ENV] = "off"
    compiled.use_traces(model, "widen_off")
    try:
        yield
    finally:
        if old is None:
            del os.environ[expert_widen.ENV]
        else:
            os.environ[expert_widen.ENV] = old
        compiled.use_traces(model, None)


def prefill_as(runners: dict, name: str, ids: list[int], keep: bool) -> tuple[float, int]:
    """prefill() of a config, or of fp16 with the widening off (never kept)."""
    if name != WIDEN_OFF:
        return prefill(runners[name], ids, keep)
    r = runners["fp16"]
    with widening_off(r.model):
        return prefill(r, ids, keep=False)


def decode_round(r: Runner, steps: int, warm: int = WARM_STEPS) -> float:
    gen = r.stream([r.last], r.cache, warm + steps + 1)
    t0 = None
    for i, tok in enumerate(gen):
        if i == warm:
            t0 = time.perf_counter()
        r.last = tok
    return steps / (time.perf_counter() - t0)


class StubKernels:
    """The IsoQuant kernels' Python path on a backend without them (CPU): every kernel launch
    replaced by a stub returning arrays of the right shapes, so a step's build costs what it
    costs on a GPU host. For host time only: the stubs compute nothing meaningful."""

    def __enter__(self):
        from app.engine.kvcache.isoquant import attention, cache
        from app.engine.kvcache.isoquant import kernel_path as kk
        from app.engine.kvcache.isoquant import kernels as iq

        class Stub:
            def __call__(self, inputs, output_shapes, output_dtypes, **kw):
                return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        self.iq = iq
        self.saved = dict(iq._KERNELS), iq.BACKEND
        iq._KERNELS.update({(n, dt): Stub() for n in iq.SPECS for dt in iq.DTYPES})
        iq.BACKEND = "cuda"
        attention.register_kernel(kk._cache_entry)
        cache.register_encoder(kk.encode_pair)
        cache.register_step_kernel(kk.window_attention)
        return self

    def __exit__(self, *exc):
        self.iq._KERNELS.clear()
        self.iq._KERNELS.update(self.saved[0])
        self.iq.BACKEND = self.saved[1]
        from app.engine.kvcache.isoquant import kernel_path as kk

        kk.install()  # back to what this backend registers


def fresh_plans() -> None:
    """Forget IsoQuant's launch plans: a real decode step's cache lengths are new every step,
    so it looks its launch up anew; a step rebuilt from the same cache state must pay that too
    (else it would find last build's). The blocks of steps planned together stay, as they do
    between real steps (a block is planned one step in STEP_ROWS, as compression is one in
    compress_every: both weigh in host_ms_mean, not in the median)."""
    from app.engine.kvcache.isoquant import kernels as iq

    iq._PLANS.clear()
    iq._iparams_cached.cache_clear()
    iq._STEP[0] = (None, None)  # the step's launch planned by its first layer


@contextlib.contextmanager
def as_variant(r: Runner, v: str):
    """The runner's model as variant `v` runs it: "_uncompiled" puts its compiled blocks back
    to mlx-lm's classes for the duration (compile_blocks turns them on again, no new trace)."""
    uncompiled = v.endswith("_uncompiled")
    if uncompiled:
        compiled.uncompile(r.model)
    try:
        yield r
    finally:
        if uncompiled:
            compiled.compile_blocks(r.model)


@contextlib.contextmanager
def kept_state(r: Runner):
    """The runner's caches exactly as they were once the block ends (a step built, not run)."""
    saved = [dict(vars(c)) for c in r.cache]
    try:
        yield
    finally:
        for cache, state in zip(r.cache, saved, strict=True):
            vars(cache).clear()
            vars(cache).update(state)


def step_nodes(r: Runner) -> dict:
    """The nodes of one decode step's graph from the cache's current state (nothing evaluated,
    the cache put back): all of them, those that launch work (not views), and the most common
    primitives. Compiled functions' fused kernels count as one node each."""
    import collections

    from app.engine.testing.graphs import VIEWS, primitives

    mx.eval([v for c in r.cache for v in vars(c).values() if isinstance(v, mx.array)])
    with kept_state(r):
        labels = primitives(r.step(mx.array([int(r.last)])))
    counts = collections.Counter("Compiled" if n.startswith("Compiled") else n for n in labels)
    return {
        "graph_nodes": sum(counts.values()),
        "launch_nodes": sum(c for n, c in counts.items() if n not in VIEWS),
        "top": dict(counts.most_common(24)),
    }


def host_ms(runners: dict, variants: list[str], steps: int) -> dict:
    """Thread CPU ms to build one decode step's graph with nothing evaluated: each variant
    builds the step from its cache's state (the caches' attributes put back after each build,
    the graph dropped, IsoQuant's launch plans forgotten as a new cache length would),
    interleaved variant by variant so that they share the machine's state, then every cache
    takes one real step: variant -> (cpu ms list, wall ms list)."""
    out = {v: ([], []) for v in variants}
    for i in range(steps + 2):
        for v in variants if i % 2 == 0 else variants[::-1]:
            r = runners[v.split("_")[0]]
            tok = mx.array([r.last])
            stub = StubKernels() if v.endswith("_stubbed") else contextlib.nullcontext()
            with as_variant(r, v), kept_state(r), stub:
                fresh_plans()
                t, c = time.perf_counter(), time.thread_time()
                y = r.step(tok)
                c1, t1 = time.thread_time(), time.perf_counter()
                del y
            if i >= 2:  # the first builds of a variant may trace compiled functions
                out[v][0].append((c1 - c) * 1e3)
                out[v][1].append((t1 - t) * 1e3)
        # one real step each: the builds cover successive cache states, so IsoQuant's batched
        # compression (one step in compress_every) weighs in the median as it does in decode
        for name in dict.fromkeys(v.split("_")[0] for v in variants):
            r = runners[name]
            for tok in r.stream([r.last], r.cache, 1):
                r.last = tok
    return out


class Timers:
    """Thread CPU time per part of a step, exclusive of the parts nested inside it."""

    def __init__(self):
        self.excl: dict[str, float] = {}
        self.stack: list[float] = []
        self.undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr)
        timers = self

        def timed(*a, **k):
            timers.stack.append(0.0)
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt = time.thread_time() - t
                child = timers.stack.pop()
                timers.excl[label] = timers.excl.get(label, 0.0) + dt - child
                if timers.stack:
                    timers.stack[-1] += dt

        self.undo.append((owner, attr, owner.__dict__.get(attr)))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, fn in reversed(self.undo):
            if fn is None:  # inherited: drop the wrapper
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)


def breakdown(r: Runner, steps: int = 16) -> dict:
    """Mean host ms per decode step by part: mlx-lm's attention module (projections, norms,
    RoPE, reshapes), the cache's update, the attention op, the feed-forward block, the layer
    norms, the rest (embedding, residuals, head, sampler); IsoQuant's cache parts apart."""
    import sys as _sys

    from app.engine.kvcache.isoquant import IsoQuantKVCache, dispatch

    layer = r.model.model.layers[0]
    attn_mod = _sys.modules[type(layer.self_attn).__module__]
    t = Timers()
    t.wrap(type(layer.self_attn), "__call__", "attention module (projections, norms, RoPE)")
    t.wrap(type(r.cache[0]), "update_and_fetch", "cache update_and_fetch")
    if isinstance(r.cache[0], IsoQuantKVCache):
        for attr in ("_append_fp", "_encode_to", "_fetch"):
            if hasattr(IsoQuantKVCache, attr):
                t.wrap(IsoQuantKVCache, attr, f"  isoquant cache {attr.strip('_')}")
        t.wrap(dispatch, "isoquant_attention", "isoquant attention (kernel call)")
    t.wrap(attn_mod, "scaled_dot_product_attention", "attention op (dispatch, SDPA)")
    t.wrap(type(layer.mlp), "__call__", "feed-forward block")
    t.wrap(nn.RMSNorm, "__call__", "RMS norms")
    tok = mx.array([r.last])
    total = 0.0
    try:
        for i in range(steps + 4):
            if i == 4:
                t.excl.clear()
                total = 0.0
            c = time.thread_time()
            y = r.step(tok)
            total += time.thread_time() - c
            mx.eval(y)
            tok = y.reshape(1)
    finally:
        t.restore()
    r.last = int(tok.item())
    parts = {k: round(v / steps * 1e3, 3) for k, v in t.excl.items()}
    parts["rest (embedding, residuals, head, sampler)"] = round(
        (total - sum(t.excl.values())) / steps * 1e3, 3
    )
    parts["total (with timers)"] = round(total / steps * 1e3, 3)
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384, 32768])
    ap.add_argument("--rounds", type=int, default=5, help="decode rounds per config")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per round")
    ap.add_argument("--warm", type=int, default=WARM_STEPS, help="untimed steps a round")
    ap.add_argument("--host-steps", type=int, default=40, help="builds per variant, interleaved")
    ap.add_argument("--layers", type=int, help="fewer layers (a quick check of the script)")
    ap.add_argument("--prefill-rounds", type=int, default=5, help="at most, time budget allowing")
    ap.add_argument("--budget-s", type=float, default=480, help="extra prefill rounds stop here")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (CPU): host time")
    ap.add_argument(
        "--before",
        action="store_true",
        help="also our configs with uncompiled blocks (decode and host time)",
    )
    ap.add_argument("--breakdown", action="store_true", help="host ms per step by part")
    ap.add_argument(
        "--prefill-ab",
        action="store_true",
        help=f"also fp16's prefill with the experts' prefill widening off ({WIDEN_OFF})",
    )
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    config = dict(QWEN3_30B_A3B, **(TINY if args.tiny else {}))
    if args.layers:
        config["num_hidden_layers"] = args.layers
    model_name = (
        "Qwen3-30B-A3B shapes"
        + (" (tiny widths: hidden 128, experts 64 wide, float32)" if args.tiny else "")
        + ", random weights, batch 1"
    )
    dtype = "float32" if args.tiny else "bfloat16"
    stock_model = build(config, True, 0, dtype)
    ours = build(config, False, 0, dtype)
    print(
        f"built in {time.perf_counter() - t_start:.0f} s: stock {weight_bytes(stock_model) / 1e9:.2f} GB, "
        f"ours {weight_bytes(ours) / 1e9:.2f} GB",
        flush=True,
    )
    chunk, why = prefill_chunk_for(config, context=max(args.contexts) + 1024)
    print(f"our prefill chunk: {chunk} ({why})")
    runners = {
        "stock": Runner("stock", stock_model, True, "fp16", 2048),
        "fp16": Runner("fp16", ours, False, "fp16", chunk),
        "isoquant3": Runner("isoquant3", ours, False, "isoquant3", chunk),
    }
    variants = [c for c in CONFIGS]
    if args.before:
        variants += ["fp16_uncompiled", "isoquant3_uncompiled"]
    host_variants = list(variants)
    from app.engine.kvcache.isoquant.kernels import kernels_available

    if not kernels_available():  # host time of the kernels' path, launches stubbed
        host_variants.append("isoquant3_stubbed")
    vocab = config["vocab_size"]
    # fp16 with the widening off right after fp16 (--prefill-ab), isoquant3 last
    prefill_names = ("stock", "fp16") + ((WIDEN_OFF,) if args.prefill_ab else ()) + ("isoquant3",)
    widen_bits = expert_widen.prefill_bits()
    print(f"experts' prefill widening: {widen_bits or 'off'} ({expert_widen.ENV})")
    # warm-up: kernels compiled for prefill chunks and decode steps
    for r in runners.values():
        prefill(r, prompt(min(args.contexts[0], 2 * r.chunk) + 3, vocab, 1), keep=True)
        decode_round(r, 4)
    if args.prefill_ab:
        warm = prompt(min(args.contexts[0], 2 * chunk) + 3, vocab, 1)
        prefill_as(runners, WIDEN_OFF, warm, keep=False)
    rows = []
    for ctx in args.contexts:
        ids = prompt(ctx, vocab, ctx)
        res = {v: {"prefill": [], "decode": [], "host": [], "wall": []} for v in variants}
        res[WIDEN_OFF] = {"prefill": []}
        for name in CONFIGS:
            runners[name].cache = None
            mx.clear_cache()
        for name in prefill_names:
            tps, peak = prefill_as(runners, name, ids, keep=name in CONFIGS)
            res[name]["prefill"].append(tps)
            res[name]["peak"] = peak
            print(
                f"ctx {ctx} {name:14s} prefill {tps:8.1f} tok/s  peak {peak / 1e9:6.2f} GB",
                flush=True,
            )
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for v in order:
                with as_variant(runners[v.split("_")[0]], v) as r:
                    res[v]["decode"].append(decode_round(r, args.steps, args.warm))
                print(
                    f"ctx {ctx} round {rnd} {v:22s} decode {res[v]['decode'][-1]:8.1f} tok/s",
                    flush=True,
                )
        for v, (cpu, wall) in host_ms(runners, host_variants, args.host_steps).items():
            res.setdefault(v, {"decode": [], "prefill": []})
            res[v]["host"], res[v]["wall"] = cpu, wall
            print(
                f"ctx {ctx} {v:22s} host {statistics.median(cpu):7.3f} ms/step (thread CPU; "
                f"wall {statistics.median(wall):7.3f})",
                flush=True,
            )
        for v in variants:
            with as_variant(runners[v.split("_")[0]], v) as r:
                n = res[v]["nodes"] = step_nodes(r)
            print(
                f"ctx {ctx} {v:22s} step graph {n['graph_nodes']} nodes, "
                f"{n['launch_nodes']} not views",
                flush=True,
            )
        first = sum(ctx / res[n]["prefill"][0] for n in prefill_names)
        for rnd in range(1, args.prefill_rounds):
            if time.perf_counter() - t_start + first > args.budget_s:
                break
            for name in prefill_names if rnd % 2 else prefill_names[::-1]:
                res[name]["prefill"].append(prefill_as(runners, name, ids, keep=False)[0])
        for v in host_variants:
            base = v.split("_")[0]
            rows.append(
                {
                    "machine": "",
                    "model": model_name,
                    "context": ctx,
                    "config": v,
                    "prefill_tps": round(statistics.median(res[base]["prefill"]), 1),
                    "prefill_rounds": [round(x, 1) for x in res[base]["prefill"]],
                    "decode_tps": round(statistics.median(res[v]["decode"]), 2)
                    if res[v]["decode"]
                    else None,
                    "rounds": [round(x, 2) for x in res[v]["decode"]],
                    # ratios within each round (adjacent in time): the machine's drift cancels
                    **{
                        f"decode_vs_{b}_paired": round(
                            statistics.median(
                                a / c
                                for a, c in zip(res[v]["decode"], res[b]["decode"], strict=True)
                            ),
                            3,
                        )
                        for b in PAIRED_WITH.get(base, ())
                        if res[v]["decode"] and res[b]["decode"]
                    },
                    "peak_gb": round(res[base]["peak"] / 1e9, 2),
                    "host_ms_per_step": round(statistics.median(res[v]["host"]), 3),
                    "host_ms_mean": round(statistics.fmean(res[v]["host"]), 3),
                    "host_ms_quartiles": [
                        round(x, 3) for x in statistics.quantiles(res[v]["host"], n=4)
                    ],
                    "host_wall_ms_per_step": round(statistics.median(res[v]["wall"]), 3),
                    "prefill_chunk": runners[base].chunk,
                    **(
                        {
                            "graph_nodes": res[v]["nodes"]["graph_nodes"],
                            "launch_nodes": res[v]["nodes"]["launch_nodes"],
                            "step_primitives": res[v]["nodes"]["top"],
                        }
                        if "nodes" in res[v]
                        else {}
                    ),
                    **({"expert_prefill_bits": widen_bits} if base != "stock" else {}),
                }
            )
        if args.prefill_ab:
            off = res[WIDEN_OFF]
            rows.append(
                {
                    "machine": "",
                    "model": model_name,
                    "context": ctx,
                    "config": WIDEN_OFF,
                    "prefill_tps": round(statistics.median(off["prefill"]), 1),
                    "prefill_rounds": [round(x, 1) for x in off["prefill"]],
                    "decode_tps": None,
                    "peak_gb": round(off["peak"] / 1e9, 2),
                    "host_ms_per_step": None,
                    "prefill_chunk": runners["fp16"].chunk,
                    "expert_prefill_bits": None,
                }
            )
    parts = {}
    if args.breakdown:
        for v in host_variants:  # the stubbed variant last: its stubs leave zeros in the cache
            stub = StubKernels() if v.endswith("_stubbed") else contextlib.nullcontext()
            with as_variant(runners[v.split("_")[0]], v) as r, stub:
                parts[v] = breakdown(r)
        names = list(dict.fromkeys(k for p in parts.values() for k in p))
        print(
            f"\nhost ms per decode step by part (thread CPU time, mean of 16 steps)\n{'part':46s}"
            + "".join(f"{v:>22s}" for v in parts)
        )
        for k in names:
            print(f"{k:46s}" + "".join(f"{p.get(k, 0.0):22.3f}" for p in parts.values()))
    report(rows, args, parts)
    print(f"total {time.perf_counter() - t_start:.0f} s")


def report(rows: list[dict], args, parts: dict) -> None:
    from app.engine.bench import machine

    m = machine()
    label = f"{m['backend']}: {m['device']}"
    for r in rows:
        r["machine"] = label
    print(f"\n{'ctx':>6} {'config':22s} {'prefill':>9} {'decode':>8} {'peak GB':>8} {'host ms':>8}")
    by = {(r["context"], r["config"]): r for r in rows}
    for r in rows:
        print(
            f"{r['context']:6d} {r['config']:22s} {r['prefill_tps']:9.1f} {r['decode_tps'] or 0:8.2f} "
            f"{r['peak_gb']:8.2f} {r['host_ms_per_step'] or 0:8.3f}"
        )
    for ctx in args.contexts:
        s = by[(ctx, "stock")]
        for c in ("fp16", "isoquant3"):
            o = by[(ctx, c)]
            print(
                f"ctx {ctx} {c}/stock: prefill {o['prefill_tps'] / s['prefill_tps']:.2f}x, decode "
                f"{o['decode_tps'] / s['decode_tps']:.2f}x (paired rounds "
                f"{o.get('decode_vs_stock_paired', 0):.2f}x), host "
                f"{o['host_ms_per_step'] / s['host_ms_per_step']:.2f}x"
                + (
                    f"; decode vs fp16 {o['decode_vs_fp16_paired']:.2f}x (paired rounds)"
                    if "decode_vs_fp16_paired" in o
                    else ""
                )
            )
        off = by.get((ctx, WIDEN_OFF))
        if off:
            on = by[(ctx, "fp16")]
            print(
                f"ctx {ctx} fp16 prefill, experts widened to {on['expert_prefill_bits'] or 'off'} "
                f"/ widening off: {on['prefill_tps'] / off['prefill_tps']:.2f}x (off/stock "
                f"{off['prefill_tps'] / s['prefill_tps']:.2f}x)"
            )
    if args.no_write:
        return
    path = RESULTS / "engine_vs_mlxlm.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    # one current run per machine kind: the other kind's rows and its run's description stay
    kept = [r for r in old.get("runs", []) if not r["machine"].startswith(m["backend"] + ":")]
    key = "cpu_run" if m["backend"] == "cpu" else "gpu_run"
    other = {k: v for k, v in old.items() if k.endswith("_run") and k != key}
    from record import header

    this = {
        **header(m),
        "command": "python benchmarks/engine_vs_mlxlm.py " + " ".join(sys.argv[1:]),
        **({"host_breakdown_ms": parts} if parts else {}),
    }
    if m["backend"] == "cpu":
        this["note"] = (
            "2-core VM shared with other work: host ms are thread CPU time, inflated against an "
            "idle core; compare configs within the run only. CPU decode/prefill tok/s are not "
            "meaningful (float32 tiny widths)."
        )
    write_result(
        "engine_vs_mlxlm",
        {
            "method": "one process, both models resident; per context each config prefills a fresh "
            "cache, decode rounds alternate configs (median; decode_vs_*_paired: the median of "
            "the ratios within each round), host_ms_per_step: median "
            "thread CPU time to build one decode step's graph (nothing evaluated meanwhile)",
            **other,
            key: this,
            "runs": kept + rows,
        },
    )


if __name__ == "__main__":
    main()
