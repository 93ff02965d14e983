"""IsoQuant's code-to-level lookup on the CPU: MLX's gather against a tree of selects.

Without kernels (MLX's CPU backend) IsoQuant attention decodes its compressed K/V every step:
unpack the 3-bit codes, then levels[codes] (quantizer.lookup). MLX's CPU gather costs ~5-8 ns
an element; the tree of selects (bit 0 picks within pairs of levels, bit 1 within pairs of
pairs, ...) compiled into one fused pass gives the same values bit for bit. Side by side in one
process, medians of timed evaluations:

  lookup rows   levels[codes] alone, eager gather vs Quantizer.lookup (the compiled tree for
                3-bit tables; 4-bit tables keep the gather: a 15-select tree was slower)
  attention     one layer's decode attention as the server's batches run it (8 rows, SmolLM2's
                3 KV heads of 64, 9 query heads; compressed tokens plus a 64-token float
                window): the compiled reference with the gather and with the tree, and
                mx.fast SDPA over the same token count in float32 (what a float cache runs)

    python benchmarks/isoquant_lookup.py

Results: benchmarks/results/isoquant_lookup.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from record import write_result  # noqa: E402

from app.engine.kvcache.isoquant import attention as at  # noqa: E402
from app.engine.kvcache.isoquant.packing import pack_codes  # noqa: E402
from app.engine.kvcache.isoquant.quantizer import TREE_MAX_LEVELS, Quantizer  # noqa: E402
from app.engine.kvcache.isoquant.rotation import Rotation  # noqa: E402

B, HKV, HQ, D, WINDOW = 8, 3, 9, 64, 64


def median_ms(fn, n: int = 60) -> float:
    for _ in range(5):
        mx.eval(fn())
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e3, 4)


class Gather:
    """Quantizer.lookup as the plain gather for the block's duration (new traces under a key
    of their own: the compiled attention is keyed by its inputs, so it is cleared)."""

    def __enter__(self):
        self.saved = Quantizer.lookup
        Quantizer.lookup = lambda self, codes: self.levels[codes]
        at._TRACES.clear()

    def __exit__(self, *exc):
        Quantizer.lookup = self.saved
        at._TRACES.clear()


def layer_tensors(tc: int, seed: int):
    rot = Rotation.make("v3", D, HKV, seed=seed)
    q3 = Quantizer.make(D, 3)
    tensors = []
    for i in range(2):
        key = mx.random.key(seed * 2 + i)
        codes = mx.random.randint(0, 8, (B, HKV, tc, D), key=key).astype(mx.uint8)
        norms = (mx.random.uniform(4, 12, (B, HKV, tc), key=key)).astype(mx.float16)
        fp = mx.random.normal((B, HKV, WINDOW, D), key=key)
        tensors.append(at.IsoQuantTensor(pack_codes(codes, 3), norms, fp, q3, rot))
    mx.eval([(t.codes, t.norms, t.fp) for t in tensors])
    return tensors


def main() -> None:
    rows = []
    for bits in (3, 4):
        q = Quantizer.make(D, bits)
        codes = mx.random.randint(0, 2**bits, (B, HKV, 128, D)).astype(mx.uint8)
        mx.eval(codes)
        assert mx.array_equal(q.lookup(codes), q.levels[codes]).item()
        gather = median_ms(lambda q=q, c=codes: q.levels[c])
        tree = median_ms(lambda q=q, c=codes: q.lookup(c))
        rows.append(
            {"what": "lookup", "bits": bits, "elements": codes.size, "gather_ms": gather,
             "lookup_ms": tree, "lookup_is_tree": 2**bits <= TREE_MAX_LEVELS,
             "speedup": round(gather / tree, 2)}
        )  # fmt: skip
    query = mx.random.normal((B, HQ, 1, D))
    for tc in (48, 192, 960):
        keys, values = layer_tensors(tc, tc)
        want = at.isoquant_attention_reference(query, keys, values, 0.125)
        assert at.compiled_eligible(query, keys, values, None, None)
        tree = median_ms(lambda k=keys, v=values: at._attend_compiled(query, k, v, 0.125))
        assert mx.array_equal(at._attend_compiled(query, keys, values, 0.125), want).item()
        with Gather():
            gather = median_ms(lambda k=keys, v=values: at._attend_compiled(query, k, v, 0.125))
        kf = mx.random.normal((B, HKV, tc + WINDOW, D))
        sdpa = median_ms(
            lambda kf=kf: mx.fast.scaled_dot_product_attention(query, kf, kf, scale=0.125)
        )
        rows.append(
            {"what": "attention", "compressed_tokens": tc, "float_tokens": WINDOW,
             "gather_ms": gather, "lookup_ms": tree, "float_sdpa_ms": sdpa,
             "speedup": round(gather / tree, 2)}
        )  # fmt: skip
    print(
        f"{'what':10s} {'size':>12s} {'gather ms':>10s} {'lookup ms':>10s} {'speedup':>8s} {'float SDPA ms':>14s}"
    )
    for r in rows:
        size = f"{r['bits']}-bit" if r["what"] == "lookup" else f"Tc {r['compressed_tokens']}"
        print(
            f"{r['what']:10s} {size:>12s} {r['gather_ms']:10.3f} {r['lookup_ms']:10.3f} "
            f"{r['speedup']:7.2f}x {r.get('float_sdpa_ms', float('nan')):14.3f}"
        )
    write_result(
        "isoquant_lookup",
        {
            "command": "python benchmarks/isoquant_lookup.py",
            "shape": {"B": B, "Hkv": HKV, "Hq": HQ, "D": D, "float_window": WINDOW},
            "method": "one process; median of 60 timed evaluations after 5 warm-ups; lookup "
            "equals the gather bit for bit (asserted); attention: the compiled reference step "
            "(attention._attend_compiled) with Quantizer.lookup as the plain gather and as it is",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
