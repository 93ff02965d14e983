"""Work that needs MLX, run for the window in a process of its own.

The window process never imports MLX: planning, conversion, checking a model folder and the
like run here instead. A `JobProcess` is a spawned child that runs top-level functions one at a
time; each gets an `emit` callback whose events come back to the caller (progress), then its
result or its exception. A child that dies (a crash, the OOM killer) raises `JobCrashed` in the
caller and cannot take the window down. This module imports neither MLX nor Qt.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
from collections.abc import Callable

START_TIMEOUT = 120.0  # spawning + importing MLX on a loaded machine takes seconds, not minutes


class JobError(RuntimeError):
    """An exception from the child that could not be sent back as itself."""


class JobCrashed(RuntimeError):
    """The child process ended while running a job (crash, out of memory, killed)."""


def _child_main(conn, env: dict) -> None:
    os.environ.update(env)
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        if req is None:
            return
        fn, args, kwargs = req

        def emit(ev, _conn=conn) -> None:
            _conn.send(("event", ev))

        try:
            out = ("ok", fn(*args, emit=emit, **kwargs))
        except BaseException as e:  # sent back to the caller, never lost in the child
            out = ("error", _picklable(e))
        try:
            conn.send(out)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            conn.send(("error", JobError(f"the job's result could not be sent back: {e}")))


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # an exception whose constructor does not round-trip: keep its words
        return JobError(f"{type(e).__name__}: {e}")


class JobProcess:
    """A spawned child running one job at a time; `call` blocks (run it on a thread in a GUI).
    Calls from several threads take turns. The child is started on first use and again after
    it died."""

    def __init__(self, name: str = "rotaryquant-job", env: dict | None = None):
        self.name = name
        self.env = dict(env or {})
        self.proc = None
        self.conn = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        env = {k: v for k, v in os.environ.items() if k in ("ROTARYQUANT_HOME", "LD_PRELOAD")}
        env.update(self.env)
        self.proc = ctx.Process(target=_child_main, args=(child, env), name=self.name, daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def call(self, fn: Callable, *args, on_event: Callable[[object], None] | None = None, **kwargs):
        """Run `fn(*args, emit=..., **kwargs)` in the child; events go to `on_event` on the
        calling thread. Returns fn's result or raises its exception (or JobCrashed)."""
        with self._lock:
            if self.proc is None or not self.proc.is_alive():
                self._start()
            try:
                self.conn.send((fn, args, kwargs))
            except (BrokenPipeError, OSError) as e:
                raise self._crashed() from e
            while True:
                try:
                    kind, value = self.conn.recv()
                except (EOFError, OSError) as e:
                    raise self._crashed() from e
                if kind == "event":
                    if on_event is not None:
                        on_event(value)
                    continue
                if kind == "error":
                    raise value
                return value

    def _crashed(self) -> JobCrashed:
        proc = self.proc
        proc.join(5)
        code = proc.exitcode
        self.close()
        why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return JobCrashed(f"the {self.name} process stopped unexpectedly ({why})")

    def close(self) -> None:
        """Stop the child (it finishes nothing it was doing)."""
        if self.conn is not None:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            self.proc.join(2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self.proc = None


def run_once(
    fn: Callable,
    *args,
    name: str = "rotaryquant-job",
    on_event: Callable[[object], None] | None = None,
    **kwargs,
):
    """Run one job in a fresh process that ends with it (conversion: its memory is returned
    to the system, and a crash there stays there)."""
    p = JobProcess(name)
    try:
        return p.call(fn, *args, on_event=on_event, **kwargs)
    finally:
        p.close()


_shared: dict[str, JobProcess] = {}
_shared_lock = threading.Lock()


def shared(name: str = "rotaryquant-planner") -> JobProcess:
    """One long-lived helper per name (planning: MLX is imported once, not per plan)."""
    with _shared_lock:
        if name not in _shared:
            _shared[name] = JobProcess(name)
        return _shared[name]
