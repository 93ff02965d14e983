"""A batched decode loop over one ZipFusion store: several conversations at once.

Admission is by the memory manager's number: a request is admitted when every layer can still
take, as new raw pages, all the pages it may ever need plus the growth still reserved for the
running sequences (each page counted at raw size: new pages are raw until full, and a block that
doesn't compress stays raw). So a running sequence never runs out of pages mid-way, while the
room that compression frees (prompt and generated pages alike) turns into more admissions.

With a growth horizon (the local server's setting: a client that sends no max_tokens may run
to the end of the context), each request reserves only its next `horizon` tokens. When a step
finds no room for the pages its sequences start, the most recently admitted request is preempted:
its pages go back to the pool and it waits at the head of the queue, to resume by prefilling its
prompt and the tokens it has produced (recompute, as vLLM does), with nothing re-sent.

The local server (app/server/batcher.py) drives it a step at a time: each step reports the
tokens every request produced, a request may carry its own sampler, and `cancel` frees a
request's pages at once (a client that went away).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from .cache import ZipFusionCache, install_attention
from .codec import PAGE_TOKENS
from .memory import ZipMemory
from .store import ZipStore


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    rid: int = -1
    # logprobs [1, V] -> token [1] (mlx-lm's sampler shape); None samples greedily
    sampler: Callable | None = None

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("a request needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def pages_needed(self) -> int:
        return math.ceil((len(self.prompt) + self.max_new_tokens) / PAGE_TOKENS)


@dataclass
class _Running:
    req: Request
    sid: int
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Tokens its KV holds once the last sampled token is fed back."""
        return len(self.req.prompt) + len(self.tokens)


@dataclass
class StepReport:
    admitted: list[int]
    finished: dict[int, list[int]]
    batch: int
    decode_s: float
    # tokens each request produced in this step, in order: an admitted request's first token
    # (from its prefill) and every running request's decoded token
    tokens: dict[int, list[int]] = field(default_factory=dict)


class ZipScheduler:
    """Prefill admitted requests one at a time, then decode all running ones in one batch.
    `growth_horizon` None reserves every request's whole prompt + max_new_tokens at admission
    (nothing is ever preempted); a number reserves that many tokens ahead of each request."""

    def __init__(
        self,
        model,
        store: ZipStore,
        prefill_step: int = 2048,
        eos: set[int] | None = None,
        growth_horizon: int | None = None,
    ):
        if store.auto_sid is not None:
            raise ValueError("this store serves a single sequence (make_zipfusion_cache)")
        self.model = model
        self.store = store
        self.caches = [ZipFusionCache(store, i) for i in range(store.cfg.n_layers)]
        install_attention(model)
        self.prefill_step = prefill_step
        self.eos = eos or set()
        self.horizon = growth_horizon
        self.waiting: deque[Request] = deque()
        self.preempted: deque[_Running] = deque()  # resumed before any waiting request
        self.running: list[_Running] = []
        self._next_rid = 0
        self.max_batch = 0
        self.preemptions = 0
        self._freed_since_compact = False
        # Pages per layer an empty store holds at raw size: a request needing more never fits.
        self.capacity_pages = min(
            ZipMemory(store.geometry).pages_fit_every_layer(),
            math.ceil(store.cfg.max_tokens_per_seq / PAGE_TOKENS),
        )

    def submit(self, req: Request) -> int:
        if req.rid < 0:
            req.rid = self._next_rid
        self._next_rid = max(self._next_rid, req.rid) + 1
        if req.pages_needed > self.capacity_pages:
            raise ValueError(
                f"request {req.rid} needs {req.pages_needed * PAGE_TOKENS} tokens of KV "
                f"({len(req.prompt)} prompt + {req.max_new_tokens} new); the ZipFusion pool holds "
                f"{self.capacity_pages * PAGE_TOKENS} a sequence"
            )
        self.waiting.append(req)
        return req.rid

    def cancel(self, rid: int) -> bool:
        """Drop a waiting, preempted or running request, freeing its pages now; False if
        unknown."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return True
        for r in self.preempted:
            if r.req.rid == rid:
                self.preempted.remove(r)
                return True
        for r in self.running:
            if r.req.rid == rid:
                self._leave(r)
                return True
        return False

    def _leave(self, r: _Running) -> None:
        self.store.free_sequence(r.sid)
        self.running.remove(r)
        self._freed_since_compact = True

    def _target_pages(self, req: Request, length: int) -> int:
        """Pages a request at `length` tokens is promised: all it may need, or its horizon."""
        if self.horizon is None:
            return req.pages_needed
        end = min(len(req.prompt) + req.max_new_tokens, length + self.horizon)
        return math.ceil(end / PAGE_TOKENS)

    def growth_reserve(self) -> int:
        return sum(
            max(0, self._target_pages(r.req, r.length) - self.store.pages_allocated(r.sid))
            for r in self.running
        )

    def _fits(self, pages: int) -> bool:
        if len(self.running) >= self.store.cfg.max_seqs:
            return False
        return self.store.pages_fit_every_layer() >= self.growth_reserve() + pages

    def can_admit(self, req: Request) -> bool:
        return self._fits(self._target_pages(req, len(req.prompt)))

    def _compact_if_freed(self) -> bool:
        """Finished sequences left holes: move pages so whole chunks return to the pool."""
        if not self._freed_since_compact:
            return False
        self.store.compact()
        self._freed_since_compact = False
        return True

    def _fill(self, tokens: list[int]) -> tuple[int, mx.array]:
        """A new sequence holding `tokens`' KV; (its id, the last position's logits)."""
        sid = self.store.add_sequence()
        logits = None
        try:
            for i in range(0, len(tokens), self.prefill_step):
                chunk = mx.array(tokens[i : i + self.prefill_step])[None]
                self.store.begin([sid])
                logits = self.model(chunk, cache=self.caches)[:, -1]
                mx.eval(logits)
                self.store.commit()
        except BaseException:
            self.store.staged = [None] * self.store.cfg.n_layers
            self.store.free_sequence(sid)
            raise
        return sid, logits

    def _prefill(self, req: Request) -> _Running:
        sid, logits = self._fill(req.prompt)
        run = _Running(req, sid)
        run.tokens.append(int(self._sample(logits, [req.sampler])[0]))
        return run

    def _resume(self, r: _Running) -> None:
        """A preempted request gets its KV back: prompt and all but its last token (the next
        step feeds that one, as if it had never left)."""
        r.sid, _ = self._fill(r.req.prompt + r.tokens[:-1])
        self.running.append(r)

    @staticmethod
    def _sample(logits: mx.array, samplers: list) -> list[int]:
        """One token per row of logits [B, V]: argmax where the sampler is None."""
        if all(s is None for s in samplers):
            return mx.argmax(logits, axis=-1).tolist()
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        rows = [
            mx.argmax(logprobs[i : i + 1], axis=-1) if s is None else s(logprobs[i : i + 1])
            for i, s in enumerate(samplers)
        ]
        return mx.concatenate([r.reshape(-1) for r in rows]).tolist()

    def _done(self, r: _Running) -> bool:
        return len(r.tokens) >= r.req.max_new_tokens or r.tokens[-1] in self.eos

    def _admit(self) -> list[int]:
        admitted = []
        while self.preempted:
            r = self.preempted[0]
            need = self._target_pages(r.req, r.length)
            if not self._fits(need) and not (self._compact_if_freed() and self._fits(need)):
                return admitted  # preempted requests go first: nothing new before them
            self._resume(self.preempted.popleft())
        while self.waiting:
            head = self.waiting[0]
            if not self.can_admit(head) and not (self._compact_if_freed() and self.can_admit(head)):
                break
            r = self._prefill(self.waiting.popleft())
            admitted.append(r.req.rid)
            self.running.append(r)
        if self.waiting and not self.running and not admitted:
            raise RuntimeError(
                f"request {self.waiting[0].rid} needs {self.waiting[0].pages_needed} pages per "
                f"layer; only {self.store.pages_fit_every_layer()} fit in the KV budget"
            )
        return admitted

    def _make_room(self) -> None:
        """Every sequence whose next token starts a page gets one in this step's commit; when
        the pool cannot give them, preempt the most recently admitted requests."""
        while True:
            need = sum(1 for r in self.running if self.store.length(r.sid) % PAGE_TOKENS == 0)
            if need <= self.store.pages_fit_every_layer() or len(self.running) <= 1:
                return
            if self._compact_if_freed():
                continue
            r = self.running[-1]
            self._leave(r)
            self.preempted.appendleft(r)
            self.preemptions += 1

    def step(self) -> StepReport:
        finished = {}
        admitted = self._admit()
        tokens = {rid: [self._by_rid(rid).tokens[0]] for rid in admitted}
        for r in [r for r in self.running if self._done(r)]:
            finished[r.req.rid] = r.tokens
            self._leave(r)
        if self.horizon is not None:
            self._make_room()
        batch = len(self.running)
        self.max_batch = max(self.max_batch, batch)
        t = 0.0
        if self.running:
            t0 = time.perf_counter()
            self.store.begin([r.sid for r in self.running])
            toks = mx.array([[r.tokens[-1]] for r in self.running])
            try:
                logits = self.model(toks, cache=self.caches)[:, -1]
                y = self._sample(logits, [r.req.sampler for r in self.running])
                self.store.commit()
            except BaseException:
                self.store.staged = [None] * self.store.cfg.n_layers
                raise
            t = time.perf_counter() - t0
            for r, tok in zip(self.running, y, strict=True):
                r.tokens.append(int(tok))
                tokens.setdefault(r.req.rid, []).append(int(tok))
        return StepReport(admitted, finished, batch, t, tokens)

    def _by_rid(self, rid: int) -> _Running:
        return next(r for r in self.running if r.req.rid == rid)

    def run(self, requests: list[Request] | None = None) -> dict[int, list[int]]:
        """Serve `requests` (plus any already submitted) to completion; rid -> generated tokens."""
        for r in requests or []:
            self.submit(r)
        out: dict[int, list[int]] = {}
        while self.waiting or self.running or self.preempted:
            out.update(self.step().finished)
        return out
