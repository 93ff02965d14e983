"""Prompts checked at the engine's boundary: chat messages and text are valid, the chat template
renders within a time and size limit (and stops on Cancel), token ids are inside the
vocabulary, and the prompt fits the model's context.

Policy on the context: a prompt of `context` tokens or more is refused (nothing is cut
silently); a shorter one generates at most up to the context, then finishes with "length".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from numbers import Integral

from .errors import EngineError

TEMPLATE_SECONDS = 10.0  # chat templates render in milliseconds: beyond this one is hostile
TEMPLATE_CHARS = 32 << 20  # rendered text; far above any context the models here take
_CHECK_EVERY = 1024  # trace events between clock reads while a template renders


class PromptError(EngineError, ValueError):
    """A prompt the engine refuses: says what is wrong and what to do."""


class Cancelled(EngineError):
    """The request was cancelled while its prompt was being prepared or prefilled."""


def check_text(text, what: str = "the prompt") -> str:
    if not isinstance(text, str):
        raise PromptError(f"{what} must be text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(
            f"{what} is not valid Unicode text ({e.reason} at character "
            f"{e.start}): remove that character"
        ) from None
    return text


def check_messages(messages) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise PromptError(f"chat message {i} must be {{'role': str, 'content': str}}")
        check_text(m["role"], f"chat message {i}'s role")
        check_text(m["content"], f"chat message {i}")
        out.append(m)
    return out


def render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    should_stop: Callable[[], bool] = lambda: False,
    seconds: float = TEMPLATE_SECONDS,
    max_chars: int = TEMPLATE_CHARS,
) -> list[int]:
    """The token ids of `messages` through the tokenizer's (sandboxed) chat template, within
    `seconds` and `max_chars`; Cancel (`should_stop`) interrupts the rendering."""
    check_messages(messages)
    with _Guard(seconds, should_stop) as guard:
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except (Cancelled, PromptError):
            raise
        except Exception as e:  # the template's own errors: the user's model, not a bug here
            guard.raise_if_stopped()
            raise PromptError(f"the model's chat template failed: {e}") from e
    if not isinstance(text, str):
        raise PromptError("the model's chat template did not render text")
    if len(text) > max_chars:
        raise PromptError(
            f"the chat template rendered {len(text):,d} characters (limit "
            f"{max_chars:,d}): shorten the conversation"
        )
    # what apply_chat_template(tokenize=True) does: the template writes the special tokens
    return list(tokenizer.encode(text, add_special_tokens=False))


class _Guard:
    """Line tracing in this thread while a template renders: raises PromptError past the
    deadline and Cancelled when asked to stop. Jinja compiles templates to Python, so every
    loop of a template is seen, however it nests."""

    def __init__(self, seconds: float, should_stop: Callable[[], bool]):
        self.seconds, self.should_stop = seconds, should_stop
        self.count = 0
        self.stopped: Exception | None = None

    def __enter__(self) -> _Guard:
        self.deadline = time.monotonic() + self.seconds
        self.old = sys.gettrace()
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self.old)

    def _trace(self, frame, event, arg):
        self.count += 1
        if self.count % _CHECK_EVERY == 0 and self.stopped is None:
            if self.should_stop():
                self.stopped = Cancelled("cancelled while rendering the chat template")
            elif time.monotonic() > self.deadline:
                self.stopped = PromptError(
                    f"the model's chat template did not finish within {self.seconds:g} s: "
                    "it is broken or hostile; use raw text or another model"
                )
            if self.stopped is not None:
                raise self.stopped
        return self._trace

    def raise_if_stopped(self) -> None:
        if self.stopped is not None:  # a template that caught our exception still stops
            raise self.stopped


def check_ids(ids, vocab_size: int | None) -> list[int]:
    """Token ids as plain ints, each in [0, vocab_size)."""
    out = []
    for i, t in enumerate(ids):
        if not isinstance(t, Integral) or isinstance(t, bool):
            raise PromptError(f"token {i} of the prompt is {type(t).__name__}, not a token id")
        t = int(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            top = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
            raise PromptError(f"token id {t} at position {i} is outside the vocabulary ({top})")
        out.append(t)
    return out


def vocab_size(model, config: dict) -> int | None:
    """Rows of the model's token embedding: the ids it can look up."""
    args = getattr(model, "args", None)
    for src in (
        getattr(args, "vocab_size", None),
        config.get("vocab_size"),
        (config.get("text_config") or {}).get("vocab_size"),
    ):
        if isinstance(src, int) and src > 0:
            return src
    return None


def context_limit(config: dict, plan: dict | None = None) -> tuple[int | None, str]:
    """The most tokens (prompt + answer) one request may hold, and where the limit comes from:
    the model's trained context, or the plan's smaller one (what memory holds)."""
    text = config.get("text_config") or {}
    trained = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    limit, why = (
        (int(trained), "the model's context")
        if isinstance(trained, int) and trained > 0
        else (None, "")
    )
    planned = (plan or {}).get("context_limit")
    if isinstance(planned, int) and planned > 0 and (limit is None or planned < limit):
        limit, why = planned, "the plan's context limit (what fits in memory)"
    return limit, why


def fit_context(n_prompt: int, max_tokens: int, limit: int | None, why: str) -> int:
    """Refuse a prompt that leaves no room in the context; the answer's token limit,
    capped so that prompt + answer stay within it (-1: up to the context)."""
    if limit is None:
        return max_tokens
    if n_prompt >= limit:
        raise PromptError(
            f"the prompt has {n_prompt:,d} tokens; {why} is {limit:,d} tokens: "
            "shorten it or start a new conversation"
        )
    room = limit - n_prompt
    return room if max_tokens < 0 else min(max_tokens, room)
