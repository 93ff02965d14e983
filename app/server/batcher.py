"""Continuous batching: concurrent requests share the model's decode steps.

One thread owns the model and runs mlx-lm's BatchGenerator: new requests join the running
batch at the next step, finished or cancelled ones leave it at once (their KV is freed with
them). Requests come in and events go out through thread-safe calls, so the HTTP layer never
touches an MLX array. Each request's KV cache is the loaded plan's mode (Engine.make_cache).
With ZipFusion (NVIDIA) the batch is ZipFusion's own scheduler over one page pool: a request is
admitted when its pages fit, and what compression frees admits more. Caches with neither (a
model ZipFusion cannot page, another library's cache) run one request at a time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("rotaryquant.server")

DEFAULT_MAX_BATCH = 8  # requests decoded together; more wait in the queue (FIFO)
PREFILL_STEP = 512  # prompt tokens per forward pass: bounds prefill's transient memory
# Admission window: when a request arrives at an idle batch, the requests that follow it within
# ADMIT_GAP of each other (ADMIT_WAIT at most, up to max_batch) are prefilled with it, in one
# forward pass, instead of each separately while the rows before it wait.
ADMIT_GAP = 0.015  # seconds
ADMIT_WAIT = 0.1  # seconds
# ZipFusion admits a request when the pool holds its next ZIP_HORIZON tokens (a client that sends
# no max_tokens may run to the end of the context); one that outgrows the pool is preempted and
# resumed (kvcache/zipfusion/scheduler.py).
ZIP_HORIZON = 512


# -- events (batcher thread -> the request's `emit`) ------------------------------------------
@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: int = 500  # the HTTP status a request that has not started answering gets
    code: str | None = None


@dataclass
class Completion:
    """One request as the batcher sees it (token ids in, events out through `emit`)."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[object], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    reasoning: bool = False  # the prompt opened the model's thinking section
    cancelled: threading.Event = field(default_factory=threading.Event)


class StopText:
    """Finds stop strings in streamed text; holds back a tail that may begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string ended the output)."""
        s = self.held + text
        if not self.stops:
            return s, False
        hits = [(i, st) for st in self.stops if (i := s.find(st)) >= 0]
        if hits:
            self.held = ""
            return s[: min(i for i, _ in hits)], True
        keep = max((_partial(s, st) for st in self.stops), default=0)
        self.held = s[len(s) - keep :]
        return s[: len(s) - keep], False

    def flush(self) -> str:
        s, self.held = self.held, ""
        return s


def _partial(s: str, stop: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(s)), 0, -1):
        if s.endswith(stop[:n]):
            return n
    return 0


def make_sampler(temperature: float, top_p: float, seed: int | None):
    """None for greedy (the batch shares mlx-lm's greedy sampler in one call); a seeded
    request draws from its own key, so its output does not depend on its neighbours."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p
    from mlx_lm.sample_utils import make_sampler as mlx_sampler

    if temperature == 0:
        return None
    if seed is None:
        return mlx_sampler(temp=temperature, top_p=top_p if top_p < 1 else 0.0)
    key = [mx.random.key(seed)]

    def sample(logprobs):
        key[0], sub = mx.random.split(key[0])
        if top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1 / temperature), key=sub)

    return sample


class _Live:
    """A request in the batch: its detokenizer, thinking state and stop matcher."""

    def __init__(self, req: Completion, tokenizer):
        self.req = req
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.reasoning = req.reasoning
        self.stop = StopText(req.stop)
        self.n = 0

    def _send(self, text: str) -> bool:
        """Send decoded text on the current channel; True when a stop string ended it."""
        if not text:
            return False
        if self.reasoning:
            self.req.emit(Delta(reasoning=text))
            return False
        out, hit = self.stop.feed(text)
        if out:
            self.req.emit(Delta(content=out))
        return hit

    def token(self, tok: int, think_start: int | None, think_end: int | None) -> bool:
        """Feed one generated token; True when a stop string ended the output."""
        self.n += 1
        if tok in (think_start, think_end):
            self.detok.finalize()
            hit = self._send(self.detok.last_segment)
            self.detok.reset()
            self.reasoning = tok == think_start
            return hit
        self.detok.add_token(tok)
        return self._send(self.detok.last_segment)

    def finish(self, reason: str) -> None:
        self.detok.finalize()
        hit = self._send(self.detok.last_segment)
        if not self.reasoning and not hit:
            tail = self.stop.flush()
            if tail:
                self.req.emit(Delta(content=tail))
        self.req.emit(Done(reason, len(self.req.prompt), self.n))


@dataclass
class _Token:
    """A token of one request, as mlx-lm's BatchGenerator responses carry it."""

    uid: int
    token: int
    finish_reason: str | None


class _ZipBatch:
    """BatchGenerator's calls (insert / next / remove / close) over ZipFusion's scheduler: one
    page pool for the batch, made at its first request and freed with it."""

    def __init__(self, model, eos: set[int], max_seqs: int, context: int):
        self._args = (model, eos, max_seqs, context)
        self.sched = None
        self.eos = eos
        self.batch = 0  # requests in the last decode step
        self._left: dict[int, int] = {}  # uid -> tokens it may still produce

    def insert(self, prompt: list[int], max_tokens: int, sampler) -> int:
        """Queue one request; ValueError when its prompt + max_tokens can never fit the pool."""
        from ..engine.kvcache import zipfusion as zf

        if self.sched is None:
            model, eos, max_seqs, context = self._args
            self.sched = zf.make_scheduler(model, max_seqs, context, eos=eos,
                                           prefill_step=PREFILL_STEP, growth_horizon=ZIP_HORIZON)  # fmt: skip
        uid = self.sched.submit(zf.Request(list(prompt), max_tokens, sampler=sampler))
        self._left[uid] = max_tokens
        return uid

    def next(self) -> tuple[None, list[_Token]]:
        rep = self.sched.step()
        self.batch = rep.batch
        out = []
        for uid, toks in rep.tokens.items():
            for t in toks:
                self._left[uid] -= 1
                reason = "stop" if t in self.eos else "length" if self._left[uid] <= 0 else None
                out.append(_Token(uid, t, reason))
        for uid in rep.finished:
            self._left.pop(uid, None)
        return None, out

    def remove(self, uids) -> None:
        for u in uids:
            self.sched.cancel(u)
            self._left.pop(u, None)

    def close(self) -> None:
        self.sched = None  # the pool goes with the scheduler
        self._left.clear()


class Batcher:
    """Owns the engine's model on its own thread. `engine` is a loaded Engine, or a callable
    that loads one (called on the batcher's thread; `state` is "loading" meanwhile)."""

    def __init__(self, engine, max_batch: int = DEFAULT_MAX_BATCH, context: int | None = None,
                 admit_gap: float = ADMIT_GAP, admit_wait: float = ADMIT_WAIT):  # fmt: skip
        self._engine_or_loader = engine
        self.engine = None
        self.max_batch = max_batch
        self.admit_gap, self.admit_wait = admit_gap, admit_wait
        self.context_override = context
        self.state = "loading"  # loading | ready | failed | stopped
        self.error = ""
        # Held for each batch step: the app's own chat takes it to run between steps.
        self.lock = threading.RLock()
        self._incoming: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._live: dict[int, _Live] = {}
        self._pending = 0
        self.finish_reasons: Counter = Counter()  # requests ended, by reason (stats and tests)
        self.max_batch_seen = 0  # most requests that shared one decode step
        self.admitted_together: list[int] = []  # requests per admission (stats and tests)
        self._zip_checked: tuple = (None, False)  # (model, batches through ZipFusion's pool)
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rq-batcher")
        self._thread.start()

    # -- thread-safe API ------------------------------------------------------------------
    def submit(self, req: Completion) -> None:
        with self._count_lock:
            self._pending += 1
        self._incoming.put(req)
        self._wake.set()

    def cancel(self, req: Completion) -> None:
        req.cancelled.set()
        self._wake.set()

    def in_flight(self) -> int:
        """Requests queued or in the batch (a cancelled one leaves at the next step)."""
        with self._count_lock:
            return self._pending

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.state == "ready"

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.state = "stopped"

    @property
    def model_id(self) -> str:
        return self.engine.info.name if self.engine is not None and self.engine.info else ""

    @property
    def context(self) -> int:
        """The longest prompt + completion a request may have (the plan's, else the model's)."""
        if self.context_override:
            return int(self.context_override)
        info, lm = self.engine.info, self.engine.loaded
        plan = (info.extra or {}).get("plan") if info else None
        if plan and plan.get("context_limit"):
            return int(plan["context_limit"])
        cfg = lm.config if lm else {}
        for key in ("max_position_embeddings", "max_seq_len", "seq_length"):
            if cfg.get(key):
                return int(cfg[key])
        return 8192

    # -- the batcher thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # MLX's per-thread streams must go before this thread ends: their destructors
            # otherwise take the GIL during interpreter shutdown and abort the process.
            import mlx.core as mx

            mx.clear_streams()

    def _serve(self) -> None:
        try:
            eng = self._engine_or_loader
            self.engine = eng() if callable(eng) else eng
            self.state = "ready"
        except Exception as e:  # reported as 503 with the reason, not a dead server
            log.exception("model load failed")
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
        self._ready.set()
        if self.state != "ready":
            return
        try:
            self._loop()
        except Exception as e:
            log.exception("batcher failed")
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            for live in list(self._live.values()):
                live.req.emit(Failed(self.error))
            self._drain_incoming(Failed(self.error))

    def _drain_incoming(self, event) -> None:
        while True:
            try:
                req = self._incoming.get_nowait()
            except queue.Empty:
                return
            req.emit(event)
            self._done()

    def _done(self) -> None:
        with self._count_lock:
            self._pending -= 1

    def _zip_pool(self) -> bool:
        """Whether requests batch through ZipFusion's pool: the plan's KV mode is ZipFusion and
        every layer of the model keeps full-attention KV (else they run one at a time)."""
        if getattr(self.engine, "default_kv_mode", None) != "zipfusion":
            return False
        model = self.engine.loaded.model
        if self._zip_checked[0] is not model:  # asked at every idle turn: decided once a model
            from ..engine.kvcache import zipfusion as zf

            reason = zf.batch_refusal(model)
            if reason:
                log.info("ZipFusion requests run one at a time: %s", reason)
            self._zip_checked = (model, reason is None)
        return self._zip_checked[1]

    def _new_generator(self):
        from mlx_lm.generate import BatchGenerator

        tok = self.engine.loaded.tokenizer
        if self._zip_pool():
            return _ZipBatch(self.engine.loaded.model, set(tok.eos_token_ids), self.max_batch,
                             self.context)  # fmt: skip
        return BatchGenerator(
            self.engine.loaded.model,
            stop_tokens=[[t] for t in tok.eos_token_ids],
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.max_batch,
            prefill_step_size=PREFILL_STEP,
        )

    def _think_ids(self) -> tuple[int | None, int | None]:
        tok = self.engine.loaded.tokenizer
        if not getattr(tok, "has_thinking", False):
            return None, None
        s, e = tok.think_start_tokens, tok.think_end_tokens
        if len(s) != 1 or len(e) != 1:
            return None, None  # multi-token markers stay in the text
        return s[0], e[0]

    def _loop(self) -> None:
        import mlx.core as mx

        gen = self._new_generator()
        used = False
        think = self._think_ids()
        serial: list[Completion] = []
        try:
            while not self._stop.is_set():
                if not self._live and self._zip_pool() != isinstance(gen, _ZipBatch):
                    gen.close()  # the plan's KV mode changed between batches
                    gen, used = self._new_generator(), False
                self._admit(gen, serial)
                # leave: cancelled requests (a client that went away) free their slot now
                gone = [u for u, lv in self._live.items() if lv.req.cancelled.is_set()]
                if gone:
                    with self.lock:
                        gen.remove(gone)
                    for u in gone:
                        self._finish(u, "cancelled")
                if serial and not self._live:
                    self._run_serial(serial.pop(0))
                    continue
                if not self._live:
                    if used:  # idle: a fresh generator holds none of the last batch's arrays
                        gen.close()
                        gen, used = self._new_generator(), False
                        mx.clear_cache()
                    self._wake.wait(0.25)
                    self._wake.clear()
                    continue
                self._step(gen, think)
                used = True
                # ZipFusion's queue holds requests its pool cannot admit yet: count its batch
                n = gen.batch if isinstance(gen, _ZipBatch) else len(self._live)
                self.max_batch_seen = max(self.max_batch_seen, n)
        finally:
            gen.close()
            for u in list(self._live):
                self._finish(u, "cancelled")
            self._drain_incoming(Done("cancelled", 0, 0))

    def _admit(self, gen, serial: list) -> None:
        """New requests join the batch, each with the plan's KV cache and its own sampler."""
        from ..engine.generate import GenerationSettings

        tok = self.engine.loaded.tokenizer
        batch = []
        for req in self._arrivals():
            if req.cancelled.is_set():
                req.emit(Done("cancelled", len(req.prompt), 0))
                self._done()
                continue
            if isinstance(gen, _ZipBatch):
                sampler = make_sampler(req.temperature, req.top_p, req.seed)
                try:
                    with self.lock:
                        uid = gen.insert(req.prompt, req.max_tokens, sampler)
                except ValueError as e:  # more KV than the pool can ever hold
                    req.emit(Failed(str(e), 400, "context_length_exceeded"))
                    self._done()
                    continue
                self._live[uid] = _Live(req, tok)
                batch.append(req)
                continue
            with self.lock:
                cache = self.engine.make_cache(
                    GenerationSettings(), len(req.prompt) + req.max_tokens
                )
            if not all(hasattr(c, "merge") for c in cache):
                serial.append(req)  # no batch protocol: one at a time
                continue
            batch.append((req, cache))
        if not batch:
            return
        if isinstance(gen, _ZipBatch):  # its scheduler prefills them as its pool admits them
            self.admitted_together.append(len(batch))
            return
        # one insert: BatchGenerator's next step prefills them together (prefill_batch_size)
        uids = gen.insert(
            [r.prompt for r, _ in batch], [r.max_tokens for r, _ in batch],
            caches=[c for _, c in batch],
            samplers=[make_sampler(r.temperature, r.top_p, r.seed) for r, _ in batch],
        )  # fmt: skip
        for uid, (req, _) in zip(uids, batch, strict=True):
            self._live[uid] = _Live(req, tok)
        self.admitted_together.append(len(batch))

    def _arrivals(self) -> list[Completion]:
        """The requests waiting now. At an idle batch, also those that follow within
        `admit_gap` of each other (`admit_wait` at most, up to max_batch): a burst of clients
        is prefilled as one batch, not one forward pass each while the first rows wait."""
        got = []
        while True:
            try:
                got.append(self._incoming.get_nowait())
            except queue.Empty:
                break
        if not got or self._live or self.admit_gap <= 0:
            return got
        deadline = time.monotonic() + self.admit_wait
        while len(got) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                got.append(self._incoming.get(timeout=min(self.admit_gap, left)))
            except queue.Empty:
                break
        return got

    def _step(self, gen, think) -> None:
        """One decode step of the whole batch (a function, so that the finished requests'
        caches mlx-lm hands back die with it)."""
        with self.lock:
            _, responses = gen.next()
        for r in responses:
            live = self._live.get(r.uid)
            if live is None:
                continue
            if r.finish_reason == "stop":  # an end-of-sequence token: not text
                self._finish(r.uid, "stop")
                continue
            if live.token(r.token, *think):
                with self.lock:
                    gen.remove([r.uid])
                self._finish(r.uid, "stop")
            elif r.finish_reason is not None:
                self._finish(r.uid, r.finish_reason)

    def _finish(self, uid: int, reason: str) -> None:
        live = self._live.pop(uid)
        live.finish(reason)
        self.finish_reasons[reason] += 1
        self._done()

    def _run_serial(self, req: Completion) -> None:
        """A request whose KV cache cannot batch: the engine's own one-request loop."""
        from ..engine.generate import Finished, GenerationSettings, TokenEvent

        settings = GenerationSettings(
            max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
            seed=req.seed,
        )  # fmt: skip
        live = _Live(req, self.engine.loaded.tokenizer)
        think = self._think_ids()
        reason = "length"
        with self.lock:
            for ev in self.engine.generate(req.prompt, settings, req.cancelled.is_set):
                if isinstance(ev, TokenEvent) and ev.token >= 0:
                    if live.token(ev.token, *think):
                        reason = "stop"
                        break
                elif isinstance(ev, Finished):
                    reason = ev.reason
        live.finish(reason)
        self.finish_reasons[reason] += 1
        self._done()
