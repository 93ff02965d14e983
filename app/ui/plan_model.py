"""The planner for the GUI: plans a model (with overrides) and reports a plan or the
planner's refusal, with its reasons and numbers.

Detecting the machine imports MLX, so plans are computed in a helper process
(app/engine/plan_jobs.py), waited for on a task thread. Applying a plan is the window's job.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from ..engine import jobs, plan_jobs
from ..engine.plan_jobs import GiB, Overrides, PlanResult, Refusal, resolve_target
from .tasks import TaskRunner

__all__ = ["GiB", "Overrides", "PlanController", "PlanResult", "Refusal", "resolve_target"]


class PlanController(QObject):
    computing = Signal(str)  # label
    target_changed = Signal(str)  # another model is planned: overrides back to the planner's
    plan_ready = Signal(object)  # PlanResult
    refused = Signal(object)  # Refusal
    failed = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.runner = TaskRunner(self, "planner")
        self.target: str | None = None
        self.label = ""
        self.overrides = Overrides()
        self.last: PlanResult | None = None  # the last accepted plan (kept when one is refused)

    def set_target(self, target: str, label: str = "") -> None:
        """Plan another model, from the planner's own choices (overrides reset)."""
        self.target, self.label = target, label or target
        self.last = None
        self.target_changed.emit(target)
        self.compute(Overrides())

    def compute(self, overrides: Overrides | None = None) -> None:
        if self.target is None:
            return
        o = overrides if overrides is not None else self.overrides
        self.overrides = o
        target, label = self.target, self.label

        def run():
            return jobs.shared().call(plan_jobs.plan, target, label, o)

        self.computing.emit(label)
        self.runner.submit(
            "plan", run, self._done, lambda e: self.failed.emit(f"{type(e).__name__}: {e}")
        )

    def _done(self, r) -> None:
        if r.target != self.target:
            return  # a plan for a model no longer shown
        if isinstance(r, Refusal):
            self.refused.emit(r)
        else:
            self.last = r
            self.plan_ready.emit(r)
