"""The first desktop window, driven through its widgets and the worker's signals."""

import pytest
from PySide6.QtCore import Qt

from app.ui.main import ChatWindow


@pytest.fixture
def window(qtbot, tiny_model_path):
    win = ChatWindow(str(tiny_model_path("qwen3_moe")))
    qtbot.addWidget(win)
    with qtbot.waitSignal(win.bridge.loaded, timeout=120_000):
        win.show()
    yield win
    win.bridge.shutdown()


def test_send_streams_tokens_then_finishes(qtbot, window):
    window.input.setPlainText("Hello, world!")
    with qtbot.waitSignals([window.bridge.token, window.bridge.done], order="simple", timeout=60_000):
        qtbot.mouseClick(window.send_btn, Qt.MouseButton.LeftButton)
    assert window.messages[0] == {"role": "user", "content": "Hello, world!"}
    assert window.messages[-1]["role"] == "assistant"
    assert "tok/s" in window.status.text()
    assert window.send_btn.isEnabled() and not window.stop_btn.isEnabled()


def test_worker_crash_keeps_conversation_and_restarts(qtbot, window):
    from app.engine import messages as M

    window.input.setPlainText("Hi")
    with qtbot.waitSignal(window.bridge.done, timeout=60_000):
        window.send()
    kept = list(window.messages)
    with qtbot.waitSignal(window.bridge.died, timeout=30_000):
        window.bridge.client.send(M.Crash())
    assert window.messages == kept
    assert not window.send_btn.isEnabled() and not window.restart_btn.isHidden()
    assert "stopped" in window.status.text()
    with qtbot.waitSignal(window.bridge.loaded, timeout=120_000):
        qtbot.mouseClick(window.restart_btn, Qt.MouseButton.LeftButton)
    assert window.send_btn.isEnabled() and window.messages == kept
