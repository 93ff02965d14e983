"""Run a few fused IsoQuant decode-attention calls for Nsight Compute (kernel-level profile):

    ncu -k regex:iq_ --launch-skip 2 --launch-count 4 --section SpeedOfLight \
        --section WarpStateStats python benchmarks/isoquant_ncu.py 8x2048 8x32768

Shapes BxT (32 q / 8 KV heads, d 128, 3-bit, one query token); BxTe: the same launch with
every sequence empty (lens 0), i.e. the threadgroups' set-up alone. Each shape runs 4 calls
(the first compiles), evaluated one at a time so every launch is its own graph.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from app.engine.kvcache.isoquant import kernels as iq  # noqa: E402

for arg in sys.argv[1:] or ["8x2048"]:
    empty = arg.endswith("e")
    b, t = (int(x) for x in arg.rstrip("e").split("x"))
    q, k, v = iq.random_problem(b, 8, 4, 1, 128, t, 0, seed=1, encoded=False)
    mx.eval(q, k.codes, k.norms, v.codes, v.norms)
    lens = [0] * b if empty else None
    for _ in range(4):
        mx.eval(iq.fused_attention(q, k, v, 1 / math.sqrt(128), lens=lens))
    print(arg, "done", flush=True)
