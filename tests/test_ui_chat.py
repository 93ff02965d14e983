"""The window against the real worker process (a tiny random llama: ~400 tok/s here, so the
GUI sees tokens at full speed): send → tokens → finished, stop mid-stream, tokens painted in
batches while generating, and a killed worker → error → restart with the conversation kept."""

from __future__ import annotations

import time

import pytest
from PySide6.QtCore import QSettings, Qt

from app.downloads.library import Library
from app.ui.history import ConversationStore
from app.ui.library_model import LibraryController
from app.ui.main import MainWindow

pytestmark = pytest.mark.slow


class Recorder:
    """Names of the signals a model emitted, in order (runs of one name collapsed)."""

    def __init__(self, obj, names):
        self.seen: list[tuple[str, tuple]] = []
        for n in names:
            getattr(obj, n).connect(lambda *args, n=n: self.seen.append((n, args)))

    def collapsed(self) -> list[str]:
        out: list[str] = []
        for n, _ in self.seen:
            if not out or out[-1] != n:
                out.append(n)
        return out

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.seen if n == name)


@pytest.fixture(scope="module")
def window(qapp, tiny_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("ui-chat-home")
    settings = QSettings(str(home / "settings.ini"), QSettings.Format.IniFormat)
    lib = LibraryController(Library(home / "models", home / "library.sqlite3"))
    win = MainWindow(str(tiny_model_path("llama")), settings=settings, library=lib, start=False)
    win.show()
    win.session.start()
    deadline = time.monotonic() + 120
    while win.session.state != "ready":
        assert time.monotonic() < deadline and win.session.state != "crashed", win.session.message
        qapp.processEvents()
        time.sleep(0.005)
    yield win
    win.close()


def test_send_streams_tokens_then_finishes(qtbot, window):
    chat = window.chat
    chat.new_conversation()
    chat.set_settings({"max_tokens": 24})
    rec = Recorder(
        chat,
        [
            "message_added",
            "stream_started",
            "token_received",
            "message_changed",
            "stream_finished",
            "stream_failed",
        ],
    )
    window.chat_view.input.setPlainText("Hello, world!")
    with qtbot.waitSignal(
        chat.stream_finished, timeout=60_000, check_params_cb=lambda r: r == "length"
    ):
        qtbot.mouseClick(window.chat_view.send_btn, Qt.MouseButton.LeftButton)
    assert rec.collapsed() == [
        "message_added",
        "stream_started",
        "token_received",
        "message_changed",
        "stream_finished",
    ]
    assert rec.count("message_added") == 2 and rec.count("token_received") == 24
    streamed = "".join(args[0] for n, args in rec.seen if n == "token_received")
    m = chat.messages[-1]
    assert m.role == "assistant" and m.state == "complete" and m.content.startswith(streamed)
    assert m.meta["generated_tokens"] == 24 and m.meta["decode_tps"] > 0
    stored = ConversationStore().messages(chat.current.id)
    assert [(x.role, x.content, x.state) for x in stored] == [
        ("user", "Hello, world!", "complete"),
        ("assistant", m.content, "complete"),
    ]
    assert window.chat_view.send_btn.isEnabled() and not window.chat_view.stop_btn.isEnabled()
    assert chat.current.title == "Hello, world!"


def test_stop_mid_stream_keeps_the_partial_answer(qtbot, window):
    chat = window.chat
    chat.new_conversation()
    chat.set_settings({"max_tokens": 100_000})
    tokens = []
    chat.token_received.connect(tokens.append)
    try:
        with qtbot.waitSignal(chat.token_received, timeout=60_000):
            assert chat.send("Tell me a long story")
        assert window.chat_view.stop_btn.isEnabled()
        with qtbot.waitSignal(
            chat.stream_finished, timeout=30_000, check_params_cb=lambda r: r == "cancelled"
        ):
            qtbot.mouseClick(window.chat_view.stop_btn, Qt.MouseButton.LeftButton)
    finally:
        chat.token_received.disconnect(tokens.append)
    m = chat.messages[-1]
    assert m.state == "stopped" and 0 < m.meta["generated_tokens"] < 100_000
    assert ConversationStore().messages(chat.current.id)[-1].state == "stopped"
    assert not window.session.generating and window.chat_view.send_btn.isEnabled()


def test_tokens_are_painted_in_batches_while_generating(qtbot, window, monkeypatch):
    """The window's per-token work is constant: a token is queued, the transcript is never
    rebuilt per token, and painting happens on the flush timer. (How long the event loop waits
    while tokens stream is a timing, measured by benchmarks/ui_latency.py, not asserted here.)"""
    chat, view = window.chat, window.chat_view
    counts = {"render_all": 0, "flush": 0}
    real_render, real_flush = view.render_all, view.flush_tokens

    def render_all():
        counts["render_all"] += 1
        real_render()

    def flush():
        counts["flush"] += 1
        real_flush()

    monkeypatch.setattr(view, "render_all", render_all)
    view.flush_timer.timeout.disconnect()
    view.flush_timer.timeout.connect(flush)
    n = []
    chat.token_received.connect(n.append)
    try:
        chat.new_conversation()
        chat.set_settings({"max_tokens": 600})
        with qtbot.waitSignal(chat.stream_finished, timeout=120_000):
            assert chat.send("Go")
    finally:
        chat.token_received.disconnect(n.append)
        view.flush_timer.timeout.disconnect()
        view.flush_timer.timeout.connect(real_flush)
    assert len(n) > 300  # streamed pieces (the detokenizer may join tokens)
    # the user's message, the answer's start and its end: a handful of rebuilds, not one a token
    assert counts["render_all"] <= 6, counts
    assert 1 <= counts["flush"] <= len(n)
    answer = chat.messages[-1]
    assert answer.state == "complete" and answer.content
    tail = answer.content.strip()[-20:]
    assert tail and tail in view.transcript.toPlainText()  # the streamed text reached the view


def test_worker_killed_shows_error_and_restart_keeps_conversation(qtbot, window):
    chat = window.chat
    chat.new_conversation()
    chat.set_settings({"max_tokens": 100_000})
    with qtbot.waitSignal(chat.token_received, timeout=60_000):
        assert chat.send("Hi")
    qtbot.wait(600)  # let the partial answer reach the disk (every 500 ms)
    with qtbot.waitSignals([window.session.crashed, chat.stream_failed], timeout=30_000):
        window.bridge.crash()
    kept = [(m.role, m.content, m.state) for m in chat.messages]
    assert kept[-1][2] == "interrupted" and kept[-1][1]
    assert [
        (m.role, m.content, m.state) for m in ConversationStore().messages(chat.current.id)
    ] == kept
    assert window.banner.isVisible() and window.restart_btn.isVisible()
    assert "stopped" in window.banner_text.text() and not window.chat_view.send_btn.isEnabled()
    with qtbot.waitSignal(window.session.model_loaded, timeout=120_000):
        qtbot.mouseClick(window.restart_btn, Qt.MouseButton.LeftButton)
    assert not window.banner.isVisible() and window.chat_view.send_btn.isEnabled()
    assert [(m.role, m.content, m.state) for m in chat.messages] == kept
    chat.set_settings({"max_tokens": 4})
    with qtbot.waitSignal(chat.stream_finished, timeout=60_000):
        assert chat.send("Still there?")
    assert chat.messages[-1].state == "complete" and len(chat.messages) == 4
