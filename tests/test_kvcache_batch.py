"""BatchIsoQuantKVCache: mlx-lm's batch protocol over IsoQuant caches. merge / extract / filter /
extend round-trip bit-exactly; batched attention equals each row's own; mlx-lm's own
batch_generate and BatchGenerator run with our caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from app.engine import kvcache
from app.engine.kvcache.isoquant import IsoQuantKVCache, isoquant_attention_reference
from app.engine.kvcache.isoquant import install as install_isoquant
from app.engine.kvcache.isoquant.batch import BatchIsoQuantKVCache

H, D = 2, 64


def _kv(t, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return (mx.random.normal((1, H, t, D), key=k1).astype(mx.float16),
            mx.random.normal((1, H, t, D), key=k2).astype(mx.float16))  # fmt: skip


def _single(prompt, decode, seed, **kw):
    """A cache after a prompt of `prompt` tokens and `decode` single-token steps."""
    c = IsoQuantKVCache(window=8, compress_every=4, **kw)
    k, v = _kv(prompt + decode, seed)
    if prompt:
        c.update_and_fetch(k[:, :, :prompt], v[:, :, :prompt])
    for t in range(prompt, prompt + decode):
        c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    return c


def _logical(c):
    """What attention reads: codes of tokens [0, compressed) (V unpacked to rows) and the float
    tokens [compressed, offset). A single cache may also hold codes ahead and float copies
    behind that boundary (encode-ahead, exact trims), which a batch row does not keep."""
    from app.engine.kvcache.isoquant.packing import unpack_v_codes

    kc, kn, vc, vn, fk, fv = c.state[:6]
    n = c.compressed
    out = [None] * 6
    if kc is not None and n:
        v = unpack_v_codes(vc, c.vq.bits, c.v_layout)[:, :, :n]
        out[:4] = [np.array(a) for a in (kc[:, :, :n], kn[:, :, :n], v, vn[:, :, :n])]
    if fk is not None and n - c.fp_start < fk.shape[2]:
        lo = n - c.fp_start
        out[4:] = [np.array(fk[:, :, lo:]), np.array(fv[:, :, lo:])]
    return out


def _same(a, b):
    for x, y in zip(_logical(a), _logical(b), strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
    assert (a.offset, a.compressed) == (b.offset, b.compressed)


def _rows():
    # compressed rows whose float tails agree (window 8 + 2 pending), a short float-only row,
    # a prompt not yet compressed (tail 12: compresses 2 tokens on merge) and an empty cache
    return [
        _single(40, 2, 1),
        _single(70, 6, 2),
        _single(5, 0, 3),
        _single(12, 0, 4),
        _single(0, 0, 5),
    ]


def test_merge_extract_round_trip_bit_exact():
    singles = _rows()
    batch = IsoQuantKVCache.merge(singles)
    assert isinstance(batch, BatchIsoQuantKVCache)
    assert batch.offset.tolist() == [c.offset for c in singles]
    for i, c in enumerate(singles):
        out = batch.extract(i)
        if c.offset and c.offset - c.compressed > batch.tf:
            # merging compressed this row's oldest float tokens early: compare what it holds
            # with the single cache's codes for them
            c._encode_to(c.offset - batch.tf)
            c.compressed = c.offset - batch.tf
        _same(out, c)


def test_extracted_rows_keep_the_batch_layout(monkeypatch):
    """A row comes out with V codes as rows even where new caches store tc16 (no repacking per
    finished request) and with the batch's rotation and codebooks (none made anew); relaid
    out to tc16 it attends exactly as it did."""
    monkeypatch.setenv("ROTARYQUANT_ISOQUANT_V_LAYOUT", "tc16")
    batch = IsoQuantKVCache.merge(_rows())
    q = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(7)).astype(mx.float16)
    coded = 0
    for i in range(batch.batch_size):
        row = batch.extract(i)
        assert row.v_layout == "rows"
        k, v = row._fetch()
        if not hasattr(k, "codes"):
            continue
        assert row.rotation is batch.proto.rotation and row.vq is batch.proto.vq  # shared
        coded += 1
        want = isoquant_attention_reference(q, k, v, scale=D**-0.5)
        row.relayout("tc16")
        k, v = row._fetch()
        assert v.layout == "tc16"
        got = isoquant_attention_reference(q, k, v, scale=D**-0.5)
        assert mx.array_equal(got, want).item()
    assert coded >= 2


def test_filter_and_extend_round_trip_bit_exact():
    singles = _rows()
    batch = IsoQuantKVCache.merge(singles)
    expect = [batch.extract(i) for i in range(len(singles))]
    batch.filter([4, 0, 2])
    for j, i in enumerate([4, 0, 2]):
        _same(batch.extract(j), expect[i])
    other = IsoQuantKVCache.merge([_single(100, 2, 7)])  # the same float tail (9)
    other_row = other.extract(0)
    batch.extend(other)
    assert batch.batch_size == 4
    for j, i in enumerate([4, 0, 2]):
        _same(batch.extract(j), expect[i])
    _same(batch.extract(3), other_row)


def test_batched_attention_equals_each_row():
    """The batch's attention (left padding masked) equals attention over each row alone, and
    decode steps keep every row equal to its own cache fed the same tokens."""
    singles = [_single(40, 2, 1), _single(70, 6, 2), _single(5, 0, 3)]
    batch = IsoQuantKVCache.merge(singles)
    for step in range(6):  # crosses a decode-time compression of the batch
        k, v = _kv(3, 100 + step)
        k, v = k.reshape(3, H, 1, D), v.reshape(3, H, 1, D)
        q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(200 + step)).astype(mx.float16)
        mask = batch.make_mask(1)
        bk, bv = batch.update_and_fetch(k, v)
        out = (isoquant_attention_reference(q, bk, bv, scale=D**-0.5, mask=mask)
               if hasattr(bk, "codes") else None)  # fmt: skip
        for i in range(3):
            row = batch.extract(i)
            rk, rv = row._fetch()
            if hasattr(rk, "codes"):
                ref = isoquant_attention_reference(q[i : i + 1], rk, rv, scale=D**-0.5)
            else:  # a row without codes yet: plain float attention
                ref = mx.fast.scaled_dot_product_attention(q[i : i + 1], rk, rv, scale=D**-0.5)
            assert out is not None
            np.testing.assert_allclose(
                np.array(out[i : i + 1]), np.array(ref), rtol=2e-3, atol=2e-3
            )


def test_compressions_write_in_place_and_keep_every_row(monkeypatch):
    """Decode-time compressions write codes into the batch's spare rows and move the float
    tail's start instead of reallocating: with tiny capacity steps (codes grown 4 rows at a
    time, float buffers of 16, so both grow, and a long prefill's float buffer shrinks) 40 steps
    keep each row equal to its own cache and bit-identical to a batch with the default steps,
    and between growths the code buffers are the same arrays."""

    def build():
        return IsoQuantKVCache.merge([_single(40, 2, 1), _single(70, 6, 2), _single(61, 0, 3)])

    big = build()
    monkeypatch.setattr(BatchIsoQuantKVCache, "code_step", 4)
    monkeypatch.setattr(BatchIsoQuantKVCache, "step", 16)
    small = build()
    caps, kept = set(), 0
    for step in range(40):
        k, v = _kv(3, 300 + step)
        k, v = k.reshape(3, H, 1, D), v.reshape(3, H, 1, D)
        q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(400 + step)).astype(mx.float16)
        before = small.codes
        outs = []
        for b in (big, small):
            bk, bv = b.update_and_fetch(k, v)
            outs.append(isoquant_attention_reference(q, bk, bv, scale=D**-0.5))
        if before is not None and small.codes[1].shape[2] == before[1].shape[2]:
            kept += all(a is b for a, b in zip(before, small.codes, strict=True))
        caps.add(small.codes[1].shape[2])
        assert small.fp_keys.shape[2] <= 32  # the prefill's 80-row buffer was given back
        np.testing.assert_array_equal(np.array(outs[0]), np.array(outs[1]))
        for x, y in zip(big.state, small.state, strict=True):
            np.testing.assert_array_equal(np.array(x), np.array(y))
        for i in range(3):
            rk, rv = small.extract(i)._fetch()
            ref = isoquant_attention_reference(q[i : i + 1], rk, rv, scale=D**-0.5)
            np.testing.assert_allclose(
                np.array(outs[1][i : i + 1]), np.array(ref), rtol=2e-3, atol=2e-3
            )
    assert len(caps) > 3 and kept > 10  # grown several times, written in place in between
    assert small.c == max(small.lens) and small.n_codes == small.c
    # bytes in use count the rows the state holds, not the buffers' spare rows
    assert small.used_nbytes == sum(a.nbytes for a in small.state[:6])
    assert small.used_nbytes < small.capacity_nbytes == small.nbytes


def test_a_compression_writes_each_row_after_its_own_codes():
    """Rows of different lengths (no float padding) compress with one scatter a buffer: row i's
    new codes land at [lens[i], lens[i] + k), equal to encoding the float tokens it took, and
    every other code row, written or spare, is unchanged."""
    batch = IsoQuantKVCache.merge([_single(40, 2, 1), _single(70, 6, 2), _single(61, 1, 3)])
    assert batch.pad == [0, 0, 0] and len(set(batch.lens)) == 3
    compressions = 0
    for step in range(12):
        before = [np.array(a) for a in batch.codes]
        lens, f0, tf = list(batch.lens), batch.f0, batch.tf
        k, v = _kv(3, 500 + step)
        batch.update_and_fetch(k.reshape(3, H, 1, D), v.reshape(3, H, 1, D))
        if batch.f0 == f0:
            continue
        compressions += 1
        n = batch.f0 - f0
        assert batch.lens == [x + n for x in lens] and batch.tf == tf + 1 - n
        enc = batch.proto.encode_rows(
            batch.fp_keys[:, :, f0 : f0 + n], batch.fp_values[:, :, f0 : f0 + n]
        )  # the float rows are still there: a compression only moves f0
        for a, b, e in zip(batch.codes, before, enc, strict=True):
            want = np.zeros(a.shape, b.dtype)  # a grown buffer: the old rows, zeros after
            want[:, :, : b.shape[2]] = b
            for i, x in enumerate(lens):
                want[i, :, x : x + n] = np.array(e[i])
            np.testing.assert_array_equal(np.array(a), want)
    assert compressions >= 2


def test_rows_of_different_lengths_reach_the_kernel_with_their_code_counts(monkeypatch):
    """Rows of different lengths keep their codes from position 0, so a registered fused kernel
    takes them with per-row code counts (`lens`) and no mask; a row with float padding (no
    codes yet, shorter than the others) goes to the reference instead. Through decode-time
    compressions (the padded row's padding is dropped, its own tokens become codes), the
    kernels' ragged reference at that entry equals each row's attention alone."""
    from dataclasses import replace

    from app.engine.kvcache.isoquant import attention as att
    from app.engine.kvcache.isoquant import kernels

    calls = []

    def entry(q, k, v, scale, mask=None, sinks=None, lens=None):
        # as a kernel does, read the rows' lengths from the arguments alone
        calls.append((mask, lens is not None))
        k, v = (replace(t, lens=None, fp_start=None) for t in (k, v))
        return kernels.attention_reference(q, k, v, scale, mask, sinks, lens)

    monkeypatch.setattr(att, "_kernel", entry)
    singles = [_single(40, 2, 1), _single(70, 6, 2), _single(23, 3, 3), _single(4, 0, 4)]
    batch = IsoQuantKVCache.merge(singles)
    assert batch.pad[3] > 0 and len(set(batch.lens[:3])) == 3
    seen = set()
    for step in range(14):  # three compressions: the padded row gets codes in the second
        k, v = _kv(4, 100 + step)
        k, v = k.reshape(4, H, 1, D), v.reshape(4, H, 1, D)
        q = mx.random.normal((4, 2 * H, 1, D), key=mx.random.key(200 + step)).astype(mx.float16)
        mask = batch.make_mask(1)
        bk, bv = batch.update_and_fetch(k, v)
        calls.clear()
        out = att.isoquant_attention(q, bk, bv, scale=D**-0.5, mask=mask)
        padded = bk.fp_start is not None
        seen.add(padded)
        assert calls == ([] if padded else [(None, True)])
        assert batch.offset.tolist() == [c.offset + step + 1 for c in singles]
        for i in range(4):
            rk, rv = batch.extract(i)._fetch()
            if hasattr(rk, "codes"):
                ref = isoquant_attention_reference(q[i : i + 1], rk, rv, scale=D**-0.5)
            else:
                ref = mx.fast.scaled_dot_product_attention(q[i : i + 1], rk, rv, scale=D**-0.5)
            np.testing.assert_allclose(
                np.array(out[i : i + 1]), np.array(ref), rtol=2e-3, atol=2e-3
            )
    assert seen == {True, False}
    assert batch.pad == [0, 0, 0, 0] and min(batch.lens) > 0


def test_compiled_step_over_rows_of_different_lengths_is_bit_identical(monkeypatch):
    """Without a kernel (CPU), a batch whose rows hold different code counts runs the compiled
    decode step with the rows' mask as an input: the same numbers as the op-by-op reference."""
    from app.engine.kvcache.isoquant import attention as att

    monkeypatch.setattr(att, "_kernel", None)
    batch = IsoQuantKVCache.merge([_single(40, 2, 1), _single(70, 6, 2), _single(23, 3, 3)])
    compiled = 0
    for step in range(6):
        k, v = _kv(3, 300 + step)
        k, v = k.reshape(3, H, 1, D), v.reshape(3, H, 1, D)
        q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(400 + step)).astype(mx.float16)
        mask = batch.make_mask(1)
        bk, bv = batch.update_and_fetch(k, v)
        assert bk.lens is not None and mask is None
        monkeypatch.setattr(att, "COMPILE_REFERENCE", True)
        compiled += att.compiled_eligible(q, bk, bv, mask, None)
        fast = att.isoquant_attention(q, bk, bv, scale=D**-0.5, mask=mask)
        monkeypatch.setattr(att, "COMPILE_REFERENCE", False)
        slow = att.isoquant_attention(q, bk, bv, scale=D**-0.5, mask=mask)
        assert mx.array_equal(fast, slow).item(), step
    assert compiled == 6


def test_sink_caches_are_refused():
    c = _single(20, 0, 1, sink=4)
    c.finish_prefill()
    with pytest.raises(ValueError, match="sink"):
        IsoQuantKVCache.merge([c])


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from app.engine.loader import load

    lm = load(tiny_model_path("qwen3_moe"))
    install_isoquant(lm.model)
    return lm


@pytest.mark.parametrize("mode", ["isoquant3", "isoquant_k4v3"])
def test_mlx_lm_batch_generate_runs_with_our_caches(tiny, mode):
    from mlx_lm.generate import batch_generate

    model, tok = tiny.model, tiny.tokenizer
    prompts = [tok.encode("The quick brown fox " * n) for n in (1, 7, 3, 12)]
    caches = [kvcache.make_cache(model, mode, window=8) for _ in prompts]
    assert all(isinstance(c, IsoQuantKVCache) for c in caches[0])
    res = batch_generate(model, tok, prompts, prompt_caches=caches, max_tokens=24,
                         return_token_ids=True, return_prompt_caches=True)  # fmt: skip
    assert [len(t) > 0 for t in res.token_ids] == [True] * 4
    for p, ids, cache in zip(prompts, res.token_ids, res.caches, strict=True):
        assert isinstance(cache[0], IsoQuantKVCache)
        assert cache[0].compressed > 0  # decode compressed the aged-out tokens
        assert cache[0].offset == len(p) + len(ids)  # the prompt and every sampled token


def test_codes_pack_and_unpack_on_a_thread_other_than_the_importing_one():
    """The API server decodes on its own thread: nothing the codec builds at import may be a
    lazy array bound to the importing thread's stream (a fresh interpreter, so no earlier test
    has evaluated it on this one). The thread ends as the server's does, by clearing MLX's
    per-thread streams: without that MLX 0.32 aborts at exit about one run in three."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import threading, mlx.core as mx\n"
        "from app.engine.kvcache.isoquant import packing\n"
        "err = []\n"
        "def f():\n"
        "    try:\n"
        "        c = mx.random.randint(0, 8, (1, 2, 5, 64)).astype(mx.uint8)\n"
        "        for bits in (3, 4):\n"
        "            assert (packing.unpack_codes(packing.pack_codes(c, bits), bits) == c).all().item()\n"
        "    except Exception as e:\n"
        "        err.append(repr(e))\n"
        "    finally:\n"
        "        mx.clear_streams()\n"
        "t = threading.Thread(target=f); t.start(); t.join()\n"
        "assert not err, err\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": root},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
