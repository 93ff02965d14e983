"""The engine's generation API on each tiny architecture and on the real SmolLM2."""

import pytest

from app.engine.errors import EngineError
from app.engine.generate import Engine, Finished, GenerationSettings, PromptProcessed, TokenEvent
from app.engine.testing.random_models import TINY_ARCHS


@pytest.fixture(scope="module")
def smol_engine(smollm2_path):
    e = Engine()
    e.load(smollm2_path)
    return e


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_generate_each_architecture(tiny_model_path, arch):
    e = Engine()
    info = e.load(tiny_model_path(arch))
    assert info.architecture == arch and info.weight_bytes > 0
    events = list(e.generate("Hello, world!", GenerationSettings(max_tokens=6)))
    assert isinstance(events[0], PromptProcessed)
    assert isinstance(events[-1], Finished)
    toks = [ev for ev in events if isinstance(ev, TokenEvent) and ev.token >= 0]
    fin = events[-1]
    assert fin.generated_tokens == len(toks) and 1 <= len(toks) <= 6
    assert fin.reason in ("stop", "length")
    assert fin.kv_bytes > 0 and fin.peak_memory > 0
    # greedy decoding is deterministic
    again = [
        ev.token
        for ev in e.generate("Hello, world!", GenerationSettings(max_tokens=6))
        if isinstance(ev, TokenEvent) and ev.token >= 0
    ]
    assert again == [t.token for t in toks]


def test_paris(smol_engine):
    text = smol_engine.generate_text(
        [{"role": "user", "content": "What is the capital of France?"}],
        GenerationSettings(max_tokens=32),
    )
    assert "Paris" in text


def test_cancel_mid_stream(smol_engine):
    n = 0

    def stop():
        return n >= 3

    events = []
    for ev in smol_engine.generate(
        "Once upon a time", GenerationSettings(max_tokens=200), should_stop=stop
    ):
        events.append(ev)
        if isinstance(ev, TokenEvent):
            n += 1
    fin = events[-1]
    assert fin.reason == "cancelled" and fin.generated_tokens == 3


def test_sampling_is_seeded(smol_engine):
    s = GenerationSettings(max_tokens=6, temperature=1.0, top_p=0.9, seed=7)
    a = smol_engine.generate_text("The weather today is", s)
    b = smol_engine.generate_text("The weather today is", s)
    assert a == b


def test_bad_settings_and_requests(smol_engine):
    with pytest.raises(ValueError):
        GenerationSettings(temperature=-1)
    with pytest.raises(ValueError):
        GenerationSettings(max_tokens=0)
    with pytest.raises(EngineError, match="empty prompt"):
        list(smol_engine.generate([], GenerationSettings()))
    with pytest.raises(EngineError, match="NVIDIA|not available"):
        list(smol_engine.generate("hi", GenerationSettings(kv_mode="zipfusion")))
    assert Engine().loaded is None
    with pytest.raises(EngineError, match="no model loaded"):
        list(Engine().generate("hi"))


def test_kv_stats_count_the_float_cache_at_its_real_dtype(smol_engine):
    from app.engine.backend import detect

    smol_engine.generate_text(
        "The weather today is", GenerationSettings(max_tokens=4, kv_mode="fp16")
    )
    kv = smol_engine.kv_stats()
    # SmolLM2: 30 layers x 3 KV heads x head dim 64, K and V; float32 on the CPU backend (its
    # dense weights are dequantized to float32 at load), the model's fp16 elsewhere
    itemsize = 4 if detect().name == "cpu" else 2
    assert kv["mode"] == "fp16" and kv["tokens"] > 4
    assert kv["float_bytes"] == 30 * 3 * 64 * 2 * itemsize * kv["tokens"]
    assert kv["bytes"] == kv["used_bytes"] == kv["float_bytes"]  # held tokens, not capacity
    assert kv["capacity_bytes"] == 30 * 3 * 64 * 2 * itemsize * 256  # mlx-lm's steps of 256
    assert kv["fallbacks"] == []


def test_isoquant_mode_saves_kv_bytes(smol_engine):
    ids = smol_engine.encode_text("To be, or not to be, that is the question. " * 20)
    smol_engine.generate_text(
        ids, GenerationSettings(max_tokens=3, kv_mode="isoquant3", kv_window=0)
    )
    kv = smol_engine.kv_stats()
    assert kv["mode"] == "isoquant3" and kv["tokens"] >= len(ids)
    assert kv["used_bytes"] * 4 < kv["float_bytes"]  # 3-bit codes + norms vs float values
    # bits per value as held: codes, norms and the float32 tail (the trim reserve and up to one
    # growth step of released copies), nothing spare
    from app.engine.kvcache.isoquant.cache import FP_STEP, TRIM_EXACT

    values = 30 * 3 * 64 * 2 * kv["tokens"]
    tail = (TRIM_EXACT + FP_STEP) * 32 / kv["tokens"]
    assert 3.0 < kv["used_bytes"] * 8 / values < 3.0 + 0.25 + tail


def test_cpu_float_dense_weights_match_quantized(smollm2_path):
    """On the CPU backend the dense layers are dequantized once (fast sgemm); the logits equal
    the quantized model's up to float rounding."""
    import mlx.core as mx

    from app.engine.backend import detect

    quant, flt = Engine(), Engine()
    quant.load(smollm2_path, {"cpu_float_weights": False})
    info = flt.load(smollm2_path)
    ids = mx.array([quant.encode_text("To be, or not to be, that is the question.")])
    a = quant.loaded.model(ids).astype(mx.float32)
    b = flt.loaded.model(ids).astype(mx.float32)
    if detect().name != "cpu":
        assert info.extra["cpu_float_dense_bytes"] == 0
        return
    assert info.extra["cpu_float_dense_bytes"] > 4 * quant.info.weight_bytes
    assert mx.argmax(a, -1).tolist() == mx.argmax(b, -1).tolist()
    assert (mx.linalg.norm(a - b) / mx.linalg.norm(a)).item() < 1e-2


def test_a_plans_context_limits_prompt_and_answer(tiny_model_path):
    """Loaded with a plan's context (the app's "Use this plan"), the engine never goes past it:
    the answer stops where prompt + answer reach it, and a longer prompt is refused."""
    eng = Engine()
    eng.load(tiny_model_path("qwen3_moe"), {"context": 24, "kv_mode": "fp16"})
    assert eng.context_limit == 24
    ids = list(range(5, 15))  # 10 prompt tokens
    fin = [
        e for e in eng.generate(ids, GenerationSettings(max_tokens=100)) if isinstance(e, Finished)
    ][0]
    assert fin.prompt_tokens == 10 and fin.generated_tokens <= 14
    with pytest.raises(EngineError, match="the plan's context limit .* is 24 tokens"):
        list(eng.generate(list(range(5, 30)), GenerationSettings(max_tokens=4)))
    eng.load(tiny_model_path("qwen3_moe"))
    assert eng.context_limit is None
