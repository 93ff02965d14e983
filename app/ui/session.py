"""The engine as the GUI sees it: one worker, one loaded model, and a small state machine.

States: starting → loading → ready; a model that fails to load leaves the engine "idle" with
the error, as does a host of a split model that drops out (`hosts_lost`); a worker that dies makes it "crashed" until `restart()`, which starts a new worker
and loads the same model again. A pipe broken by an unreadable frame restarts it at once (once
until a model loads again).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, Signal

from ..engine import messages as M
from .bridge import WorkerBridge

# Mirrors app.engine.generate.DEFAULT_MODEL_REF without importing the engine (and MLX) here;
# a test checks that the two agree.
DEFAULT_MODEL_REF = "embedded:default"
STATS_IDLE_INTERVAL_MS = 1000  # the worker streams stats itself while generating (every 0.5 s)
STATES = ("stopped", "starting", "loading", "ready", "idle", "crashed")


class EngineSession(QObject):
    state_changed = Signal(str, str)  # state, message for the user
    model_loaded = Signal(dict)  # ModelInfo fields
    load_failed = Signal(str)
    crashed = Signal(str)
    hosts_lost = Signal(str)  # the machines a split model ran over stopped (names the host)
    stats = Signal(object)  # M.Stats

    def __init__(
        self,
        model: str = DEFAULT_MODEL_REF,
        bridge: WorkerBridge | None = None,
        options: dict | None = None,
        parent=None,
    ):
        super().__init__(parent)
        self.model_ref = model
        self.options = dict(options or {})
        self.bridge = bridge or WorkerBridge(self)
        self.state = "stopped"
        self.message = ""
        self.info: dict | None = None
        self.device = ""
        self.backend = ""
        self.load_req: int | None = None
        self.lost = ""  # the last lost host's report, while no model runs since
        self._auto_restarted = False
        b = self.bridge
        b.ready.connect(self._on_ready)
        b.loaded.connect(self._on_loaded)
        b.error.connect(self._on_error)
        b.died.connect(self._on_died)
        b.host_lost.connect(self._on_host_lost)
        b.stats.connect(self.stats)
        self.poll = QTimer(self)
        self.poll.setInterval(STATS_IDLE_INTERVAL_MS)
        self.poll.timeout.connect(self._poll_stats)

    # -- state -------------------------------------------------------------------------------
    def _set(self, state: str, message: str) -> None:
        assert state in STATES, state
        self.state, self.message = state, message
        self.state_changed.emit(state, message)

    @property
    def generating(self) -> bool:
        return self.bridge.current is not None

    def can_generate(self) -> bool:
        return self.state == "ready" and not self.generating

    # -- actions -----------------------------------------------------------------------------
    def start(self) -> None:
        self._set("starting", "Starting the engine…")
        self.bridge.start()

    def load(self, model: str, options: dict | None = None) -> None:
        """Load another model (or the same with other options) in the running worker."""
        self.model_ref = model
        self.options = dict(options or {})
        if self.state in ("starting", "crashed", "stopped"):
            return  # loaded once the worker is ready
        self._load()

    def _load(self) -> None:
        self.info = None
        self.lost = ""
        self._set("loading", f"Loading {_short(self.model_ref)}…")
        self.load_req = self.bridge.load(self.model_ref, self.options)

    def restart(self, model: str | None = None, options: dict | None = None) -> None:
        """A fresh worker, loading the same model (or `model` with `options`)."""
        if model is not None:
            self.model_ref, self.options = model, dict(options or {})
        self.poll.stop()
        self._set("starting", "Restarting the engine…")
        self.bridge.restart()

    def shutdown(self) -> None:
        self.poll.stop()
        self.bridge.shutdown()
        self.state = "stopped"

    def _poll_stats(self) -> None:
        if self.state == "ready" and not self.generating:
            self.bridge.request_stats()

    # -- worker events -----------------------------------------------------------------------
    def _on_ready(self, msg: M.Ready) -> None:
        self.device, self.backend = msg.device, msg.backend
        self.poll.start()
        self._load()

    def _on_loaded(self, msg: M.Loaded) -> None:
        if msg.req_id != self.load_req:
            return  # an older load, superseded
        self.info = dict(msg.info)
        i = self.info
        self._set("ready", f"{i['name']} · {i['architecture']} · {i['backend']}")
        self._auto_restarted = False
        self.model_loaded.emit(self.info)
        self.bridge.request_stats()

    def _on_error(self, msg: M.Error) -> None:
        if msg.req_id is not None and msg.req_id == self.load_req and self.state == "loading":
            self._set("idle", f"Could not load {_short(self.model_ref)}: {msg.message}")
            self.load_failed.emit(msg.message)

    @property
    def split(self) -> bool:
        """The model runs over several machines (a hosts.json was given)."""
        return bool(self.options.get("hosts"))

    def _on_host_lost(self, msg: M.HostLost) -> None:
        """A host of a split model dropped out: the worker lives on with no model; the window
        keeps the conversation and offers to go on on this machine."""
        if not self.split:
            return
        self.info = None
        self.lost = msg.message
        self._set("idle", f"A machine dropped out: {msg.message}. Your conversation is kept.")
        self.hosts_lost.emit(msg.message)

    def _on_died(self, msg: M.WorkerDied) -> None:
        self.poll.stop()
        self.info = None
        if msg.broken_pipe and not self._auto_restarted:
            self._auto_restarted = True  # once: a worker that keeps breaking waits for the user
            self.crashed.emit(msg.message)  # the answer in flight ends as interrupted
            self._set("starting", f"Restarting the engine: {msg.message}…")
            self.bridge.restart()
            return
        self._set("crashed", f"The engine stopped: {msg.message}. Your conversation is kept.")
        self.crashed.emit(msg.message)


def _short(ref: str) -> str:
    if ref == DEFAULT_MODEL_REF:
        return "the built-in model"
    return ref.rstrip("/").split("/")[-1]
