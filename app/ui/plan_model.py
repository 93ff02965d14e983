"""The planner for the GUI: plans a model (with overrides) off the GUI thread and reports a
plan or the planner's refusal, with its reasons and numbers.

The planner is plain Python (app/engine/planner.py); detecting the machine imports MLX once,
on the task thread. Nothing here touches the worker: applying a plan is the window's job.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal

from .session import DEFAULT_MODEL_REF
from .tasks import TaskRunner

GiB = 1 << 30


@dataclass(frozen=True)
class Overrides:
    kv_mode: str | None = None  # an offered row of the KV modes table; None: the planner decides
    expert_budget: int | None = None  # bytes
    context: int | None = None  # tokens
    widths: str | None = None  # 'routed=3' style (RoleWidths.parse); at conversion only

    def __post_init__(self):
        if self.expert_budget is not None and self.expert_budget < 0:
            raise ValueError("expert budget must be >= 0")
        if self.context is not None and self.context < 1:
            raise ValueError("context must be at least 1 token")

    def describe(self) -> str:
        parts = [
            f"KV {self.kv_mode}" if self.kv_mode else "",
            f"expert budget {self.expert_budget / GiB:.1f} GB" if self.expert_budget is not None else "",
            f"context {self.context}" if self.context else "",
            f"widths {self.widths}" if self.widths else "",
        ]
        return ", ".join(p for p in parts if p) or "none"


@dataclass(frozen=True)
class PlanResult:
    target: str
    label: str
    overrides: Overrides
    plan: object  # app.engine.planner.Plan (frozen; read only here)
    unavailable: dict  # KV mode -> why it cannot run on this machine


@dataclass(frozen=True)
class Refusal:
    target: str
    label: str
    overrides: Overrides
    setting: str  # which setting was refused: kv-mode, expert-budget, context, widths, model
    reason: str
    message: str  # the planner's full sentence with the numbers
    needed: int | None = None
    available: int | None = None
    smallest_ram: int | None = None


def resolve_target(target: str) -> str:
    """What the planner reads: a folder, a config.json or a known config name."""
    if target == DEFAULT_MODEL_REF:
        from ..engine.embedded import default_model_path

        return str(default_model_path())
    return target


def unavailable_kv_modes() -> dict[str, str]:
    """Offered KV modes that this machine cannot run, with the reason."""
    from ..engine import kvcache
    from ..engine.backend import detect

    b = detect().name
    return {m: why for m in kvcache.names(offered=True) if (why := kvcache.unavailable_reason(m, b))}


def make_plan(target: str, o: Overrides, machine=None):
    from ..engine import planner

    return planner.plan_model(
        resolve_target(target), machine, o.context, kv_mode=o.kv_mode,
        expert_budget=o.expert_budget, widths=o.widths,
    )


class PlanController(QObject):
    computing = Signal(str)  # label
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
        self.machine = None

    def set_target(self, target: str, label: str = "") -> None:
        """Plan another model, from the planner's own choices (overrides reset)."""
        self.target, self.label = target, label or target
        self.last = None
        self.compute(Overrides())

    def compute(self, overrides: Overrides | None = None) -> None:
        if self.target is None:
            return
        o = overrides if overrides is not None else self.overrides
        self.overrides = o
        target, label = self.target, self.label

        def run():
            from ..engine import planner

            if self.machine is None:
                self.machine = planner.Machine.detect()
            try:
                plan = make_plan(target, o, self.machine)
            except planner.PlanRefused as e:
                return Refusal(target, label, o, e.setting, e.reason, str(e), e.needed,
                               e.available, e.smallest_ram)
            return PlanResult(target, label, o, plan, unavailable_kv_modes())

        self.computing.emit(label)
        self.runner.submit("plan", run, self._done, lambda e: self.failed.emit(f"{type(e).__name__}: {e}"))

    def _done(self, r) -> None:
        if r.target != self.target:
            return  # a plan for a model no longer shown
        if isinstance(r, Refusal):
            self.refused.emit(r)
        else:
            self.last = r
            self.plan_ready.emit(r)
