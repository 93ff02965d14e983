"""ZipFusion's paged store, cache and batched decode loop on the MLX-ops reference path (CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import _get_classes

from app.engine.kvcache import zipfusion as zf
from app.engine.kvcache.zipfusion import codec
from app.engine.kvcache.zipfusion import kernels as zk
from app.engine.kvcache.zipfusion.scheduler import Request, ZipScheduler
from app.engine.testing.random_models import _randomize

CFG = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def model():
    mc, ac = _get_classes(CFG)
    m = mc(ac.from_dict(CFG))
    m.set_dtype(mx.bfloat16)
    _randomize(m, 3, 0.2)
    return m


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path))


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, CFG["vocab_size"], n).tolist()


def _generate(model, cache, prompt, n, prefill_step=32):
    toks, lps = [], []
    gen = generate_step(
        mx.array(prompt), model, max_tokens=n, prompt_cache=cache, prefill_step_size=prefill_step
    )
    for tok, lp in gen:
        toks.append(int(tok))
        lps.append(np.array(lp.astype(mx.float32)))
    return toks, lps


def test_generation_bit_identical_to_bf16_cache(model):
    """Multi-chunk prefill (75 tokens, chunks of 32), then decode across page boundaries."""
    prompt = _prompt(75)
    ref_t, ref_lp = _generate(model, [KVCache() for _ in range(2)], prompt, 40)
    caches = zf.make_zipfusion_cache(model, max_tokens=256, use_kernel=False)
    got_t, got_lp = _generate(model, caches, prompt, 40)
    assert got_t == ref_t
    assert all((a == b).all() for a, b in zip(got_lp, ref_lp, strict=True))
    st = caches[0].store
    st.flush()
    assert st.seqs[st.auto_sid].length >= 75 + 40 - 1  # mlx-lm computes one token ahead
    assert st.stats["pages_compressed"] >= 2 * 7 and st.stats["blocks_compressed"] > 0


def test_raw_pages_and_compressed_pages_give_the_same_bits(model):
    prompt = _prompt(40, seed=1)
    out = []
    for compress in (True, False):
        caches = zf.make_zipfusion_cache(model, max_tokens=128, compress=compress, use_kernel=False)
        out.append(_generate(model, caches, prompt, 30))
        st = caches[0].store
        assert (st.stats["blocks_compressed"] > 0) == compress
    assert out[0][0] == out[1][0]
    assert all((a == b).all() for a, b in zip(out[0][1], out[1][1], strict=True))


def _store(n_layers=2, budget_pages=200, **kw):
    cfg = zf.ZipConfig(
        n_layers,
        2,
        64,
        budget_pages * 2 * 2 * 2 * 4 * 256,
        max_seqs=8,
        max_tokens_per_seq=512,
        **kw,
    )
    return zf.ZipStore(cfg, use_kernel=False)


def _bf16(rng, shape, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(mx.bfloat16)


def test_store_pages_hold_exact_bits_across_prefill_and_decode():
    rng = np.random.default_rng(4)
    st = _store()
    a, b = st.add_sequence(), st.add_sequence()
    keys = {a: [], b: []}
    vals = {a: [], b: []}
    # prefill a with 37 tokens, b with 16 (exactly one page), in two steps each
    for sid, n in ((a, 37), (b, 16)):
        for part in (n // 2, n - n // 2):
            st.begin([sid])
            k, v = _bf16(rng, (1, 2, part, 64), 0.5), _bf16(rng, (1, 2, part, 64), 4.0)
            v = mx.where(mx.arange(64) == 3, mx.array(1e30, mx.bfloat16), v)  # some raw blocks
            for layer in range(2):
                st.stage(layer, k + layer, v)
            st.commit()
            keys[sid].append(k)
            vals[sid].append(v)
    # 20 decode steps for both
    for _ in range(20):
        st.begin([a, b])
        k, v = _bf16(rng, (2, 2, 1, 64)), _bf16(rng, (2, 2, 1, 64))
        for layer in range(2):
            st.stage(layer, k + layer, v)
        st.commit()
        for i, sid in enumerate((a, b)):
            keys[sid].append(k[i : i + 1])
            vals[sid].append(v[i : i + 1])
    for sid in (a, b):
        st.begin([sid])
        for layer in range(2):
            st.stage(
                layer, mx.zeros((1, 2, 0, 64), mx.bfloat16), mx.zeros((1, 2, 0, 64), mx.bfloat16)
            )
        for layer in range(2):
            kd, vd = st.dense_kv(layer)
            kr = mx.concatenate(keys[sid], axis=2) + layer
            vr = mx.concatenate(vals[sid], axis=2)
            assert kd.shape == kr.shape
            assert bool(mx.all(kd.view(mx.uint16) == kr.view(mx.uint16)))
            assert bool(mx.all(vd.view(mx.uint16) == vr.view(mx.uint16)))
        st.staged = [None] * 2
    assert 0 < st.stats["blocks_compressed"] < st.stats["blocks"]
    assert st.used_bytes() < 2 * 2 * len(st.seqs[a].pages + st.seqs[b].pages) * 2 * 2 * 4 * 256
    st.mem.check()


def test_reference_attention_matches_fp32_math():
    rng = np.random.default_rng(5)
    st = _store()
    sids = [st.add_sequence() for _ in range(3)]
    for sid, n in zip(sids, (5, 33, 64), strict=True):
        st.begin([sid])
        for layer in range(2):
            st.stage(layer, _bf16(rng, (1, 2, n, 64)), _bf16(rng, (1, 2, n, 64)))
        st.commit()
    st.begin(sids)
    q = _bf16(rng, (3, 4, 1, 64))
    kn, vn = _bf16(rng, (3, 2, 1, 64)), _bf16(rng, (3, 2, 1, 64))
    st.stage(1, kn, vn)
    out = st.attend(1, q, 0.125)
    k, v = zk.gather_pages_reference(st.pool, st.meta, st.page_table, 1, st.n_ids, 2, 64)
    for i, n in enumerate((5, 33, 64)):
        kk = mx.concatenate([k[i, :, :n], kn[i]], axis=1).astype(mx.float32)  # [2, n+1, 64]
        vv = mx.concatenate([v[i, :, :n], vn[i]], axis=1).astype(mx.float32)
        qq = q[i, :, 0].astype(mx.float32).reshape(2, 2, 64)
        p = mx.softmax((qq @ mx.swapaxes(kk, -1, -2)) * 0.125, axis=-1)
        ref = (p @ vv).reshape(4, 64)
        err = float(mx.linalg.norm(out[i, :, 0].astype(mx.float32) - ref) / mx.linalg.norm(ref))
        assert err < 1e-2
    st.staged = [None] * 2


def test_compaction_moves_pages_without_changing_them():
    rng = np.random.default_rng(6)
    st = _store(budget_pages=400)
    sids = [st.add_sequence() for _ in range(4)]
    data = {}
    for _ in range(6):  # interleave the sequences so their pages share chunks
        for sid in sids:
            st.begin([sid])
            k, v = _bf16(rng, (1, 2, 16, 64)), _bf16(rng, (1, 2, 16, 64))
            for layer in range(2):
                st.stage(layer, k, v)
            st.commit()
            data.setdefault(sid, []).append((k, v))
    for sid in sids[:3]:
        st.free_sequence(sid)
    moved = st.compact(max_live_fraction=0.5)
    assert moved > 0
    st.begin([sids[3]])
    for layer in range(2):
        st.stage(layer, mx.zeros((1, 2, 0, 64), mx.bfloat16), mx.zeros((1, 2, 0, 64), mx.bfloat16))
    kd, vd = st.dense_kv(0)
    kr = mx.concatenate([d[0] for d in data[sids[3]]], axis=2)
    vr = mx.concatenate([d[1] for d in data[sids[3]]], axis=2)
    assert bool(mx.all(kd.view(mx.uint16) == kr.view(mx.uint16)))
    assert bool(mx.all(vd.view(mx.uint16) == vr.view(mx.uint16)))
    st.staged = [None] * 2
    st.mem.check()


def _greedy_single(model, prompt, n):
    cache = [KVCache() for _ in range(2)]
    toks = []
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1]
    for _ in range(n):
        y = int(mx.argmax(logits, axis=-1).item())
        toks.append(y)
        logits = model(mx.array([[y]]), cache=cache)[:, -1]
    return toks


def test_batched_scheduler_matches_single_sequence_generation(model):
    reqs = [
        Request(_prompt(n, seed=n), m) for n, m in ((9, 12), (40, 20), (16, 5), (23, 17), (3, 30))
    ]
    st = zf.make_zipfusion_store(
        model,
        2 * 16 * 2 * 2 * 2 * 4 * 256 * 6,
        max_seqs=4,
        max_tokens_per_seq=128,
        use_kernel=False,
    )
    sched = ZipScheduler(model, st)
    out = sched.run([Request(r.prompt, r.max_new_tokens) for r in reqs])
    assert 1 < sched.max_batch <= 4
    for rid, r in enumerate(reqs):
        assert out[rid] == _greedy_single(model, r.prompt, r.max_new_tokens), rid
    assert not st.seqs and st.used_bytes() == 0
    st.mem.check()


def test_admission_with_compression_admits_more_at_equal_memory(model):
    budget = 2 * 16 * 2 * 2 * 2 * 4 * 256 * 7  # 7 chunks of 16 raw pages per layer
    prompt_len, new = 120, 4  # 8 pages each at raw size
    batches = {}
    for compress in (False, True):
        st = zf.make_zipfusion_store(
            model, budget, max_seqs=32, max_tokens_per_seq=256, compress=compress, use_kernel=False
        )
        sched = ZipScheduler(model, st)
        for i in range(30):
            sched.submit(Request(_prompt(prompt_len, seed=100 + i), new))
        sched.step()
        batches[compress] = len(sched.running)
    assert batches[True] > batches[False] >= 1, batches


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="cannot hold one chunk"):
        zf.ZipConfig(2, 2, 64, 1000)
    with pytest.raises(ValueError, match="multiple of 32"):
        zf.ZipConfig(2, 2, 80, 1 << 30)
    st = _store()
    st.begin([st.add_sequence()])
    with pytest.raises(RuntimeError, match="not staged"):
        st.commit()


def test_available_says_why_not_here():
    ok, reason = zf.available()
    if mx.cuda.is_available():
        assert ok
    else:
        assert not ok and "NVIDIA" in reason


def test_attention_dispatch_installs_once_and_falls_back(model):
    import sys

    names = zf.install_attention(model)
    mod = sys.modules[type(model).__module__]
    assert mod.scaled_dot_product_attention is zf.zipfusion_sdpa or not names
    assert zf.install_attention(model) == []
    q = mx.ones((1, 4, 3, 64), mx.bfloat16)
    k = mx.ones((1, 2, 3, 64), mx.bfloat16)
    out = mod.scaled_dot_product_attention(q, k, k, cache=KVCache(), scale=1.0, mask="causal")
    assert out.shape == (1, 4, 3, 64)


def test_page_layout_constants_agree():
    cfg = zf.ZipConfig(2, 2, 64, 1 << 26)
    assert cfg.raw_page_bytes == 2 * 2 * 16 * 64 * 2  # Hkv x (K, V) x 16 tokens x D x bf16
    assert cfg.raw_page_granules * codec.GRANULE == cfg.raw_page_bytes


def test_a_full_pool_preempts_and_resumes_without_changing_the_output(model):
    """With a growth horizon, requests are admitted on their next tokens only; when the pool
    runs out mid-decode the newest request is preempted, then resumed by recomputing its KV.
    Raw pages (no compression) so the pool surely runs out."""
    raw_page = 2 * 2 * 2 * 4 * 256  # layers' K/V of 2 heads, 16 tokens, D 64, bf16
    st = zf.make_zipfusion_store(
        model, 2 * 16 * raw_page * 4, max_seqs=4, max_tokens_per_seq=512, compress=False,
        use_kernel=False,
    )  # fmt: skip
    sched = ZipScheduler(model, st, prefill_step=32, growth_horizon=16)
    reqs = [Request(_prompt(20 + i, seed=40 + i), 180) for i in range(4)]
    assert sum(r.pages_needed for r in reqs) > sched.capacity_pages >= reqs[0].pages_needed
    streamed: dict[int, list[int]] = {}
    for r in reqs:
        sched.submit(Request(r.prompt, r.max_new_tokens))
    out = {}
    while sched.waiting or sched.running or sched.preempted:
        rep = sched.step()
        for rid, toks in rep.tokens.items():
            streamed.setdefault(rid, []).extend(toks)
        out.update(rep.finished)
    assert sched.preemptions > 0 and sched.max_batch >= 2
    for rid, r in enumerate(reqs):
        assert streamed[rid] == out[rid]  # each token reported once, resumed or not
        assert out[rid] == _greedy_single(model, r.prompt, r.max_new_tokens), rid
    assert not st.seqs and st.used_bytes() == 0
    st.mem.check()


def test_cancel_frees_a_running_request_at_once(model):
    st = _store()
    sched = ZipScheduler(model, st, prefill_step=32)
    a = sched.submit(Request(_prompt(40, seed=7), 50))
    b = sched.submit(Request(_prompt(30, seed=8), 50))
    sched.step()
    used = st.used_bytes()
    assert len(sched.running) == 2 and used > 0
    assert sched.cancel(a) and not sched.cancel(a)
    assert len(sched.running) == 1 and st.used_bytes() < used
    with pytest.raises(ValueError, match="tokens of KV"):
        sched.submit(Request(_prompt(10), 600))  # beyond max_tokens_per_seq
    sched.cancel(b)
    assert not st.seqs and st.used_bytes() == 0
