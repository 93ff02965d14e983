"""The plan view: the planner's choices and reasons for a model on this machine, overrides
refused with their reason in place (the last plan that fits stays), and applying a plan
reloads the model with its expert budget and KV mode."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings, Qt
from test_ui_fakes import FakeBridge

from app.downloads.library import Library
from app.engine import messages as M
from app.engine.backend import detect
from app.ui.library_model import LibraryController
from app.ui.main import MainWindow
from app.ui.plan_model import Overrides, PlanController, PlanResult, Refusal
from app.ui.plan_view import PlanView


@pytest.fixture
def plan_view(qtbot):
    ctl = PlanController()
    v = PlanView(ctl)
    qtbot.addWidget(v)
    return v


def plan_for(qtbot, view, target: str, label: str) -> PlanResult:
    with qtbot.waitSignal(view.ctl.plan_ready, timeout=60_000) as b:
        view.ctl.set_target(target, label)
    return b.args[0]


def test_plan_shows_choices_reasons_and_unavailable_modes(qtbot, plan_view, smollm2_path):
    r = plan_for(qtbot, plan_view, str(smollm2_path), "SmolLM2")
    plan = r.plan
    assert plan.reasons and plan.expert_bytes == 0 and plan.widths_fixed
    text = plan_view.result.toPlainText()
    assert "Expected peak" in text and "SmolLM2" in text
    assert all(reason in text for reason in plan.reasons)
    assert "none (dense model)" in text and "fixed by the conversion" in text
    assert plan_view.apply_btn.isEnabled() and not plan_view.refusal.isVisible()
    # KV modes this machine cannot run are disabled, with the backend's reason
    why = detect().unavailable_reason("zipfusion")
    i = plan_view.kv_combo.findData("zipfusion")
    assert plan_view.kv_combo.model().item(i).isEnabled() == (why is None)
    if why:
        assert plan_view.kv_combo.itemData(i, Qt.ItemDataRole.ToolTipRole) == why
        assert why in plan_view.kv_note.text()


def test_override_refused_in_place_keeps_the_last_plan(qtbot, plan_view, smollm2_path):
    first = plan_for(qtbot, plan_view, str(smollm2_path), "SmolLM2")
    plan_view.context_auto.setChecked(False)
    plan_view.context_spin.setValue(100_000)
    with qtbot.waitSignal(plan_view.ctl.refused, timeout=60_000) as b:
        qtbot.mouseClick(plan_view.replan_btn, Qt.MouseButton.LeftButton)
    ref: Refusal = b.args[0]
    assert ref.setting == "context" and "at most 8192 tokens" in ref.reason
    assert plan_view.refusal.isVisibleTo(plan_view)
    shown = plan_view.refusal_text.text()
    assert (
        "Refused: context" in shown
        and "at most 8192 tokens" in shown
        and "last one that fits" in shown
    )
    assert plan_view.ctl.last is first and plan_view.apply_btn.isEnabled()
    assert "Expected peak" in plan_view.result.toPlainText()
    # widths cannot change on a converted model: refused with the reason
    with qtbot.waitSignal(plan_view.ctl.refused, timeout=60_000) as b:
        plan_view.ctl.compute(Overrides(widths="routed=3"))
    assert b.args[0].setting == "widths" and "new conversion" in b.args[0].reason
    # a valid override is accepted and the refusal goes away
    plan_view.context_spin.setValue(4096)
    with qtbot.waitSignal(plan_view.ctl.plan_ready, timeout=60_000) as b:
        qtbot.mouseClick(plan_view.replan_btn, Qt.MouseButton.LeftButton)
    assert b.args[0].plan.context_limit == 4096 and not plan_view.refusal.isVisibleTo(plan_view)


def test_expert_budget_override_on_a_moe(qtbot, plan_view, tiny_model_path):
    folder = str(tiny_model_path("qwen3_moe"))
    base = plan_for(qtbot, plan_view, folder, "tiny").plan
    assert not base.paging and base.expert_bytes > 0
    with qtbot.waitSignal(plan_view.ctl.refused, timeout=60_000) as b:
        plan_view.ctl.compute(Overrides(expert_budget=base.min_expert_budget - 1))
    ref = b.args[0]
    assert ref.setting == "expert-budget" and "below the pager's minimum" in ref.reason
    assert ref.needed == base.min_expert_budget and "Needs" in plan_view.refusal_text.text()
    with qtbot.waitSignal(plan_view.ctl.plan_ready, timeout=60_000) as b:
        plan_view.ctl.compute(Overrides(expert_budget=base.min_expert_budget))
    p = b.args[0].plan
    assert p.paging and p.expert_budget == base.min_expert_budget
    assert "paged from SSD" in plan_view.result.toPlainText()


def test_use_this_plan_reloads_with_its_budget(qtbot, tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path))
    folder = str(tiny_model_path("qwen3_moe"))
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    win = MainWindow(
        folder,
        bridge=FakeBridge(),
        settings=settings,
        library=LibraryController(Library(tmp_path / "m", tmp_path / "l.sqlite3")),
        start=False,
    )
    qtbot.addWidget(win)
    with qtbot.waitSignal(win.planner.plan_ready, timeout=60_000) as b:
        win.session.start()
    base = b.args[0].plan
    assert win.memory.peak_line.isVisible()
    assert win.memory.peak_line.value() == pytest.approx(base.process_peak / 2**30)
    with qtbot.waitSignal(win.planner.plan_ready, timeout=60_000):
        win.planner.compute(Overrides(expert_budget=base.min_expert_budget))
    win.bridge.sent.clear()
    with qtbot.waitSignal(win.session.model_loaded, timeout=10_000):
        qtbot.mouseClick(win.plan_view.apply_btn, Qt.MouseButton.LeftButton)
    loads = [m for m in win.bridge.sent if isinstance(m, M.Load)]
    assert len(loads) == 1 and loads[0].path == folder
    assert loads[0].options["expert_budget"] == base.min_expert_budget
    assert win.chat.settings()["kv_mode"] == "fp16"


def test_use_this_plan_applies_kv_mode_and_context(qtbot, tmp_path, monkeypatch, tiny_model_path):
    """KV isoquant3 and context 4096 chosen, then "Use this plan": a fresh engine loads the
    model with them, the chat uses isoquant3, the plan view keeps the overrides it shows and
    the memory panel's expected peak is the applied plan's."""
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path))
    folder = str(tiny_model_path("qwen3_moe"))
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    win = MainWindow(
        folder,
        bridge=FakeBridge(),
        settings=settings,
        library=LibraryController(Library(tmp_path / "m", tmp_path / "l.sqlite3")),
        start=False,
    )
    qtbot.addWidget(win)
    with qtbot.waitSignal(win.planner.plan_ready, timeout=60_000):
        win.session.start()
    view = win.plan_view
    view.kv_combo.setCurrentIndex(view.kv_combo.findData("isoquant3"))
    view.context_auto.setChecked(False)
    view.context_spin.setValue(4096)
    with qtbot.waitSignal(win.planner.plan_ready, timeout=60_000) as b:
        qtbot.mouseClick(view.replan_btn, Qt.MouseButton.LeftButton)
    chosen = b.args[0]
    assert chosen.plan.kv_mode == "isoquant3" and chosen.plan.context_limit == 4096
    win.bridge.sent.clear()
    restarts = []
    monkeypatch.setattr(win.bridge, "restart", lambda: (restarts.append(1), win.bridge.start()))
    with qtbot.waitSignal(win.session.model_loaded, timeout=10_000):
        qtbot.mouseClick(view.apply_btn, Qt.MouseButton.LeftButton)
    assert restarts == [1]
    loads = [m for m in win.bridge.sent if isinstance(m, M.Load)]
    assert len(loads) == 1 and loads[0].path == folder
    assert loads[0].options["kv_mode"] == "isoquant3" and loads[0].options["context"] == 4096
    assert win.chat.settings()["kv_mode"] == "isoquant3"
    assert win.chat_view.kv_combo.currentData() == "isoquant3"
    qtbot.wait(50)  # no plan is recomputed behind the applied one
    assert win.planner.last is chosen and win.planner.overrides.kv_mode == "isoquant3"
    assert "overrides: KV isoquant3, context 4096" in view.result.toPlainText()
    assert view.kv_combo.currentData() == "isoquant3" and view.context_spin.value() == 4096
    assert win.memory.peak_line.value() == pytest.approx(chosen.plan.process_peak / 2**30)
    # planning another model resets the boxes along with the overrides
    with qtbot.waitSignal(win.planner.plan_ready, timeout=60_000) as b:
        win.planner.set_target(str(tiny_model_path("qwen3_moe", seed=1)), "other")
    assert b.args[0].overrides.describe() == "none"
    assert view.kv_combo.currentData() is None and view.context_auto.isChecked()
