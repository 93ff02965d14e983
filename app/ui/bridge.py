"""Qt side of the worker: turns the worker client's messages into Qt signals.

The GUI talks to the engine only through this bridge; replies arrive on the client's reader
thread and are re-emitted as queued signals in the GUI thread. Starting the worker (spawn +
importing MLX, seconds) happens on a thread too, so the window never waits for it.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Signal

from ..engine import messages as M
from ..engine.worker import WorkerClient, WorkerError

WORKER_NICE = 5  # the engine yields the CPU to the window: a CPU-bound decode never starves it


def lower_priority(pid: int | None, nice: int = WORKER_NICE) -> None:
    """Run the worker below the GUI's priority (CPU backend: both compete for the same cores;
    on a GPU backend the worker mostly waits, so this costs nothing)."""
    if pid is None:
        return
    try:
        import psutil

        p = psutil.Process(pid)
        if p.nice() < nice:
            p.nice(nice)
    except Exception:  # not permitted or already gone: a priority is a nicety, never an error
        pass


class WorkerBridge(QObject):
    ready = Signal(object)  # M.Ready
    loaded = Signal(object)  # M.Loaded
    prompt = Signal(object)  # M.Prompt
    token = Signal(object)  # M.Token
    done = Signal(object)  # M.Done
    error = Signal(object)  # M.Error
    stats = Signal(object)  # M.Stats
    died = Signal(object)  # M.WorkerDied
    serving = Signal(object)  # M.Serving
    host_lost = Signal(object)  # M.HostLost
    _incoming = Signal(object)  # from the reader thread

    def __init__(self, parent=None, env: dict | None = None):
        super().__init__(parent)
        self._incoming.connect(self._dispatch)
        self.client = WorkerClient(on_message=self._deliver, env=env)
        self.current: int | None = None  # request being generated
        self.starting = False
        self.stats_pending = False
        self._closed = False

    def _deliver(self, msg) -> None:
        """Called on the client's threads."""
        try:
            self._incoming.emit(msg)
        except RuntimeError:  # the window (and this bridge) was closed: nothing to deliver to
            pass

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker on a thread; `ready` (or `died`) follows."""
        if self.starting:
            return
        self.starting = True
        self.current = None
        self.stats_pending = False
        old_reader = self.client._reader_thread

        def run():
            # The previous reader must be gone before a new process starts, or it could report
            # the old process's end as the new one's death.
            if old_reader is not None:
                old_reader.join(timeout=10)
            try:
                msg = self.client.start()
                lower_priority(self.client.pid)
            except WorkerError as e:
                msg = M.WorkerDied(None, str(e))
            self._deliver(msg)

        threading.Thread(target=run, name="worker-start", daemon=True).start()

    def restart(self) -> None:
        self.client.kill()
        self.start()

    def shutdown(self) -> None:
        self._closed = True
        self.client.stop()

    def is_alive(self) -> bool:
        return self.client.is_alive() and not self.starting

    # -- requests ----------------------------------------------------------------------------
    def _send(self, msg) -> bool:
        try:
            self.client.send(msg)
            return True
        except WorkerError as e:
            self.error.emit(M.Error(getattr(msg, "req_id", None), "WorkerError", str(e)))
            return False

    def load(self, path: str, options: dict | None = None) -> int:
        rid = self.client.next_id()
        self._send(M.Load(str(path), options=dict(options or {}), req_id=rid))
        return rid

    def generate(self, prompt, settings: dict | None = None) -> int | None:
        rid = self.client.next_id()
        if self._send(M.Generate(rid, prompt, dict(settings or {}))):
            self.current = rid
            return rid
        return None

    def cancel(self) -> None:
        if self.current is not None:
            self._send(M.Cancel(self.current))

    def request_stats(self) -> None:
        """Ask for one Stats reply, unless one is already on its way (the worker answers
        between requests, so asking during a long load must not pile requests up)."""
        if self.is_alive() and not self.stats_pending:
            self.stats_pending = self._send(M.GetStats())

    def serve(self, host: str, port: int, api_key: str | None = None) -> None:
        """Serve the loaded model over the API from the worker; `serving` answers."""
        self._send(M.StartServing(self.client.next_id(), host, port, api_key))

    def stop_serving(self) -> None:
        self._send(M.StopServing(self.client.next_id()))

    def crash(self) -> None:
        """Test and demo hook: make the worker die as a segfault would."""
        self._send(M.Crash())

    # -- replies -----------------------------------------------------------------------------
    def _dispatch(self, msg) -> None:
        if isinstance(msg, M.Token):
            self.token.emit(msg)
        elif isinstance(msg, M.Stats):
            if msg.req_id == 0:
                self.stats_pending = False
            self.stats.emit(msg)
        elif isinstance(msg, M.Prompt):
            self.prompt.emit(msg)
        elif isinstance(msg, M.Done):
            if msg.req_id == self.current:
                self.current = None
            self.done.emit(msg)
        elif isinstance(msg, M.Loaded):
            self.loaded.emit(msg)
        elif isinstance(msg, M.Serving):
            self.serving.emit(msg)
        elif isinstance(msg, M.Error):
            if msg.req_id is not None and msg.req_id == self.current:
                self.current = None
            self.error.emit(msg)
        elif isinstance(msg, M.HostLost):
            self.host_lost.emit(msg)
        elif isinstance(msg, M.WorkerDied):
            self.starting = False
            self.current = None
            self.stats_pending = False
            if not self._closed:
                self.died.emit(msg)
        elif isinstance(msg, M.Ready):
            self.starting = False
            self.ready.emit(msg)
