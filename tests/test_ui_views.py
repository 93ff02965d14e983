"""The window's views driven through their models against a scripted worker (FakeBridge):
thinking, incremental streaming, markdown, errors in place, a worker death mid-answer,
settings, regenerate/copy, keyboard, recovery after an app crash, window state and themes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings, Qt, QUrl
from PySide6.QtGui import QGuiApplication, QPalette, QTextCursor
from PySide6.QtWidgets import QLabel
from test_ui_fakes import FakeBridge

from app.downloads.library import Library
from app.engine import messages as M
from app.ui import render
from app.ui.history import ConversationStore
from app.ui.library_model import LibraryController
from app.ui.main import MainWindow

ROOT = Path(__file__).resolve().parents[1]


def make_window(qtbot, home: Path, model: str = "/fake/model") -> MainWindow:
    settings = QSettings(str(home / "settings.ini"), QSettings.Format.IniFormat)
    lib = LibraryController(Library(home / "models", home / "library.sqlite3"))
    win = MainWindow(model, bridge=FakeBridge(), settings=settings, library=lib, start=False)
    qtbot.addWidget(win)
    win.session.start()  # the fake answers Ready at once and Loaded on the next loop turn
    qtbot.waitUntil(lambda: win.session.state == "ready", timeout=5000)
    return win


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def win(qtbot, home):
    return make_window(qtbot, home)


def last_generate(win) -> M.Generate:
    return [m for m in win.bridge.sent if isinstance(m, M.Generate)][-1]


def test_thinking_streams_muted_then_collapses(qtbot, win):
    view, chat = win.chat_view, win.chat
    assert chat.send("What is 2+2?")
    win.bridge.play_tokens(["<thi", "nk>Let me ", "think.</th", "ink>The answer", " is 4."])
    view.flush_tokens()
    text = view.transcript.toPlainText()
    assert "Let me think." in text and "The answer is 4." in text and "think>" not in text
    with qtbot.waitSignal(chat.stream_finished, check_params_cb=lambda r: r == "stop"):
        win.bridge.play_done("<think>Let me think.</think>The answer is 4.", n=9)
    text = view.transcript.toPlainText()
    assert "Thought for 3 words" in text and "Let me think." not in text
    assert "The answer is 4." in text
    mid = chat.messages[-1].id
    view.transcript.anchorClicked.emit(QUrl(f"think:{mid}"))
    assert "Let me think." in view.transcript.toPlainText()
    view.transcript.anchorClicked.emit(QUrl(f"think:{mid}"))
    assert "Let me think." not in view.transcript.toPlainText()
    # the thinking stays out of the next prompt and out of the clipboard
    assert chat.copy_last() == "The answer is 4."
    assert QGuiApplication.clipboard().text() == "The answer is 4."
    assert chat.prompt()[-1] == {"role": "assistant", "content": "The answer is 4."}


def test_tokens_are_appended_without_rebuilding_the_transcript(qtbot, win, monkeypatch):
    view = win.chat_view
    calls = []
    original = view.transcript.setHtml
    monkeypatch.setattr(view.transcript, "setHtml", lambda html: (calls.append(1), original(html)))
    assert win.chat.send("Count")
    before = len(calls)
    for i in range(300):
        win.bridge.play_tokens([f" {i}"])
        if i % 10 == 0:
            view.flush_tokens()
    view.flush_tokens()
    assert len(calls) == before  # 300 tokens, no rebuild
    assert view.transcript.toPlainText().rstrip().endswith(" 298 299")
    win.bridge.play_done("".join(f" {i}" for i in range(300)), n=300)
    assert len(calls) == before + 1  # one rebuild when the answer is complete


def test_markdown_code_block_renders_as_code(qtbot, win):
    assert win.chat.send("Show code")
    win.bridge.play_done(
        "Here:\n\n```python\nprint('hi')  # <b>not bold</b>\n```\n\nUse `x` **now**."
    )
    doc_html = win.chat_view.transcript.toHtml()
    text = win.chat_view.transcript.toPlainText()
    assert "print('hi')  # <b>not bold</b>" in text  # escaped, shown verbatim
    assert "monospace" in doc_html and "python" in text
    assert "**" not in text and "now" in text


def test_engine_error_is_shown_in_place_and_chat_goes_on(qtbot, win):
    assert win.chat.send("Hi")
    win.bridge.play_tokens(["Hel"])
    with qtbot.waitSignal(win.chat.stream_failed):
        win.bridge.play_error("KV mode 'zipfusion' is not available on cpu")
    m = win.chat.messages[-1]
    assert m.state == "error" and m.content == "Hel"
    assert "zipfusion" in win.chat_view.transcript.toPlainText()
    assert win.chat_view.send_btn.isEnabled() and not win.chat_view.stop_btn.isEnabled()
    stored = ConversationStore().messages(win.chat.current.id)
    assert stored[-1].state == "error" and "zipfusion" in stored[-1].meta["error"]


def test_worker_death_mid_answer_keeps_it_and_offers_restart(qtbot, win):
    assert win.chat.send("Tell me about Paris")
    win.bridge.play_tokens(["Paris ", "is"])
    with qtbot.waitSignals([win.session.crashed, win.chat.stream_failed]):
        win.bridge.play_death()
    assert win.banner.isVisibleTo(win) and win.restart_btn.isVisibleTo(win)
    assert "conversation is kept" in win.banner_text.text()
    assert not win.chat_view.send_btn.isEnabled()
    kept = [(m.role, m.content, m.state) for m in win.chat.messages]
    assert kept[-1] == ("assistant", "Paris is", "interrupted")
    assert [
        (m.role, m.content, m.state) for m in ConversationStore().messages(win.chat.current.id)
    ] == kept
    with qtbot.waitSignal(win.session.model_loaded):
        qtbot.mouseClick(win.restart_btn, Qt.MouseButton.LeftButton)
    assert not win.banner.isVisibleTo(win) and win.chat_view.send_btn.isEnabled()
    assert [(m.role, m.content, m.state) for m in win.chat.messages] == kept
    assert "Paris is" in win.chat_view.transcript.toPlainText()


def test_settings_go_with_the_request_and_stay_with_the_conversation(qtbot, win):
    v = win.chat_view
    v.set_kv_modes(["fp16", "isoquant3"], {"zipfusion": "needs an NVIDIA GPU"})
    z = v.kv_combo.findData("zipfusion")
    assert z >= 0 and not v.kv_combo.model().item(z).isEnabled()
    assert v.kv_combo.itemData(z, Qt.ItemDataRole.ToolTipRole) == "needs an NVIDIA GPU"
    win.chat.new_conversation()
    first = win.chat.current.id
    v.temp_spin.setValue(0.7)
    v.seed_spin.setValue(42)
    v.max_spin.setValue(77)
    v.kv_combo.setCurrentIndex(v.kv_combo.findData("isoquant3"))
    v.system_edit.setPlainText("Answer in French.")
    v.save_settings()
    assert win.chat.send("Hello")
    g = last_generate(win)
    assert g.settings["temperature"] == pytest.approx(0.7) and g.settings["seed"] == 42
    assert g.settings["max_tokens"] == 77 and g.settings["kv_mode"] == "isoquant3"
    assert g.prompt[0] == {"role": "system", "content": "Answer in French."}
    win.bridge.play_done("Bonjour")
    # a new chat starts from the last settings; editing it leaves the first one alone
    win.chat.new_conversation()
    assert v.seed_spin.value() == 42
    v.seed_spin.setValue(-1)  # "random"
    assert win.chat.settings()["seed"] is None
    win.chat.open(first)
    assert v.seed_spin.value() == 42 and v.system_edit.toPlainText() == "Answer in French."


def test_regenerate_replaces_the_last_answer(qtbot, win):
    assert win.chat.send("Name a color")
    win.bridge.play_done("Blue")
    old = win.chat.messages[-1].id
    with qtbot.waitSignal(win.chat.stream_started):
        qtbot.mouseClick(win.chat_view.regen_btn, Qt.MouseButton.LeftButton)
    g = last_generate(win)
    assert g.prompt[-1] == {"role": "user", "content": "Name a color"}
    win.bridge.play_done("Red")
    msgs = ConversationStore().messages(win.chat.current.id)
    assert [m.content for m in msgs] == ["Name a color", "Red"] and msgs[-1].id != old


def test_keyboard_send_stop_and_tabs(qtbot, win):
    win.show()
    win.activateWindow()
    qtbot.waitUntil(lambda: QGuiApplication.focusWindow() is not None, timeout=5000)
    v = win.chat_view
    v.input.setFocus()
    qtbot.keyClicks(v.input, "Hi there")
    with qtbot.waitSignal(win.chat.stream_started):
        qtbot.keyClick(v.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert v.input.toPlainText() == ""
    qtbot.keyClick(v.input, Qt.Key.Key_Escape)
    assert isinstance(win.bridge.sent[-1], M.Cancel)
    win.bridge.play_done("Hi", reason="cancelled")
    assert win.chat.messages[-1].state == "stopped"
    qtbot.keyClick(v.input, Qt.Key.Key_2, Qt.KeyboardModifier.ControlModifier)
    assert win.tabs.currentIndex() == 1
    qtbot.keyClick(win.tabs.currentWidget(), Qt.Key.Key_3, Qt.KeyboardModifier.ControlModifier)
    assert win.tabs.currentIndex() == 2
    qtbot.keyClick(win.tabs.currentWidget(), Qt.Key.Key_L, Qt.KeyboardModifier.ControlModifier)
    assert win.tabs.currentIndex() == 0 and v.input.hasFocus()


def test_an_answer_cut_by_an_app_crash_is_recovered(qtbot, home):
    w1 = make_window(qtbot, home)
    assert w1.chat.send("Long story please")
    w1.bridge.play_tokens(["Once ", "upon"])
    w1.chat._persist_partial()  # what the 500 ms timer does while streaming
    cid = w1.chat.current.id
    # the app dies here: no Done, no close. A new app opens the same history.
    w2 = make_window(qtbot, home)
    assert w2.chat.recovered == 1
    assert w2.chat.current.id == cid
    assert [(m.content, m.state) for m in w2.chat.messages] == [
        ("Long story please", "complete"),
        ("Once upon", "interrupted"),
    ]
    assert "Once upon" in w2.chat_view.transcript.toPlainText()


def test_window_state_is_restored(qtbot, home):
    model_dir = home / "some-model"
    model_dir.mkdir()
    w1 = make_window(qtbot, home, str(model_dir))
    w1.resize(701, 555)  # inside the offscreen screen (800x600): restoreGeometry clamps
    w1.main_splitter.setSizes([400, 290])
    w1.chat_view.splitter.setSizes([300, 400])
    w1.tabs.setCurrentIndex(2)
    w1.memory_action.trigger()  # hide the memory panel
    sizes = w1.chat_view.splitter.sizes()
    w1.close()
    assert QSettings(str(home / "settings.ini"), QSettings.Format.IniFormat).value(
        "last_model"
    ) == str(model_dir)
    w2 = make_window(qtbot, home, model=None)  # no model given: the last one
    assert w2.session.model_ref == str(model_dir)
    assert (w2.width(), w2.height()) == (701, 555)
    assert w2.tabs.currentIndex() == 2 and not w2.memory_action.isChecked()
    assert w2.chat_view.splitter.sizes() == sizes


def test_themes_follow_the_system_or_the_choice(qtbot, qapp, monkeypatch):
    from app.ui.theme import Theme

    def lightness():
        return qapp.palette().color(QPalette.ColorRole.Window).lightness()

    seen = []
    theme = Theme(qapp, "dark")
    theme.changed.connect(seen.append)
    try:
        assert theme.dark and lightness() < 128 and theme.colors == render.DARK
        theme.set_mode("light")
        assert not theme.dark and lightness() > 128
        monkeypatch.setattr(Theme, "system_is_dark", lambda self: True)
        theme.set_mode("system")
        assert theme.dark and seen == [False, True]
        with pytest.raises(ValueError, match="theme must be one of"):
            theme.set_mode("purple")
    finally:
        monkeypatch.undo()
        theme.set_mode("light")
        qapp.setStyleSheet("")


def test_gui_start_does_not_import_the_engine():
    """The window process stays light: MLX and transformers load in the worker only."""
    code = (
        "import sys, app.ui.main\n"
        "bad = [m for m in ('mlx', 'mlx_lm', 'transformers') if m in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_default_model_reference_matches_the_engine():
    from app.engine.generate import DEFAULT_MODEL_REF
    from app.ui.session import DEFAULT_MODEL_REF as UI_REF

    assert UI_REF == DEFAULT_MODEL_REF


def test_after_a_crash_the_window_keeps_its_size_place_and_says_it_once(qtbot, win):
    """An engine killed mid-answer: the window keeps its width, the crash is said once (the
    banner), the transcript stays where the user was reading, the memory panel drops the dead
    engine's figures."""
    win.resize(1280, 800)
    win.show()
    qtbot.waitExposed(win)
    for i in range(12):
        assert win.chat.send(f"Question {i}")
        win.bridge.play_done("A long answer. " * 40, n=40)
    win.memory.add_stats(M.Stats(0, 0.0, 3 << 30, 0, 0, 0, 1 << 30, 0, 12.5, False))
    win.memory.redraw()
    assert win.memory.metrics["rss"].text() == "3.00 GiB"
    assert win.chat.send("One more")
    win.bridge.play_tokens(["Partial ", "answer"])
    win.chat_view.flush_tokens()
    sb = win.chat_view.transcript.verticalScrollBar()
    qtbot.waitUntil(lambda: sb.maximum() > 1000)
    sb.setValue(sb.maximum() // 2)
    mid = sb.value()
    statuses = []
    win.statusBar().messageChanged.connect(statuses.append)
    with qtbot.waitSignal(win.session.crashed):
        win.bridge.play_death()
    qtbot.wait(50)
    assert win.width() == 1280
    said = "stopped unexpectedly"
    places = [
        win.banner_text.text(),
        win.engine_label.text(),
        *statuses,
        win.chat_view.transcript.toPlainText(),
    ]
    assert sum(said in p for p in places) == 1, places
    assert win.banner.isVisibleTo(win) and said in win.banner_text.text()
    assert abs(sb.value() - mid) <= 2
    assert win.memory.metrics["rss"].text() == "—" and win.memory.metrics["tps"].text() == "—"


def test_rename_and_delete_conversations(qtbot, win):
    view, chat = win.chat_view, win.chat
    chat.new_conversation()
    assert chat.send("First question")
    win.bridge.play_done("ok", n=1)
    cid = chat.current.id
    item = view.conv_list.currentItem()
    item.setText("  Trip   to Paris ")  # what editing the item in place does
    assert chat.current.title == "Trip to Paris"
    assert ConversationStore().get(cid).title == "Trip to Paris"
    assert view.conv_list.currentItem().text() == "Trip to Paris"
    view.conv_list.currentItem().setText("   ")  # an empty name keeps the old one
    assert ConversationStore().get(cid).title == "Trip to Paris"
    assert view.conv_list.currentItem().text() == "Trip to Paris"
    assert [a.text() for a in view.conv_list.actions()] == ["Rename", "Delete"]
    n = len(chat.conversations())
    chat.delete_conversation(cid)
    assert len(chat.conversations()) == n - 1 and all(c.id != cid for c in chat.conversations())


def test_enter_sends_when_chosen_shift_enter_is_a_new_line(qtbot, win):
    view = win.chat_view
    view.input.setFocus()
    view.input.setPlainText("Hello")
    view.input.moveCursor(QTextCursor.MoveOperation.End)
    qtbot.keyClick(view.input, Qt.Key.Key_Return)  # the default: Enter is a new line
    assert view.input.toPlainText() == "Hello\n" and not win.chat.busy
    dlg = win.settings_dialog()
    dlg.enter_check.setChecked(True)
    dlg.accept()
    assert view.enter_sends and win.settings.value("chat/enter_sends") in (True, "true")
    view.input.setPlainText("Line one")
    view.input.moveCursor(QTextCursor.MoveOperation.End)
    qtbot.keyClick(view.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    assert view.input.toPlainText() == "Line one\n" and not win.chat.busy
    view.input.insertPlainText("line two")
    qtbot.keyClick(view.input, Qt.Key.Key_Return)
    assert win.chat.busy and last_generate(win).prompt[-1]["content"] == "Line one\nline two"
    assert view.input.toPlainText() == ""


def test_copy_button_on_code_blocks(qtbot, win):
    chat, view = win.chat, win.chat_view
    assert chat.send("Code please")
    answer = "<think>hmm</think>Two:\n```python\nprint(1)\n```\nand\n```\nls -l\n```\n"
    win.bridge.play_done(answer, n=9)
    mid = chat.messages[-1].id
    html = view.transcript.toHtml()
    assert f"copycode:{mid}:0" in html and f"copycode:{mid}:1" in html
    view.transcript.anchorClicked.emit(QUrl(f"copycode:{mid}:1"))
    assert QGuiApplication.clipboard().text() == "ls -l"
    view.transcript.anchorClicked.emit(QUrl(f"copycode:{mid}:0"))
    assert QGuiApplication.clipboard().text() == "print(1)"


def test_settings_dialog_data_folder_default_model_and_sampling(qtbot, win, home, tmp_path):
    from app import paths

    dlg = win.settings_dialog()
    assert dlg.data_edit.text() == str(paths.data_dir())
    dlg.model_combo.setCurrentIndex(dlg.model_combo.findData("embedded:default"))
    dlg.temp_spin.setValue(0.7)
    dlg.max_spin.setValue(333)
    new_home = tmp_path / "elsewhere"
    dlg.data_edit.setText(str(new_home))
    server = dlg.add_section("Local server", QLabel("the server's switch"))
    assert server.title() == "Local server"
    dlg.accept()
    assert win.settings.value("default_model") == "embedded:default"
    c = win.chat.new_conversation()
    assert c is not None and win.chat.settings()["temperature"] == 0.7
    assert win.chat.settings()["max_tokens"] == 333
    try:
        assert paths.data_dir() == new_home.resolve()  # from the next start
    finally:
        paths.set_data_dir(None)
    assert paths.data_dir() == paths.default_data_dir()
