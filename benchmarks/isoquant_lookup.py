"""IsoQuant's code-to-level decoding on the CPU: unpack + gather, unpack + a tree of selects,
and the lookup by word.

Without kernels (MLX's CPU backend) IsoQuant attention decodes its compressed K/V every step:
3-bit codes to levels[codes]. Three ways, the same values bit for bit (asserted):

  gather    unpack_codes (a sum over each block's bytes, then shifts), then levels[codes] as
            MLX's gather (~5-8 ns an element on a CPU)
  tree      unpack_codes, then a tree of selects (bit 0 picks within pairs of levels, bit 1
            within pairs of pairs, ...) compiled into one fused pass (Quantizer.lookup)
  words     what the cache does: the codes viewed as uint32 words, unpacked by shifts and
            masks and looked up in a byte table held in one uint64 (levels = scale · int8
            grid), all in one elementwise pass (Quantizer.lookup_words)

Side by side in one process, medians of timed evaluations:

  decode rows     packed [8, 3, 128, 64] 3-bit codes -> levels, each way alone
  attention rows  one layer's decode attention as the server's batches run it (8 rows,
                  SmolLM2's 3 KV heads of 64, 9 query heads; compressed tokens plus a 64-token
                  float window): the compiled reference step each way, and mx.fast SDPA over
                  the same token count in float32 (what a float cache runs)

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
from app.engine.kvcache.isoquant.quantizer import Quantizer  # noqa: E402
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


class Way:
    """Decode the codes one way for the block's duration: "gather" and "tree" unpack the
    bytes (no lookup by word), "gather" then takes levels[codes] as MLX's gather. New traces
    under a key of their own: the compiled attention is keyed by its inputs, so it is cleared."""

    def __init__(self, way: str):
        self.way = way

    def __enter__(self):
        self.saved = Quantizer.lookup, at.IsoQuantTensor.code_words
        if self.way in ("gather", "tree"):
            at.IsoQuantTensor.code_words = lambda self: None
        if self.way == "gather":
            Quantizer.lookup = lambda self, codes: self.levels[codes]
        at._TRACES.clear()

    def __exit__(self, *exc):
        Quantizer.lookup, at.IsoQuantTensor.code_words = self.saved
        at._TRACES.clear()


WAYS = ("gather", "tree", "words")


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
    q = Quantizer.make(D, 3)
    codes = mx.random.randint(0, 8, (B, HKV, 128, D)).astype(mx.uint8)
    t = at.IsoQuantTensor(pack_codes(codes, 3), mx.ones((B, HKV, 128), mx.float16), None, q,
                          Rotation.make("v3", D, HKV, seed=0))  # fmt: skip
    mx.eval(t.codes)
    row = {"what": "decode", "elements": codes.size}
    for way in WAYS:
        with Way(way):
            assert mx.array_equal(t.levels(), q.levels[codes]).item()
            row[f"{way}_ms"] = median_ms(t.levels)
    rows.append(row)
    query = mx.random.normal((B, HQ, 1, D))
    for tc in (16, 48, 192, 960):
        keys, values = layer_tensors(tc, tc)
        want = at.isoquant_attention_reference(query, keys, values, 0.125)
        assert at.compiled_eligible(query, keys, values, None, None)
        row = {"what": "attention", "compressed_tokens": tc, "float_tokens": WINDOW}
        for way in WAYS:
            with Way(way):
                got = at._attend_compiled(query, keys, values, 0.125)
                assert mx.array_equal(got, want).item()
                row[f"{way}_ms"] = median_ms(
                    lambda k=keys, v=values: at._attend_compiled(query, k, v, 0.125)
                )
        kf = mx.random.normal((B, HKV, tc + WINDOW, D))
        row["float_sdpa_ms"] = median_ms(
            lambda kf=kf: mx.fast.scaled_dot_product_attention(query, kf, kf, scale=0.125)
        )
        rows.append(row)
    for r in rows:
        r["words_vs_tree"] = round(r["tree_ms"] / r["words_ms"], 2)
    head = f"{'what':10s} {'size':>10s}" + "".join(f"{w + ' ms':>11s}" for w in WAYS)
    print(head + f"{'words/tree':>11s} {'float SDPA ms':>14s}")
    for r in rows:
        size = f"Tc {r['compressed_tokens']}" if r["what"] == "attention" else "3-bit"
        times = "".join(f"{r[w + '_ms']:11.3f}" for w in WAYS)
        print(
            f"{r['what']:10s} {size:>10s}{times}{r['words_vs_tree']:10.2f}x "
            f"{r.get('float_sdpa_ms', float('nan')):14.3f}"
        )
    write_result(
        "isoquant_lookup",
        {
            "command": "python benchmarks/isoquant_lookup.py",
            "shape": {"B": B, "Hkv": HKV, "Hq": HQ, "D": D, "float_window": WINDOW},
            "method": "one process; median of 60 timed evaluations after 5 warm-ups; every way "
            "gives the gather's levels bit for bit (asserted); attention: the compiled "
            "reference step (attention._attend_compiled) decoding each way",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
