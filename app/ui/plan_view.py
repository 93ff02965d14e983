"""The plan view: what the planner chose for a model on this machine and why, the expected
peak by part, and overrides (KV mode, expert budget, context, widths at conversion) with the
planner's refusal shown in place when one cannot fit."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFrame,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from ..engine import kvcache
from ..units import size
from .plan_model import GiB, Overrides, PlanController, PlanResult, Refusal
from .session import DEFAULT_MODEL_REF
from .theme import current_colors

WIDTH_CHOICES = (
    ("As converted / planner default", None),
    ("Routed experts 3-bit", "routed=3"),
    ("Routed experts 4-bit", "routed=4"),
    ("Dense 8-bit", "dense=8"),
)
PART_LABELS = {
    "dense_weights": "Dense weights (always resident)",
    "resident_experts": "Routed experts resident",
    "kv_cache": "KV cache",
    "recurrent_state": "Recurrent state",
    "activations": "Activations (prefill step)",
    "runtime": "Runtime (Python, MLX)",
    "os_gui_reserve": "Left to the OS and the GUI",
}


def gb(n: int | float | None) -> str:
    return size(n, 2)


def _bits(w: dict) -> str:
    return "float" if w.get("bits") is None else f"{w['bits']}-bit (group {w.get('group_size')})"


def plan_html(r: PlanResult) -> str:
    """The plan as rich text: headline, choices, peak by part (with bars) and reasons."""
    c = current_colors()
    d = r.plan.to_dict()
    m = d["machine"]
    share = d["attention_share"]
    sizes = r.plan.sizes
    present = [
        role
        for role in d["widths"]
        if role != "keep_float" and (sizes is None or role == "dense" or sizes.params.get(role))
    ]
    rows = [
        (
            "Weights",
            ", ".join(f"{role} {_bits(d['widths'][role])}" for role in present)
            + (" — fixed by the conversion" if d["widths_fixed"] else ""),
        ),
        (
            "Experts",
            (
                f"paged from SSD, {gb(d['expert_budget'])} of {gb(d['expert_bytes'])} resident"
                if d["paging"]
                else f"all resident ({gb(d['expert_bytes'])})"
            )
            if d["expert_bytes"]
            else "none (dense model)",
        ),
        ("KV cache", ", ".join(f"{k}: {v}" for k, v in d["kv_modes"].items()) or "none"),
        ("Context limit", f"{d['context_limit']:,} tokens (target {d['target_context']:,})"),
        (
            "Attention share",
            f"{share['share']:.0%} of decode time at {share['context']:,} tokens "
            f"({'measured' if share['measured'] else 'estimated'})",
        ),
    ]
    total = max(d["total_peak"], 1)
    peak_rows = []
    for part, nbytes in d["peak"].items():
        w = max(1, int(220 * nbytes / total)) if nbytes else 0
        bar = (
            f'<table cellspacing="0" cellpadding="0"><tr><td width="{w}" height="10" style="background-color:{c.accent};"></td></tr></table>'
            if w
            else ""
        )
        peak_rows.append(
            f"<tr><td nowrap>{html.escape(PART_LABELS.get(part, part))}</td>"
            f'<td align="right" nowrap>&nbsp;&nbsp;{gb(nbytes)}&nbsp;&nbsp;</td><td>{bar}</td></tr>'
        )
    choice_rows = "".join(
        f'<tr><td nowrap style="color:{c.muted};">{html.escape(k)}&nbsp;&nbsp;</td><td>{html.escape(v)}</td></tr>'
        for k, v in rows
    )
    reasons = "".join(f"<li>{html.escape(x)}</li>" for x in d["reasons"])
    sim = " (simulated)" if m["simulated"] else ""
    return (
        f'<p style="font-size:large;"><b>{html.escape(r.label)}</b></p>'
        f'<p style="color:{c.muted};">on {m["ram"] / GiB:.0f} GB {m["backend"]}{sim}: '
        f"{gb(m['usable'])} usable by the engine · overrides: {html.escape(r.overrides.describe())}</p>"
        f'<p style="font-size:x-large;">Expected peak <b>{gb(d["process_peak"])}</b> '
        f'<span style="color:{c.muted}; font-size:medium;">+ {gb(d["peak"]["os_gui_reserve"])} reserve '
        f"= {gb(d['total_peak'])} of {gb(m['ram'])}</span></p>"
        f"<table cellspacing='2'>{choice_rows}</table>"
        f"<p><b>Memory at the peak</b></p><table cellspacing='2'>{''.join(peak_rows)}</table>"
        f"<p><b>Why</b></p><ul>{reasons}</ul>"
    )


class PlanView(QWidget):
    apply_requested = Signal(object)  # PlanResult to load with

    def __init__(self, ctl: PlanController, parent=None):
        super().__init__(parent)
        self.ctl = ctl
        self.unavailable: dict[str, str] = {}
        self._build()
        ctl.computing.connect(lambda label: self.state.setText(f"Planning {label}…"))
        ctl.target_changed.connect(lambda _t: self.reset_boxes())
        ctl.plan_ready.connect(self.show_plan)
        ctl.refused.connect(self.show_refusal)
        ctl.failed.connect(self.show_failure)

    def _build(self) -> None:
        box = QGroupBox("Overrides")
        self.kv_combo = QComboBox()
        self.kv_combo.addItem("Planner's choice", None)
        for mode in kvcache.names(offered=True):  # the planner's modes
            self.kv_combo.addItem(mode, mode)
        self.kv_note = QLabel("")
        self.kv_note.setObjectName("muted")
        self.kv_note.setWordWrap(True)
        self.budget_auto = QCheckBox("Planner's choice")
        self.budget_auto.setChecked(True)
        self.budget_spin = QDoubleSpinBox(
            minimum=0.0, maximum=4096.0, decimals=2, singleStep=0.5, suffix=" GiB"
        )
        self.budget_spin.setEnabled(False)
        self.budget_auto.toggled.connect(lambda on: self.budget_spin.setEnabled(not on))
        self.context_auto = QCheckBox("Planner's choice")
        self.context_auto.setChecked(True)
        self.context_spin = QSpinBox(
            minimum=256, maximum=1_048_576, singleStep=1024, value=8192, suffix=" tokens"
        )
        self.context_spin.setEnabled(False)
        self.context_auto.toggled.connect(lambda on: self.context_spin.setEnabled(not on))
        self.widths_combo = QComboBox()
        for label, spec in WIDTH_CHOICES:
            self.widths_combo.addItem(label, spec)
        self.widths_combo.addItem("Custom…", "custom")
        self.widths_edit = QLineEdit()
        self.widths_edit.setPlaceholderText("e.g. dense=4,routed=2,shared=8")
        self.widths_edit.setVisible(False)
        self.widths_combo.currentIndexChanged.connect(
            lambda _i: self.widths_edit.setVisible(self.widths_combo.currentData() == "custom")
        )
        grid = QGridLayout(box)
        grid.setColumnStretch(1, 1)
        grid.setColumnStretch(4, 1)
        kv_label = QLabel("&KV mode")
        kv_label.setBuddy(self.kv_combo)
        widths_label = QLabel("&Widths at conversion")
        widths_label.setBuddy(self.widths_combo)
        grid.addWidget(kv_label, 0, 0)
        grid.addWidget(self.kv_combo, 0, 1)
        grid.addWidget(widths_label, 1, 0)
        grid.addWidget(self.widths_combo, 1, 1)
        grid.addWidget(self.widths_edit, 2, 1)
        grid.addWidget(QLabel("Expert budget"), 0, 3)
        grid.addWidget(self.budget_auto, 0, 4)
        grid.addWidget(self.budget_spin, 0, 5)
        grid.addWidget(QLabel("Context limit"), 1, 3)
        grid.addWidget(self.context_auto, 1, 4)
        grid.addWidget(self.context_spin, 1, 5)
        grid.setColumnMinimumWidth(2, 16)
        grid.addWidget(self.kv_note, 3, 0, 1, 6)
        self.replan_btn = QPushButton("&Re-plan")
        self.replan_btn.clicked.connect(self.replan)
        self.reset_btn = QPushButton("Reset")
        self.reset_btn.clicked.connect(self.reset)
        self.apply_btn = QPushButton("&Use this plan")
        self.apply_btn.setToolTip("Reload the model with this plan's expert budget and KV mode")
        self.apply_btn.setEnabled(False)
        self.apply_btn.clicked.connect(self._apply)
        buttons = QHBoxLayout()
        buttons.addWidget(self.replan_btn)
        buttons.addWidget(self.reset_btn)
        buttons.addStretch(1)
        buttons.addWidget(self.apply_btn)
        grid.addLayout(buttons, 4, 0, 1, 6)

        self.refusal = QFrame()
        self.refusal.setObjectName("refusal")
        rl = QVBoxLayout(self.refusal)
        self.refusal_text = QLabel("")
        self.refusal_text.setObjectName("refusalText")
        self.refusal_text.setWordWrap(True)
        self.refusal_text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        rl.addWidget(self.refusal_text)
        self.refusal.hide()

        top = QWidget()
        ll = QVBoxLayout(top)
        ll.setContentsMargins(0, 0, 0, 0)
        ll.addWidget(box)
        ll.addWidget(self.refusal)
        top.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)

        self.state = QLabel("No model planned yet: load one, or pick one in the library.")
        self.state.setObjectName("muted")
        self.state.setWordWrap(True)
        self.result = QTextBrowser()
        self.result.setAccessibleName("Plan")
        self.result.setOpenLinks(False)
        self.result.document().setDocumentMargin(10)
        right = QWidget()
        rl2 = QVBoxLayout(right)
        rl2.setContentsMargins(0, 0, 0, 0)
        rl2.addWidget(self.state)
        rl2.addWidget(self.result, 1)

        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.setObjectName("planSplitter")
        self.splitter.addWidget(top)
        self.splitter.addWidget(right)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setCollapsible(1, False)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addWidget(self.splitter)

    # -- overrides ---------------------------------------------------------------------------
    def set_unavailable(self, unavailable: dict[str, str]) -> None:
        """Disable KV modes this machine cannot run, with the reason beside them."""
        self.unavailable = dict(unavailable)
        model = self.kv_combo.model()
        for i in range(self.kv_combo.count()):
            mode = self.kv_combo.itemData(i)
            why = self.unavailable.get(mode)
            model.item(i).setEnabled(why is None)
            self.kv_combo.setItemData(i, why, Qt.ItemDataRole.ToolTipRole)
        self.kv_note.setText("\n".join(f"{m}: {why}" for m, why in self.unavailable.items()))

    def overrides(self) -> Overrides:
        spec = self.widths_combo.currentData()
        if spec == "custom":
            spec = self.widths_edit.text().strip() or None
        return Overrides(
            kv_mode=self.kv_combo.currentData(),
            expert_budget=None
            if self.budget_auto.isChecked()
            else int(self.budget_spin.value() * GiB),
            context=None if self.context_auto.isChecked() else self.context_spin.value(),
            widths=spec,
        )

    def replan(self) -> None:
        try:
            o = self.overrides()
        except ValueError as e:
            self.show_failure(str(e))
            return
        self.ctl.compute(o)

    def reset_boxes(self) -> None:
        """The boxes show the planner's own choices (as the plan's "overrides: none" says)."""
        self.kv_combo.setCurrentIndex(0)
        self.budget_auto.setChecked(True)
        self.context_auto.setChecked(True)
        self.widths_combo.setCurrentIndex(0)

    def reset(self) -> None:
        self.reset_boxes()
        self.ctl.compute(Overrides())

    def _apply(self) -> None:
        if self.ctl.last is not None:
            self.apply_requested.emit(self.ctl.last)

    # -- results -----------------------------------------------------------------------------
    def show_plan(self, r: PlanResult) -> None:
        self.set_unavailable(r.unavailable)
        self.refusal.hide()
        self.state.setText(f"Plan for {r.label} on this machine")
        self.result.setHtml(plan_html(r))
        self.apply_btn.setEnabled(True)
        local = r.target == DEFAULT_MODEL_REF or Path(r.target).is_dir()
        self.apply_btn.setText("&Use this plan" if local else "&Download with this plan")
        self.apply_btn.setToolTip(
            "Reload the model with this plan's expert budget and KV mode"
            if local
            else "Download and convert this model at the plan's widths"
        )
        d = r.plan
        if d.expert_bytes and self.budget_auto.isChecked():
            self.budget_spin.setValue(d.expert_budget / GiB)
        if self.context_auto.isChecked():
            self.context_spin.setValue(d.context_limit)

    def show_refusal(self, r: Refusal) -> None:
        lines = [f"<b>Refused: {html.escape(r.setting)}</b>", html.escape(r.reason)]
        if r.needed is not None and r.available is not None:
            lines.append(f"Needs {gb(r.needed)}, {gb(r.available)} available.")
        if r.smallest_ram:
            lines.append(
                f"The smallest machine that runs it has {r.smallest_ram // GiB} GB of RAM."
            )
        if self.ctl.last is not None:
            lines.append("The plan below is the last one that fits.")
        self.refusal_text.setText("<br>".join(lines))
        self.refusal.show()
        self.state.setText(f"{r.label}: the override was refused")
        if self.ctl.last is None:
            self.result.clear()
            self.apply_btn.setEnabled(False)

    def show_failure(self, message: str) -> None:
        self.refusal_text.setText(f"<b>Could not plan</b><br>{html.escape(message)}")
        self.refusal.show()
