"""Qt side of the worker: turns the worker client's messages into Qt signals.

The GUI talks to the engine only through this bridge; replies arrive on the client's reader
thread and are re-emitted as queued signals in the GUI thread.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from ..engine import messages as M
from ..engine.worker import WorkerClient, WorkerError


class WorkerBridge(QObject):
    ready = Signal(object)  # M.Ready
    loaded = Signal(object)  # M.Loaded
    prompt = Signal(object)  # M.Prompt
    token = Signal(object)  # M.Token
    done = Signal(object)  # M.Done
    error = Signal(object)  # M.Error
    stats = Signal(object)  # M.Stats
    died = Signal(object)  # M.WorkerDied
    _incoming = Signal(object)  # from the reader thread

    def __init__(self, parent=None, env: dict | None = None):
        super().__init__(parent)
        self._incoming.connect(self._dispatch)
        self.client = WorkerClient(on_message=self._incoming.emit, env=env)
        self.current: int | None = None  # request being generated

    def start(self) -> None:
        try:
            msg = self.client.start()
        except WorkerError as e:
            self.died.emit(M.WorkerDied(None, str(e)))
            return
        self.ready.emit(msg)

    def restart(self) -> None:
        self.current = None
        self.client.kill()
        self.start()

    def shutdown(self) -> None:
        self.client.stop()

    def is_alive(self) -> bool:
        return self.client.is_alive()

    def _send(self, msg) -> bool:
        try:
            self.client.send(msg)
            return True
        except WorkerError as e:
            self.error.emit(M.Error(getattr(msg, "req_id", None), "WorkerError", str(e)))
            return False

    def load(self, path: str) -> int:
        rid = self.client.next_id()
        self._send(M.Load(str(path), req_id=rid))
        return rid

    def generate(self, prompt, settings: dict | None = None) -> int:
        rid = self.client.next_id()
        if self._send(M.Generate(rid, prompt, dict(settings or {}))):
            self.current = rid
        return rid

    def cancel(self) -> None:
        if self.current is not None:
            self._send(M.Cancel(self.current))

    def request_stats(self) -> None:
        if self.client.is_alive():
            self._send(M.GetStats())

    def _dispatch(self, msg) -> None:
        if isinstance(msg, M.Token):
            self.token.emit(msg)
        elif isinstance(msg, M.Stats):
            self.stats.emit(msg)
        elif isinstance(msg, M.Prompt):
            self.prompt.emit(msg)
        elif isinstance(msg, M.Done):
            if msg.req_id == self.current:
                self.current = None
            self.done.emit(msg)
        elif isinstance(msg, M.Loaded):
            self.loaded.emit(msg)
        elif isinstance(msg, M.Error):
            if msg.req_id is not None and msg.req_id == self.current:
                self.current = None
            self.error.emit(msg)
        elif isinstance(msg, M.WorkerDied):
            self.current = None
            self.died.emit(msg)
        elif isinstance(msg, M.Ready):
            self.ready.emit(msg)
