"""A stand-in for the worker, for GUI tests that need exact control of what the engine says
(thinking tags, errors, a death at a chosen token). It is a WorkerBridge whose requests are
recorded instead of sent; the test plays the worker's replies through the bridge's signals."""

from __future__ import annotations

from PySide6.QtCore import QTimer

from app.engine import messages as M
from app.ui.bridge import WorkerBridge

INFO = {
    "path": "/fake/model",
    "name": "FakeModel",
    "architecture": "llama",
    "num_layers": 2,
    "weight_bytes": 1 << 20,
    "kv_modes": ["fp16", "isoquant3"],
    "backend": "cpu",
    "load_seconds": 0.0,
    "extra": {},
}


class FakeBridge(WorkerBridge):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.sent: list = []
        self.alive = False
        self._ids = 100

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def start(self) -> None:
        self.alive = True
        self._dispatch(M.Ready(1, "cpu", "fake CPU"))

    def restart(self) -> None:
        self.start()

    def shutdown(self) -> None:
        self.alive = False

    def is_alive(self) -> bool:
        return self.alive

    def load(self, path: str, options: dict | None = None) -> int:
        rid = self.next_id()
        self.sent.append(M.Load(path, options=dict(options or {}), req_id=rid))
        # replies never come back inside the request call, as with the real pipe
        QTimer.singleShot(0, lambda: self._dispatch(M.Loaded(rid, dict(INFO))))
        return rid

    def generate(self, prompt, settings: dict | None = None) -> int | None:
        if not self.alive:
            return None
        rid = self.next_id()
        self.sent.append(M.Generate(rid, prompt, dict(settings or {})))
        self.current = rid
        return rid

    def cancel(self) -> None:
        if self.current is not None:
            self.sent.append(M.Cancel(self.current))

    def request_stats(self) -> None:
        pass

    # -- the worker's side, played by the test -----------------------------------------------
    def play_tokens(self, pieces: list[str]) -> None:
        for i, text in enumerate(pieces):
            self._dispatch(M.Token(self.current, text, i))

    def play_done(self, text: str, reason: str = "stop", n: int = 0) -> None:
        self._dispatch(M.Done(self.current, reason, 5, n, 100.0, 50.0, 1 << 20, 1 << 16, text))

    def play_error(self, message: str) -> None:
        self._dispatch(M.Error(self.current, "EngineError", message))

    def play_death(self) -> None:
        self.alive = False
        self._dispatch(M.WorkerDied(-11, "the engine process stopped unexpectedly (exit code -11)"))


def test_fake_bridge_overrides_every_request():
    """The fake must not fall through to the real client (which would need a process)."""
    for name in (
        "start",
        "restart",
        "shutdown",
        "is_alive",
        "load",
        "generate",
        "cancel",
        "request_stats",
    ):
        assert getattr(FakeBridge, name) is not getattr(WorkerBridge, name), name


def test_broken_pipe_restarts_the_engine_once(qtbot):
    from app.ui.session import EngineSession

    bridge = FakeBridge()
    s = EngineSession("/fake/model", bridge=bridge)
    crashed = []
    s.crashed.connect(crashed.append)
    s.start()
    qtbot.waitUntil(lambda: s.state == "ready")
    starts = sum(isinstance(m, M.Load) for m in bridge.sent)
    bridge._dispatch(
        M.WorkerDied(
            M.PROTOCOL_EXIT, "the engine got a message it could not read", broken_pipe=True
        )
    )
    qtbot.waitUntil(lambda: s.state == "ready")  # restarted and loaded again, unasked
    assert sum(isinstance(m, M.Load) for m in bridge.sent) == starts + 1 and len(crashed) == 1
    bridge._dispatch(M.WorkerDied(M.PROTOCOL_EXIT, "again", broken_pipe=True))
    qtbot.waitUntil(lambda: s.state == "ready")  # a model loaded in between: restarts again
    bridge._dispatch(M.WorkerDied(M.PROTOCOL_EXIT, "before the model loaded", broken_pipe=True))
    bridge._dispatch(M.WorkerDied(M.PROTOCOL_EXIT, "and again", broken_pipe=True))
    assert s.state == "crashed"  # twice before a load: the user decides
    bridge._dispatch(M.WorkerDied(-11, "exit code -11"))
    assert s.state == "crashed"
