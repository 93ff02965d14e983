"""Drive the real window like a person (type, Ctrl+Enter, wait for the answer) and save a
screenshot. Run under Xvfb:

    xvfb-run -a -s "-screen 0 1280x800x24" .venv/bin/python scripts/screenshot_chat.py docs/chat.png

Uses the app's own data dir (ROTARYQUANT_HOME if set); scripts/screenshots.py takes every
view from a fresh one.
"""

import sys
import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

from app.ui.main import MainWindow, app_settings
from app.ui.theme import Theme


def main(out: str, question: str = "What is the capital of France?") -> int:
    app = QApplication(sys.argv)
    settings = app_settings()
    theme = Theme(app, str(settings.value("theme", "system") or "system"))
    win = MainWindow(settings=settings, theme=theme)
    win.resize(1280, 800)
    win.show()
    state = {"done": False, "text": None}

    def on_loaded(_info):
        win.show_tab(0)
        win.activateWindow()
        box = win.chat_view.input
        box.setFocus()
        QTest.keyClicks(box, question)
        QTest.keyClick(box, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
        if not win.chat.busy:  # no window manager under Xvfb: focus may be elsewhere
            QTest.mouseClick(win.chat_view.send_btn, Qt.MouseButton.LeftButton)

    def on_finished(_reason):
        state["done"] = True
        state["text"] = win.chat.messages[-1].content
        QTimer.singleShot(1500, lambda: (win.grab().save(out), win.close(), app.quit()))

    win.session.model_loaded.connect(on_loaded)
    win.chat.stream_finished.connect(on_finished)
    win.chat.stream_failed.connect(lambda why: (print("failed:", why), app.quit()))
    QTimer.singleShot(300_000, app.quit)  # give up after 5 minutes
    t0 = time.time()
    app.exec()
    print(f"answer: {state['text']!r} ({time.time() - t0:.1f} s) -> {out}")
    return 0 if state["done"] else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
