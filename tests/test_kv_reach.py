"""Compressed caches wherever tokens enter, on every family mlx-lm loads: chunked prefill and
multi-token steps compress, the window is exact, mlx-lm's prompt-cache files round-trip, its
max_kv_size / kv_bits are honoured or refused, and families IsoQuant cannot serve fall back per
layer to a float cache with the reason. Our own tests of what mlx-lm's test_prompt_cache.py and
test_models.py check, run with our caches."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from app.engine import kvcache
from app.engine.kvcache.isoquant import IsoQuantKVCache, IsoQuantTensor
from app.engine.kvcache.isoquant.cache import FP_STEP, TRIM_EXACT
from app.engine.testing import tiny_families


def _kv(t, seed, d=64, h=2):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, h, t, d), key=k1), mx.random.normal((1, h, t, d), key=k2)


def _ids(n, seed=0):
    return mx.array(np.random.default_rng(seed).integers(3, tiny_families.VOCAB, n).tolist())


@pytest.fixture(scope="module")
def family():
    built = {}

    def get(model_type):
        if model_type not in built:
            built[model_type] = tiny_families.build(model_type)[0]
        return built[model_type]

    return get


def _chunked(model, cache, ids, chunk=32, decode=4):
    """Prefill in chunks (as generate_step does), then greedy decode: (tokens, last logits)."""
    for i in range(0, ids.size, chunk):
        logits = model(ids[None, i : i + chunk], cache=cache)
    toks = []
    for _ in range(decode):
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        toks.append(int(tok.item()))
        logits = model(tok[:, None], cache=cache)
    return toks, logits


# ---- compression wherever tokens enter --------------------------------------------------
def test_prefill_chunks_are_compressed_as_they_come():
    """Each chunk attends to itself in float and to the older tokens through codes, except
    the window before its first query; the float buffer stays bounded by chunk + window."""
    c = IsoQuantKVCache(window=8, v_layout="rows")
    k, v = _kv(200, 1)
    for i in range(0, 200, 40):
        out_k, _ = c.update_and_fetch(k[:, :, i : i + 40], v[:, :, i : i + 40])
        if i:
            assert isinstance(out_k, IsoQuantTensor)
            assert out_k.compressed_len == i + 1 - 8 and out_k.fp_len == 40 + 8 - 1
            assert mx.array_equal(out_k.fp, k[:, :, i - 7 : i + 40])
        held = c.offset - c.fp_start
        assert held <= 8 + TRIM_EXACT + FP_STEP, held  # the prompt is never all float
        assert c.fp_keys.shape[2] <= 40 + 8 + TRIM_EXACT + 2 * FP_STEP
    assert c.encoded == 200 + 1 - 8  # what the next step reads compressed is already coded


def test_window_is_what_the_user_sets_with_the_default_batch():
    for window in (0, 5, 64):
        c = IsoQuantKVCache(window=window)  # the app's default compress_every
        k, v = _kv(150, 2)
        c.update_and_fetch(k[:, :, :70], v[:, :, :70])
        for t in range(70, 150):
            out_k, out_v = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            assert out_k.fp_len == out_v.fp_len == min(window, t + 1)
            assert out_k.compressed_len == t + 1 - window


def test_speculative_verify_steps_compress_and_trim_exactly():
    """A verify step feeds several tokens; rejected drafts are trimmed; the cache is then the
    one a plain decode of the accepted tokens leaves (codes, float tail, split)."""
    k, v = _kv(120, 3)
    spec, plain = IsoQuantKVCache(window=6), IsoQuantKVCache(window=6)
    for c in (spec, plain):
        c.update_and_fetch(k[:, :, :50], v[:, :, :50])
    t = 50
    while t < 110:
        spec.update_and_fetch(k[:, :, t : t + 4], v[:, :, t : t + 4])  # 1 accepted + 3 drafts
        assert spec.compressed == t + 1 - 6  # compressed up to the first query's window
        spec.trim(2)  # two drafts rejected
        for s in (t, t + 1):
            plain.update_and_fetch(k[:, :, s : s + 1], v[:, :, s : s + 1])
        t += 2
    a, b = spec._fetch(), plain._fetch()
    assert spec.offset == plain.offset == 110 and spec.compressed == plain.compressed == 104
    for x, y in zip(a, b, strict=True):
        assert mx.array_equal(x.fp, y.fp) and mx.array_equal(x.norms, y.norms)
        assert mx.array_equal(x.codes, y.codes)


def test_chunked_prefill_peak_is_below_the_float_cache(family):
    """With the prompt compressed as prefill goes, isoquant3's KV held after a long prompt is
    a fraction of the float cache's (what sets the peak on a long prompt)."""
    model = family("llama")
    ids = _ids(1024)
    sizes = {}
    for mode in ("fp16", "isoquant3"):
        cache = kvcache.make_cache(model, mode)
        for i in range(0, 1024, 128):
            model(ids[None, i : i + 128], cache=cache)
            mx.eval([a for c in cache for a in c.state if isinstance(a, mx.array)])
        sizes[mode] = kvcache.cache_capacity_nbytes(cache)
    assert sizes["isoquant3"] * 3 < sizes["fp16"]


# ---- mlx-lm's prompt-cache files, trims, copies --------------------------------------------
def test_mlx_lm_save_and_load_prompt_cache_round_trip(tmp_path, family):
    model = family("nemotron_h")  # SSM caches beside an IsoQuant one
    cache = kvcache.make_cache(model, "isoquant3", window=4)
    assert any(isinstance(c, ArraysCache) for c in cache)
    _chunked(model, cache, _ids(90), decode=3)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, cache, {"who": "test"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"who": "test"} and [type(c) for c in loaded] == [type(c) for c in cache]
    iso = [c for c in loaded if isinstance(c, IsoQuantKVCache)]
    assert iso and all(c.compressed > 0 for c in iso)
    tok = mx.array([[5]])
    for _ in range(3):  # both continue identically, bit for bit
        a, b = model(tok, cache=cache), model(tok, cache=loaded)
        assert mx.array_equal(a, b).item()
        tok = mx.argmax(a[:, -1:], axis=-1)
    # an empty (never used) cache and a float-fallback layer round-trip too
    fresh = IsoQuantKVCache(window=3)
    fb = IsoQuantKVCache(window=3)
    kk, vv = _kv(5, 4, d=48)
    fb.update_and_fetch(kk, mx.concatenate([vv, vv[..., :16]], axis=-1))  # unequal dims
    save_prompt_cache(path, [fresh, fb])
    f2, fb2 = load_prompt_cache(path)
    assert f2.empty() and fb2.fallback_reason == fb.fallback_reason and fb2.offset == 5
    assert mx.array_equal(fb2.state[4], kk)


def test_trim_prompt_cache_and_copies_with_generate(family):
    """As mlx-lm checks for its caches: after a trim back to the prompt, generation repeats
    exactly; a deep copy is independent of the original."""
    model = family("llama")
    cache = kvcache.make_cache(model, "isoquant3", window=4)
    prompt = _ids(80)
    last, _ = next(generate_step(prompt, model, prompt_cache=cache))
    last = mx.array([last])
    first = [
        t
        for _, (t, _) in zip(range(3), generate_step(last, model, prompt_cache=cache), strict=False)
    ]
    off = cache[0].offset
    snapshot = copy.deepcopy(cache)
    assert trim_prompt_cache(cache, 3) == 3
    assert snapshot[0].offset == off and cache[0].offset == off - 3
    again = [
        t
        for _, (t, _) in zip(range(3), generate_step(last, model, prompt_cache=cache), strict=False)
    ]
    assert again == first
    assert snapshot[0].k_codes is not cache[0].k_codes


def test_max_kv_size_and_kv_bits_are_not_ignored(family):
    model = family("llama")
    with pytest.raises(ValueError, match="max_kv_size=64"):
        kvcache.make_cache(model, "isoquant3", max_kv_size=64)
    with pytest.raises(ValueError, match="max_kv_size"):
        kvcache.make_cache(model, "zipfusion", max_kv_size=64)
    bounded = kvcache.make_cache(model, "fp16", max_kv_size=64)  # mlx-lm's rotating cache
    _chunked(model, bounded, _ids(100))
    assert all(c.size() <= 64 for c in bounded)
    cache = kvcache.make_cache(model, "isoquant3")
    with pytest.raises(ValueError, match="kv_bits=4 does not apply"):
        list(
            generate_step(
                _ids(20), model, prompt_cache=cache, kv_bits=4, max_tokens=2, quantized_kv_start=0
            )
        )


# ---- families: compressed, or float per layer with the reason ----------------------------
@pytest.mark.parametrize(
    "model_type,why",
    [
        ("gemma2", "own maths"),  # softcapping on the cached K/V
        ("stablelm", "own maths"),  # keys.astype(float32)
        ("plamo2", "own maths"),  # mx.fast.scaled_dot_product_attention directly
        ("deepseek_v3", "own maths"),  # MLA: latent projections of the cache output
        ("minicpm3", "K and V head dims differ"),  # MLA with unequal head dims
    ],
)
def test_families_that_keep_float_caches_match_fp16_exactly(family, model_type, why):
    model = family(model_type)
    ids = _ids(100, seed=3)
    ref_toks, ref = _chunked(model, kvcache.make_cache(model, "fp16"), ids)
    cache = kvcache.make_cache(model, "isoquant3")
    toks, got = _chunked(model, cache, ids)
    falls = kvcache.fallbacks(cache)
    assert falls and all(why in f["reason"] for f in falls)
    assert toks == ref_toks and mx.array_equal(got, ref).item()


def test_head_dim_not_a_multiple_of_8_falls_back():
    from mlx_lm.models import llama

    cfg = {**tiny_families.tiny_config("llama"), "hidden_size": 80, "head_dim": 20}
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    cache = kvcache.make_cache(model, "isoquant3")
    _chunked(model, cache, _ids(90))
    assert all("multiple of 8" in f["reason"] for f in kvcache.fallbacks(cache))
    assert len(kvcache.fallbacks(cache)) == len(model.layers)


@pytest.mark.parametrize(
    "model_type", ["llama", "qwen3", "nemotron_h", "gpt_oss", "gemma2", "minicpm3"]
)
def test_model_runs_with_our_cache_in_each_dtype_and_copies(family, model_type):
    """mlx-lm's model checks with our cache: float32 and float16, prompt then a step (past the
    window, so codes are read), the output's shape and dtype; batch 2; deep copy."""
    model = copy.deepcopy(family(model_type))
    moe = model_type in ("nemotron_h", "gpt_oss")  # MLX's CPU gather_mm takes float32 only
    for t in (mx.float32,) if moe and mx.default_device() == mx.cpu else (mx.float32, mx.float16):
        model.update(
            tree_map(
                lambda p, t=t: p.astype(t) if mx.issubdtype(p.dtype, mx.floating) else p,
                model.parameters(),
            )
        )
        cache = kvcache.make_cache(model, "isoquant3", window=2)
        out = model(_ids(6)[None], cache=cache)
        assert out.shape == (1, 6, tiny_families.VOCAB) and out.dtype == t
        out = model(mx.argmax(out[0, -1:, :], keepdims=True), cache=cache)
        assert out.shape == (1, 1, tiny_families.VOCAB) and out.dtype == t
        assert bool(mx.isfinite(out).all())
    cache = kvcache.make_cache(model, "isoquant3", window=2)
    out = model(mx.array([[0, 1, 2], [3, 4, 5]]), cache=cache)
    out = model(mx.array([[1], [2]]), cache=cache)
    assert out.shape == (2, 1, tiny_families.VOCAB)
    copy.deepcopy(model)


def test_zipfusion_on_a_hybrid_model_has_one_cache_per_state(family):
    from app.engine.kvcache import zipfusion as zf

    model = family("nemotron_h")
    base = make_prompt_cache(model)
    caches = zf.make_zipfusion_cache(model, max_tokens=128, use_kernel=False)
    assert len(caches) == len(base) == 3
    kinds = [type(c).__name__ for c in caches]
    assert kinds == [type(c).__name__ if type(c) is not KVCache else "ZipFusionCache" for c in base]


def test_top1_agrees_with_float_on_smollm2_with_chunked_prefill(smollm2_path):
    """Lossy where equality means nothing: SmolLM2's next-token choice over a 384-token text
    prefilled in chunks of 64 (compressed as it goes) agrees with the float cache >= 95%."""
    from app.engine.loader import load

    lm = load(smollm2_path)
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind " * 40
    ids = mx.array(lm.tokenizer.encode(text)[:384])
    picks = {}
    for mode in ("fp16", "isoquant3"):
        cache = kvcache.make_cache(lm.model, mode)
        out = [
            mx.argmax(lm.model(ids[None, i : i + 64], cache=cache)[0], axis=-1)
            for i in range(0, ids.size, 64)
        ]
        picks[mode] = np.array(mx.concatenate(out))
        if mode == "isoquant3":
            assert all(c.compressed > 250 for c in cache)
    assert (picks["fp16"] == picks["isoquant3"]).mean() >= 0.95
