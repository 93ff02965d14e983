"""Hostile or oversized prompts at the engine's boundary: token ids outside the vocabulary,
prompts over the context, chat templates that never finish, Cancel during prefill, and
settings that are not numbers."""

import math

import pytest

from app.engine.generate import Engine, Finished, GenerationSettings, PromptProcessed, TokenEvent
from app.engine.prompts import Cancelled, PromptError, render_chat

HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    e = Engine()
    e.load(tiny_model_path("qwen3_moe"))
    return e


def _tokens(events):
    return [ev.token for ev in events if isinstance(ev, TokenEvent) and ev.token >= 0]


@pytest.mark.parametrize("bad", [1000, 1001, 200_000, 2**40, -1])
def test_token_ids_outside_the_vocabulary_are_refused(tiny, bad):
    assert tiny.loaded.model.args.vocab_size == 1000
    with pytest.raises(
        PromptError,
        match=f"token id {bad} at position 1 is outside the "
        r"vocabulary \(0\.\.999\)",
    ):
        list(tiny.generate([5, bad, 7], GenerationSettings(max_tokens=2)))
    assert len(_tokens(tiny.generate([5, 999, 7], GenerationSettings(max_tokens=2)))) >= 1


@pytest.mark.parametrize("bad", [[1.5], ["7"], [True], [[1, 2]], [None]])
def test_token_ids_must_be_integers(tiny, bad):
    with pytest.raises(PromptError, match="not a token id"):
        list(tiny.generate([3, *bad], GenerationSettings(max_tokens=2)))


def test_prompt_over_the_context_is_refused_and_the_answer_capped(tiny):
    ctx = tiny.loaded.config["max_position_embeddings"]
    assert ctx == 4096
    with pytest.raises(PromptError, match=r"4,096 tokens; the model's context is 4,096 tokens"):
        list(tiny.generate([3] * ctx, GenerationSettings(max_tokens=4)))
    events = list(
        tiny.generate([3] * (ctx - 3), GenerationSettings(max_tokens=50, prefill_step_size=2048))
    )
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.generated_tokens <= 3
    assert fin.reason == "length" or fin.reason == "stop"


def test_cancel_takes_effect_between_prefill_chunks(tiny):
    calls = 0

    def stop():
        nonlocal calls
        calls += 1
        return calls >= 3  # after two chunks of the prompt

    events = list(
        tiny.generate(
            [3, 4, 5, 6] * 250,
            GenerationSettings(max_tokens=20, prefill_step_size=64),
            should_stop=stop,
        )
    )
    assert not any(isinstance(ev, (PromptProcessed, TokenEvent)) for ev in events)
    fin = events[-1]
    assert fin.reason == "cancelled" and fin.generated_tokens == 0 and calls == 3
    assert len(_tokens(tiny.generate([3, 4], GenerationSettings(max_tokens=2)))) >= 1


def test_hostile_chat_template_stops_at_its_time_limit_and_on_cancel(tiny):
    tok = tiny.loaded.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    good = render_chat(tok, msgs)
    old = tok.chat_template
    tok._tokenizer.chat_template = HOSTILE
    try:
        with pytest.raises(PromptError, match="did not finish within 0.3 s"):
            render_chat(tok, msgs, seconds=0.3)
        n = 0

        def stop():
            nonlocal n
            n += 1
            return n >= 5

        with pytest.raises(Cancelled):
            render_chat(tok, msgs, should_stop=stop)
        (fin,) = tiny.generate(msgs, GenerationSettings(max_tokens=2), should_stop=lambda: True)
        assert fin.reason == "cancelled" and fin.generated_tokens == 0
        tok._tokenizer.chat_template = "{{ 'x' * 100 }}"
        with pytest.raises(PromptError, match="rendered 100 characters"):
            render_chat(tok, msgs, max_chars=99)
    finally:
        tok._tokenizer.chat_template = old
    assert render_chat(tok, msgs) == good


def test_chat_template_ids_equal_the_tokenizers_own(tiny, smollm2_path):
    e = Engine()
    e.load(smollm2_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ref = e.loaded.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert e.encode_chat(msgs) == list(ref)


@pytest.mark.parametrize("prompt", ["caf\ud800e", [{"role": "user", "content": "a\udfffb"}]])
def test_lone_surrogates_are_refused(tiny, prompt):
    with pytest.raises(PromptError, match="not valid Unicode text"):
        list(tiny.generate(prompt, GenerationSettings(max_tokens=2)))


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", math.nan),
        ("repetition_penalty", math.nan),
        ("top_p", math.inf),
        ("seed", -1),
        ("seed", 2**80),
        ("max_tokens", "5"),
        ("max_tokens", 5.0),
        ("top_k", True),
        ("prefill_step_size", 0),
    ],
)
def test_settings_that_are_not_numbers_or_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationSettings(**{field: value})
