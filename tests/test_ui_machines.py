"""The Machines section (a hosts.json, each host's memory and role from the plan, Start) and a
host that drops out: the conversation stays, the error names the host, the chat goes on on
this machine. The worker is the test's FakeBridge; the plan is the real planner's (helper
process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings, Qt
from test_ui_fakes import FakeBridge

from app.downloads.library import Library
from app.engine import messages as M
from app.ui.library_model import LibraryController
from app.ui.machines import MachinesController, MachinesView
from app.ui.main import MainWindow

SUPER = str(Path(__file__).parent / "data" / "configs" / "nemotron-3-super-120b-a12b.json")
LOST = "rank 0 (mac-0): lost rank 1 on host mac-1: [ring] connection to a peer was lost"


def _hosts(path: Path, rams: list[str | None]) -> str:
    hosts = []
    for i, ram in enumerate(rams):
        h = {"ssh": f"mac-{i}.local", "ips": [f"10.0.0.{i + 1}"], "name": f"mac-{i}"}
        if ram:
            h["ram"] = ram
        hosts.append(h)
    path.write_text(json.dumps({"backend": "ring", "link": "thunderbolt5", "hosts": hosts}))
    return str(path)


def _cells(view: MachinesView) -> list[list[str]]:
    t = view.table
    return [[t.item(r, c).text() for c in range(t.columnCount())] for r in range(t.rowCount())]


def test_section_shows_each_host_memory_and_role_then_starts(qtbot, tmp_path):
    ctl = MachinesController()
    view = MachinesView(ctl)
    qtbot.addWidget(view)
    ctl.set_target(SUPER, "Nemotron 3 Super")
    two = _hosts(tmp_path / "two.json", ["32GB", "32GB"])
    with qtbot.waitSignal(ctl.planned, timeout=120_000) as sig:
        view.path_edit.setText(two)
        view.path_edit.editingFinished.emit()
    r = sig.args[0]
    assert r.plan is not None and not r.error
    rows = _cells(view)
    assert [row[0] for row in rows] == ["mac-0 (rank 0)", "mac-1 (rank 1)"]
    assert all(row[1] == "32.0 GiB" for row in rows), rows
    # rank 0 runs the last layers, rank 1 the first (mlx-lm's convention)
    assert rows[0][2] == "layers 44–87" and rows[1][2] == "layers 0–43 (first)"
    assert all(row[3].startswith("resident") for row in rows), rows
    assert "Split 44 / 44" in view.summary.text() and "everything resident" in view.summary.text()
    assert view.start_btn.isEnabled()
    with qtbot.waitSignal(view.start_requested) as started:
        qtbot.mouseClick(view.start_btn, Qt.MouseButton.LeftButton)
    opts = started.args[0]
    assert opts["hosts"] == two and opts["split"] == [44, 44] and opts["expert_budget"] is None

    # one 32 GB machine: its experts page
    with qtbot.waitSignal(ctl.planned, timeout=120_000):
        ctl.set_hosts(_hosts(tmp_path / "one.json", ["32GB"]))
    (row,) = _cells(view)
    assert row[2] == "layers 0–87 (first)" and row[3].startswith("paged:"), row
    assert "some experts paged" in view.summary.text()
    assert ctl.last.start_options()["expert_budget"][0] > 0

    # a host without its memory: no plan, the reason names it, nothing to start
    with qtbot.waitSignal(ctl.planned, timeout=120_000):
        ctl.set_hosts(_hosts(tmp_path / "noram.json", ["32GB", None]))
    assert "mac-1" in view.error.text() and "ram" in view.error.text()
    assert not view.start_btn.isEnabled() and _cells(view)[1][1] == "unknown"


@pytest.fixture
def window(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    lib = LibraryController(Library(tmp_path / "models", tmp_path / "library.sqlite3"))
    bridge = FakeBridge()
    win = MainWindow("/fake/model", bridge=bridge, settings=settings, library=lib, start=False)
    qtbot.addWidget(win)
    win.show()
    win.session.start()
    qtbot.waitUntil(lambda: win.session.state == "ready")
    return win, bridge


def _loaded(qtbot, win, bridge, extra: dict | None = None) -> M.Load:
    load = bridge.sent[-1]
    assert isinstance(load, M.Load)
    qtbot.waitUntil(lambda: win.session.state == "ready")
    if extra is not None:  # what the worker says of a model split over machines
        win.session.info["extra"] = extra
        win.session.model_loaded.emit(win.session.info)
    return load


def test_a_lost_host_keeps_the_conversation_and_goes_on_on_this_mac(qtbot, window, tmp_path):
    win, bridge = window
    hosts = _hosts(tmp_path / "hosts.json", ["32GB", "32GB"])
    win.start_on_machines({"hosts": hosts, "split": [1, 1], "expert_budget": None})
    load = _loaded(qtbot, win, bridge, {"hosts": ["mac-0", "mac-1"]})
    assert load.path == "/fake/model" and load.options["hosts"] == hosts
    assert load.options["split"] == [1, 1] and win.session.split
    assert "mac-0, mac-1" in win.machines_view.status.text()
    assert win.settings.value("machines/hosts") == hosts  # the next start offers the same file

    chat = win.chat
    chat.new_conversation()  # the chat history is the test run's, shared with earlier tests
    assert chat.send("Tell me a story")
    bridge.play_tokens(["Once", " upon"])
    # the answer in flight fails with the server's report, then the ranks are gone
    bridge.play_error(LOST)
    bridge._dispatch(M.HostLost(LOST))
    assert [m.role for m in chat.messages] == ["user", "assistant"]
    answer = chat.messages[1]
    assert answer.content == "Once upon" and answer.state == "error"
    assert "mac-1" in answer.meta["error"]
    stored = chat.store.messages(chat.current.id)  # on disk too
    assert [m.content for m in stored] == ["Tell me a story", "Once upon"]
    assert win.session.state == "idle"
    assert win.banner.isVisible() and "mac-1" in win.banner_text.text()
    assert "conversation is kept" in win.banner_text.text()
    assert win.local_btn.isVisible() and not win.fallback_btn.isVisible()
    assert not chat.can_send()

    qtbot.mouseClick(win.local_btn, Qt.MouseButton.LeftButton)
    load = _loaded(qtbot, win, bridge)
    assert "hosts" not in load.options and load.options.get("plan") is True
    assert not win.session.split and not win.banner.isVisible()
    assert chat.send("Go on")
    gen = bridge.sent[-1]
    assert isinstance(gen, M.Generate)
    # the conversation so far goes to the model on this machine
    assert [m["content"] for m in gen.prompt] == ["Tell me a story", "Once upon", "Go on"]
    bridge.play_tokens([" a time"])
    bridge.play_done(" a time", n=3)
    assert [m.content for m in chat.messages] == [
        "Tell me a story",
        "Once upon",
        "Go on",
        " a time",
    ]
