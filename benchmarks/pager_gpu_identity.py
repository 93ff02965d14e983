"""Is the expert pager bit-identical to the resident model on this backend, and if not, why?

Two parts, both against a reference computed the resident model's way:

(a) `gather_qmm` probes at the pager's shapes (Nemotron-3-Super experts: N 2688, K 1024,
    affine group 64, 2 and 4 bits, bfloat16 activations; 16 tokens x top-22 = 352 pairs over
    64 experts). Reference: one unsorted call on the `[experts, ...]` tensors. Variants: the
    same rows sorted by expert, in groups of experts (one call each), one expert per call
    (some calls under 8 rows), those padded to 8 rows, a decode step's 22 rows alone, the
    experts at permuted slots of a 256-slot pool, at the top of a pool whose weight tensor
    holds more than 2^32 weight elements (MLX CUDA's kernels offset weights in 32-bit ints),
    and the same through a view of that pool starting at the lowest slot (the pager's fix).
    Each: rows bitwise equal / all, max |diff|, and the reference's max |y| for scale.
(b) tiny random qwen3_moe, qwen2_moe and nemotron_h (bfloat16, converted at the default
    widths: 2-bit experts), paged at 100%, 50%, 25% of the expert bytes, at 2 slots (every
    prompt call split into groups) and at 50% with windows of 3 slots forced (the CUDA path
    exercised on small pools), vs `loader.load`: greedy 200 tokens from an 80-token
    prompt (more experts than slots) and from a 1-token prompt. Each: first differing token
    (None: all equal), whether the first step's log-probabilities are bitwise equal, and
    the calls split into groups of experts for that prompt.

    python benchmarks/pager_gpu_identity.py --out benchmarks/results/pager_gpu_identity.json

The big-pool probes allocate ~5 GB; they run by default on a GPU only (`--big` / `--no-big`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N, K, GROUP, E, TOKENS, TOPK = 2688, 1024, 64, 64, 16, 22
ARCHS = ("qwen3_moe", "qwen2_moe", "nemotron_h")
PROMPT_LEN, GEN = 80, 200


def machine() -> dict:
    import mlx.core as mx

    d = {
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "mlx": mx.__version__,
        "default_device": str(mx.default_device()),
        "cuda": bool(mx.cuda.is_available()),
        "metal": bool(mx.metal.is_available()),
    }
    if d["cuda"] or d["metal"]:
        try:
            d["device"] = mx.device_info()
        except Exception:  # older MLX: no device_info
            pass
    return json.loads(json.dumps(d, default=str))


# -- (a) gather_qmm probes ---------------------------------------------------------------------
def _compare(y, ref) -> dict:
    import mlx.core as mx

    y, ref = y.astype(mx.float32), ref.astype(mx.float32)
    rows = mx.all((y == ref).reshape(ref.shape[0], -1), axis=-1)
    return {
        "rows_equal": int(rows.sum().item()),
        "rows": int(ref.shape[0]),
        "max_abs_diff": float(mx.abs(y - ref).max().item()),
    }


def probe_bits(bits: int, big: bool) -> dict:
    import mlx.core as mx

    def qmm(x, w, idx, sorted_=False):
        # x: [n, 1, K]; idx: [n] -> [n, 1, N]
        return mx.gather_qmm(
            x,
            *w,
            rhs_indices=idx,
            transpose=True,
            group_size=GROUP,
            bits=bits,
            sorted_indices=sorted_,
        )

    wf = (mx.random.normal((E, N, K), key=mx.random.key(bits)) / K**0.5).astype(mx.bfloat16)
    w = mx.quantize(wf, GROUP, bits)  # (packed [E, N, K*bits/32], scales, biases)
    del wf
    mx.eval(w)
    rng = np.random.default_rng(bits)
    experts = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(TOKENS)])
    flat = experts.reshape(-1)  # [352] expert per pair
    x = mx.random.normal((TOKENS, 1, K), key=mx.random.key(100 + bits)).astype(mx.bfloat16)
    xr = x[mx.array(np.arange(flat.size) // TOPK)]  # [352, 1, K] each pair's token
    ref = qmm(xr, w, mx.array(flat.astype(np.uint32)))
    mx.eval(ref)
    out = {"reference_max_abs": float(mx.abs(ref.astype(mx.float32)).max().item())}

    def rows_of(order_parts):
        """[(pair rows, output)] -> output in pair order."""
        rows = np.concatenate([r for r, _ in order_parts])
        y = mx.concatenate([p for _, p in order_parts], axis=0)
        return y[mx.array(np.argsort(rows, kind="stable"))]

    order = np.argsort(flat, kind="stable")
    ys = qmm(xr[mx.array(order)], w, mx.array(flat[order].astype(np.uint32)), True)
    out["sorted_one_call"] = _compare(rows_of([(order, ys)]), ref)

    def per_groups(size, pad=False):
        parts = []
        uniq = np.unique(flat)
        for i in range(0, len(uniq), size):
            rows = order[np.isin(flat[order], uniq[i : i + size])]
            r = (
                np.concatenate([rows, np.repeat(rows[-1:], 8 - len(rows))])
                if pad and len(rows) < 8
                else rows
            )
            y = qmm(xr[mx.array(r)], w, mx.array(flat[r].astype(np.uint32)), True)
            parts.append((rows, y[: len(rows)]))
        return rows_of(parts), min(len(r) for r, _ in parts)

    y, least = per_groups(16)
    out["groups_of_16_experts"] = {**_compare(y, ref), "fewest_rows_per_call": least}
    y, least = per_groups(1)
    out["one_expert_per_call"] = {**_compare(y, ref), "fewest_rows_per_call": least}
    y, least = per_groups(1, pad=True)
    out["one_expert_per_call_padded_to_8"] = {**_compare(y, ref), "fewest_rows_per_call": least}
    y = qmm(xr[:TOPK], w, mx.array(flat[:TOPK].astype(np.uint32)))
    out["decode_step_alone"] = _compare(y, ref[:TOPK])
    y = qmm(xr[:4], w, mx.array(flat[:4].astype(np.uint32)))
    out["four_rows_alone"] = _compare(y, ref[:4])

    def pool_case(num_slots, slot_of):
        pool = [mx.zeros((num_slots, *a.shape[1:]), dtype=a.dtype) for a in w]
        sl = mx.array(slot_of.astype(np.uint32))
        for p, a in zip(pool, w, strict=True):
            p[sl] = a
        mx.eval(pool)
        return pool

    perm = np.random.default_rng(7).permutation(256)[:E]
    pool = pool_case(256, perm)
    out["permuted_slots_of_256"] = _compare(
        qmm(xr, pool, mx.array(perm[flat].astype(np.uint32))), ref
    )
    del pool
    if big:
        per_slot = N * K  # weight elements per expert
        slots = int((1 << 32) // per_slot + E + 8)
        lo = slots - E - 4  # every expert's offset past 2^32 elements
        slot_of = lo + np.arange(E)
        pool = pool_case(slots, slot_of)
        out["big_pool"] = {
            "slots": slots,
            "lowest_slot": lo,
            "weight_elements": slots * per_slot,
            "pool_bytes": sum(p.nbytes for p in pool),
        }
        ok = all(
            mx.array_equal(p[mx.array(slot_of.astype(np.uint32))], a).item()
            for p, a in zip(pool, w, strict=True)
        )
        out["big_pool"]["scatter_wrote_right_slots"] = bool(ok)
        out["big_pool_top_slots"] = _compare(
            qmm(xr, pool, mx.array(slot_of[flat].astype(np.uint32))), ref
        )
        view = [p[lo : lo + E] for p in pool]
        out["big_pool_view_from_lowest_slot"] = _compare(
            qmm(xr, view, mx.array(flat.astype(np.uint32))), ref
        )
        del pool, view
        mx.clear_cache()
    return out


# -- (b) tiny models ----------------------------------------------------------------------------
def _generate(model, prompt, n):
    from mlx_lm.generate import generate_step

    toks, first = [], None
    for tok, lp in generate_step(prompt, model, max_tokens=n):
        toks.append(int(tok))
        if first is None:
            first = lp
    return toks, first


def _first_mismatch(got, ref):
    n = 0
    while n < min(len(got), len(ref)) and got[n] == ref[n]:
        n += 1
    return None if n == len(got) == len(ref) else n


def tiny_models(dtype: str, gen: int, res: dict | None = None, saved=lambda: None) -> dict:
    import mlx.core as mx

    from app.engine.loader import load
    from app.engine.offload import layers, load_paged
    from app.engine.offload.records import ExpertStore
    from app.engine.quant.convert import convert
    from app.engine.testing.random_models import make_random_model

    prompts = {
        "prompt_80": mx.array(np.random.default_rng(7).integers(3, 1000, PROMPT_LEN).tolist()),
        "prompt_1": mx.array([17]),
    }
    res = {} if res is None else res
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            src = make_random_model(
                arch, Path(tmp) / f"{arch}-src", seed=11, scale=0.5, dtype=dtype
            )
            folder = Path(tmp) / f"{arch}-rq"
            convert(src, folder)
            with ExpertStore(folder) as st:
                slot = st.layout(st.layers[0]).expert_bytes
                eb = st.expert_bytes()
                per = st.layout(st.layers[0]).slot_elements
            ref_model = load(folder).model
            refs = {p: _generate(ref_model, prompts[p], gen) for p in prompts}
            del ref_model
            cases = {
                "budget_100": (eb, None),
                "budget_50": (eb // 2, None),
                "budget_25": (eb // 4, None),
                "slots_2": (2 * slot + slot // 2, None),
                "budget_50_windows_of_3": (eb // 2, 3 * per + 1),
            }
            real_limit = layers._index_limit
            for case, (budget, limit) in cases.items():
                if limit is not None:
                    layers._index_limit = lambda lim=limit: lim
                try:
                    lm = load_paged(folder, budget)
                finally:
                    layers._index_limit = real_limit
                pager = lm.model.rq_pager
                for p in prompts:
                    pager.reset_stats()
                    toks, first = _generate(lm.model, prompts[p], gen)
                    rt, rf = refs[p]
                    res[f"{arch}/{case}/{p}"] = {
                        "first_mismatch": _first_mismatch(toks, rt),
                        "tokens": len(rt),
                        "first_logprobs_equal": bool(mx.array_equal(first, rf).item()),
                        "first_logprobs_max_abs_diff": float(
                            mx.abs(first.astype(mx.float32) - rf.astype(mx.float32)).max().item()
                        ),
                        "slots": pager.stats()["slots"],
                        "split_calls": pager.stats()["split_calls"],
                    }
                    saved()
                pager.close()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "pager_gpu_identity.json")
    )
    ap.add_argument(
        "--big",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="big-pool probes (~5 GB; default: on a GPU only)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="tiny models' dtype")
    ap.add_argument("--tokens", type=int, default=GEN)
    ap.add_argument("--skip-probes", action="store_true", help="only the tiny models (part b)")
    a = ap.parse_args()
    import mlx.core as mx

    big = a.big if a.big is not None else bool(mx.cuda.is_available() or mx.metal.is_available())
    t0 = time.perf_counter()
    result = {
        "machine": machine(),
        "settings": {
            "probe": {
                "N": N,
                "K": K,
                "group_size": GROUP,
                "experts": E,
                "tokens": TOKENS,
                "top_k": TOPK,
                "x_dtype": "bfloat16",
                "big_pool": big,
            },
            "models": {
                "archs": ARCHS,
                "dtype": a.dtype,
                "prompt_tokens": [PROMPT_LEN, 1],
                "generated": a.tokens,
                "sampler": "greedy",
            },
        },
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        result["seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    result["gather_qmm"] = {}
    for bits in () if a.skip_probes else (2, 4):
        result["gather_qmm"][f"{bits}bit"] = probe_bits(bits, big)
        save()
    result["probe_seconds"] = time.perf_counter() - t0
    print(f"{'gather_qmm probe':40s} {'rows equal':>12s} {'max |diff|':>11s}")
    for b, d in result["gather_qmm"].items():
        for case, v in d.items():
            if isinstance(v, dict) and "rows" in v:
                print(
                    f"{b + ' ' + case:40s} {v['rows_equal']:>5d} / {v['rows']:<5d} "
                    f"{v['max_abs_diff']:11.3g}"
                )
        print(f"{b + ' reference max |y|':40s} {d['reference_max_abs']:>25.3g}")
    result["models"] = {}
    tiny_models(a.dtype, a.tokens, result["models"], save)
    result["models_seconds"] = time.perf_counter() - t0 - result["probe_seconds"]
    save()
    print(
        f"\n{'model / budget / prompt':44s} {'first mismatch':>14s} {'step-0 logprobs':>16s} "
        f"{'splits':>6s}"
    )
    for name, v in result["models"].items():
        fm = "none" if v["first_mismatch"] is None else str(v["first_mismatch"])
        eq = "equal" if v["first_logprobs_equal"] else f"{v['first_logprobs_max_abs_diff']:.2g}"
        print(f"{name:44s} {fm:>14s} {eq:>16s} {v['split_calls']:>6d}")
    print(
        f"wrote {out} ({result['seconds']:.0f} s: probes {result['probe_seconds']:.0f} s, "
        f"models {result['models_seconds']:.0f} s)"
    )


if __name__ == "__main__":
    main()
