"""The batcher's text handling without a model: stop strings across pieces, the thinking
section split into reasoning, seeded samplers independent of their neighbours."""

from __future__ import annotations

from app.server.batcher import Completion, Delta, Done, StopText, _Live, make_sampler


def test_stop_text_holds_back_a_possible_start():
    st = StopText(("Paris", "\n\n"))
    assert st.feed("The cap") == ("The cap", False)
    assert st.feed("ital is Pa") == ("ital is ", False)  # "Pa" may begin "Paris"
    assert st.feed("ris.") == ("", True)
    st = StopText(("Paris",))
    assert st.feed("a P") == ("a ", False)
    assert st.feed("ie") == ("Pie", False) and st.flush() == ""
    assert StopText(()).feed("x") == ("x", False)


class _Detok:
    """The streaming detokenizer's protocol over a table of token texts."""

    def __init__(self, table):
        self.table, self.pending, self.last_segment = table, "", ""

    def reset(self):
        self.pending = self.last_segment = ""

    def add_token(self, t):
        self.last_segment = self.table[t]

    def finalize(self):
        self.last_segment = ""


class _Tok:
    def __init__(self, table):
        self.detokenizer = _Detok(table)


def test_thinking_goes_to_reasoning_and_stop_applies_to_content():
    events = []
    req = Completion(prompt=[1, 2, 3], max_tokens=10, emit=events.append, stop=("!",))
    live = _Live(req, _Tok({10: "Let me ", 11: "think.", 12: "Paris", 13: "!", 14: "more"}))
    think = (5, 6)
    for t in (5, 10, 11, 6, 12):
        assert not live.token(t, *think)
    assert live.token(13, *think)  # the stop string ends the answer
    live.finish("stop")
    assert events[:-1] == [
        Delta(reasoning="Let me "),
        Delta(reasoning="think."),
        Delta(content="Paris"),
    ]
    assert events[-1] == Done("stop", 3, 6)


def test_prompt_that_opened_thinking_starts_in_reasoning():
    events = []
    live = _Live(Completion([1], 5, events.append, reasoning=True), _Tok({10: "hmm", 12: "ok"}))
    for t in (10, 6, 12):
        live.token(t, 5, 6)
    live.finish("length")
    assert events == [Delta(reasoning="hmm"), Delta(content="ok"), Done("length", 1, 3)]


def test_seeded_samplers_do_not_depend_on_neighbours():
    import mlx.core as mx

    logits = mx.random.normal((1, 50), key=mx.random.key(0))
    a, b = make_sampler(1.0, 0.9, 3), make_sampler(1.0, 0.9, 3)
    other = make_sampler(1.0, 1.0, 4)
    seq_a = [int(a(logits)[0]) for _ in range(6)]
    seq_b = []
    for _ in range(6):
        other(logits)  # a neighbour draws in between
        seq_b.append(int(b(logits)[0]))
    assert seq_a == seq_b
    assert make_sampler(0.0, 1.0, None) is None  # greedy: the batch's shared sampler
