"""Planning for the window, run in a helper process (app/engine/jobs.py): the planner and the
backend detection import MLX, which the window process never does.

The results are plain dataclasses (picklable, no MLX inside) that the window shows.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
EMBEDDED_REF = "embedded:default"  # app.engine.generate.DEFAULT_MODEL_REF, without importing it


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
            f"expert budget {self.expert_budget / GiB:.1f} GiB"
            if self.expert_budget is not None
            else "",
            f"context {self.context}" if self.context else "",
            f"widths {self.widths}" if self.widths else "",
        ]
        return ", ".join(p for p in parts if p) or "none"


@dataclass(frozen=True)
class PlanResult:
    target: str
    label: str
    overrides: Overrides
    plan: object  # app.engine.planner.Plan (frozen; read only)
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
    if target == EMBEDDED_REF:
        from .embedded import default_model_path

        return str(default_model_path())
    return target


def unavailable_kv_modes() -> dict[str, str]:
    """Offered KV modes that this machine cannot run, with the reason."""
    from . import kvcache
    from .backend import detect

    b = detect().name
    return {
        m: why for m in kvcache.names(offered=True) if (why := kvcache.unavailable_reason(m, b))
    }


_machine = None  # detected once per helper process


def plan(target: str, label: str, o: Overrides, emit=None) -> PlanResult | Refusal:
    """The plan of `target` with the overrides `o`, or the planner's refusal."""
    global _machine
    from . import planner

    if _machine is None:
        _machine = planner.Machine.detect()
    try:
        p = planner.plan_model(
            resolve_target(target),
            _machine,
            o.context,
            kv_mode=o.kv_mode,
            expert_budget=o.expert_budget,
            widths=o.widths,
        )
    except planner.PlanRefused as e:
        return Refusal(
            target, label, o, e.setting, e.reason, str(e), e.needed, e.available, e.smallest_ram
        )
    return PlanResult(target, label, o, p, unavailable_kv_modes())


@dataclass(frozen=True)
class MachinesPlan:
    """A model planned over the machines of a hosts.json (distributed/plan.py), for the
    window's Machines section; `error` instead of `plan` when the file or the plan fails."""

    target: str
    hosts_path: str
    hosts: tuple[tuple[str, int | None], ...]  # (name, RAM bytes) per host, rank 0 first
    plan: dict | None  # DistPlan.to_dict()
    error: str = ""

    def start_options(self) -> dict:
        """The worker's Load options that run the model as planned over these machines."""
        p = self.plan or {}
        budgets = [s["expert_budget"] if s["paging"] else None for s in p.get("stages", ())]
        return {
            "hosts": self.hosts_path,
            "split": p["split"]
            if isinstance(p.get("split"), str)
            else list(p.get("split") or []) or None,
            "expert_budget": budgets if any(b is not None for b in budgets) else None,
            "kv_mode": (p.get("kv_modes") or {}).get("full", "fp16"),
        }


def plan_machines(target: str, hosts_path: str, emit=None) -> MachinesPlan:
    """The plan of `target` over the hosts of `hosts_path`, or why there is none."""
    from .distributed.hosts import load_hosts
    from .distributed.plan import plan_hosts
    from .errors import EngineError
    from .planner import PlanRefused

    try:
        hosts = load_hosts(hosts_path)
    except EngineError as e:
        return MachinesPlan(target, hosts_path, (), None, str(e))
    rows = tuple((h.label, h.ram) for h in hosts.hosts)
    try:
        p = plan_hosts(resolve_target(target), hosts)
    except (PlanRefused, EngineError, ValueError, OSError) as e:
        return MachinesPlan(target, hosts_path, rows, None, str(e))
    return MachinesPlan(target, hosts_path, rows, p.to_dict())
