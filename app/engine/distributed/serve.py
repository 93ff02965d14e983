"""`rotaryquant serve --hosts`: the OpenAI-compatible API (app/server) over a pipeline split.

Rank 0 serves HTTP and runs requests one at a time, first come first served; the other ranks
follow it step for step. Before a request rank 0 broadcasts its prompt ids and sampling
settings (with a seed it draws when sampling has none, so that every rank draws the same
tokens); every rank then runs the same `Engine.generate`, whose model call carries the hidden
state between the stages (stage.py). Whether to go on after each token (a stop string, a client
that went away, the server stopping) is rank 0's alone to know: one 4-byte all_sum per token
hands its answer to every rank, a step late (`Agreement`), so all of them end a request at
the same step.

Why not mlx-lm's BatchGenerator as the one-machine server does: every rank would have to mirror
each change of the batch (requests joining with left padding, leaving, being filtered) in the
same order, and a stage's caches repeat one local cache in the slots of remote layers, which a
batch merge would split into copies that never advance. One request at a time is exact and
each rank's per-step cost (its layers for one token) is what the planner counts.

A host that drops out: the watchdog (group.py) or MLX's error names it; rank 0 then fails the
request in flight and the queued ones with HTTP 503 naming the host, answers 503 to new ones
for `LOST_GRACE_S`, and ends with status 3. mlx.launch stops the ranks left when one ends with
an error; rank 0 takes that signal as the same loss.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import signal
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from ...server.batcher import Batcher, Completion, Done, Failed, _Live

log = logging.getLogger("rotaryquant.server")

LOST_GRACE_S = 2.0  # rank 0 answers 503 naming the lost host this long before it ends
HOST_LOST = "host_lost"  # the error code clients get


def _stream():
    """The model's own stream: a collective on another stream could run before or after the
    step in flight, in a different order on each rank, and the ranks would wait on each other."""
    from mlx_lm.generate import generation_stream

    return generation_stream


def broadcast_json(obj, group):
    """Rank 0's JSON-able `obj` on every rank (the others pass None); None ends the session."""
    root = group.rank() == 0
    data = json.dumps(obj).encode() if root and obj is not None else b""
    size = mx.array([len(data)], dtype=mx.int32)
    n = mx.distributed.all_sum(size, group=group, stream=_stream()).item()
    if n == 0:
        return None
    raw = np.frombuffer(data, dtype=np.uint8) if root else np.zeros(n, dtype=np.uint8)
    got = mx.distributed.all_sum(mx.array(raw.astype(np.int32)), group=group, stream=_stream())
    return json.loads(np.array(got).astype(np.uint8).tobytes().decode())


class Agreement:
    """Rank 0's stop-or-go-on on every rank, one step late: each call queues this step's
    4-byte all_sum behind the step in flight and answers with the previous call's, which is
    done once the token just read is. Waiting for this call's own would wait for the next step
    too and lose the overlap of building one step while the device runs the last (measured
    here: a quarter of the decode speed of two local ranks). Every rank answers the same at
    every call, so all end at the same step; rank 0 drops the one token past a stop."""

    def __init__(self, group):
        self.group = group
        self.pending = None

    def __call__(self, flag: bool = False) -> bool:
        x = mx.array([1 if flag and self.group.rank() == 0 else 0], dtype=mx.int32)
        x = mx.distributed.all_sum(x, group=self.group, stream=_stream())
        mx.async_eval(x)
        prev, self.pending = self.pending, x
        return prev is not None and prev.item() > 0


def request_settings(req: Completion) -> dict:
    """The GenerationSettings every rank runs `req` with (sampling always seeded)."""
    seed = req.seed
    if seed is None and req.temperature > 0:
        seed = secrets.randbits(63)
    return {
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": seed,
    }


class PipelineBatcher(Batcher):
    """Rank 0's batcher: one request at a time over the pipeline, FIFO (see the module doc)."""

    def __init__(self, engine, group, watchdog, context: int | None = None):
        self.group, self.watchdog = group, watchdog
        self._current: Completion | None = None
        self.load_failed = False
        super().__init__(engine, max_batch=1, context=context)

    # -- any thread ----------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        """A host is gone: the request in flight and the queued ones end with 503 naming it,
        and new ones are refused with it (the API reads `state` and `error`)."""
        self.state, self.error = "failed", message
        event = self._lost()
        req = self._current
        if req is not None:
            emit, req.emit = req.emit, lambda ev: None  # the batcher thread may still emit
            emit(event)
        self._drain_incoming(event)

    def _lost(self) -> Failed:
        return Failed(self.error, status=503, code=HOST_LOST)

    def submit(self, req: Completion) -> None:
        super().submit(req)
        if self.state == "failed" and not self.load_failed:
            # the host was lost after the API checked `state` and before this request was
            # queued: fail() has drained the queue already, so it is answered here (state is
            # set before fail() drains, so one of the two always sees the request)
            self._drain_incoming(self._lost())

    # -- the batcher thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            eng = self._engine_or_loader
            self.engine = eng() if callable(eng) else eng
            self.state = "ready"
        except Exception as e:
            log.exception("model load failed")
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            self.load_failed = True
        self._ready.set()
        if self.state == "ready":
            self._loop()
        self._end_followers()

    def _end_followers(self) -> None:
        if self.state == "failed" and not self.load_failed:
            return  # a lost host: the group cannot carry a message any more
        self.watchdog.close()  # the others leaving from now on is expected
        try:
            broadcast_json(None, self.group)
        except RuntimeError as e:
            log.warning("could not tell the other ranks to end: %s", e)

    def _loop(self) -> None:
        from .group import is_link_error

        while not self._stop.is_set() and self.state == "ready":
            try:
                req = self._incoming.get(timeout=0.25)
            except queue.Empty:
                continue
            if self.state != "ready":  # the host was lost while this request was taken
                req.emit(self._lost())
                self._done()
                continue
            if req.cancelled.is_set():
                req.emit(Done("cancelled", len(req.prompt), 0))
                self._done()
                continue
            try:
                self._run_one(req)
            except Exception as e:
                if isinstance(e, RuntimeError) and is_link_error(e):
                    self.watchdog.end(str(e))  # reports, fails the requests, ends the process
                # otherwise the same on every rank (same ids, same settings): the next goes on
                log.exception("request failed")
                self._current = None
                req.emit(Failed(f"{type(e).__name__}: {e}"))
                self._done()
        lost = self._lost() if self.state == "failed" else None
        for req in self._drain():
            req.emit(lost or Done("cancelled", len(req.prompt), 0))
            self._done()

    def _drain(self) -> list[Completion]:
        out = []
        while True:
            try:
                out.append(self._incoming.get_nowait())
            except queue.Empty:
                return out

    def _run_one(self, req: Completion) -> None:
        from ..generate import Finished, GenerationSettings, TokenEvent

        settings = request_settings(req)
        live = _Live(req, self.engine.loaded.tokenizer)
        think = self._think_ids()
        hit = [False]  # a stop string ended the text: every rank ends a step later
        agreement = Agreement(self.group)

        def should_stop() -> bool:
            return agreement(hit[0] or req.cancelled.is_set() or self._stop.is_set())

        self._current = req
        reason = "length"
        broadcast_json({"ids": list(req.prompt), "settings": settings}, self.group)
        self.watchdog.arm()
        try:
            with self.lock:
                gen = self.engine.generate(
                    list(req.prompt), GenerationSettings.from_dict(settings), should_stop
                )
                for ev in gen:
                    self.watchdog.beat()
                    if isinstance(ev, TokenEvent) and ev.token >= 0 and not hit[0]:
                        hit[0] = live.token(ev.token, *think)
                    elif isinstance(ev, Finished):
                        reason = ev.reason
        finally:
            self.watchdog.disarm()
        self._current = None  # (after an error, fail() still reaches it)
        live.finish("stop" if hit[0] else reason)
        self.finish_reasons[reason] += 1
        self._done()


def follow(engine, group, watchdog) -> None:
    """A rank other than 0: run each request rank 0 broadcasts until it says the end."""
    from ..generate import GenerationSettings
    from .group import is_link_error

    while True:
        header = broadcast_json(None, group)  # idle here between requests
        if header is None:
            watchdog.close()
            return
        watchdog.arm()
        try:
            settings = GenerationSettings.from_dict(header["settings"])
            for _ in engine.generate(header["ids"], settings, Agreement(group)):
                watchdog.beat()
        except RuntimeError as e:
            if is_link_error(e):
                raise
            log.exception("request failed")
        except Exception:  # rank 0 fails it the same way and goes on
            log.exception("request failed")
        finally:
            watchdog.disarm()


def serve_root(args, engine, options: dict, peers, watchdog) -> int:
    """Rank 0: the API on args.host:args.port over the pipeline until Ctrl+C, `quit` on stdin
    or a lost host. Returns the process's exit status."""
    from ...server.run import ApiServer
    from .rank import EXIT_ERROR

    def load():
        engine.load(args.model, options)
        return engine

    batcher = PipelineBatcher(load, engine.group, watchdog, context=args.context)

    def on_end(err) -> None:
        batcher.fail(str(err))
        time.sleep(LOST_GRACE_S)  # clients are told who is gone before the port closes

    watchdog.on_end = on_end
    api_key = sys.stdin.readline().strip() if args.api_key_stdin else None
    try:
        srv = ApiServer(None, args.host, args.port, api_key=api_key or None, batcher=batcher)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        batcher.close()
        return EXIT_ERROR
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(signum, _frame):
        signals.append(signum)
        stop.set()

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    def read_quit():  # the app's engine ends the session with a line on stdin
        for line in sys.stdin:
            if line.strip() == "quit":
                stop.set()
                return

    threading.Thread(target=read_quit, daemon=True, name="rq-stdin").start()
    srv.start()  # uvicorn on a thread: these handlers, not uvicorn's, get the signals
    print(f"serving on {srv.url} (loading the model…)", flush=True)
    announced = False
    while not stop.wait(0.25):
        if batcher.load_failed:
            print(f"error: could not load the model: {batcher.error}", file=sys.stderr, flush=True)
            srv.stop()
            return EXIT_ERROR
        if batcher.state == "ready" and not announced:
            announced = True
            st = engine.info.extra["stage"]
            print(
                f"ready: {engine.info.name} over {st['size']} hosts, split {st['split']} "
                "(one request at a time, in order)",
                flush=True,
            )
    # mlx.launch stops every rank when one ends with an error: that is a lost host
    if signals and signals[0] != signal.SIGINT and peers.lost():
        watchdog.end("its process ended")
    srv.stop()
    return 0
