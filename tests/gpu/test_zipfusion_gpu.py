"""ZipFusion end to end on an NVIDIA GPU (MLX's CUDA backend): generation through the fused
kernel. Skipped elsewhere; the same paths run on the MLX-ops reference in
tests/test_zipfusion_cache.py on every machine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import _get_classes

from app.engine.kvcache import zipfusion as zf
from app.engine.kvcache.zipfusion.scheduler import Request, ZipScheduler
from app.engine.testing.random_models import _randomize

pytestmark = pytest.mark.skipif(
    not (getattr(mx, "cuda", None) and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend (an NVIDIA GPU)",
)

CFG = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def model():
    mc, ac = _get_classes(CFG)
    m = mc(ac.from_dict(CFG))
    m.set_dtype(mx.bfloat16)
    _randomize(m, 11, 0.08)
    return m


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, CFG["vocab_size"], n).tolist()


def _generate(model, cache, prompt, n):
    toks, lps = [], []
    for tok, lp in generate_step(
        mx.array(prompt), model, max_tokens=n, prompt_cache=cache, prefill_step_size=64
    ):
        toks.append(int(tok))
        lps.append(np.array(lp.astype(mx.float32)))
    return toks, lps


def test_generation_through_the_kernel_is_lossless(model):
    """Compressed pages and raw pages through the same fused kernel: identical bits (the codec
    is lossless). Against mlx-lm's KVCache + mx.fast SDPA the attention arithmetic differs
    (tensor-core order, P as bf16 hi+lo): tokens agree until a near-tie of this random model's
    logits flips (H200: first difference at token 39 of 48; logprobs within 0.07 in one run, one
    bf16 unit (0.125) at a |logprob| > 16 in another)."""
    prompt = _prompt(150, 0)
    runs = {}
    for compress in (True, False):
        caches = zf.make_zipfusion_cache(model, max_tokens=512, compress=compress, use_kernel=True)
        runs[compress] = _generate(model, caches, prompt, 48)
        assert caches[0].store.use_kernel
        if compress:
            assert caches[0].store.stats["blocks_compressed"] > 0
    assert runs[True][0] == runs[False][0]
    assert all((a == b).all() for a, b in zip(runs[True][1], runs[False][1], strict=True))
    ref_t, ref_lp = _generate(
        model, [KVCache() for _ in range(CFG["num_hidden_layers"])], prompt, 48
    )
    same = [a == b for a, b in zip(runs[True][0], ref_t, strict=True)]
    first = same.index(False) if not all(same) else len(same)
    assert first >= 16, first
    # logprobs are bf16: beyond one unit in the last place of the reference's value (0.125 at
    # |logprob| in [16, 32)), the two arithmetics agree within 0.1
    diff = max(
        float((np.abs(a - b) - _bf16_ulp(b)).max())
        for a, b in zip(runs[True][1][:first], ref_lp[:first], strict=True)
    )
    assert diff < 0.1, diff


def _bf16_ulp(x: np.ndarray) -> np.ndarray:
    """Spacing of bf16 values at |x| (8 significant bits)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), np.finfo(np.float32).tiny)))
    return np.exp2(e - 7)


def test_batched_decode_on_the_gpu_is_lossless(model):
    """Several sequences of different lengths through one batched kernel call per layer:
    compressed and raw pages give the same tokens."""
    reqs = [(_prompt(n, n), m) for n, m in ((20, 30), (70, 12), (33, 40), (5, 25), (140, 20))]
    outs = []
    for compress in (True, False):
        st = zf.make_zipfusion_store(
            model, 64 << 20, max_seqs=4, max_tokens_per_seq=256, compress=compress, use_kernel=True
        )
        sched = ZipScheduler(model, st)
        outs.append(sched.run([Request(p, m) for p, m in reqs]))
        assert sched.max_batch >= 2
    assert outs[0] == outs[1]
    assert all(len(outs[0][i]) == m for i, (_, m) in enumerate(reqs))
