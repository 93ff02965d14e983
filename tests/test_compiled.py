"""Compiled feed-forward blocks and the engine's generation loop: same numbers as mlx-lm's."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from app.engine import compiled
from app.engine.generate import Engine, GenerationSettings, TokenEvent, token_stream
from app.engine.loader import load
from app.engine.testing.graphs import primitives
from app.engine.testing.random_models import make_random_model

PROMPT = np.random.default_rng(3).integers(3, 1000, 37).tolist()
ARCHS = ["qwen3_moe", "qwen2_moe", "gpt_oss", "gemma4_text", "llama"]


@pytest.fixture(scope="module")
def model_of(tmp_path_factory):
    """arch -> a freshly loaded tiny model (scale 0.5: varied tokens), folder built once."""
    root = tmp_path_factory.mktemp("compiled")

    def get(arch):
        folder = root / arch
        if not folder.exists():
            make_random_model(arch, folder, seed=5, scale=0.5)
        return load(folder).model

    return get


def _forward(model, tokens, steps=6):
    """Logits of a 37-token prefill and `steps` greedy decode steps, evaluated as it goes."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([tokens]), cache=cache)[:, -1, :]]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1], axis=-1)[None], cache=cache)[:, -1, :])
        mx.eval(out[-1])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_blocks_give_bit_identical_logits(model_of, arch):
    model = model_of(arch)
    names = [k for k, _ in tree_flatten(model.parameters())]
    ref = _forward(model, PROMPT)
    paths = compiled.compile_blocks(model)
    assert paths and all(".layers." in f".{p}" for p in paths)
    assert [k for k, _ in tree_flatten(model.parameters())] == names  # same tree, same paths
    assert compiled.compile_blocks(model) == paths  # idempotent
    got = _forward(model, PROMPT)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert mx.array_equal(a, b).item(), f"{arch}: logits differ at step {i}"
    assert compiled.uncompile(model) == len(paths)
    assert not any(compiled.is_compiled(m) for _, m in model.named_modules())


def _isoquant_logits(model, steps=30):
    """isoquant3 logits (window 8): a 20-token and a 17-token chunk, then greedy decode steps
    that cross several compression batches."""
    from app.engine import kvcache

    cache = kvcache.make_cache(model, "isoquant3", window=8)
    assert not kvcache.fallbacks(cache)  # the compiled attention still takes compressed K/V
    out = [model(mx.array([PROMPT[:20]]), cache=cache)[:, -1, :]]
    out.append(model(mx.array([PROMPT[20:]]), cache=cache)[:, -1, :])
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1], axis=-1)[None], cache=cache)[:, -1, :])
        mx.eval(out[-1])
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_compiled_attention_gives_bit_identical_logits(model_of, arch):
    """The attention modules' decode step compiled (RoPE's offset an array): the same logits
    with mlx-lm's float cache and with IsoQuant's, prefill chunks left to mlx-lm's code."""
    model = model_of(arch)
    ref_fp, ref_iq = _forward(model, PROMPT, steps=20), _isoquant_logits(model)
    paths = compiled.compile_blocks(model)
    attn = [p for p in paths if p.endswith(".self_attn")]
    assert len(attn) == len(model.layers)
    # the decoder layers too: a decode step is two compiled calls a layer around the cache
    assert compiled.compiled_layers(model) == len(model.layers)
    for got, ref in (
        (_forward(model, PROMPT, steps=20), ref_fp),
        (_isoquant_logits(model), ref_iq),
    ):
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert mx.array_equal(a, b).item(), f"{arch}: logits differ at step {i}"
    assert len({int(mx.argmax(x).item()) for x in ref_iq}) > 1
    compiled.uncompile(model)
    assert type(model.layers[0].self_attn).__call__ is not compiled._attention_call
    # a RoPE that does host arithmetic on its offset: that module stays as mlx-lm built it
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    attn = model.layers[0].self_attn
    rope = attn.rope
    attn.rope = DynamicNTKScalingRoPE(8, 4096, False, 10000.0, 2.0)
    assert not compiled.attention_compilable(attn)
    attn.rope = rope
    assert compiled.attention_compilable(attn)


def test_compiled_block_sees_new_weights(model_of):
    model = model_of("qwen3_moe")
    compiled.compile_blocks(model)
    x = mx.random.normal((1, 3, model.args.hidden_size))
    block = model.model.layers[0].mlp
    before = block(x)
    block.gate.weight = block.gate.weight * 3  # a different routing
    after = block(x)
    compiled.uncompile(model)
    assert mx.array_equal(after, block(x)).item()
    assert not mx.array_equal(after, before).item()


def test_impure_blocks_and_the_switch_stay_as_built(model_of, monkeypatch):
    model = model_of("qwen3_moe")
    monkeypatch.setenv(compiled.COMPILE_ENV, "0")
    assert compiled.compile_blocks(model) == []
    monkeypatch.delenv(compiled.COMPILE_ENV)
    block = model.model.layers[0].mlp

    class HostSide(type(block.switch_mlp)):  # e.g. the pager's layers: routes read on the host
        pass

    HostSide.__module__ = "app.engine.offload.layers"
    block.switch_mlp.__class__ = HostSide
    assert not compiled.compilable(block)
    paths = compiled.compile_blocks(model)
    assert "model.layers.0.mlp" not in paths and "model.layers.1.mlp" in paths
    # a layer whose block reads routes on the host keeps mlx-lm's call (its attention compiled)
    layers = model.model.layers
    assert compiled.is_compiled(layers[0].self_attn) and not compiled.layer_compilable(layers[0])
    assert compiled.compiled_layers(model) == len(layers) - 1
    compiled.uncompile(model)
    assert compiled.compiled_layers(model) == 0


def _mlx_lm_tokens(model, n, **kw):
    cache = make_prompt_cache(model)
    return [
        int(t)
        for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n, prompt_cache=cache, **kw)
    ]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_token_stream_matches_mlx_lm_generate_step(model_of, arch):
    model = model_of(arch)
    ref = _mlx_lm_tokens(model, 12, prefill_step_size=16)
    compiled.compile_blocks(model)
    got = list(
        token_stream(model, PROMPT, make_prompt_cache(model), max_tokens=12, prefill_chunk=16)
    )
    assert got == ref and len(set(got)) > 1
    # repetition penalty (history) and a seeded sampler
    procs = make_logits_processors(repetition_penalty=1.3)
    mx.random.seed(4)
    ref = _mlx_lm_tokens(
        model, 10, logits_processors=procs, sampler=make_sampler(temp=0.8), prefill_step_size=8
    )
    mx.random.seed(4)
    got = list(
        token_stream(
            model,
            PROMPT,
            make_prompt_cache(model),
            max_tokens=10,
            sampler=make_sampler(temp=0.8),
            processors=procs,
            prefill_chunk=8,
        )
    )
    assert got == ref
    compiled.uncompile(model)


def test_engine_prefill_chunk_comes_from_the_planner(tmp_path):
    folder = make_random_model("qwen3_moe", tmp_path / "m", seed=5, scale=0.5)
    e = Engine()
    info = e.load(folder)
    assert e.prefill_chunk in (512, 1024, 2048)
    assert info.extra["prefill_chunk"] == e.prefill_chunk and info.extra["prefill_chunk_reason"]
    assert info.extra["compiled_blocks"] == 4 and info.extra["compiled_attention"] == 4
    chunks = {}
    for chunk in (None, 5):
        s = GenerationSettings(max_tokens=8, prefill_step_size=chunk)
        chunks[chunk] = [
            ev.token for ev in e.generate(PROMPT, s) if isinstance(ev, TokenEvent) and ev.token >= 0
        ]
    assert chunks[None] == chunks[5]
    with pytest.raises(ValueError, match="prefill_step_size"):
        GenerationSettings(prefill_step_size=0)


def test_larger_prefill_step_stays_within_the_planners_expectation(tmp_path):
    """Prefill at 2048- and 512-token steps: MLX's peak over the weights stays within what the
    plan counts for them (activations + KV at that step, and its compute allowance), and the
    larger step does not make the estimate worse (CPU: MLX's unfused attention, the hard case;
    both run ~12-14% above activations + KV on a tiny model, inside the allowance)."""
    from app.engine import planner, sizes

    folder = make_random_model("qwen3_moe", tmp_path / "m", seed=5, scale=0.5)
    model = load(folder).model
    s = sizes.sizes_for(folder)
    m = planner.Machine.detect()
    ids = np.random.default_rng(1).integers(3, 1000, 2100).tolist()
    ratio = {}
    for chunk in (512, 2048):
        cache = make_prompt_cache(model)
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        next(iter(token_stream(model, ids, cache, max_tokens=1, prefill_chunk=chunk)))
        measured = mx.get_peak_memory() - base
        expected = planner.activation_bytes(s, len(ids), m, chunk) + s.kv_bytes(
            len(ids), "fp16", chunk
        )
        assert measured <= expected + planner.COMPUTE_ALLOWANCE, (chunk, measured, expected)
        ratio[chunk] = measured / expected
    assert ratio[2048] <= ratio[512] * 1.05, ratio


@pytest.mark.parametrize("bits", [None, 4, 8])
def test_fused_projections_one_matmul_same_logits(tmp_path, bits):
    """A decode step's q/k/v projections as one matmul (float and quantized): two matmul nodes
    a layer fewer, logits bit-identical to mlx-lm's three projections, no extra memory (the
    projections' arrays become views of the fused ones), and a later weight update is seen."""
    import gc

    import mlx.nn as nn

    folder = make_random_model("qwen3_moe", tmp_path / "m", seed=5, scale=0.5)
    model = load(folder).model
    if bits:
        nn.quantize(
            model, group_size=32, bits=bits, class_predicate=lambda _, m: type(m) is nn.Linear
        )
    mx.eval(model.parameters())
    ref = _forward(model, PROMPT, steps=8)
    names = [k for k, _ in tree_flatten(model.parameters())]
    gc.collect()
    before = mx.get_active_memory()
    compiled.compile_blocks(model)
    gc.collect()
    attn = [layer.self_attn for layer in model.layers]
    assert all("_rq_qkv" in a.__dict__ for a in attn)
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    qkv_bytes = sum(v.nbytes for v in attn[0]._rq_qkv["arrays"].values())
    assert mx.get_active_memory() - before < qkv_bytes  # not one layer's copy more
    got = _forward(model, PROMPT, steps=8)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert mx.array_equal(a, b).item(), f"logits differ at step {i}"
    assert all("_rq_qkv" in a.__dict__ for a in attn)  # still fused after the steps
    # the step's graph: two (quantized) matmuls a layer fewer than three projections
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=cache)
    mx.eval([c.state for c in cache])
    kind = "QuantizedMatmul" if bits else "Matmul"
    step = model(mx.array([[5]]), cache=cache)
    fused_n = primitives(step).count(kind)
    mx.eval(step, [c.state for c in cache])
    for c in cache:
        c.offset -= 1
    for a in attn:  # the same step, three projections
        object.__delattr__(a, "_rq_qkv")

    three_n = primitives(model(mx.array([[5]]), cache=cache)).count(kind)
    assert three_n - fused_n == 2 * len(attn)
    # the unfused compiled step rewrapped the projections' arrays (mx.compile's captured
    # inputs), which reads as an update: fuse them again
    assert all(compiled.fuse_projections(a) for a in attn)
    assert all(compiled._qkv_arrays(a) is not None for a in attn)
    # a batch of two rows through the fused arrays: each row as it is alone
    x = mx.random.normal((2, 1, model.args.hidden_size))
    off = mx.array(7, mx.int32)
    a0 = attn[0]
    pair = a0._rq_fused_fn(x, off, compiled._qkv_arrays(a0))
    for r in range(2):
        one = a0._rq_fused_fn(x[r : r + 1], off, compiled._qkv_arrays(a0))
        for p, o in zip(pair, one, strict=True):
            assert mx.allclose(p[r : r + 1], o, atol=1e-5).item()
    # new weights for one projection: the fusion is dropped and the step follows them
    new = {k: (v[::-1] if v.dtype == mx.uint32 else v * 2) for k, v in a0.k_proj.items()}
    a0.k_proj.update(new)
    cache = make_prompt_cache(model)
    step = model(mx.array([[5]]), cache=cache)
    assert "_rq_qkv" not in a0.__dict__ and "_rq_qkv" in attn[1].__dict__
    compiled.uncompile(model)
    assert mx.array_equal(step, model(mx.array([[5]]), cache=make_prompt_cache(model))).item()


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_token_step_rotates_q_and_k_in_one_call(model_of, arch, dtype):
    """A one-token step takes its heads from one reshape of the fused projection and rotates
    the q and k heads in one RoPE; with q/k norms (qwen3_moe) it normalises them in one
    rms_norm (times each head's weight row): logits bit-identical to mlx-lm's two norms and two
    RoPEs, one RoPE a layer in the graph. A later update of a norm's weight drops the fusion
    and the step follows it."""
    import mlx.nn as nn

    model = model_of(arch)
    if dtype == "bfloat16":  # the CPU's gather_mm is float32 only: quantized experts then
        model.set_dtype(mx.bfloat16)
        nn.quantize(model, group_size=32, bits=8)
    mx.eval(model.parameters())
    ref = _forward(model, PROMPT, steps=6)
    compiled.compile_blocks(model)
    attn = [layer.self_attn for layer in model.layers]
    assert all((compiled.QK_NORM in a._rq_qkv["arrays"]) == (arch == "qwen3_moe") for a in attn)
    got = _forward(model, PROMPT, steps=6)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert mx.array_equal(a, b).item(), f"logits differ at step {i}"
    assert all(compiled._qkv_arrays(a) is not None for a in attn)  # still fused
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=cache)
    mx.eval([c.state for c in cache])
    # one RoPE a layer (float32 on the CPU: composed of ops, its cos once a layer)
    labels = primitives(model(mx.array([[5]]), cache=cache))
    assert sum(n == "RoPE" or "Cos" in n for n in labels) == len(attn), labels
    if arch != "qwen3_moe":
        return
    # a new weight for one k norm: that layer's fusion is dropped and the step follows it
    a0 = attn[0]
    a0.k_norm.update({"weight": a0.k_norm.weight * 1.5})
    step = model(mx.array([[5]]), cache=make_prompt_cache(model))
    assert "_rq_qkv" not in a0.__dict__ and "_rq_qkv" in attn[1].__dict__
    compiled.uncompile(model)
    assert mx.array_equal(step, model(mx.array([[5]]), cache=make_prompt_cache(model))).item()
