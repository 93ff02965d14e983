"""IsoQuantKVCache: protocol (deferred prefill, window, nbytes, state, trim), installation on
mlx-lm models and generation on every tiny architecture with IsoQuant on."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from app.engine import kvcache
from app.engine.kvcache.isoquant import FORMAT_VERSION, IsoQuantKVCache, IsoQuantTensor, install
from app.engine.kvcache.isoquant.cache import FP_STEP, TRIM_EXACT
from app.engine.kvcache.isoquant.quantizer import decode
from app.engine.testing.random_models import TINY_CONFIGS


@pytest.fixture(autouse=True)
def per_token_compression(monkeypatch):
    """These tests pin exact token positions: compress every aged-out token at once (decode
    batches of COMPRESS_EVERY are tested on their own below)."""
    from app.engine.kvcache.isoquant import cache as cache_mod

    monkeypatch.setattr(cache_mod, "COMPRESS_EVERY", 1)


def _kv(b, h, t, d, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((b, h, t, d), key=k1), mx.random.normal((b, h, t, d), key=k2)


def _feed(cache, keys, values, prefill):
    """Prefill `prefill` tokens at once, then one token at a time (as generation does)."""
    cache.update_and_fetch(keys[:, :, :prefill], values[:, :, :prefill])
    out = None
    for t in range(prefill, keys.shape[2]):
        out = cache.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    return out


def test_deferred_prefill_then_window():
    c = IsoQuantKVCache(window=4)
    k, v = _kv(1, 2, 30, 64, 0)
    out_k, out_v = c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    assert isinstance(out_k, mx.array) and mx.array_equal(out_k, k[:, :, :20])  # prefill: exact
    assert c.compressed == 0 and c.offset == 20
    out_k, out_v = c.update_and_fetch(k[:, :, 20:21], v[:, :, 20:21])  # first decode step
    assert isinstance(out_k, IsoQuantTensor)
    assert c.compressed == 17 and out_k.compressed_len == 17 and out_k.fp_len == 4
    assert mx.array_equal(out_k.fp, k[:, :, 17:21]) and mx.array_equal(out_v.fp, v[:, :, 17:21])
    for t in range(21, 30):
        out_k, out_v = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert c.offset == 30 and c.compressed == 26 and out_k.shape == (1, 2, 30, 64)
    # compressed rows decode to the originals up to the 3-bit codebook error
    dk = decode(out_k.codes, out_k.norms, out_k.rotation, out_k.quantizer)
    rel = float(mx.sum((dk - k[:, :, :26]) ** 2) / mx.sum(k[:, :, :26] ** 2))
    assert 0.02 < rel < 0.05


@pytest.mark.parametrize("kb,vb", [(3, 3), (4, 3)])
def test_dequantized_is_what_the_cache_stores(kb, vb):
    """dequantized(): the numbers attention reads for tokens once compressed (the quality
    benchmark scores with it) are the decoded codes and norms the cache holds for them."""
    c = IsoQuantKVCache(key_bits=kb, value_bits=vb, window=4, seed=3, layer=2, v_layout="rows")
    k, v = _kv(2, 3, 40, 64, 7)
    _feed(c, k, v, prefill=30)
    kh, vh = IsoQuantKVCache(key_bits=kb, value_bits=vb, seed=3, layer=2).dequantized(k, v)
    out_k, out_v = c._fetch()
    n = out_k.compressed_len
    assert n == 36
    dk = decode(out_k.codes, out_k.norms, out_k.rotation, out_k.quantizer)
    dv = decode(out_v.codes, out_v.norms, out_v.rotation, out_v.quantizer)
    assert mx.array_equal(kh[:, :, :n], dk) and mx.array_equal(vh[:, :, :n], dv)
    assert not mx.array_equal(kh, k)  # lossy: not the float keys themselves


def test_finish_prefill_and_window_zero():
    c = IsoQuantKVCache(window=0)
    k, v = _kv(2, 1, 9, 128, 1)
    c.update_and_fetch(k, v)
    kvcache.finish_prefill([c, KVCache()])
    assert c.compressed == 9 and c._fetch()[0].fp is None
    out_k, _ = c.update_and_fetch(
        k[:, :, :1], v[:, :, :1]
    )  # W = 0: the new token is compressed too
    assert c.compressed == 10 and out_k.fp_len == 0


def _held_arrays(c):
    """Every array attribute of the cache, found independently of c._arrays()."""
    held = [a for a in vars(c).values() if isinstance(a, mx.array)]
    assert sorted(map(id, held)) == sorted(map(id, c._arrays()))
    return held


@pytest.mark.parametrize("kb,vb,d", [(3, 3, 128), (4, 3, 64), (4, 4, 64)])
def test_nbytes_is_exact(kb, vb, d):
    c = IsoQuantKVCache(key_bits=kb, value_bits=vb, window=8, v_layout="rows")  # (bytes as rows)
    assert c.nbytes == 0 and c.used_nbytes == 0 and c.empty()
    k, v = _kv(1, 2, 300, d, 2)
    _feed(c, k, v, prefill=290)
    mx.eval(*_held_arrays(c))
    assert c.capacity_nbytes == sum(a.nbytes for a in _held_arrays(c))
    # nbytes: what is held, not capacity. 292 compressed tokens × 2 heads × (codes K + codes V +
    # two fp16 norms) + the float32 tail: the window (8) and the trim reserve behind it
    per_tok = d * kb // 8 + d * vb // 8 + 4
    n_float = c.offset - c.fp_start
    assert c.compressed == 292 and 8 + TRIM_EXACT <= n_float < 8 + TRIM_EXACT + FP_STEP
    assert c.nbytes == c.used_nbytes == 2 * (292 * per_tok + n_float * d * 4 * 2)
    if (kb, vb, d) == (3, 3, 128):
        assert per_tok == 100  # 48 + 48 bytes of codes + 2 + 2 bytes of norms
    # the prompt's float buffer was released after the bulk compression
    assert c.fp_keys.shape[2] <= 2 * FP_STEP
    assert kvcache.cache_nbytes([c, KVCache()]) == c.nbytes


def test_state_round_trip_with_format_version(tmp_path):
    c = IsoQuantKVCache("v3", 4, 3, window=3, seed=7, layer=5)
    k, v = _kv(1, 2, 40, 64, 3)
    _feed(c, k, v, prefill=30)
    c2 = IsoQuantKVCache.from_state(c.state, c.meta_state)
    assert (c2.offset, c2.compressed, c2.layer, c2.seed) == (40, 37, 5, 7)
    a, b = c._fetch(), c2._fetch()
    for x, y in zip(a, b, strict=True):
        assert mx.array_equal(x.codes, y.codes) and mx.array_equal(x.norms, y.norms)
        assert mx.array_equal(x.fp, y.fp)
    assert mx.array_equal(c.rotation.blocks, c2.rotation.blocks)
    # both continue identically
    nk, nv = _kv(1, 2, 1, 64, 9)
    ra, rb = c.update_and_fetch(nk, nv), c2.update_and_fetch(nk, nv)
    assert mx.array_equal(ra[0].codes, rb[0].codes)
    # through a file, next to mlx-lm's own cache types
    rot = RotatingKVCache(max_size=8)
    rot.update_and_fetch(*_kv(1, 2, 5, 64, 4))
    path = tmp_path / "cache.safetensors"
    kvcache.save_cache(path, [c, rot], {"model": "tiny"})
    loaded, meta = kvcache.load_cache(path)
    assert meta == {"model": "tiny"} and isinstance(loaded[1], RotatingKVCache)
    assert loaded[0].offset == c.offset and mx.array_equal(
        loaded[0]._fetch()[1].codes, c._fetch()[1].codes
    )
    assert f'"format_version": {FORMAT_VERSION}' in c.meta_state
    bad = c.meta_state.replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99')
    with pytest.raises(ValueError, match="version 99"):
        IsoQuantKVCache.from_state(c.state, bad)


def test_code_views_follow_the_window_and_encoding_runs_in_batches():
    """Attention reads exactly the rows before the window; codes are written ahead in batches
    of compress_every, so most steps only move the split; a trim into the codes or a new state
    rebuilds the views, and what they show is always the codes buffer's current rows."""
    c = IsoQuantKVCache("v3", 3, 3, window=4, compress_every=8)
    mx.random.seed(2)
    c.update_and_fetch(*(mx.random.normal((1, 2, 12, 64)) for _ in "kv"))
    c.finish_prefill()
    assert (c.compressed, c.encoded) == (8, 9)  # the prefill encoded what step 13 reads
    encoded = []
    for _ in range(8):
        k3, v3 = c.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)) for _ in "kv"))
        assert k3.fp_len == 4 and k3.compressed_len == c.compressed == c.offset - 4
        encoded.append(c.encoded)
    assert encoded == [9, 14, 14, 14, 14, 14, 19, 19]  # ahead, as far as the tokens held
    assert mx.array_equal(k3.codes, c.k_codes[:, :, :16]).item()
    assert mx.array_equal(v3.norms, c.v_norms[:, :, :16]).item()
    c.trim(12)  # back into the codes: offset 8, rows 0..7 stay
    k4, _ = c.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)) for _ in "kv"))
    assert k4.codes.shape[2] == c._n_rows == 5 and k4.fp_len == 4
    c2 = IsoQuantKVCache("v3", 3, 3, window=4, compress_every=8)
    c2.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)) for _ in "kv"))
    c2.state = c.state
    k5, _ = c2.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)) for _ in "kv"))
    assert mx.array_equal(k5.codes[:, :, :5], k4.codes).item() and k5.fp_len == 4


def test_trim_is_exact_within_the_reserve():
    """Speculative decoding trims rejected drafts: up to TRIM_EXACT tokens the cache is then
    exactly the cache that never saw them (same split, codes and float tail)."""
    c = IsoQuantKVCache(window=4)
    k, v = _kv(1, 1, 50, 64, 5)
    _feed(c, k, v, prefill=40)
    assert (c.offset, c.compressed) == (50, 46)
    assert c.trim(3) == 3 and c.offset == 47
    assert c.trim(10) == 10 and c.offset == 37
    out_k, out_v = c.update_and_fetch(k[:, :, 37:38], v[:, :, 37:38])
    fresh = IsoQuantKVCache(window=4)
    ref_k, ref_v = _feed(fresh, k[:, :, :38], v[:, :, :38], prefill=30)
    assert c.offset == 38 and out_k.compressed_len == ref_k.compressed_len == 34
    for x, y in ((out_k, ref_k), (out_v, ref_v)):
        assert mx.array_equal(x.fp, y.fp) and mx.array_equal(x.codes, y.codes)
        assert mx.array_equal(x.norms, y.norms)
    assert mx.array_equal(out_k.fp, k[:, :, 34:38])
    assert c.trim(100) == 38 and c.empty()


def test_bits_attribute_is_absent():
    # mlx-lm's attention routes any cache with `bits` to its QuantizedKVCache path
    assert not hasattr(IsoQuantKVCache(), "bits")


def test_make_cache_modes_and_errors():
    assert set(kvcache.names()) >= {"fp16", "isoquant3", "isoquant4", "isoquant_k4v3"}
    with pytest.raises(ValueError, match="unknown KV mode"):
        kvcache.make_cache(None, "isoquant2")
    with pytest.raises(ValueError, match="window"):
        IsoQuantKVCache(window=-1)


# ---- models -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tiny_model_path):
    from app.engine.loader import load

    out = {}

    def get(arch):
        if arch not in out:
            lm = load(tiny_model_path(arch))
            install(lm.model)
            out[arch] = lm.model
        return out[arch]

    return get


def _run(model, cache, prompt, n):
    toks, logits = [], []
    for (t, lp), _ in zip(
        generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n),
        range(n),
        strict=False,
    ):
        toks.append(int(t))
        logits.append(np.array(lp.astype(mx.float32)))
    return toks, np.stack(logits)


RELATIVE_LOGIT_ERROR = 0.2


class _DenseView(IsoQuantKVCache):
    """Same cache, but hands attention x̂ = Rᵀ ŷ as plain arrays (mlx's own attention)."""

    @classmethod
    def of(cls, c, sink):
        return cls(c.rotation_kind, c.key_bits, c.value_bits, c.window, c.seed, c.layer, sink=sink)

    def _fetch(self, **kw):
        k, v = super()._fetch(**kw)
        if not isinstance(k, IsoQuantTensor):
            return k, v

        def dense(t):
            t = t.as_rows()
            x = decode(t.codes, t.norms, t.rotation, t.quantizer).astype(t.dtype)
            segs = [a for a in (t.prefix, x, t.fp) if a is not None]
            return mx.concatenate(segs, axis=2)

        return dense(k), dense(v)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_generation_on_tiny_architectures(arch, tiny_models, monkeypatch):
    model = tiny_models(arch)
    prompt = list(range(3, 40))
    fp_toks, fp_logits = _run(model, kvcache.make_cache(model, "fp16"), prompt, 6)

    # A window longer than the whole run never compresses: identical to the float cache.
    big = kvcache.make_cache(model, "isoquant3", window=1000)
    toks, logits = _run(model, big, prompt, 6)
    assert toks == fp_toks and np.array_equal(logits, fp_logits)

    calls = []
    from app.engine.kvcache.isoquant import dispatch

    real = dispatch.isoquant_attention
    monkeypatch.setattr(
        dispatch, "isoquant_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    cache = kvcache.make_cache(model, "isoquant4", window=2, seed=1)
    iso = [c for c in cache if isinstance(c, IsoQuantKVCache)]
    full_layers = {"gemma4_text": 2, "gpt_oss": 2, "nemotron_h": 1}.get(arch, len(cache))
    assert len(iso) == full_layers  # sliding-window and Mamba layers keep their own caches
    assert all(isinstance(c, (IsoQuantKVCache, RotatingKVCache, ArraysCache)) for c in cache)
    toks, logits = _run(model, cache, prompt, 6)
    assert calls, "compressed-space attention never ran"
    assert all(c.compressed == c.offset - 2 for c in iso)
    # every generated token read 4-bit KV (the last prompt token is a decode step): close
    assert not np.array_equal(logits, fp_logits)
    # Random tiny models have near-uniform next-token laws, so compare the logits themselves:
    # the 4-bit KV error must stay a small fraction of the logits' own spread.
    dev = logits - logits.mean(-1, keepdims=True)
    ref = fp_logits - fp_logits.mean(-1, keepdims=True)
    rel = float(np.linalg.norm(dev - ref) / np.linalg.norm(ref))
    if arch != "gemma4_text":  # random q/k norms with scale 1: attention is nearly one-hot
        assert rel < RELATIVE_LOGIT_ERROR, f"{arch}: relative logit error {rel}"

    # Exactness: the same run with attention over the dequantized K/V (same codes) in float.
    dense = kvcache.make_cache(model, "isoquant4", window=2, seed=1)
    dense = [_DenseView.of(c, 0) if isinstance(c, IsoQuantKVCache) else c for c in dense]
    d_toks, d_logits = _run(model, dense, prompt, 6)
    assert d_toks == toks
    err = float(np.abs(d_logits - logits).max() / np.abs(logits).max())
    assert err < 1e-4, f"{arch}: compressed-space vs dequantized dense attention differ by {err}"
    assert kvcache.cache_nbytes(cache) > 0


def test_install_is_idempotent_and_passes_other_caches_through(tiny_models):
    import mlx_lm.models.llama as llama_mod

    model = tiny_models("llama")
    before = llama_mod.scaled_dot_product_attention
    assert install(model) == ["mlx_lm.models.llama"]
    assert llama_mod.scaled_dot_product_attention is before
    q, k, v = (mx.random.normal((1, 4, 3, 32), key=mx.random.key(i)) for i in range(3))
    got = llama_mod.scaled_dot_product_attention(q, k, v, cache=None, scale=0.2, mask="causal")
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    assert mx.array_equal(got, ref)


def test_multi_token_chunk_after_compression_uses_causal_mask(tiny_models):
    """A second prompt (new chat turn) after decoding: mask over codes + float tail."""
    model = tiny_models("llama")
    cache = kvcache.make_cache(model, "isoquant4", window=0)
    _run(model, cache, list(range(5, 25)), 3)
    ref_cache = kvcache.make_cache(model, "fp16")
    _run(model, ref_cache, list(range(5, 25)), 3)
    turn = mx.array([list(range(50, 60))])
    a = np.array(model(turn, cache=cache)[0, -1].astype(mx.float32))
    b = np.array(model(turn, cache=ref_cache)[0, -1].astype(mx.float32))
    assert math.isfinite(a.sum())
    assert np.corrcoef(a, b)[0, 1] > 0.98


def test_sink_prefix_stays_float():
    c = IsoQuantKVCache(window=3, sink=4, v_layout="rows")  # (bytes as rows)
    k, v = _kv(1, 2, 40, 64, 11)
    out_k, out_v = _feed(c, k, v, prefill=2)  # the sink fills while decoding, then codes start
    assert (c.offset, c.compressed) == (40, 37)
    assert out_k.prefix_len == 4 and out_k.compressed_len == 33 and out_k.fp_len == 3
    assert mx.array_equal(out_k.prefix, k[:, :, :4]) and mx.array_equal(out_v.prefix, v[:, :, :4])
    assert out_k.shape == (1, 2, 40, 64)
    # code row r is position 4 + r: the same codes as a sink-less cache makes for those tokens
    ref = IsoQuantKVCache(window=0)
    ref.update_and_fetch(k[:, :, 4:37], v[:, :, 4:37])
    ref.finish_prefill()
    assert mx.array_equal(ref._fetch()[0].codes, out_k.codes)
    per_row = 24 + 24 + 4
    n_float = c.offset - c.fp_start + 4  # the tail with its trim reserve, and the sink
    assert c.used_nbytes == 2 * (33 * per_row + n_float * 64 * 4 * 2)
    mx.eval(*c._arrays())
    assert c.capacity_nbytes == sum(a.nbytes for a in c._arrays())
    # state round trip keeps the sink; trimming into the sink shrinks it
    c2 = IsoQuantKVCache.from_state(c.state, c.meta_state)
    assert c2.sink == 4 and mx.array_equal(c2._fetch()[0].prefix, out_k.prefix)
    c.trim(38)
    assert (c.offset, c.compressed) == (2, 2)
    pk, _ = c._fetch()
    assert isinstance(pk, mx.array) and mx.array_equal(pk, k[:, :, :2])  # no codes: plain arrays


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_sink_generation_equals_dense_attention(arch, tiny_models):
    model = tiny_models(arch)
    prompt = list(range(3, 30))
    cache = kvcache.make_cache(model, "isoquant3", window=1, sink=3, seed=2)
    toks, logits = _run(model, cache, prompt, 5)
    assert all(c.compressed == c.offset - 1 for c in cache if isinstance(c, IsoQuantKVCache))
    dense = kvcache.make_cache(model, "isoquant3", window=1, sink=3, seed=2)
    dense = [_DenseView.of(c, 3) if isinstance(c, IsoQuantKVCache) else c for c in dense]
    d_toks, d_logits = _run(model, dense, prompt, 5)
    assert d_toks == toks
    assert float(np.abs(d_logits - logits).max() / np.abs(logits).max()) < 1e-4


def test_compiled_encoders_are_bit_identical(monkeypatch):
    """The compiled per-token encoder (default on GPUs) writes exactly the op-by-op bytes."""
    from app.engine.kvcache.isoquant import cache as cache_mod

    caches = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(cache_mod.COMPILE_ENV, flag)
        assert cache_mod.compile_encoders() is (flag == "1")
        c = IsoQuantKVCache(window=2, seed=3, layer=1)
        mx.random.seed(11)
        c.update_and_fetch(*(mx.random.normal((2, 3, 9, 64)).astype(mx.bfloat16) for _ in "kv"))
        c.finish_prefill()
        for _ in range(5):  # decode appends: one token each, compressed as it ages out
            c.update_and_fetch(*(mx.random.normal((2, 3, 1, 64)).astype(mx.bfloat16) for _ in "kv"))
        assert (c._enc_k is not None) is (flag == "1")
        caches[flag] = c
    a, b = caches["0"], caches["1"]
    assert a.compressed == b.compressed == 12
    for name in ("k_codes", "v_codes", "k_norms", "v_norms"):
        x, y = getattr(a, name), getattr(b, name)
        assert mx.array_equal(x, y).item(), name


def test_decode_encodes_in_batches_with_the_same_codes_and_an_exact_window():
    """With compress_every=8 the window stays exactly 12 float tokens every step; codes are
    written 8 at a time ahead of it, exactly the codes per-token encoding writes."""
    k, v = _kv(1, 2, 80, 64, 5)
    a = IsoQuantKVCache(window=12, compress_every=1, v_layout="rows")  # (rows compared by index)
    b = IsoQuantKVCache(window=12, compress_every=8, v_layout="rows")
    seen = []
    for c in (a, b):
        c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    for t in range(20, 80):
        ra, _ = a.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        out_k, _ = b.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert out_k.fp_len == ra.fp_len == 12 and out_k.compressed_len == b.compressed
        assert mx.array_equal(out_k.codes, ra.codes).item()
        seen.append(b.encoded)
    assert seen[0] == 9  # the prompt was encoded in bulk up to the first step's split
    assert sorted(set(seen)) == [9, 17, 25, 33, 41, 49, 57, 65, 73]  # then 8 tokens at a time
    n = a.encoded
    assert n == 68 and b.encoded == 73
    for name in ("k_codes", "v_codes", "k_norms", "v_norms"):
        assert mx.array_equal(getattr(a, name)[:, :, :n], getattr(b, name)[:, :, :n]).item()
    with pytest.raises(ValueError, match="compress_every"):
        IsoQuantKVCache(compress_every=0)


def test_batches_survive_a_state_round_trip():
    c = IsoQuantKVCache(window=4, compress_every=16)
    k, v = _kv(1, 2, 30, 64, 6)
    _feed(c, k, v, 10)
    c2 = IsoQuantKVCache.from_state(c.state, c.meta_state)
    assert (c2.compress_every, c2.offset, c2.compressed) == (c.compress_every, 30, c.compressed)
