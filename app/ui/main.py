"""The desktop window: chat, library and plan tabs beside the live memory panel, over one
engine session (the worker), and `main()`, the app's entry point."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtGui import QAction, QActionGroup, QIcon, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from .. import paths
from .bridge import WorkerBridge
from .chat_model import ChatModel
from .chat_view import ChatView
from .library_model import LibraryController, embedded_row
from .library_view import LibraryView
from .machines import MachinesController, MachinesDialog, MachinesView
from .memory import MemoryPanel
from .plan_model import PlanController, PlanResult
from .plan_view import PlanView
from .server_view import ServerSwitch
from .session import DEFAULT_MODEL_REF, EngineSession
from .theme import MODES, RESOURCES, Theme

SETTINGS_FILE = "settings.ini"
SHORTCUTS = (
    ("Ctrl+Enter", "send the message"),
    ("Esc", "stop the answer"),
    ("Ctrl+R", "regenerate the last answer"),
    ("Ctrl+Shift+C", "copy the last answer"),
    ("Ctrl+N", "new chat"),
    ("Ctrl+O", "open a model folder"),
    ("Delete", "delete the selected chat or model"),
    ("Ctrl+1 / 2 / 3", "chat, library, plan"),
    ("Ctrl+L", "focus the message box"),
    ("Ctrl+M", "show or hide the memory panel"),
    ("Enter", "load the selected model (library)"),
    ("F5", "re-check the library"),
    ("Ctrl+Shift+R", "restart the engine"),
)
SETTINGS_VERSION = 2  # bump when saved window state can no longer be restored


def app_settings() -> QSettings:
    """The app's settings, in its data dir (so tests with ROTARYQUANT_HOME stay isolated)."""
    return QSettings(str(paths.data_dir() / SETTINGS_FILE), QSettings.Format.IniFormat)


def _ref_exists(ref: str) -> bool:
    return ref == DEFAULT_MODEL_REF or Path(ref).is_dir()


class MainWindow(QMainWindow):
    TABS = ("Chat", "Library", "Plan")

    def __init__(
        self,
        model: str | None = None,
        bridge: WorkerBridge | None = None,
        settings: QSettings | None = None,
        library: LibraryController | None = None,
        theme: Theme | None = None,
        start: bool = True,
    ):
        super().__init__()
        self.setWindowTitle("RotaryQuant")
        self.resize(1280, 800)
        self.settings = settings or app_settings()
        self.theme = theme
        last = str(self.settings.value("last_model", "") or "")
        default = str(self.settings.value("default_model", "") or "")  # set in Settings
        last = default if default and _ref_exists(default) else last
        model = model or (last if last and _ref_exists(last) else DEFAULT_MODEL_REF)
        self.session = EngineSession(model, bridge, parent=self)
        self.bridge = self.session.bridge
        self.chat = ChatModel(self.session, parent=self)
        self.library = library or LibraryController(parent=self)
        self.planner = PlanController(self)
        self.machines = MachinesController(self)
        self.machines.hosts_path = str(self.settings.value("machines/hosts", "") or "")
        self.applied: PlanResult | None = None  # the plan the engine runs, once applied
        self._restore_chat_defaults()

        self.chat_view = ChatView(self.chat)
        self.library_view = LibraryView(self.library)
        self.plan_view = PlanView(self.planner)
        self.memory = MemoryPanel()
        self.machines_view = MachinesView(self.machines)
        self.machines_dialog = MachinesDialog(self.machines_view, self)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        for w, name in zip(
            (self.chat_view, self.library_view, self.plan_view), self.TABS, strict=True
        ):
            self.tabs.addTab(w, name)
        self.main_splitter = QSplitter(Qt.Orientation.Horizontal)
        self.main_splitter.setObjectName("mainSplitter")
        self.main_splitter.addWidget(self.tabs)
        self.main_splitter.addWidget(self.memory)
        self.main_splitter.setStretchFactor(0, 1)
        self.main_splitter.setStretchFactor(1, 0)
        self.main_splitter.setSizes([900, 380])
        self.main_splitter.setCollapsible(0, False)

        self._build_top()
        self._build_banner()
        central = QWidget()
        lay = QVBoxLayout(central)
        lay.setContentsMargins(8, 4, 8, 4)
        lay.setSpacing(4)
        lay.addLayout(self.top)
        lay.addWidget(self.banner)
        lay.addWidget(self.main_splitter, 1)
        self.setCentralWidget(central)
        self.status_label = QLabel("")
        self.statusBar().addPermanentWidget(self.status_label)
        self.server_switch = ServerSwitch(self.bridge)
        self.statusBar().addPermanentWidget(self.server_switch)
        self._build_menus()
        self._connect()
        self._restore_state()
        self.refresh_models()
        self.chat.open_latest()
        if self.chat.recovered:
            self.statusBar().showMessage(
                f"Recovered {self.chat.recovered} answer(s) interrupted when the app last closed",
                8000,
            )
        if self.chat.store.set_aside is not None:
            self.statusBar().showMessage(
                f"The conversation history was damaged and is kept as {self.chat.store.set_aside}; "
                "starting with an empty history",
                30000,
            )
        if theme is not None:
            theme.changed.connect(self._on_theme)
            self._on_theme(theme.dark)
        if start:
            QTimer.singleShot(0, self.start)

    def start(self) -> None:
        self.session.start()
        self.library.refresh(check=True)
        self.library.load_verdicts()

    # -- layout ------------------------------------------------------------------------------
    def _build_top(self) -> None:
        self.model_combo = QComboBox()
        self.model_combo.setAccessibleName("Model")
        self.model_combo.setMinimumWidth(260)
        self.model_combo.activated.connect(self._on_model_chosen)
        label = QLabel("&Model:")
        label.setBuddy(self.model_combo)
        self.engine_label = QLabel("")
        self.engine_label.setObjectName("muted")
        # a long message must not widen the window past the screen
        self.engine_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.top = QHBoxLayout()
        self.top.addWidget(label)
        self.top.addWidget(self.model_combo)
        self.top.addWidget(self.engine_label, 1)

    def _build_banner(self) -> None:
        self.banner = QFrame()
        self.banner.setObjectName("banner")
        bl = QHBoxLayout(self.banner)
        self.banner_text = QLabel("")
        self.banner_text.setObjectName("bannerText")
        self.banner_text.setWordWrap(True)
        self.restart_btn = QPushButton("Restart engine")
        self.restart_btn.clicked.connect(self.restart_engine)
        self.fallback_btn = QPushButton("Load the built-in model")
        self.fallback_btn.clicked.connect(lambda: self.load_model(DEFAULT_MODEL_REF))
        self.local_btn = QPushButton("Continue on this Mac")
        self.local_btn.setToolTip("Load the model on this machine alone (paged if it must be)")
        self.local_btn.clicked.connect(self.run_locally)
        bl.addWidget(self.banner_text, 1)
        bl.addWidget(self.local_btn)
        bl.addWidget(self.fallback_btn)
        bl.addWidget(self.restart_btn)
        self.banner.hide()

    def _build_menus(self) -> None:
        mb = self.menuBar()
        file = mb.addMenu("&File")
        self._action(file, "&New chat", "Ctrl+N", self._new_chat)
        self._action(
            file,
            "&Open model folder…",
            "Ctrl+O",
            lambda: (self.show_tab(1), self.library_view.open_folder()),
        )
        file.addSeparator()
        self._action(file, "&Settings…", QKeySequence.StandardKey.Preferences, self.show_settings)
        file.addSeparator()
        self._action(file, "&Quit", QKeySequence.StandardKey.Quit, self.close)
        view = mb.addMenu("&View")
        for i, name in enumerate(self.TABS):
            self._action(view, f"&{name}", f"Ctrl+{i + 1}", lambda _c=False, i=i: self.show_tab(i))
        self._action(view, "Focus the &message box", "Ctrl+L", self._focus_input)
        view.addSeparator()
        self.memory_action = self._action(view, "Live &memory panel", "Ctrl+M", self._toggle_memory)
        self.memory_action.setCheckable(True)
        self.memory_action.setChecked(True)
        theme = view.addMenu("&Theme")
        self.theme_group = QActionGroup(self)
        for mode in MODES:
            a = QAction(mode.capitalize(), self, checkable=True)
            a.setData(mode)
            a.triggered.connect(lambda _c=False, m=mode: self.set_theme(m))
            self.theme_group.addAction(a)
            theme.addAction(a)
        engine = mb.addMenu("&Engine")
        self._action(engine, "&Stop generating", None, self.chat.stop)
        self._action(
            engine, "&Reload the model", None, lambda: self.load_model(self.session.model_ref)
        )
        self._action(engine, "Res&tart the engine", "Ctrl+Shift+R", self.restart_engine)
        engine.addSeparator()
        self._action(engine, "&Machines…", None, self.show_machines)
        helpm = mb.addMenu("&Help")
        self._action(
            helpm, "&Keyboard shortcuts", QKeySequence.StandardKey.HelpContents, self.show_shortcuts
        )

    def _action(self, menu, text, shortcut, slot) -> QAction:
        a = QAction(text, self)
        if shortcut is not None:
            a.setShortcut(QKeySequence(shortcut))
        a.triggered.connect(slot)
        menu.addAction(a)
        return a

    def _connect(self) -> None:
        s = self.session
        s.state_changed.connect(self._on_state)
        s.model_loaded.connect(self._on_loaded)
        s.stats.connect(self.memory.add_stats)
        self.bridge.prompt.connect(self._on_prompt)
        self.bridge.token.connect(self._on_token_count)
        self.chat.stream_started.connect(self._on_stream_started)
        self.chat_view.status.connect(lambda m: self.statusBar().showMessage(m, 5000))
        self.library_view.status.connect(lambda m: self.statusBar().showMessage(m, 5000))
        self.server_switch.status.connect(lambda m: self.statusBar().showMessage(m, 5000))
        self.library_view.load_requested.connect(self._load_from_library)
        self.library_view.plan_requested.connect(self._plan_from_library)
        self.library.entries_changed.connect(self.refresh_models)
        self.planner.plan_ready.connect(self._on_plan)
        self.plan_view.apply_requested.connect(self.apply_plan)
        self.machines_view.start_requested.connect(self.start_on_machines)
        self.machines_view.local_requested.connect(self.run_locally)

    def settings_dialog(self):
        from .settings_dialog import SettingsDialog

        return SettingsDialog(self)

    def show_settings(self) -> None:
        self.settings_dialog().exec()

    def show_shortcuts(self) -> None:
        rows = "".join(
            f"<tr><td><b>{k}</b>&nbsp;&nbsp;</td><td>{what}</td></tr>" for k, what in SHORTCUTS
        )
        QMessageBox.information(self, "Keyboard shortcuts", f"<table>{rows}</table>")

    # -- engine ------------------------------------------------------------------------------
    def load_model(self, ref: str, options: dict | None = None) -> None:
        self.applied = None
        self.session.load(ref, options)
        self._select_model(ref)

    def show_machines(self) -> None:
        self.machines.set_target(self.session.model_ref, self.model_combo.currentText())
        if self.machines.hosts_path and self.machines.last is None:
            self.machines.compute()
        self.machines_dialog.show()
        self.machines_dialog.raise_()

    def start_on_machines(self, options: dict) -> None:
        """Load the current model split over the machines of options["hosts"] (the worker
        starts the ranks); the conversation stays as it is."""
        if self.session.generating:
            self.statusBar().showMessage("Stop the answer (Esc) before changing machines", 5000)
            return
        self.settings.setValue("machines/hosts", options["hosts"])
        self.load_model(self.session.model_ref, options)
        self.statusBar().showMessage(
            f"Starting the model over the machines of {options['hosts']}…", 8000
        )

    def run_locally(self) -> None:
        """The current model on this machine alone, planned for it (after a host dropped out)."""
        if self.session.generating:
            self.statusBar().showMessage("Stop the answer (Esc) first", 5000)
            return
        self.load_model(self.session.model_ref, {"plan": True})

    def restart_engine(self) -> None:
        self.banner.hide()
        self.session.restart()

    def _on_state(self, state: str, message: str) -> None:
        # the crash's sentence is in the banner; the top line only says the engine stopped
        self.engine_label.setText("" if state == "crashed" else message)
        self.engine_label.setToolTip(message)
        self.status_label.setText(
            {
                "ready": "●  engine ready",
                "loading": "◌  loading",
                "starting": "◌  starting",
                "crashed": "✕  engine stopped",
                "idle": "●  no model",
            }.get(state, state)
        )
        if state == "crashed":
            self.memory.engine_stopped()
            self.banner_text.setText(message)
            self.restart_btn.show()
            self.fallback_btn.hide()
            self.local_btn.hide()
            self.banner.show()
        elif state == "idle":
            self.banner_text.setText(message)
            self.restart_btn.hide()
            lost = bool(self.session.lost)  # a host of the split model dropped out
            self.local_btn.setVisible(lost)
            self.fallback_btn.setVisible(not lost and self.session.model_ref != DEFAULT_MODEL_REF)
            self.banner.show()
            if lost:
                self.machines_view.set_running(None)
        else:
            self.banner.hide()
        self.model_combo.setEnabled(state in ("ready", "idle"))

    def _on_loaded(self, info: dict) -> None:
        self.settings.setValue("last_model", self.session.model_ref)
        a = self.applied if self.applied and self.applied.target == self.session.model_ref else None
        if a is not None and a.plan.kv_mode in info.get("kv_modes", ["fp16"]):
            self.chat.set_settings({"kv_mode": a.plan.kv_mode})
        self.chat_view.set_kv_modes(
            list(info.get("kv_modes", ["fp16"])), self.plan_view.unavailable
        )
        if a is None:
            self.planner.set_target(self.session.model_ref, info["name"])
        else:  # the plan view keeps the applied plan and its overrides
            self._show_expected(a)
        self.memory.set_note(
            f"{info['name']}: {info['num_layers']} layers, {info['architecture']}, on {info['backend']}."
        )
        self.machines.set_target(self.session.model_ref, info["name"])
        hosts = (info.get("extra") or {}).get("hosts") if self.session.split else None
        self.machines_view.set_running(hosts)

    def _on_prompt(self, msg) -> None:
        self.memory.history.context_tokens = msg.prompt_tokens

    def _on_token_count(self, _msg) -> None:
        self.memory.history.context_tokens += 1

    def _on_stream_started(self, _rid: int) -> None:
        self.memory.history.kv_mode = self.chat.settings().get("kv_mode", "fp16")

    def _on_plan(self, r: PlanResult) -> None:
        if r.target != self.session.model_ref:
            return
        if self.applied is None:  # once a plan is applied, the panel shows that one
            self._show_expected(r)
        if self.session.info:
            self.chat_view.set_kv_modes(
                list(self.session.info.get("kv_modes", ["fp16"])), r.unavailable
            )

    def _show_expected(self, r: PlanResult) -> None:
        self.memory.set_expected_peak(r.plan.process_peak)
        sizes = r.plan.sizes
        if sizes is not None:
            self.memory.history.kv_fp16 = lambda tokens: sizes.kv_bytes(tokens, "fp16")

    def apply_plan(self, r: PlanResult) -> None:
        """Run the planned model as planned: a fresh engine (the memory of the model it
        replaces goes back to the system) loads it with the plan's expert budget, KV mode and
        context, and the chat uses the plan's KV mode."""
        plan = r.plan
        if not _ref_exists(r.target):
            entry = next((e for e in self.library.catalog if e.config == r.target), None)
            if entry is not None:
                self.library.download(entry.repo, widths=plan.widths.to_dict())
                self.show_tab(1)
            return
        if self.session.generating:
            self.statusBar().showMessage("Stop the answer (Esc) before applying a plan", 5000)
            return
        options = {"kv_mode": plan.kv_mode, "context": plan.context_limit}
        if plan.paging:
            options["expert_budget"] = plan.expert_budget
        self.applied = r
        self.chat.set_settings({"kv_mode": plan.kv_mode})
        self._select_model(r.target)
        self._show_expected(r)
        self.session.restart(r.target, options)
        self.statusBar().showMessage(
            f"Restarting the engine with the plan for {r.label}: KV {plan.kv_mode}, "
            f"context {plan.context_limit}",
            5000,
        )

    # -- models ------------------------------------------------------------------------------
    def refresh_models(self) -> None:
        cur = self.session.model_ref
        self.model_combo.blockSignals(True)
        self.model_combo.clear()
        b = embedded_row()
        self.model_combo.addItem(b.name, b.ref)
        for e in self.library.entries:
            if e.state == "ready" and e.folder:
                self.model_combo.addItem(e.name, e.folder)
        if self.model_combo.findData(cur) < 0 and cur != DEFAULT_MODEL_REF:
            self.model_combo.addItem(Path(cur).name, cur)
        self._select_model(cur)
        self.model_combo.blockSignals(False)

    def _select_model(self, ref: str) -> None:
        i = self.model_combo.findData(ref)
        if i >= 0:
            self.model_combo.setCurrentIndex(i)

    def _on_model_chosen(self, i: int) -> None:
        ref = self.model_combo.itemData(i)
        if ref and ref != self.session.model_ref:
            self.load_model(ref)

    def _load_from_library(self, ref: str) -> None:
        self.load_model(ref)
        self.show_tab(0)

    def _plan_from_library(self, target: str, label: str) -> None:
        self.planner.set_target(target, label)
        self.show_tab(2)

    # -- view --------------------------------------------------------------------------------
    def show_tab(self, i: int) -> None:
        self.tabs.setCurrentIndex(i)
        if i == 0:
            self._focus_input()

    def _focus_input(self) -> None:
        self.tabs.setCurrentIndex(0)
        self.chat_view.input.setFocus()

    def _new_chat(self) -> None:
        self.show_tab(0)
        self.chat_view.new_chat()

    def _toggle_memory(self, on: bool) -> None:
        self.memory.setVisible(on)

    def set_theme(self, mode: str) -> None:
        if self.theme is not None:
            self.theme.set_mode(mode)
        self.settings.setValue("theme", mode)

    def _on_theme(self, dark: bool) -> None:
        self.memory.apply_theme(dark)
        self.chat_view.render_all()
        if self.planner.last is not None:
            self.plan_view.show_plan(self.planner.last)
        for a in self.theme_group.actions():
            a.setChecked(a.data() == self.theme.mode)

    # -- persistence -------------------------------------------------------------------------
    def _splitters(self) -> dict[str, QSplitter]:
        return {
            "main": self.main_splitter,
            "chat": self.chat_view.splitter,
            "chat_left": self.chat_view.left,
            "library": self.library_view.splitter,
            "plan": self.plan_view.splitter,
        }

    def save_state(self) -> None:
        s = self.settings
        s.setValue("version", SETTINGS_VERSION)
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState())
        s.setValue("window/tab", self.tabs.currentIndex())
        s.setValue("window/memory_visible", self.memory_action.isChecked())
        for name, sp in self._splitters().items():
            s.setValue(f"splitters/{name}", sp.saveState())
        import json

        s.setValue("chat/defaults", json.dumps(self.chat.default_settings))
        s.setValue("chat/system_prompt", self.chat.default_system_prompt)
        s.sync()

    def _restore_state(self) -> None:
        s = self.settings
        self.chat_view.set_enter_sends(str(s.value("chat/enter_sends", "false")).lower() == "true")
        if int(s.value("version", 0) or 0) != SETTINGS_VERSION:
            return
        geo = s.value("window/geometry")
        if geo is not None:
            self.restoreGeometry(geo)
        st = s.value("window/state")
        if st is not None:
            self.restoreState(st)
        for name, sp in self._splitters().items():
            v = s.value(f"splitters/{name}")
            if v is not None:
                sp.restoreState(v)
        self.tabs.setCurrentIndex(int(s.value("window/tab", 0) or 0))
        visible = str(s.value("window/memory_visible", "true")).lower() != "false"
        self.memory_action.setChecked(visible)
        self.memory.setVisible(visible)

    def _restore_chat_defaults(self) -> None:
        import json

        raw = self.settings.value("chat/defaults")
        if raw:
            try:
                d = json.loads(raw)
                self.chat.default_settings.update(
                    {k: v for k, v in d.items() if k in self.chat.default_settings}
                )
            except (ValueError, TypeError, AttributeError):
                pass  # unreadable defaults: the built-in ones
        self.chat.default_system_prompt = str(self.settings.value("chat/system_prompt", "") or "")

    def closeEvent(self, event) -> None:
        self.save_state()
        self.chat._persist_partial()
        self.session.shutdown()
        self.library.shutdown()
        super().closeEvent(event)


def app_icon() -> QIcon:
    for name in ("icon.png", "icon.svg"):
        p = RESOURCES / name
        if p.exists():
            return QIcon(str(p))
    return QIcon()


def main(argv: list[str] | None = None) -> int:
    multiprocessing.freeze_support()
    argv = list(sys.argv if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app = QApplication.instance() or QApplication(argv)
    app.setApplicationName("RotaryQuant")
    app.setWindowIcon(app_icon())
    settings = app_settings()
    theme = Theme(app, str(settings.value("theme", "system") or "system"))
    model = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else None
    win = MainWindow(model, settings=settings, theme=theme)
    win.show()
    try:
        return app.exec()
    except Exception as e:  # last resort: never lose the user's session silently
        QMessageBox.critical(None, "RotaryQuant", str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
