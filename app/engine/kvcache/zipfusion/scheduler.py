"""A batched decode loop over one ZipFusion store: several conversations at once.

Admission is by the memory manager's number: a request is admitted when every layer can still
take, as new raw pages, all the pages it may ever need plus the growth still reserved for the
running sequences (each page counted at raw size: new pages are raw until full, and a block that
doesn't compress stays raw). So a running sequence never runs out of pages mid-way, while the
room that compression frees (prompt and generated pages alike) turns into more admissions.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from .cache import ZipFusionCache, install_attention
from .codec import PAGE_TOKENS
from .store import ZipStore


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    rid: int = -1

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


@dataclass
class StepReport:
    admitted: list[int]
    finished: dict[int, list[int]]
    batch: int
    decode_s: float


class ZipScheduler:
    """Prefill admitted requests one at a time, then decode all running ones in one batch."""

    def __init__(
        self, model, store: ZipStore, prefill_step: int = 2048, eos: set[int] | None = None
    ):
        if store.auto_sid is not None:
            raise ValueError("this store serves a single sequence (make_zipfusion_cache)")
        self.model = model
        self.store = store
        self.caches = [ZipFusionCache(store, i) for i in range(store.cfg.n_layers)]
        install_attention(model)
        self.prefill_step = prefill_step
        self.eos = eos or set()
        self.waiting: deque[Request] = deque()
        self.running: list[_Running] = []
        self._next_rid = 0
        self.max_batch = 0
        self._freed_since_compact = False

    def submit(self, req: Request) -> int:
        if req.rid < 0:
            req.rid = self._next_rid
        self._next_rid = max(self._next_rid, req.rid) + 1
        if req.pages_needed > self.store.cfg.n_page_ids // self.store.cfg.max_seqs:
            raise ValueError(
                f"request {req.rid} needs {req.pages_needed} pages, more than max_tokens_per_seq allows"
            )
        self.waiting.append(req)
        return req.rid

    def growth_reserve(self) -> int:
        return sum(
            max(0, r.req.pages_needed - self.store.pages_allocated(r.sid)) for r in self.running
        )

    def can_admit(self, req: Request) -> bool:
        if len(self.running) >= self.store.cfg.max_seqs:
            return False
        return self.store.pages_fit_every_layer() >= self.growth_reserve() + req.pages_needed

    def _prefill(self, req: Request) -> _Running:
        sid = self.store.add_sequence()
        prompt = req.prompt
        logits = None
        for i in range(0, len(prompt), self.prefill_step):
            chunk = mx.array(prompt[i : i + self.prefill_step])[None]
            self.store.begin([sid])
            logits = self.model(chunk, cache=self.caches)[:, -1]
            mx.eval(logits)
            self.store.commit()
        run = _Running(req, sid)
        run.tokens.append(int(mx.argmax(logits, axis=-1).item()))
        return run

    def _done(self, r: _Running) -> bool:
        return len(r.tokens) >= r.req.max_new_tokens or r.tokens[-1] in self.eos

    def _admit(self) -> list[int]:
        admitted = []
        while self.waiting:
            head = self.waiting[0]
            if not self.can_admit(head):
                if not self._freed_since_compact:
                    break
                # Finished sequences left holes: move pages so whole chunks return to the pool.
                self.store.compact()
                self._freed_since_compact = False
                if not self.can_admit(head):
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

    def step(self) -> StepReport:
        finished = {}
        admitted = self._admit()
        for r in [r for r in self.running if self._done(r)]:
            finished[r.req.rid] = r.tokens
            self.store.free_sequence(r.sid)
            self.running.remove(r)
            self._freed_since_compact = True
        batch = len(self.running)
        self.max_batch = max(self.max_batch, batch)
        t = 0.0
        if self.running:
            t0 = time.perf_counter()
            self.store.begin([r.sid for r in self.running])
            toks = mx.array([[r.tokens[-1]] for r in self.running])
            y = mx.argmax(self.model(toks, cache=self.caches)[:, -1], axis=-1)
            mx.eval(y)
            self.store.commit()
            t = time.perf_counter() - t0
            for r, tok in zip(self.running, y.tolist(), strict=True):
                r.tokens.append(int(tok))
        return StepReport(admitted, finished, batch, t)

    def run(self, requests: list[Request] | None = None) -> dict[int, list[int]]:
        """Serve `requests` (plus any already submitted) to completion; rid -> generated tokens."""
        for r in requests or []:
            self.submit(r)
        out: dict[int, list[int]] = {}
        while self.waiting or self.running:
            out.update(self.step().finished)
        return out
