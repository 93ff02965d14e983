"""The identities the one-token decode step relies on (compiled._fused_heads), bit for bit, on
whatever backend runs the tests: on a GPU, MLX's CUDA or Metal kernels for rms_norm and RoPE
(the same checks at head dim 128 passed on the H200, bf16 / fp16 / fp32), on the CPU their
composed ops. The q and k heads normalised in one rms_norm without weight, times a per-head
weight array, equal the two norms with their weights; one RoPE over the q and k heads equals
two; and the heads laid out as [B, heads, 1, D] at once equal mlx-lm's [B, 1, heads, D]
transposed."""

from __future__ import annotations

import mlx.core as mx
import pytest


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (16, 2, 64), (40, 8, 128), (9, 3, 64)])
def test_merged_q_k_norm_and_rope_equal_the_separate_ones(dtype, hq, hkv, d):
    dt = getattr(mx, dtype)
    key = mx.random.key(hq * 100 + d)
    k1, k2, k3 = mx.random.split(key, 3)
    y = (mx.random.normal((1, hq + 2 * hkv, 1, d), key=k1) * 3).astype(dt)  # q | k | v heads
    wq = (mx.random.normal((d,), key=k2) * 0.3 + 1).astype(dt)
    wk = (mx.random.normal((d,), key=k3) * 0.3 + 1).astype(dt)
    rows = mx.concatenate([mx.broadcast_to(wq, (hq, 1, d)), mx.broadcast_to(wk, (hkv, 1, d))])
    off = mx.array(1234, mx.int32)

    def rope(x):
        return mx.fast.rope(x, d, traditional=False, base=1e6, scale=1.0, offset=off)

    merged = rope(mx.fast.rms_norm(y[:, : hq + hkv], None, 1e-6) * rows)
    # mlx-lm's order: [B, 1, heads, D], each norm with its weight, transposed, rotated apart
    flat = y.reshape(1, 1, hq + 2 * hkv, d)
    q = rope(mx.fast.rms_norm(flat[:, :, :hq], wq, 1e-6).transpose(0, 2, 1, 3))
    k = rope(mx.fast.rms_norm(flat[:, :, hq : hq + hkv], wk, 1e-6).transpose(0, 2, 1, 3))
    assert mx.array_equal(merged[:, :hq], q).item()
    assert mx.array_equal(merged[:, hq:], k).item()
