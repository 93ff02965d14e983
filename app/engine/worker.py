"""The background worker process that owns the engine and MLX, and its client.

The client (used by the GUI and the CLI) spawns the worker, sends requests from
`messages`, and receives replies on a reader thread. A bad request gets an `Error` reply and
the worker goes on; if the worker dies, the client reports `WorkerDied` and can start another.
This module imports MLX only inside the worker process.
"""

from __future__ import annotations

import itertools
import logging
import logging.handlers
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from . import messages as M

STATS_INTERVAL = 0.5  # seconds between stats messages while generating (throttled at the source)
LOG_BYTES = 1 << 20  # worker.log rotates at 1 MiB, three old files kept
LOG_BACKUPS = 3
log = logging.getLogger("rotaryquant.worker")


class _PrivateLog(logging.handlers.RotatingFileHandler):
    """worker.log and its rotations, readable by the user only (0600)."""

    def _open(self):
        from ..paths import private_file

        private_file(Path(self.baseFilename))
        return super()._open()


def describe(msg) -> str:
    """A request as the log may keep it: its type and sizes, never the prompt's text."""
    if isinstance(msg, M.Generate):
        p = msg.prompt
        if isinstance(p, str):
            what = f"{len(p)} chars of text"
        elif isinstance(p, (list, tuple)):
            what = f"{len(p)} messages" if p and isinstance(p[0], dict) else f"{len(p)} token ids"
        else:
            what = f"a {type(p).__name__}"
        keys = sorted(map(str, msg.settings)) if isinstance(msg.settings, dict) else "?"
        return f"Generate #{msg.req_id} ({what}, settings {keys})"
    return f"{type(msg).__name__} #{getattr(msg, 'req_id', '-')}"


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
def _worker_main(conn, env: dict) -> None:
    os.environ.update(env)
    if hasattr(os, "setpgid"):
        try:  # its own process group: the ranks it may start end with it (WorkerClient.kill)
            os.setpgid(0, 0)
        except OSError:
            pass
    from ..paths import log_dir

    handler = _PrivateLog(log_dir() / "worker.log", maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    try:
        _Worker(conn).run()
    except (EOFError, OSError, BrokenPipeError):
        pass  # the client went away: nothing to report to


class _Worker:
    def __init__(self, conn):
        self.conn = conn
        self.requests: queue.Queue = queue.Queue()
        self.cancelled: set[int] = set()
        self.shutdown = threading.Event()
        self.send_lock = threading.Lock()
        self.generating = False
        self.decode_tps = 0.0
        self.api = None  # app.server.run.ApiServer while serving the loaded model
        self.api_settings: dict | None = None  # host/port/key to serve again after a load

    def send(self, msg) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def _reader(self) -> None:
        # Runs on its own thread so that Cancel arrives while the main thread generates.
        while not self.shutdown.is_set():
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.shutdown.set()
                self.requests.put(M.Shutdown())
                return
            except Exception as e:  # not a message (garbage, a class we cannot import)
                self._broken_frame(e)
            if isinstance(msg, M.Cancel):
                self.cancelled.add(msg.req_id)
            elif isinstance(msg, M.Crash):
                os._exit(msg.code)
            elif isinstance(msg, M.Shutdown):
                self.shutdown.set()
                self.requests.put(msg)
            else:
                self.requests.put(msg)

    def _broken_frame(self, e: Exception) -> None:
        """The stream can no longer be trusted to be in step: say so and end the process;
        the client sees the exit code and starts a new worker."""
        log.error("broken frame on the pipe (%s): the worker ends", type(e).__name__)
        try:
            with self.send_lock:
                self.conn.send(
                    M.Error(
                        None,
                        "ProtocolError",
                        f"the engine got a message it could not read "
                        f"({type(e).__name__}); it restarts",
                    )
                )
        except Exception:
            pass
        logging.shutdown()
        os._exit(M.PROTOCOL_EXIT)

    def run(self) -> None:
        from .backend import detect
        from .generate import Engine

        self.engine = Engine()
        b = detect()
        threading.Thread(target=self._reader, daemon=True, name="worker-reader").start()
        self.send(M.Ready(os.getpid(), b.name, b.device))
        while True:
            msg = self.requests.get()
            if isinstance(msg, M.Shutdown):
                self._stop_api()
                self.engine.unload()  # ranks on other machines end too
                return
            try:
                self.handle(msg)
            except Exception as e:  # a bad request must not kill the worker
                log.exception("request failed: %s", describe(msg))
                self.send(M.Error(getattr(msg, "req_id", None), type(e).__name__, str(e)))

    def handle(self, msg) -> None:
        if isinstance(msg, M.Load):
            serving = self.api_settings if self.api is not None else None
            self._stop_api()  # the API's batch must not run while the model changes
            info = self._load(msg.path, msg.options)
            self.send(M.Loaded(msg.req_id, asdict(info)))
            if serving:
                self._start_api(msg.req_id, **serving)
        elif isinstance(msg, M.StartServing):
            self._start_api(msg.req_id, msg.host, msg.port, msg.api_key)
        elif isinstance(msg, M.StopServing):
            self._stop_api()
            self.api_settings = None
            self.send(M.Serving(msg.req_id, ""))
        elif isinstance(msg, M.Generate):
            self.generate(msg)
        elif isinstance(msg, M.GetStats):
            self.send(self.stats(msg.req_id))
        else:
            raise ValueError(f"unknown request {type(msg).__name__}")

    def _load(self, path: str, options: dict):
        """Load on this machine, or with options["hosts"] over the machines of that hosts.json
        (distributed/remote.py: the ranks run the model, this process drives them)."""
        from .distributed.remote import RemoteEngine
        from .generate import Engine

        remote = bool(options.get("hosts"))
        if remote != isinstance(self.engine, RemoteEngine) or remote:
            self.engine.unload()  # the memory (or the ranks) of the model it replaces
            self.engine = RemoteEngine(self._host_lost) if remote else Engine()
        return self.engine.load(path, options)

    def _host_lost(self, message: str) -> None:
        """The ranks ended by themselves (on their own thread): the window keeps the chat."""
        log.error("the machines stopped: %s", message)
        self.send(M.HostLost(message))

    def _start_api(self, req_id: int, host: str, port: int, api_key: str | None) -> None:
        """Serve the loaded model (one model in memory: the window and the API share it)."""
        if self.engine.info is not None and self.engine.loaded is None:  # over several machines
            self.send(M.Serving(req_id, "", host, port, error="the model runs over several "
                                "machines: serve it with `rotaryquant serve --hosts`"))  # fmt: skip
            return
        if self.engine.loaded is None:
            raise ValueError("load a model before serving it")
        from ..server.run import ApiServer

        self._stop_api()
        try:
            self.api = ApiServer(self.engine, host, port, api_key=api_key).start()
        except OSError as e:
            self.send(M.Serving(req_id, "", host, port, error=str(e)))
            return
        self.api_settings = {"host": host, "port": self.api.port, "api_key": api_key}
        self.send(M.Serving(req_id, self.api.url, host, self.api.port))

    def _stop_api(self) -> None:
        if self.api is not None:
            self.api.stop()
            self.api = None

    def generate(self, msg: M.Generate) -> None:
        if self.api is None:
            self._generate(msg)
            return
        with self.api.batcher.lock:  # the API's batch waits between its steps meanwhile
            self._generate(msg)

    def _generate(self, msg: M.Generate) -> None:
        from .generate import Finished, GenerationSettings, PromptProcessed, TokenEvent

        settings = GenerationSettings.from_dict(msg.settings)
        rid = msg.req_id
        self.generating = True
        self.decode_tps = 0.0
        last_stats = time.monotonic()
        t_first = None
        n = 0
        try:
            for ev in self.engine.generate(
                msg.prompt,
                settings,
                should_stop=lambda: rid in self.cancelled or self.shutdown.is_set(),
            ):
                if isinstance(ev, TokenEvent):
                    self.send(M.Token(rid, ev.text, ev.token))
                    n += 1
                    now = time.monotonic()
                    t_first = t_first or now
                    if n > 1 and now > t_first:
                        self.decode_tps = (n - 1) / (now - t_first)
                    if now - last_stats >= STATS_INTERVAL:
                        last_stats = now
                        self.send(self.stats(rid))
                elif isinstance(ev, PromptProcessed):
                    self.send(M.Prompt(rid, ev.prompt_tokens, ev.prompt_tps))
                elif isinstance(ev, Finished):
                    self.decode_tps = ev.decode_tps
                    self.send(
                        M.Done(
                            rid,
                            ev.reason,
                            ev.prompt_tokens,
                            ev.generated_tokens,
                            ev.prompt_tps,
                            ev.decode_tps,
                            ev.peak_memory,
                            ev.kv_bytes,
                            ev.text,
                        )
                    )
        finally:
            self.generating = False
            self.cancelled.discard(rid)
        self.send(self.stats(rid))

    def stats(self, req_id: int) -> M.Stats:
        import mlx.core as mx
        import psutil

        info = self.engine.info
        extra = {}
        model = self.engine.loaded.model if self.engine.loaded else None
        pager = getattr(model, "rq_pager", None)
        if pager is not None and hasattr(pager, "stats"):
            extra["pager"] = pager.stats()
        kv_bytes = 0  # the cache's bytes, summed once (kv_stats has them)
        if self.engine.last_cache is not None:
            extra["kv"] = self.engine.kv_stats()
            kv_bytes = extra["kv"]["bytes"]
        return M.Stats(
            req_id=req_id,
            time=time.time(),
            rss=psutil.Process().memory_info().rss,
            mlx_active=int(mx.get_active_memory()),
            mlx_peak=int(mx.get_peak_memory()),
            mlx_cache=int(mx.get_cache_memory()),
            weight_bytes=info.weight_bytes if info else 0,
            kv_bytes=kv_bytes,
            decode_tps=self.decode_tps,
            generating=self.generating,
            extra=extra,
        )


# ---------------------------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------------------------
class WorkerError(RuntimeError):
    pass


def _end_group(pid: int | None) -> None:
    """Kill the worker's process group (the worker leads its own: _worker_main), so ranks it
    started do not outlive it. Nothing happens if it never became a group leader."""
    if pid is None or not hasattr(os, "killpg"):
        return
    try:
        if os.getpgid(pid) != pid:
            return
    except OSError:
        pass  # the leader is gone; its group may still have members
    try:
        os.killpg(pid, 9)
    except OSError:
        pass


class WorkerClient:
    """Spawns and talks to the worker. Replies go to `on_message` (called on the reader
    thread) or, when it is None, into `self.replies` for synchronous use (CLI, tests)."""

    def __init__(self, on_message: Callable[[object], None] | None = None, env: dict | None = None):
        self.on_message = on_message
        self.env = dict(env or {})
        self.replies: queue.Queue = queue.Queue()
        self.proc: mp.Process | None = None
        self.conn = None
        self.ready: M.Ready | None = None
        self._ids = itertools.count(1)
        self._stopping = False
        self._reader_thread: threading.Thread | None = None
        self._send_lock = threading.Lock()
        # Process.join / is_alive reap the child with waitpid, which is not safe from two threads
        # at once (the loser gets ECHILD and still sees the process as alive): the reader thread
        # and stop()/kill() take turns.
        self._reap_lock = threading.RLock()

    # lifecycle
    def start(self, timeout: float = 120.0) -> M.Ready:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        env = {k: v for k, v in os.environ.items() if k in ("ROTARYQUANT_HOME", "LD_PRELOAD")}
        env.update(self.env)
        self._stopping = False
        self.proc = ctx.Process(
            target=_worker_main, args=(child, env), name="rotaryquant-worker", daemon=True
        )
        self.proc.start()
        child.close()
        self.conn = parent
        if not parent.poll(timeout):
            self.kill()
            raise WorkerError(f"the worker did not start within {timeout:.0f} s")
        try:
            msg = parent.recv()
        except (EOFError, OSError) as e:
            raise WorkerError(
                f"the worker died while starting (exit code {self.proc.exitcode})"
            ) from e
        if not isinstance(msg, M.Ready):
            raise WorkerError(f"unexpected first message from the worker: {msg!r}")
        self.ready = msg
        # The reader owns this process and pipe: after a restart, the old reader must not
        # report (or join) the new process.
        self._reader_thread = threading.Thread(
            target=self._reader, args=(self.proc, parent), daemon=True, name="worker-client-reader"
        )
        self._reader_thread.start()
        return msg

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def is_alive(self) -> bool:
        with self._reap_lock:
            return bool(self.proc and self.proc.is_alive())

    def _deliver(self, msg) -> None:
        if self.on_message is not None:
            self.on_message(msg)
        else:
            self.replies.put(msg)

    def _reader(self, proc, conn) -> None:
        broken = None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # a frame we cannot read: the stream is out of step
                broken = e
                log.error("broken frame from the worker (%s): it is stopped", type(e).__name__)
                with self._reap_lock:
                    proc.kill()
                break
            self._deliver(msg)
        with self._reap_lock:
            proc.join(timeout=5)
            code = proc.exitcode
        _end_group(proc.pid)  # what it started (the ranks of a split model) ends with it
        if not self._stopping and proc is self.proc:
            if broken is not None:
                what = f"a message from the engine could not be read ({type(broken).__name__})"
            elif code == M.PROTOCOL_EXIT:
                what = "the engine got a message it could not read"
            else:
                what = f"the engine process stopped unexpectedly (exit code {code})"
            self._deliver(M.WorkerDied(code, what, broken is not None or code == M.PROTOCOL_EXIT))

    def send(self, msg) -> None:
        if not self.is_alive() or self.conn is None:
            raise WorkerError("the worker is not running")
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (BrokenPipeError, OSError) as e:
                raise WorkerError("the worker is not running") from e

    def next_id(self) -> int:
        return next(self._ids)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to shut down; kill it if it does not within `timeout`."""
        self._stopping = True
        if self.is_alive():
            try:
                self.send(M.Shutdown())
            except WorkerError:
                pass
            with self._reap_lock:
                self.proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        self._stopping = True
        with self._reap_lock:
            if self.proc is not None and self.proc.is_alive():
                _end_group(self.proc.pid)
                self.proc.kill()
                self.proc.join(5)
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def restart(self, timeout: float = 120.0) -> M.Ready:
        self.kill()
        return self.start(timeout)

    # synchronous helpers (on_message must be None)
    def _wait(self, pred: Callable[[object], bool], timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError("timed out waiting for the worker")
            try:
                msg = self.replies.get(timeout=left)
            except queue.Empty:
                continue
            if isinstance(msg, M.WorkerDied):
                raise WorkerError(msg.message)
            if pred(msg):
                return msg

    def load(self, path: str, options: dict | None = None, timeout: float = 300.0) -> dict:
        rid = self.next_id()
        self.send(M.Load(str(path), options=dict(options or {}), req_id=rid))
        msg = self._wait(lambda m: isinstance(m, (M.Loaded, M.Error)) and m.req_id == rid, timeout)
        if isinstance(msg, M.Error):
            raise WorkerError(f"{msg.kind}: {msg.message}")
        return msg.info

    def generate(
        self, prompt, settings: dict | None = None, timeout: float = 600.0
    ) -> Iterator[object]:
        """Yield Prompt, Token, Stats and finally Done (or raise on Error) for one request."""
        rid = self.next_id()
        self.send(M.Generate(rid, prompt, dict(settings or {})))
        while True:
            msg = self._wait(lambda m: getattr(m, "req_id", None) == rid, timeout)
            if isinstance(msg, M.Error):
                raise WorkerError(f"{msg.kind}: {msg.message}")
            yield msg
            if isinstance(msg, M.Done):
                return

    def cancel(self, req_id: int) -> None:
        self.send(M.Cancel(req_id))

    def serve(self, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
              timeout: float = 60.0) -> M.Serving:  # fmt: skip
        """Start serving the loaded model over the API; the reply says where (or why not)."""
        rid = self.next_id()
        self.send(M.StartServing(rid, host, port, api_key))
        msg = self._wait(lambda m: isinstance(m, (M.Serving, M.Error)) and m.req_id == rid, timeout)
        if isinstance(msg, M.Error):
            raise WorkerError(f"{msg.kind}: {msg.message}")
        return msg

    def stop_serving(self, timeout: float = 60.0) -> M.Serving:
        rid = self.next_id()
        self.send(M.StopServing(rid))
        return self._wait(lambda m: isinstance(m, M.Serving) and m.req_id == rid, timeout)

    def __enter__(self) -> WorkerClient:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
