"""The API switch: serve the loaded model over the OpenAI-compatible API from the engine
worker, with the address shown and a Copy button. Another address than loopback is an
explicit choice, confirmed after a warning."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QSpinBox,
    QWidget,
)

from ..server.address import DEFAULT_HOST, DEFAULT_PORT, is_loopback


class ServerSwitch(QWidget):
    status = Signal(str)  # one-line messages for the status bar

    def __init__(self, bridge, parent=None):
        super().__init__(parent)
        self.bridge = bridge
        self.url = ""
        self.toggle = QCheckBox("Serve API")
        self.toggle.setToolTip("Serve the loaded model over an OpenAI-compatible API "
                               "(/v1/chat/completions, /v1/completions, /v1/messages)")  # fmt: skip
        self.host = QLineEdit(DEFAULT_HOST)
        self.host.setToolTip("Address to listen on: 127.0.0.1 is this computer only")
        self.host.setMaximumWidth(120)
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setValue(DEFAULT_PORT)
        self.address = QLabel("")
        self.address.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.copy_btn = QPushButton("Copy")
        self.copy_btn.setToolTip("Copy the base URL for an OpenAI client")
        self.copy_btn.setEnabled(False)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        for w in (self.toggle, self.host, self.port, self.address, self.copy_btn):
            lay.addWidget(w)
        self.toggle.toggled.connect(self._on_toggled)
        self.copy_btn.clicked.connect(self.copy)
        bridge.serving.connect(self._on_serving)
        bridge.died.connect(lambda _msg: self._show("", ""))

    def _on_toggled(self, on: bool) -> None:
        if not on:
            self.bridge.stop_serving()
            return
        host = self.host.text().strip() or DEFAULT_HOST
        if not is_loopback(host) and not self.confirm_exposed(host):
            self._show("", "")
            return
        self.address.setText("starting…")
        self.host.setEnabled(False)
        self.port.setEnabled(False)
        self.bridge.serve(host, self.port.value())

    def confirm_exposed(self, host: str) -> bool:
        answer = QMessageBox.warning(
            self, "Serve on the network?",
            f"Listening on {host} lets other computers that can reach this one use the model, "
            "with no key asked. Serve on this address anyway?",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,
        )  # fmt: skip
        return answer == QMessageBox.StandardButton.Yes

    def _on_serving(self, msg) -> None:
        if msg.error:
            self.status.emit(f"API not started: {msg.error}")
        self._show(msg.url, msg.error)

    def _show(self, url: str, error: str) -> None:
        self.url = url
        self.address.setText(url or (f"error: {error}" if error else ""))
        self.copy_btn.setEnabled(bool(url))
        self.host.setEnabled(not url)
        self.port.setEnabled(not url)
        self.toggle.blockSignals(True)
        self.toggle.setChecked(bool(url))
        self.toggle.blockSignals(False)

    def copy(self) -> None:
        if self.url:
            QGuiApplication.clipboard().setText(self.url)
            self.status.emit(f"Copied {self.url}")
