"""The API switch: sends StartServing / StopServing, shows the address with Copy, and asks before
listening on a non-loopback address."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QMessageBox
from test_ui_fakes import FakeBridge

from app.engine import messages as M
from app.ui.server_view import ServerSwitch


class RecordingBridge(FakeBridge):
    def _send(self, msg) -> bool:
        self.sent.append(msg)
        return True


def _switch(qtbot):
    bridge = RecordingBridge()
    w = ServerSwitch(bridge)
    qtbot.addWidget(w)
    return bridge, w


def test_loopback_serves_and_shows_the_address(qtbot):
    bridge, w = _switch(qtbot)
    w.port.setValue(8123)
    w.toggle.setChecked(True)
    (msg,) = bridge.sent
    assert isinstance(msg, M.StartServing) and (msg.host, msg.port) == ("127.0.0.1", 8123)
    assert not w.copy_btn.isEnabled()
    bridge.serving.emit(M.Serving(msg.req_id, "http://127.0.0.1:8123/v1", "127.0.0.1", 8123))
    assert w.address.text() == "http://127.0.0.1:8123/v1" and w.copy_btn.isEnabled()
    assert not w.host.isEnabled() and not w.port.isEnabled()
    w.copy_btn.click()
    assert QGuiApplication.clipboard().text() == "http://127.0.0.1:8123/v1"
    w.toggle.setChecked(False)
    assert isinstance(bridge.sent[-1], M.StopServing)
    bridge.serving.emit(M.Serving(bridge.sent[-1].req_id, ""))
    assert w.address.text() == "" and not w.copy_btn.isEnabled() and w.host.isEnabled()


def test_non_loopback_asks_first(qtbot, monkeypatch):
    bridge, w = _switch(qtbot)
    asked = []

    def answer(choice):
        def warning(*args, **kwargs):
            asked.append(args[2])  # the text
            return choice

        return warning

    w.host.setText("0.0.0.0")
    monkeypatch.setattr(QMessageBox, "warning", answer(QMessageBox.StandardButton.No))
    w.toggle.setChecked(True)
    assert asked and "0.0.0.0" in asked[0] and bridge.sent == [] and not w.toggle.isChecked()
    monkeypatch.setattr(QMessageBox, "warning", answer(QMessageBox.StandardButton.Yes))
    w.toggle.setChecked(True)
    assert isinstance(bridge.sent[-1], M.StartServing) and bridge.sent[-1].host == "0.0.0.0"


def test_a_failed_start_or_a_dead_worker_turns_the_switch_off(qtbot):
    bridge, w = _switch(qtbot)
    w.toggle.setChecked(True)
    with qtbot.waitSignal(w.status) as sig:
        bridge.serving.emit(M.Serving(1, "", "127.0.0.1", 8080, error="address already in use"))
    assert "address already in use" in sig.args[0] and not w.toggle.isChecked()
    w.toggle.setChecked(True)
    bridge.serving.emit(M.Serving(2, "http://127.0.0.1:8080/v1", "127.0.0.1", 8080))
    bridge.play_death()
    assert not w.toggle.isChecked() and w.address.text() == ""
