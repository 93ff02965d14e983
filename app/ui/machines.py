"""The Machines section: run the model split over several Macs.

The user points at a hosts.json (mlx.launch's hostfile with each host's `ram`); the plan for
the current model over those machines (computed in the planner's helper process:
plan_jobs.plan_machines) shows each host's memory and role (its layers, its experts resident or
paged, its expected peak). Start loads the model over them in the engine worker
(distributed/remote.py); the window keeps talking to the worker by messages only.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ..engine import jobs, plan_jobs
from ..engine.plan_jobs import MachinesPlan
from ..units import size
from .tasks import TaskRunner

COLUMNS = ("Host", "Memory", "Role", "Experts", "Expected peak")


class MachinesController(QObject):
    computing = Signal()
    planned = Signal(object)  # MachinesPlan (with a plan or an error)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.runner = TaskRunner(self, "machines")
        self.target: str | None = None
        self.label = ""
        self.hosts_path = ""
        self.last: MachinesPlan | None = None

    def set_target(self, target: str, label: str = "") -> None:
        if target == self.target:
            return
        self.target, self.label = target, label or target
        self.compute()

    def set_hosts(self, path: str) -> None:
        self.hosts_path = path.strip()
        self.compute()

    def compute(self) -> None:
        self.last = None
        if not self.target or not self.hosts_path:
            return
        target, path = self.target, self.hosts_path
        self.computing.emit()
        self.runner.submit(
            "plan",
            lambda: jobs.shared().call(plan_jobs.plan_machines, target, path),
            self._done,
            lambda e: self._done(MachinesPlan(target, path, (), None, f"{type(e).__name__}: {e}")),
        )

    def _done(self, r: MachinesPlan) -> None:
        if r.target != self.target or r.hosts_path != self.hosts_path:
            return  # planned for a model or a file no longer shown
        self.last = r
        self.planned.emit(r)


def role(stage: dict) -> tuple[str, str]:
    """(layers, experts) of one planned host."""
    a, b = stage["layers"]
    layers = f"layers {a}–{b - 1}" + (" (first)" if a == 0 else "")
    if stage.get("experts"):  # an expert split: every layer, a share of each layer's experts
        lo, hi = stage["experts"]
        layers = f"all layers, experts {lo}–{hi - 1} of each"
    if not stage["expert_bytes"]:
        experts = "—"
    elif stage["paging"]:
        experts = f"paged: {size(stage['expert_budget'])} of {size(stage['expert_bytes'])}"
    else:
        experts = f"resident ({size(stage['expert_bytes'])})"
    return layers, experts


class MachinesView(QWidget):
    """The section's widget. `start_requested(options)`: run the model as planned over the
    machines; `local_requested()`: go back to this machine alone."""

    start_requested = Signal(dict)
    local_requested = Signal()

    def __init__(self, ctl: MachinesController, parent=None):
        super().__init__(parent)
        self.ctl = ctl
        lay = QVBoxLayout(self)
        row = QHBoxLayout()
        self.path_edit = QLineEdit(ctl.hosts_path)
        self.path_edit.setPlaceholderText(
            "hosts.json (mlx.launch's hostfile, with each host's ram)"
        )
        self.path_edit.setAccessibleName("Hosts file")
        self.path_edit.editingFinished.connect(lambda: self._set_path(self.path_edit.text()))
        choose = QPushButton("Choose…")
        choose.clicked.connect(self._choose)
        row.addWidget(QLabel("Hosts:"))
        row.addWidget(self.path_edit, 1)
        row.addWidget(choose)
        lay.addLayout(row)
        self.model_label = QLabel("")
        self.model_label.setObjectName("muted")
        lay.addWidget(self.model_label)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        lay.addWidget(self.table, 1)
        self.summary = QLabel("")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        self.error = QLabel("")
        self.error.setObjectName("error")
        self.error.setWordWrap(True)
        self.error.hide()
        lay.addWidget(self.error)
        buttons = QHBoxLayout()
        self.start_btn = QPushButton("Start over these machines")
        self.start_btn.setEnabled(False)
        self.start_btn.clicked.connect(self._start)
        self.local_btn = QPushButton("Run on this Mac only")
        self.local_btn.clicked.connect(self.local_requested)
        self.status = QLabel("")
        self.status.setObjectName("muted")
        buttons.addWidget(self.status, 1)
        buttons.addWidget(self.local_btn)
        buttons.addWidget(self.start_btn)
        lay.addLayout(buttons)
        ctl.computing.connect(self._on_computing)
        ctl.planned.connect(self.show_plan)
        self.set_running(False)

    def _choose(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Hosts file", self.path_edit.text(), "JSON (*.json)"
        )
        if path:
            self.path_edit.setText(path)
            self._set_path(path)

    def _set_path(self, path: str) -> None:
        if path.strip() != self.ctl.hosts_path:
            self.ctl.set_hosts(path)

    def _on_computing(self) -> None:
        self.start_btn.setEnabled(False)
        self.status.setText("Planning…")

    def show_plan(self, r: MachinesPlan) -> None:
        self.status.setText("")
        self.model_label.setText(f"{self.ctl.label} over the machines of {r.hosts_path}")
        p = r.plan or {}
        stages = {s["rank"]: s for s in p.get("stages", ())}
        self.table.setRowCount(len(r.hosts))
        for i, (name, ram) in enumerate(r.hosts):
            st = stages.get(i)
            layers, experts = role(st) if st else ("—", "—")
            peak = f"{size(st['expected_peak'])} of {size(st['usable'])}" if st else "—"
            cells = (f"{name} (rank {i})", size(ram) if ram else "unknown", layers, experts, peak)
            for j, text in enumerate(cells):
                self.table.setItem(i, j, QTableWidgetItem(text))
        if r.plan:
            link = p["link"]
            self.summary.setText(
                (
                    "Split by experts (each host a share of every MoE layer's experts) · "
                    if isinstance(p["split"], str)
                    else f"Split {' / '.join(map(str, p['split']))} layers (rank 0 first) · "
                )
                + f"{'some experts paged' if p['paging'] else 'everything resident'} · expected "
                f"{p['expected_tok_s']:.1f} tok/s over {link['name']} "
                f"({link['latency_us']:g} µs per message)\n"
                + "\n".join(f"• {reason}" for reason in p.get("reasons", ()))
            )
        else:
            self.summary.setText("")
        self.error.setText(r.error)
        self.error.setVisible(bool(r.error))
        self.start_btn.setEnabled(r.plan is not None)

    def _start(self) -> None:
        r = self.ctl.last
        if r is not None and r.plan is not None:
            self.start_requested.emit(r.start_options())

    def set_running(self, hosts: list[str] | None) -> None:
        """What the engine runs now: over these hosts, or on this machine (None / False)."""
        self.local_btn.setEnabled(bool(hosts))
        self.status.setText(f"Running over {', '.join(hosts)}" if hosts else "")


class MachinesDialog(QDialog):
    def __init__(self, view: MachinesView, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Machines")
        self.resize(760, 420)
        QVBoxLayout(self).addWidget(view)
