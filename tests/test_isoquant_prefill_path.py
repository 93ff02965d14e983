"""The kernel path's prefill route: chunks of many queries attend through the dequantized K/V
and mx.fast's SDPA (kernel_path.dequantized_attention), held to the MLX-ops reference."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from app.engine.kvcache.isoquant import IsoQuantKVCache, kernel_path
from app.engine.kvcache.isoquant.kernels import attention_reference, rel_error

HKV, G, D = 2, 3, 64


def _cache(layout: str, sink: int, window: int, n: int, seed: int):
    c = IsoQuantKVCache("v3", 3, 3, window=window, sink=sink, compress_every=5, v_layout=layout)
    k1, k2 = mx.random.split(mx.random.key(seed))
    c.update_and_fetch(
        mx.random.normal((1, HKV, n, D), key=k1), mx.random.normal((1, HKV, n, D), key=k2)
    )
    c.finish_prefill()
    return c


@pytest.mark.parametrize("layout", ["rows", "tc16"])
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("n_new", [1, 37, 70])
def test_dequantized_attention_matches_the_reference(layout, sink, use_sinks, n_new):
    c = _cache(layout, sink, window=9, n=83, seed=n_new)
    k1, k2, k3 = mx.random.split(mx.random.key(7 + n_new), 3)
    keys, values = c.update_and_fetch(
        mx.random.normal((1, HKV, n_new, D), key=k1), mx.random.normal((1, HKV, n_new, D), key=k2)
    )
    assert keys.compressed_len > 0 and keys.fp_len >= n_new
    assert (keys.prefix is not None) == bool(sink) and values.layout == layout
    q = mx.random.normal((1, HKV * G, n_new, D), key=k3)
    mask = "causal" if n_new > 1 else None
    sinks = mx.array([0.5, -1.0, 0.0, 2.0, 1.0, -0.5]) if use_sinks else None
    got = kernel_path.dequantized_attention(q, keys, values, 0.125, mask, sinks)
    want = attention_reference(q, keys, values, 0.125, mask, sinks)
    assert got.shape == want.shape == q.shape and got.dtype == q.dtype
    assert rel_error(got, want) < 2e-5


@pytest.mark.parametrize("layout", ["rows", "tc16"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 71, 72])
def test_dequantizing_in_pieces_is_exact(layout, chunk):
    """The prefill route dequantizes the compressed tokens a piece at a time (to bound its
    temporaries): any piece size, awkward ones included, gives the one-piece result bit for
    bit, for the codes, a float sink prefix and the window, and with the decoded shadow."""
    c = _cache(layout, 3, window=9, n=83, seed=11)
    keys, values = c.update_and_fetch(mx.random.normal((1, HKV, 1, D)),
                                      mx.random.normal((1, HKV, 1, D)))  # fmt: skip
    assert keys.compressed_len == 72  # pieces of 71 and 72: 2 and 1
    for t in (keys, values):
        for dtype in (mx.float32, mx.bfloat16):
            whole = kernel_path._dequantized(t, dtype, chunk=0)
            assert whole.shape == t.shape
            assert mx.array_equal(kernel_path._dequantized(t, dtype, chunk=chunk), whole).item()
    shadow = replace(keys.as_rows(), decoded=keys.levels())
    whole = kernel_path._dequantized(shadow, mx.float32, chunk=0)
    assert mx.array_equal(kernel_path._dequantized(shadow, mx.float32, chunk=chunk), whole).item()


def test_dequantized_attention_in_bfloat16_stays_near_the_reference():
    c = _cache("rows", 0, window=4, n=200, seed=3)
    keys, values = c.update_and_fetch(
        mx.random.normal((1, HKV, 80, D)).astype(mx.bfloat16),
        mx.random.normal((1, HKV, 80, D)).astype(mx.bfloat16),
    )
    q = mx.random.normal((1, HKV * G, 80, D)).astype(mx.bfloat16)
    got = kernel_path.dequantized_attention(q, keys, values, 0.125, "causal")
    want = attention_reference(q.astype(mx.float32), keys, values, 0.125, "causal")
    assert got.dtype == mx.bfloat16 and rel_error(got.astype(mx.float32), want) < 2e-2


def test_the_kernel_path_sends_long_chunks_to_the_dequantized_route(monkeypatch):
    """With kernels present, chunks of >= DEQUANT_MIN_QUERIES queries (no ragged lens) take the
    dequantized route unless the setting asks for the kernel; shorter ones, the kernel."""
    calls = []
    monkeypatch.setattr(kernel_path, "kernels_available", lambda: True)

    def fake_kernel(q, *a, **k):
        calls.append(("kernel", q.shape[2]))
        return mx.zeros_like(q)

    monkeypatch.setattr(kernel_path, "attention", fake_kernel)
    c = _cache("rows", 0, window=4, n=300, seed=5)
    n = kernel_path.DEQUANT_MIN_QUERIES
    for L in (1, n - 1, n, n + 9):
        keys, values = c.update_and_fetch(
            mx.random.normal((1, HKV, L, D)), mx.random.normal((1, HKV, L, D))
        )
        q = mx.random.normal((1, HKV * G, L, D))
        mask = "causal" if L > 1 else None
        out = kernel_path.isoquant_attention(q, keys, values, 0.125, mask)
        if L >= n:
            assert calls[-1:] != [("kernel", L)]
            assert rel_error(out, attention_reference(q, keys, values, 0.125, mask)) < 2e-5
            monkeypatch.setenv(kernel_path.PREFILL_ENV, "kernel")
            kernel_path.isoquant_attention(q, keys, values, 0.125, mask)
            assert calls[-1] == ("kernel", L)
            monkeypatch.delenv(kernel_path.PREFILL_ENV)
        else:
            assert calls[-1] == ("kernel", L)
    monkeypatch.setenv(kernel_path.PREFILL_ENV, "flash")
    with pytest.raises(ValueError, match="expected one of"):
        kernel_path.isoquant_attention(q, keys, values, 0.125, "causal")
