"""Run a few ZipFusion decode-attention calls for Nsight Compute (kernel-level profile):

    ncu --cache-control none --clock-control none -k regex:"zipfusion_(attn|reduce)" \
        --launch-skip 2 --launch-count 14 --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section LaunchStats python benchmarks/zipfusion_ncu.py 8

Arguments: batch sizes (Llama-3.1-8B attention: 32 q / 8 KV heads, d 128, 8K context, random
bf16 KV with the random-weight model's scale, compressed pages); each batch runs 4 calls of
the library's default launch, evaluated one at a time (the first compiles), then the same on
raw pages.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from zipfusion import build_timing_stores  # noqa: E402

from app.engine.kvcache.zipfusion import kernels as zk  # noqa: E402

N_Q, N_KV, D, CTX = 32, 8, 128, 8192
for arg in sys.argv[1:] or ["8"]:
    b = int(arg)
    src = []
    for i in range(4):
        mx.random.seed(i)
        k = (mx.random.normal((1, N_KV, 1024, D)) * 2.0).astype(mx.bfloat16)
        v = mx.random.normal((1, N_KV, 1024, D)).astype(mx.bfloat16)
        src.append((k, v))
    zst, rst = build_timing_stores(src, b, CTX, N_KV, D)
    q = mx.random.normal((b, N_Q, D)).astype(mx.bfloat16)
    kn = mx.random.normal((b, N_KV, D)).astype(mx.bfloat16)
    vn = mx.random.normal((b, N_KV, D)).astype(mx.bfloat16)
    for st, tag in ((zst, "compressed"), (rst, "raw")):
        st.begin(list(range(b)))
        for _ in range(4):
            mx.eval(
                zk.paged_decode_attention(
                    q, st.pool, st.meta, st.page_table, st.seq_len, kn, vn, layer=0,
                    n_ids=st.n_ids, scale=D**-0.5, use_kernel=True,
                )
            )  # fmt: skip
        st.staged = [None]
        print(f"B={b} {tag} done", flush=True)
