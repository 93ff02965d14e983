"""The desktop window: a chat pane streaming tokens from the worker, and a status line."""

from __future__ import annotations

import html
import multiprocessing
import os
import sys

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from ..engine import messages as M
from ..engine.generate import DEFAULT_MODEL_REF
from .bridge import WorkerBridge


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class ChatWindow(QMainWindow):
    def __init__(self, model: str = DEFAULT_MODEL_REF, bridge: WorkerBridge | None = None):
        super().__init__()
        self.setWindowTitle("RotaryQuant")
        self.resize(900, 640)
        self.model_ref = model
        self.messages: list[dict] = []
        self.partial = ""
        self.model_name = ""

        self.transcript = QTextBrowser()
        self.transcript.setOpenExternalLinks(False)
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message (Ctrl+Enter to send, Esc to stop)")
        self.input.setFixedHeight(90)
        self.send_btn = QPushButton("Send")
        self.stop_btn = QPushButton("Stop")
        self.restart_btn = QPushButton("Restart engine")
        self.stop_btn.setEnabled(False)
        self.send_btn.setEnabled(False)
        self.restart_btn.hide()
        self.status = QLabel("Starting the engine…")

        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.restart_btn)
        buttons.addWidget(self.stop_btn)
        buttons.addWidget(self.send_btn)
        layout = QVBoxLayout()
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.input)
        layout.addLayout(buttons)
        central = QWidget()
        central.setLayout(layout)
        self.setCentralWidget(central)
        self.statusBar().addWidget(self.status, 1)

        send = QAction("Send", self, shortcut=QKeySequence("Ctrl+Return"), triggered=self.send)
        stop = QAction("Stop", self, shortcut=QKeySequence(Qt.Key.Key_Escape), triggered=self.stop)
        self.addAction(send)
        self.addAction(stop)
        self.send_btn.clicked.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.restart_btn.clicked.connect(self.restart)

        self.bridge = bridge or WorkerBridge(self)
        b = self.bridge
        b.ready.connect(self.on_ready)
        b.loaded.connect(self.on_loaded)
        b.token.connect(self.on_token)
        b.done.connect(self.on_done)
        b.error.connect(self.on_error)
        b.stats.connect(self.on_stats)
        b.died.connect(self.on_died)
        QTimer.singleShot(0, b.start)

    # -- worker events -----------------------------------------------------------------------
    def on_ready(self, msg: M.Ready) -> None:
        self.status.setText(f"Engine ready on {msg.device}. Loading model…")
        self.bridge.load(self.model_ref)

    def on_loaded(self, msg: M.Loaded) -> None:
        info = msg.info
        self.model_name = info["name"]
        self.status.setText(f"{info['name']} · {info['architecture']} · {_mib(info['weight_bytes'])} weights · {info['backend']}")
        self.send_btn.setEnabled(True)
        self.restart_btn.hide()
        self.render()

    def on_token(self, msg: M.Token) -> None:
        self.partial += msg.text
        self.render()

    def on_done(self, msg: M.Done) -> None:
        self.messages.append({"role": "assistant", "content": self.partial})
        self.partial = ""
        self.set_generating(False)
        self.render()
        self.status.setText(
            f"{self.model_name} · {msg.generated_tokens} tokens · {msg.decode_tps:.1f} tok/s · "
            f"prompt {msg.prompt_tps:.0f} tok/s · peak {_mib(msg.peak_memory)} · KV {_mib(msg.kv_bytes)}"
        )

    def on_error(self, msg: M.Error) -> None:
        if self.partial:
            self.messages.append({"role": "assistant", "content": self.partial})
            self.partial = ""
        self.set_generating(False)
        self.status.setText(f"Error: {msg.message}")
        self.render()

    def on_stats(self, msg: M.Stats) -> None:
        if msg.generating:
            self.status.setText(f"{self.model_name} · {msg.decode_tps:.1f} tok/s · memory {_mib(msg.rss)} · KV {_mib(msg.kv_bytes)}")

    def on_died(self, msg: M.WorkerDied) -> None:
        if self.partial:  # keep what was streamed before the crash
            self.messages.append({"role": "assistant", "content": self.partial + " [interrupted]"})
            self.partial = ""
        self.set_generating(False)
        self.send_btn.setEnabled(False)
        self.restart_btn.show()
        self.status.setText(f"The engine stopped: {msg.message}. Your conversation is kept.")
        self.render()

    # -- actions -------------------------------------------------------------------------------
    def set_generating(self, on: bool) -> None:
        self.stop_btn.setEnabled(on)
        self.send_btn.setEnabled(not on and self.bridge.is_alive())

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or not self.send_btn.isEnabled():
            return
        self.input.clear()
        self.messages.append({"role": "user", "content": text})
        self.partial = ""
        self.set_generating(True)
        self.render()
        self.bridge.generate(list(self.messages), {"max_tokens": 512})

    def stop(self) -> None:
        self.bridge.cancel()

    def restart(self) -> None:
        self.restart_btn.hide()
        self.status.setText("Restarting the engine…")
        self.bridge.restart()

    def render(self) -> None:
        parts = []
        for m in self.messages + ([{"role": "assistant", "content": self.partial + " ▍"}] if self.stop_btn.isEnabled() else []):
            who = {"user": "You", "assistant": self.model_name or "Assistant"}.get(m["role"], m["role"])
            body = html.escape(m["content"]).replace("\n", "<br>")
            parts.append(f"<p><b>{html.escape(who)}</b><br>{body}</p>")
        self.transcript.setHtml("".join(parts))
        sb = self.transcript.verticalScrollBar()
        sb.setValue(sb.maximum())

    def closeEvent(self, event) -> None:
        self.bridge.shutdown()
        super().closeEvent(event)


def main(argv: list[str] | None = None) -> int:
    multiprocessing.freeze_support()
    argv = list(sys.argv if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app = QApplication.instance() or QApplication(argv)
    app.setApplicationName("RotaryQuant")
    model = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else DEFAULT_MODEL_REF
    win = ChatWindow(model)
    win.show()
    try:
        return app.exec()
    except Exception as e:  # last resort: never lose the user's session silently
        QMessageBox.critical(None, "RotaryQuant", str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
