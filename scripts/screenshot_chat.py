"""Drive the real chat window like a person (type, Ctrl+Enter, wait for the answer) and save a
screenshot. Run under Xvfb: `xvfb-run -a python scripts/screenshot_chat.py docs/chat.png`."""

import sys
import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

from app.ui.main import ChatWindow


def main(out: str, question: str = "What is the capital of France?") -> int:
    app = QApplication(sys.argv)
    win = ChatWindow()
    win.resize(900, 600)
    win.show()
    state = {"done": False}

    def on_loaded(_msg):
        win.activateWindow()
        QTest.keyClicks(win.input, question)
        QTest.keyClick(win.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
        if not win.stop_btn.isEnabled():  # no window manager under Xvfb: focus may be elsewhere
            QTest.mouseClick(win.send_btn, Qt.MouseButton.LeftButton)

    def on_done(msg):
        state["done"] = True
        state["text"] = msg.text
        QTimer.singleShot(300, lambda: (win.grab().save(out), app.quit()))

    win.bridge.loaded.connect(on_loaded)
    win.bridge.done.connect(on_done)
    QTimer.singleShot(300_000, app.quit)  # give up after 5 minutes
    t0 = time.time()
    app.exec()
    win.bridge.shutdown()
    print(f"answer: {state.get('text')!r} ({time.time() - t0:.1f} s) -> {out}")
    return 0 if state["done"] else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
