"""Expert codes widened for prefill calls: same weights, same outputs, one layer's copy at a time."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from app.engine import compiled
from app.engine import expert_widen as ew
from app.engine.errors import EngineError
from app.engine.generate import prepare_model
from app.engine.loader import load
from app.engine.testing.graphs import primitives
from app.engine.testing.random_models import TINY_CONFIGS, make_random_model

# (bits, to): every widening the engine can ask for
PAIRS = [(2, 4), (2, 8), (3, 4), (3, 8), (4, 8)]


@pytest.mark.parametrize("bits,to", PAIRS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_widened_codes_dequantize_bit_for_bit(bits, to, group, dtype):
    # 3 experts, 13 outputs (odd), 384 inputs: several groups a row at each group size
    w = (mx.random.normal((3, 13, 384), key=mx.random.key(bits * 100 + group)) * 0.1).astype(dtype)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    wide = ew.widen(q, bits, to)
    assert wide.dtype == mx.uint32 and wide.shape == (3, 13, 384 * to // 32)
    ref = mx.dequantize(q, s, b, group_size=group, bits=bits)
    got = mx.dequantize(wide, s, b, group_size=group, bits=to)
    assert got.dtype == ref.dtype
    assert mx.array_equal(got, ref).item()
    # the codes themselves: dequantized with unit scales and zero biases
    one, zero = mx.ones_like(s), mx.zeros_like(b)
    assert mx.array_equal(
        mx.dequantize(wide, one, zero, group_size=group, bits=to),
        mx.dequantize(q, one, zero, group_size=group, bits=bits),
    ).item()


def test_widen_refuses_what_it_cannot_do():
    q, _, _ = mx.quantize(mx.zeros((2, 64)), group_size=64, bits=8)
    assert ew.widen(q, 8, 8) is q
    with pytest.raises(ValueError):
        ew.widen(q, 8, 4)
    q6, _, _ = mx.quantize(mx.zeros((2, 64)), group_size=64, bits=6)
    with pytest.raises(ValueError):
        ew.widen(q6, 6, 8)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sort", [True, False])
def test_gather_qmm_through_widened_weights(bits, sort):
    experts, out, inp, rows = 5, 37, 256, 96
    w = mx.random.normal((experts, out, inp), key=mx.random.key(bits)) * inp**-0.5
    q, s, b = mx.quantize(w, group_size=64, bits=bits)
    idx = mx.random.randint(0, experts, (rows,), key=mx.random.key(7)).astype(mx.uint32)
    if sort:
        idx = mx.sort(idx)
    x = mx.random.normal((rows, 1, inp), key=mx.random.key(8))

    def run(wq, width):
        return mx.gather_qmm(
            x, wq, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=width,
            sorted_indices=sort,
        )  # fmt: skip

    ref = run(q, bits)
    got = run(ew.widen(q, bits, 8), 8)
    assert got.shape == ref.shape
    assert float(mx.abs(ref).max()) > 0.1
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)


def test_prefill_bits_defaults_and_override(monkeypatch):
    monkeypatch.delenv(ew.ENV, raising=False)
    assert ew.prefill_bits("cuda") == 8
    assert ew.prefill_bits("cpu") is None and ew.prefill_bits("metal") is None
    for value, want in (("8", 8), ("4", 4), ("off", None), ("OFF ", None)):
        monkeypatch.setenv(ew.ENV, value)
        assert ew.prefill_bits("cuda") == want and ew.prefill_bits("cpu") == want
    monkeypatch.setenv(ew.ENV, "2")
    with pytest.raises(EngineError, match=ew.ENV):
        ew.prefill_bits("cuda")


def _quantized_tiny(folder, config="qwen3_moe", bits=2, seed=5):
    """A tiny random model, loaded, its routed experts quantized at `bits` (the rest float)."""
    make_random_model(config, folder, seed=seed, scale=0.5)
    model = load(folder).model
    nn.quantize(
        model,
        class_predicate=lambda _, m: (
            isinstance(m, SwitchLinear) and {"group_size": 64, "bits": bits}
        ),
    )
    mx.eval(model.parameters())
    return model


def _prefill_logits(model, tokens):
    cache = make_prompt_cache(model)
    out = model(mx.array([tokens]), cache=cache)
    mx.eval(out)
    return out, cache


@pytest.mark.parametrize("bits", [2, 3])
def test_model_prefill_logits_with_widening(tmp_path, monkeypatch, bits):
    model = _quantized_tiny(tmp_path / "m", bits=bits)
    monkeypatch.setenv(ew.ENV, "off")
    facts = prepare_model(model, float_dense=False)
    n_layers = TINY_CONFIGS["qwen3_moe"]["num_hidden_layers"]
    assert facts["expert_prefill_layers"] == 3 * n_layers and facts["expert_prefill_bits"] is None
    assert facts["compiled_blocks"] == n_layers  # the widening layers keep the blocks compilable
    switches = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(switches) == 3 * n_layers and all(ew.is_widening(m) for m in switches)

    calls = []
    real = ew.widen
    monkeypatch.setattr(ew, "widen", lambda w, b, to=8: calls.append((b, to)) or real(w, b, to))
    tokens = np.random.default_rng(3).integers(3, 1000, 300).tolist()  # 600 rows at top-2
    ref, _ = _prefill_logits(model, tokens)
    assert not calls
    results = {}
    for mode in ("8", "4"):
        monkeypatch.setenv(ew.ENV, mode)
        compiled.use_traces(model, mode)
        calls.clear()
        results[mode], cache = _prefill_logits(model, tokens)
        # every expert projection widened once while its block was traced for the shape
        assert calls == [(bits, int(mode))] * (3 * n_layers)
        # a decode step (2 rows) runs the stored width: nothing widened
        calls.clear()
        step = model(mx.argmax(results[mode][:, -1:], axis=-1), cache=cache)
        mx.eval(step)
        assert not calls
    for mode, got in results.items():
        assert float(mx.abs(got - ref).max()) < 1e-3 * float(mx.abs(ref).max()), mode
    # back to the first traces: the stored width again, bit for bit
    monkeypatch.setenv(ew.ENV, "off")
    compiled.use_traces(model, None)
    again, _ = _prefill_logits(model, tokens)
    assert mx.array_equal(again, ref).item()
    assert ew.uninstall(model) == 3 * n_layers
    assert not any(ew.is_widening(m) for m in switches)


@pytest.mark.parametrize("compile_blocks", [True, False])
def test_prefill_peak_holds_one_layers_widened_weights(tmp_path, monkeypatch, compile_blocks):
    """Eight layers whose experts dwarf the activations: widening on costs about one layer's
    widened copy of peak memory, not eight."""
    cfg = dict(
        TINY_CONFIGS["qwen3_moe"],
        hidden_size=256,
        moe_intermediate_size=256,
        num_experts=64,
        num_hidden_layers=8,
    )
    model = _quantized_tiny(tmp_path / "m", config=cfg, bits=2, seed=1)
    monkeypatch.setenv(ew.ENV, "off")
    prepare_model(model, float_dense=False, compile_blocks=compile_blocks)
    assert compiled.is_compiled(model.model.layers[0].mlp) == compile_blocks
    tokens = list(range(3, 259))  # 256 tokens, 512 rows at top-2
    one_layer = 3 * 64 * 256 * 256  # bytes of one layer's three projections at 8 bits

    def peak(mode):
        monkeypatch.setenv(ew.ENV, mode)
        compiled.use_traces(model, mode)
        _prefill_logits(model, tokens)  # traced (compiled blocks) and warm
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out, cache = _prefill_logits(model, tokens)
        p = mx.get_peak_memory() - base
        del out, cache
        return p

    off, on = peak("off"), peak("8")
    extra = on - off
    assert extra > 0.5 * one_layer  # the widening ran
    assert extra < 1.5 * one_layer, f"extra peak {extra / 1e6:.1f} MB: more than one layer's"


@pytest.mark.parametrize("compile_blocks", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_decode_steps_pass_the_left_indices_as_a_constant(
    tmp_path, compile_blocks, bits, monkeypatch
):
    """A decode step's expert calls hand gather_qmm its default left indices as a constant: the
    step's graph has three Arange nodes a layer fewer (gate, up, down; the CPU's RoPE makes
    its own, so q and k keep their two RoPEs here), and its logits equal mlx-lm's own calls bit
    for bit."""
    monkeypatch.setattr(compiled, "MERGE_QK", False)
    model = _quantized_tiny(tmp_path / "m", bits=bits)
    tokens = np.random.default_rng(4).integers(3, 1000, 40).tolist()
    ref_logits, ref_cache = _prefill_logits(model, tokens)
    prepare_model(model, float_dense=False, compile_blocks=compile_blocks)
    switches = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert switches and all(ew.is_installed(m) for m in switches)
    assert all(ew.is_widening(m) == (bits == 4) for m in switches)
    got_logits, cache = _prefill_logits(model, tokens)
    assert mx.array_equal(got_logits, ref_logits).item()
    n_layers = TINY_CONFIGS["qwen3_moe"]["num_hidden_layers"]
    tok = mx.argmax(got_logits[:, -1:], axis=-1)
    for _ in range(3):
        mx.eval(tok)
        y = model(tok, cache=cache)
        ours = primitives(y)
        ew.uninstall(model)
        compiled.uncompile(model)  # (a compiled block keeps its traces: mlx-lm's calls anew)
        ref = model(tok, cache=ref_cache)
        theirs = primitives(ref)
        assert theirs.count("Arange") - ours.count("Arange") == 3 * n_layers
        if not compile_blocks:  # gate and up: the left indices come broadcast
            assert theirs.count("Broadcast") - ours.count("Broadcast") == 2 * n_layers
        prepare_model(model, float_dense=False, compile_blocks=compile_blocks)
        assert mx.array_equal(y, ref).item()
        tok = mx.argmax(y[:, -1:], axis=-1)
