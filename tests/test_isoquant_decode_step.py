"""IsoQuant's decode step on backends without kernels: the reference attention as one shapeless
compiled graph (attention._attend_compiled) gives the op-by-op reference's numbers exactly, one
trace serving every token count and layer; the code unpacking it traces takes any row count."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from app.engine import kvcache
from app.engine.kvcache.isoquant import IsoQuantKVCache, IsoQuantTensor
from app.engine.kvcache.isoquant import attention as att
from app.engine.kvcache.isoquant.packing import pack_codes, unpack_codes
from app.engine.testing.random_models import make_random_model


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    """The cache's attention through the reference (on a backend with kernels too)."""
    monkeypatch.setattr(att, "_kernel", None)
    monkeypatch.setattr(att, "COMPILE_REFERENCE", True)


def _kv(b, h, t, d, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((b, h, t, d), key=k1), mx.random.normal((b, h, t, d), key=k2)


@pytest.mark.parametrize(("bits", "dim"), [(3, 128), (3, 64), (3, 40), (4, 64)])
def test_unpack_codes_follows_the_row_count_in_a_shapeless_trace(bits, dim):
    unpack = mx.compile(lambda p: unpack_codes(p, bits), shapeless=True)
    rng = np.random.default_rng(bits + dim)
    for t in (1, 17, 300):
        codes = mx.array(rng.integers(0, 2**bits, (2, 3, t, dim)).astype(np.uint8))
        packed = pack_codes(codes, bits)
        assert mx.array_equal(unpack(packed), codes).item(), t
        assert mx.array_equal(unpack_codes(packed, bits), codes).item(), t


@pytest.mark.parametrize(("sink", "shadow", "window"), [(0, False, 8), (3, False, 8), (0, True, 0)])
def test_compiled_step_equals_the_reference_as_the_cache_grows(sink, shadow, window):
    b, hq, hkv, d = 1, 8, 2, 64
    cache = IsoQuantKVCache(window=window, sink=sink, decoded_shadow=shadow, compress_every=4)
    k, v = _kv(b, hkv, 60, d, 1)
    cache.update_and_fetch(k[:, :, :20], v[:, :, :20])
    att._TRACES.clear()
    seen = 0
    for t in range(20, 60):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert isinstance(keys, IsoQuantTensor)
        q = mx.random.normal((b, hq, 1, d), key=mx.random.key(t))
        assert att.compiled_eligible(q, keys, values, None, None)
        ref = att.isoquant_attention_reference(q, keys, values, scale=0.125)
        got = att.isoquant_attention(q, keys, values, scale=0.125)
        assert mx.array_equal(got, ref).item(), t
        seen = max(seen, keys.compressed_len)
    assert seen > 30
    # one trace for the whole run (a sink prefix: one per prefix length while it fills)
    assert len(att._TRACES) <= 1 + sink


def test_one_trace_serves_every_layer_and_ineligible_calls_take_the_reference():
    d, hq, hkv = 64, 4, 2
    caches = [IsoQuantKVCache(window=4, layer=i, compress_every=1) for i in range(3)]
    k, v = _kv(1, hkv, 12, d, 2)
    att._TRACES.clear()
    outs = []
    for c in caches:
        c.update_and_fetch(k[:, :, :11], v[:, :, :11])
        keys, values = c.update_and_fetch(k[:, :, 11:], v[:, :, 11:])
        q = mx.random.normal((1, hq, 1, d), key=mx.random.key(0))
        got = att.isoquant_attention(q, keys, values, scale=0.125)
        ref = att.isoquant_attention_reference(q, keys, values, scale=0.125)
        assert mx.array_equal(got, ref).item()
        outs.append(got)
    assert len(att._TRACES) == 1
    assert not mx.array_equal(outs[0], outs[1]).item()  # each layer's own rotation is an input
    q = mx.random.normal((1, hq, 1, d), key=mx.random.key(0))
    sinks = mx.zeros((hq,))
    assert not att.compiled_eligible(q, keys, values, "causal", None)
    assert not att.compiled_eligible(q, keys, values, None, sinks)
    got = att.isoquant_attention(q, keys, values, scale=0.125, sinks=sinks)
    ref = att.isoquant_attention_reference(q, keys, values, scale=0.125, sinks=sinks)
    assert mx.array_equal(got, ref).item()


def _decode_logits(model, mode, steps=40):
    prompt = np.random.default_rng(3).integers(3, 1000, 37).tolist()
    cache = kvcache.make_cache(model, mode, window=8)
    out = [model(mx.array([prompt[:20]]), cache=cache)[:, -1, :]]
    out.append(model(mx.array([prompt[20:]]), cache=cache)[:, -1, :])
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1], axis=-1)[None], cache=cache)[:, -1, :])
        mx.eval(out[-1])
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_model_logits_are_bit_identical_with_the_compiled_step(tmp_path, monkeypatch, arch):
    from app.engine.loader import load

    model = load(make_random_model(arch, tmp_path / arch, seed=5, scale=0.5)).model
    att._TRACES.clear()
    got = _decode_logits(model, "isoquant3")
    assert att._TRACES  # the decode steps ran compiled
    monkeypatch.setattr(att, "COMPILE_REFERENCE", False)
    ref = _decode_logits(model, "isoquant3")
    for i, (a, r) in enumerate(zip(got, ref, strict=True)):
        assert mx.array_equal(a, r).item(), f"{arch}: logits differ at step {i}"
    assert len({int(mx.argmax(x).item()) for x in got}) > 1


@pytest.mark.parametrize("layout", ["rows", "tc16"])
def test_cache_views_read_as_the_tensors_they_stand_for(layout):
    """A single-token step hands CacheViews: read, they are the codes, norms and float window
    a multi-token fetch slices (their codes' words and levels too); dataclasses.replace and
    as_rows give plain tensors."""
    import dataclasses

    c = IsoQuantKVCache(window=4, compress_every=4, v_layout=layout)
    k, v = _kv(1, 2, 40, 64, 3)
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    keys, values = c.update_and_fetch(k[:, :, 30:31], v[:, :, 30:31])
    assert isinstance(keys, att.CacheView) and isinstance(values, att.CacheView)
    eager_k, eager_v = c._fetch()  # the same step's views, sliced
    for lazy, eager in ((keys, eager_k), (values, eager_v)):
        assert type(eager) is IsoQuantTensor
        assert lazy.compressed_len == eager.compressed_len == 27
        assert lazy.fp_len == eager.fp_len == 4 and lazy.shape == eager.shape
        assert lazy.dtype == eager.dtype and lazy.layout == eager.layout
        for name in ("codes", "norms", "fp"):
            assert mx.array_equal(getattr(lazy, name), getattr(eager, name)).item(), name
        plain = dataclasses.replace(lazy, layout=lazy.layout)
        assert "_src" not in plain.__dict__ and mx.array_equal(plain.codes, eager.codes).item()
        assert mx.array_equal(lazy.as_rows().codes, eager.as_rows().codes).item()
        # the codes by word, viewed from the whole buffer: the rows' levels, nothing past them
        want = lazy.quantizer.levels[lazy.codes_unpacked()]
        if lazy.layout == "rows":
            assert lazy.code_words()[0].shape == (1, 2, 27, 2, 3)
        assert mx.array_equal(lazy.levels(), want).item()
        assert mx.array_equal(eager.levels(), want).item()
    q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(1))
    got = att.isoquant_attention(q, keys, values, scale=0.125)
    ref = att.isoquant_attention_reference(q, eager_k, eager_v, scale=0.125)
    assert mx.array_equal(got, ref).item()
