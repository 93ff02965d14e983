"""IsoQuant modes that code a band of layers at other bits and window (modes.LayerBand): each
layer stores the bits and window it claims, the modes table counts those bytes, a user's window
applies to every layer, and mlx-lm's prompt-cache files round-trip the per-layer settings."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from app.engine import kvcache
from app.engine.kvcache import modes
from app.engine.kvcache.isoquant import IsoQuantKVCache
from app.engine.testing import tiny_families

LAYERS = 6
BAND = modes.LayerBand(0.5, 5 / 6, key_bits=4, value_bits=3, window=8)  # layers 3 and 4 of 6


@pytest.fixture(scope="module")
def model():
    """A tiny random llama with 6 layers (4 query / 2 KV heads of 32)."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama

    cfg = {**tiny_families.tiny_config("llama"), "num_hidden_layers": LAYERS}
    m = llama.Model(llama.ModelArgs.from_dict(cfg))
    key = mx.random.key(3)
    flat = []
    for i, (name, p) in enumerate(tree_flatten(m.parameters())):
        k = mx.random.split(key, i + 2)[-1]
        base = 1.0 if "norm" in name else 0.0
        flat.append((name, (base + 0.05 * mx.random.normal(p.shape, key=k)).astype(mx.float32)))
    m.update(tree_unflatten(flat))
    mx.eval(m.parameters())
    return m


@pytest.fixture
def band_row():
    row = kvcache.register(
        kvcache.KVMode(
            "isoquant_band_test", "IsoQuant band (test)", False, modes.BACKENDS,
            functools.partial(modes.banded_isoquant_nbytes, 3, 3, 4, BAND),
            "app.engine.kvcache.isoquant:make_cache", description="test row",
            options={"rotation": "v3", "key_bits": 3, "value_bits": 3, "default_window": 4,
                     "band": BAND},
        )
    )  # fmt: skip
    yield row
    del kvcache.MODES[row.name]


def _ids(n, seed=0):
    return mx.array(np.random.default_rng(seed).integers(3, tiny_families.VOCAB, n).tolist())


def _fill(model, cache, n=70, chunk=16):
    ids = _ids(n)
    for i in range(0, n, chunk):
        model(ids[None, i : i + chunk], cache=cache)
    kvcache.finish_prefill(cache)
    mx.eval([a for c in cache for a in c.state if isinstance(a, mx.array)])


def test_band_picks_layers_by_relative_depth():
    band = modes.LayerBand(0.5, 5 / 6, 4, 3, 64)
    assert band.layers(30) == list(range(15, 25))
    assert band.layers(60) == list(range(30, 50))
    assert band.layers(48) == list(range(24, 40))
    assert BAND.layers(LAYERS) == [3, 4]


def test_each_layer_stores_the_bits_and_window_it_claims(model, band_row):
    cache = kvcache.make_cache(model, band_row.name)
    assert all(isinstance(c, IsoQuantKVCache) for c in cache)
    _fill(model, cache)
    for i, c in enumerate(cache):
        kb, vb, w = (4, 3, 8) if i in (3, 4) else (3, 3, 4)
        assert (c.key_bits, c.value_bits, c.window) == (kb, vb, w), i
        d = c.rotation.head_dim
        # the codes really are kb / vb bits a coordinate: packed row widths
        assert c.k_codes.shape[-1] == d * kb // 8 and c.kq.bits == kb
        assert c.vq.bits == vb and c.vq.row_bytes == d * vb // 8
        assert c.compressed == c.offset - w  # the window is the layer's own
        r, h = c._enc_rows, c.rotation.n_heads
        n_float = c.offset - c.fp_start
        held = h * (
            r * (d * kb // 8 + 4) + c._v_rows(r) * (d * vb // 8) + n_float * 2 * d * 4
        )  # codes, two fp16 scales, float tail (float32 on this CPU)
        assert c.nbytes == held
    deep, shallow = cache[3].nbytes, cache[0].nbytes
    assert deep > shallow  # 4-bit keys and a longer window cost bytes


def test_table_row_counts_the_band(band_row):
    dims = kvcache.AttentionDims(kv_heads=2, k_head_dim=64, v_head_dim=64)
    t = 2048
    per_layer = [
        modes.isoquant_nbytes(4, 3, dims, t, 8)
        if BAND.holds(i, LAYERS)
        else modes.isoquant_nbytes(3, 3, dims, t, 4)
        for i in range(LAYERS)
    ]
    # the band's share (1/3) is exactly 2 of 6 layers here: the row's mean is the layers' mean
    assert band_row.nbytes(dims, t) == round(sum(per_layer) / LAYERS)
    k4 = modes.isoquant_nbytes(4, 3, dims, t, 4)
    assert modes.isoquant_nbytes(3, 3, dims, t, 4) < band_row.nbytes(dims, t) < k4


def test_a_user_window_applies_to_every_layer(model, band_row):
    cache = kvcache.make_cache(model, band_row.name, window=2)
    assert [c.window for c in cache] == [2] * LAYERS
    assert [c.key_bits for c in cache] == [3, 3, 3, 4, 4, 3]


def test_mlx_lm_prompt_cache_files_keep_each_layers_settings(model, band_row, tmp_path):
    cache = kvcache.make_cache(model, band_row.name)
    _fill(model, cache)
    path = str(tmp_path / "band.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [(c.key_bits, c.value_bits, c.window) for c in loaded] == [
        (c.key_bits, c.value_bits, c.window) for c in cache
    ]
    assert [c.nbytes for c in loaded] == [c.nbytes for c in cache]
    tok = mx.array([[7]])
    for _ in range(10):  # past both windows: tokens age into codes on both, bit for bit
        a, b = model(tok, cache=cache), model(tok, cache=loaded)
        assert mx.array_equal(a, b).item()
        tok = mx.argmax(a[:, -1:], axis=-1)
    assert [c.compressed for c in loaded] == [c.offset - c.window for c in cache]


def _kv_quality():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_quality.py"
    spec = importlib.util.spec_from_file_location("kv_quality_bits", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "kb, vb, window",
    [
        ([4, 3, 3, 4], 3, [64, 8, 8, 64]),  # keys 4-bit and W 64 on two layers, W 8 elsewhere
        (3, [3, 4, 4, 3], 16),
        (4, 3, [0, 32, 128, 64]),
    ],
)
def test_benchmark_bits_per_value_are_what_the_caches_store(kb, vb, window):
    """kv_quality.py's bits/value of a per-layer spec equal the bytes of what float16 caches with
    those per-layer settings store for attention (codes and scales of the compressed tokens, the
    window in float); with the trim reserve, what they hold is that plus the reserve's float
    copies, up to a token either way (the encoder runs one token ahead of the window)."""
    from app.engine.kvcache.isoquant.cache import TRIM_EXACT

    q = _kv_quality()
    spec = q.iso(kb, vb, window)
    layers, t, h, d = 4, 700, 2, 64
    stored = held = 0
    for i in range(layers):
        b_k, b_v, w = q.layer_bits(kb, i), q.layer_bits(vb, i), q.layer_bits(window, i)
        c = IsoQuantKVCache("v3", b_k, b_v, w, 0, i, compress_every=1)
        k = mx.random.normal((1, h, t, d), key=mx.random.key(i)).astype(mx.float16)
        c.update_and_fetch(k, k * 0.5)
        c.finish_prefill()
        mx.eval([a for a in c.state if isinstance(a, mx.array)])
        assert c.compressed == t - w and c.k_codes.shape[-1] == d * b_k // 8
        code_row = c.kq.row_bytes + c.vq.row_bytes + 2 * 2  # K and V codes, fp16 scales
        stored += h * (c.compressed * code_row + (t - c.compressed) * 2 * d * 2)
        held += c.nbytes
        slack = h * (code_row + 2 * 2 * d * 2)  # a code row and two float tokens
    values = layers * h * t * d * 2
    assert 8 * stored / values == pytest.approx(q.spec_bits(spec, t, d, layers), rel=1e-12)
    with_reserve = q.spec_bits(spec, t, d, layers, reserve=TRIM_EXACT)
    assert abs(held - with_reserve * values / 8) <= layers * slack
    assert held - stored > layers * h * (TRIM_EXACT - 2) * 2 * d * 2  # the reserve is held
