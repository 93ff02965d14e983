"""The library view against the local hub (tests/hubserver.py): a download's progress to
ready (through the real converter), pause and resume from the buttons, errors shown in place,
remove. No network."""

from __future__ import annotations

import os
from pathlib import Path

import hubserver
import pytest
from PySide6.QtCore import Qt

from app.downloads.library import Library
from app.ui.library_model import LibraryController, ProgressRole
from app.ui.library_view import LibraryView

pytestmark = pytest.mark.slow
hub_env = hubserver.hub_env
REPO = "org/tiny-moe"
FAST = {"backoff": 0.001, "max_backoff": 0.01, "progress_interval": 0.0, "reserve": 0}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny qwen3_moe as the hub has it (Hugging Face names), so the library converts it."""
    from app.engine.quant.hf_layout import to_hf_layout
    from app.engine.testing.random_models import make_random_model

    tmp = tmp_path_factory.mktemp("ui-lib")
    return to_hf_layout(make_random_model("qwen3_moe", tmp / "mlx", seed=3), tmp / "hf")


@pytest.fixture
def view(qtbot, hub_env):
    ctl = LibraryController(Library(), transfer_options=FAST)
    v = LibraryView(ctl)
    qtbot.addWidget(v)
    v.show()
    yield v
    ctl.shutdown()


def row_of(view, name):
    i = view.local.row_of(name)
    return None if i < 0 else view.local.rows[i]


def test_download_progress_then_ready(qtbot, view, hub_env, tiny_hf):
    hub_env.add_folder(REPO, tiny_hf)
    hub_env.delay = 0.002  # a few ms per 64 KiB chunk: enough progress events to watch
    ctl = view.ctl
    states, progress, cells = [], [], []
    ctl.state_changed.connect(lambda e: states.append(e.state))

    def on_progress(key):
        progress.append(dict(ctl.progress[key]))
        i = next(
            (k for k, r in enumerate(view.local.rows) if r.repo.lower() == key or r.name == key), -1
        )
        if i >= 0:
            ix = view.local.index(i, 4)
            cells.append((ix.data(), ix.data(ProgressRole)))

    ctl.progress_changed.connect(on_progress)
    view.repo_edit.setText(REPO)
    with qtbot.waitSignal(
        ctl.state_changed, timeout=120_000, check_params_cb=lambda e: e.state == "ready"
    ):
        qtbot.mouseClick(view.repo_btn, Qt.MouseButton.LeftButton)
    assert states == ["downloading", "downloaded", "converting", "ready"]
    down = [p["fraction"] for p in progress if p["text"].startswith("Downloading")]
    conv = [p["fraction"] for p in progress if p["text"].startswith("Converting")]
    assert len(down) > 3 and down == sorted(down) and down[-1] == 1.0
    assert conv and conv == sorted(conv) and conv[-1] == 1.0
    assert any("/s" in p["text"] and "left" in p["text"] for p in progress)  # rate and ETA
    assert any(t.startswith("Downloading") and 0 <= f < 1 for t, f in cells)  # the row's bar
    qtbot.waitUntil(
        lambda: row_of(view, "tiny-moe") is not None and row_of(view, "tiny-moe").state == "ready"
    )
    r = row_of(view, "tiny-moe")
    ix = view.local.index(view.local.row_of("tiny-moe"), 4)
    assert ix.data() == "Ready" and ix.data(ProgressRole) is None
    assert r.architecture == "qwen3_moe" and r.plan.startswith("peak ")
    view.select("tiny-moe")
    assert (
        view.load_btn.isEnabled() and view.remove_btn.isEnabled() and not view.pause_btn.isEnabled()
    )
    with qtbot.waitSignal(view.load_requested) as blocker:
        qtbot.mouseClick(view.load_btn, Qt.MouseButton.LeftButton)
    assert blocker.args == [r.ref] and Path(r.ref).is_dir()
    # remove: the row and the folder go (wait for that, not for the next entries_changed: a
    # refresh started before the removal, e.g. by the conversion's end, may land first)
    qtbot.mouseClick(view.remove_btn, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: row_of(view, "tiny-moe") is None, timeout=30_000)
    assert not Path(r.ref).exists()


def test_pause_and_resume_from_the_buttons(qtbot, view, hub_env, tiny_hf):
    hub_env.add_folder(REPO, tiny_hf)
    hub_env.delay = 0.02
    ctl = view.ctl
    assert ctl.download(REPO)
    qtbot.waitUntil(
        lambda: (
            row_of(view, "tiny-moe") is not None
            and REPO in ctl.progress
            and ctl.progress[REPO]["fraction"] > 0
        ),
        timeout=30_000,
    )
    view.select("tiny-moe")
    qtbot.waitUntil(view.pause_btn.isEnabled, timeout=10_000)
    with qtbot.waitSignal(
        ctl.state_changed, timeout=30_000, check_params_cb=lambda e: e.state == "paused"
    ):
        qtbot.mouseClick(view.pause_btn, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(
        lambda: row_of(view, "tiny-moe").state == "paused" and view.resume_btn.isEnabled()
    )
    assert view.local.index(view.local.row_of("tiny-moe"), 4).data() == "Paused"
    assert "Resume" in view.detail.text()
    hub_env.delay = 0.0
    view.select("tiny-moe")
    with qtbot.waitSignal(
        ctl.state_changed, timeout=120_000, check_params_cb=lambda e: e.state == "ready"
    ):
        qtbot.mouseClick(view.resume_btn, Qt.MouseButton.LeftButton)


def test_errors_are_shown_where_the_user_acted(qtbot, view, hub_env, tiny_hf):
    ctl = view.ctl
    view.repo_edit.setText("org/missing")
    with qtbot.waitSignal(ctl.failed, timeout=30_000) as blocker:
        qtbot.mouseClick(view.repo_btn, Qt.MouseButton.LeftButton)
    assert blocker.args[0] == "org/missing"
    assert (
        "org/missing" in view.catalog_error.text()
        and "not found" in view.catalog_error.text().lower()
    )
    hub_env.add_folder("org/gated", tiny_hf, gated=True, tokens=("hf_ok",))
    with qtbot.waitSignal(ctl.failed, timeout=30_000):
        assert ctl.download("org/gated")
    assert "gated" in view.catalog_error.text() and "HF_TOKEN" in view.catalog_error.text()
    assert ctl.download("not a repo") is False
    assert "not a catalog model or a repo id" in view.catalog_error.text()


def test_catalog_has_a_download_button_per_model_and_a_verdict(qtbot, view):
    ctl = view.ctl
    assert len(view.buttons) == len(ctl.catalog) > 0
    assert all(b.isEnabled() and b.text() == "Download" for b in view.buttons.values())
    with qtbot.waitSignal(ctl.catalog_changed, timeout=60_000):
        ctl.load_verdicts()
    for i, e in enumerate(ctl.catalog):
        verdict = view.cat.index(i, 4).data()
        assert verdict.startswith("fits: peak") or verdict.startswith("too large"), (
            e.name,
            verdict,
        )


def test_sizes_agree_between_the_app_and_the_cli(qtbot, tmp_path, capsys):
    """One unit (GiB, labelled) in the catalog table and in `rotaryquant models --catalog`."""
    from app.cli import main
    from app.ui.library_model import CatalogModel

    ctl = LibraryController(Library(tmp_path / "m", tmp_path / "l.sqlite3"))
    model = CatalogModel(ctl)
    assert main(["models", "--catalog"]) == 0
    out = capsys.readouterr().out
    for row, e in enumerate(ctl.catalog):
        shown = model.index(row, 3).data()
        assert shown.endswith(" GiB"), shown
        line = next(x for x in out.splitlines() if x.startswith(e.name + " "))
        assert f"download ~{shown}" in line, (shown, line)


def test_offline_download_says_the_hub_cannot_be_reached_and_offers_retry(
    qtbot, view, hub_env, tiny_hf, monkeypatch
):
    """No connection can be made: the message says so and what to check, the typed repo id
    stays, Retry starts the download again (and works once the hub is back)."""
    hub_env.add_folder(REPO, tiny_hf)
    real = os.environ["HF_ENDPOINT"]
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    view.repo_edit.setText(REPO)
    with qtbot.waitSignal(view.ctl.failed, timeout=60_000) as b:
        qtbot.mouseClick(view.repo_btn, Qt.MouseButton.LeftButton)
    msg = b.args[1]
    assert "the hub cannot be reached" in msg and "lost the connection" not in msg
    assert "online" in msg and "HF_ENDPOINT" in msg
    assert view.repo_edit.text() == REPO
    assert view.retry_btn.isVisibleTo(view) and "cannot be reached" in view.catalog_error.text()
    monkeypatch.setenv("HF_ENDPOINT", real)
    with qtbot.waitSignal(
        view.ctl.state_changed, timeout=120_000, check_params_cb=lambda e: e.state == "ready"
    ):
        qtbot.mouseClick(view.retry_btn, Qt.MouseButton.LeftButton)
    assert not view.retry_btn.isVisibleTo(view)
    qtbot.waitUntil(lambda: view.repo_edit.text() == "")  # cleared once its download is done


def test_download_button_selects_its_own_catalog_row(qtbot, view, monkeypatch):
    started = []
    monkeypatch.setattr(view.ctl, "download", lambda repo, **kw: started.append(repo) or True)
    view.catalog.selectRow(0)
    last = len(view.ctl.catalog) - 1
    qtbot.mouseClick(view.buttons[view.ctl.catalog[last].repo.lower()], Qt.MouseButton.LeftButton)
    assert started == [view.ctl.catalog[last].repo]
    assert [ix.row() for ix in view.catalog.selectionModel().selectedRows()] == [last]


def test_open_folder_converts_a_moe_and_adds_it(qtbot, view, tiny_hf, tmp_path):
    """ "Open folder…": a Hugging Face MoE folder is checked and converted (in its own
    process) into the library, the user's folder untouched; a folder that is not a model is
    refused with the reason, and nothing is added."""
    import hashlib

    def digest(folder):
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
        }

    before = digest(tiny_hf)
    with qtbot.waitSignal(
        view.ctl.message, timeout=180_000, check_params_cb=lambda m: m.startswith("Added")
    ):
        view.open_folder(str(tiny_hf))
    qtbot.waitUntil(
        lambda: row_of(view, "hf") is not None and row_of(view, "hf").state == "ready",
        timeout=10_000,
    )
    r = row_of(view, "hf")
    assert r.architecture == "qwen3_moe" and Path(r.ref).parent == view.ctl.library.root
    assert (Path(r.ref) / "rotaryquant.json").exists() and digest(tiny_hf) == before
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with qtbot.waitSignal(view.ctl.failed, timeout=60_000) as b:
        view.open_folder(str(empty))
    assert "no config.json" in b.args[1] and "no config.json" in view.catalog_error.text()
    assert not view.retry_btn.isVisibleTo(view)
    assert [x.name for x in view.ctl.library.entries(check=False)] == ["hf"]


def test_plan_button_plans_a_selected_catalog_row(qtbot, view):
    assert not view.plan_btn.isEnabled()
    row = next(i for i, e in enumerate(view.ctl.catalog) if e.config)
    view.catalog.selectRow(row)
    assert view.plan_btn.isEnabled()
    with qtbot.waitSignal(view.plan_requested) as b:
        qtbot.mouseClick(view.plan_btn, Qt.MouseButton.LeftButton)
    e = view.ctl.catalog[row]
    assert b.args == [e.config, e.name]


def test_a_conversion_killed_like_by_the_oom_killer_leaves_the_window_working(
    qtbot, view, hub_env, tiny_hf
):
    """The conversion runs in a process of its own: killed mid-way (SIGKILL, as the OOM killer
    does), the window hears of it, the entry is back to "downloaded" with the reason, and
    converting again works."""
    import psutil

    hub_env.add_folder(REPO, tiny_hf)
    ctl = view.ctl
    ctl.library.download(REPO, transfer_options=FAST, finish=False)
    ctl.refresh()
    me = psutil.Process()
    before = {p.pid for p in me.children()}

    def conversion_child():
        for p in me.children():
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if p.pid not in before and "spawn_main" in cmd and "resource_tracker" not in cmd:
                return p
        return None

    with qtbot.waitSignal(ctl.failed, timeout=120_000) as b:
        ctl.convert("tiny-moe")
        qtbot.waitUntil(lambda: conversion_child() is not None, timeout=60_000)
        conversion_child().kill()
    assert b.args[0] == "tiny-moe" and "stopped unexpectedly (killed by signal 9)" in b.args[1]
    e = ctl.library.store.get("tiny-moe")
    assert e.state == "downloaded" and "conversion failed" in e.error and not e.busy
    with qtbot.waitSignal(
        ctl.state_changed, timeout=120_000, check_params_cb=lambda ev: ev.state == "ready"
    ):
        ctl.convert("tiny-moe")
