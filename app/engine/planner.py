"""The auto-planner (SPEC §6): from this machine and a model to widths, expert budget, KV mode
and context limit, with the expected peak memory by part and the reasons.

Order of decisions (the axes do not commute, SPEC §2): widths first (fixed by the conversion
for a converted model), then the KV mode per layer kind, then the context limit, and the
expert budget is the memory left after all of them. When memory is short, the planner gives
up, in this order: expert residency (page experts, down to the minimum the pager needs), KV
precision (IsoQuant 3-bit on full-attention layers), context length; then it refuses and
names the smallest machine that would run the model.

Sizes are shown in GiB (app/units.py); a "32 GB" Mac, as machines are sold, has 32 GiB of RAM.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..units import size
from . import kvcache
from .errors import EngineError
from .profile import ShareSource, estimate_share, share_for
from .quant.widths import ROLES, RoleWidths
from .sizes import ModelSizes, compute, load_config, sizes_for

GiB = 1 << 30
MiB = 1 << 20
# Mac and PC RAM sizes, for "the smallest machine that would do".
STANDARD_RAM_GIB = (8, 16, 18, 24, 32, 36, 48, 64, 96, 128, 192, 256, 512)
DEFAULT_CONTEXT = 8192
MIN_CONTEXT = 2048  # below this a chat is not useful; the planner refuses instead
SHARE_THRESHOLD = 0.20  # SPEC §4: compressing KV pays above ~20% of decode time in attention
PREFILL_CHUNK = 512  # the smallest prefill step (tokens): what every plan can afford
# Larger prefill steps tried, largest first: per-step host and launch costs are paid over more
# tokens (512 costs 25-35% of prefill speed against 2048 on an H200); 2048 is mlx-lm's default.
PREFILL_CHUNKS = (2048, 1024, PREFILL_CHUNK)
OS_RESERVE_MIN = 3 * GiB  # the OS and other apps' floor...
OS_RESERVE_FRACTION = 8  # ...or 1/8 of RAM on larger machines
GUI_RESERVE = 512 * MiB  # the Qt GUI process (PySide6 + pyqtgraph + chat history)
# Python + MLX + mlx-lm + tokenizer before any weight is loaded (measured 80-130 MiB on Linux
# CPU; Metal adds its framework). The worker passes its measured RSS instead when it can.
RUNTIME_BASE = 512 * MiB
# Resident memory the first computation adds beyond MLX's arrays: OpenBLAS thread buffers,
# kernel code, MLX's buffer cache. Measured 8-49 MiB on Linux CPU (benchmarks/planner_accuracy.py).
COMPUTE_ALLOWANCE = 32 * MiB
SSM_STEP = 256  # mlx-lm's Mamba-2 prefill works in 256-token steps
# Metal's recommended working set as a fraction of RAM (Apple: ~2/3 below 36 GB, ~3/4 above);
# used only when planning for a Mac other than this one.
METAL_WORKING_SET = ((36 * GiB, 2 / 3), (1 << 62, 3 / 4))
BACKENDS = kvcache.modes.BACKENDS


class PlanRefused(EngineError):
    """A plan (or an override) that cannot fit: says which setting, why, and the numbers."""

    def __init__(
        self,
        setting: str,
        reason: str,
        needed: int | None = None,
        available: int | None = None,
        smallest_ram: int | None = None,
    ):
        self.setting = setting
        self.reason = reason
        self.needed = needed
        self.available = available
        self.smallest_ram = smallest_ram
        msg = f"{setting}: {reason}"
        if needed is not None and available is not None:
            msg += f" (needs {gb(needed)}, {gb(available)} available)"
        if smallest_ram is not None:
            msg += f"; the smallest machine that runs it has {smallest_ram // GiB} GB of RAM"
        super().__init__(msg)


class ModelTooLarge(PlanRefused):
    """The model cannot run on this machine with any setting."""


def gb(n: int | float) -> str:
    return size(n)


def parse_size(text: str | int) -> int:
    """'32GB', '32G', '32GiB', '512MB', '32' (GB) -> bytes. GB means GiB (see module doc)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise ValueError(f"bad size {text!r}: expected e.g. 32GB or 512MB")
    unit = {"": GiB, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * unit)


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """What the planner knows about the machine. `simulated` = described, not detected."""

    ram: int
    backend: str = "cpu"
    metal_kernels: bool = False
    cuda_kernels: bool = False
    working_set: int | None = None  # Metal: the GPU's recommended working set
    gpu_memory: int | None = None  # CUDA: device memory
    available: int | None = None
    free_disk: int | None = None
    runtime_base: int = RUNTIME_BASE
    simulated: bool = False

    def __post_init__(self):
        if self.ram <= 0:
            raise ValueError(f"RAM must be positive, got {self.ram}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if (
            self.metal_kernels
            and self.backend != "metal"
            or self.cuda_kernels
            and self.backend != "cuda"
        ):
            raise ValueError("kernels must match the backend")

    @property
    def reserve(self) -> int:
        """Left to the OS, other apps and the GUI."""
        return max(OS_RESERVE_MIN, self.ram // OS_RESERVE_FRACTION) + GUI_RESERVE

    @property
    def usable(self) -> int:
        """What the engine process may use: RAM less the reserve, capped by the GPU's limits."""
        u = self.ram - self.reserve
        if self.working_set is not None:
            u = min(u, self.working_set)
        if self.gpu_memory is not None:
            u = min(u, self.gpu_memory - GUI_RESERVE)  # CUDA context and fragmentation
        return max(u, 0)

    @property
    def fused_kernels(self) -> bool:
        return self.metal_kernels or self.cuda_kernels

    @property
    def kv_modes(self) -> tuple[str, ...]:
        """The KV modes the planner may choose here: the table's offered rows for this backend."""
        return kvcache.names(self.backend, offered=True)

    def with_ram(self, ram: int) -> Machine:
        """The same kind of machine with another amount of RAM (for 'smallest machine')."""
        return Machine.simulate(ram, self.backend, runtime_base=self.runtime_base)

    @classmethod
    def simulate(
        cls, ram: int | str, backend: str = "metal", runtime_base: int = RUNTIME_BASE
    ) -> Machine:
        """A described machine: an Apple-silicon Mac (working set estimated), an NVIDIA box
        (GPU memory unknown: RAM only) or a CPU-only one."""
        ram = parse_size(ram)
        ws = None
        if backend == "metal":
            frac = next(f for limit, f in METAL_WORKING_SET if ram < limit)
            ws = int(ram * frac)
        return cls(
            ram,
            backend,
            metal_kernels=backend == "metal",
            cuda_kernels=backend == "cuda",
            working_set=ws,
            runtime_base=runtime_base,
            simulated=True,
        )

    @classmethod
    def detect(
        cls, disk_path: str | os.PathLike | None = None, ram: int | str | None = None
    ) -> Machine:
        """This machine (psutil + the backend); `ram` pretends it has that much RAM."""
        import psutil

        from .backend import detect

        b = detect()
        vm = psutil.virtual_memory()
        disk = None
        try:
            from .. import paths

            disk = psutil.disk_usage(str(disk_path or paths.models_dir())).free
        except OSError:
            pass
        gpu = None
        if b.name == "cuda":
            gpu = b.info.get("memory_size") or b.info.get("total_memory")
        total = parse_size(ram) if ram is not None else vm.total
        ws = b.recommended_working_set
        if ram is not None and b.name == "metal":
            ws = int(total * next(f for limit, f in METAL_WORKING_SET if total < limit))
        return cls(
            total,
            b.name,
            metal_kernels=b.metal_kernels,
            cuda_kernels=b.cuda_kernels,
            working_set=ws,
            gpu_memory=int(gpu) if gpu else None,
            available=vm.available if ram is None else None,
            free_disk=disk,
            simulated=ram is not None,
        )

    def to_dict(self) -> dict:
        return {
            "ram": self.ram,
            "backend": self.backend,
            "metal_kernels": self.metal_kernels,
            "cuda_kernels": self.cuda_kernels,
            "working_set": self.working_set,
            "gpu_memory": self.gpu_memory,
            "available": self.available,
            "free_disk": self.free_disk,
            "reserve": self.reserve,
            "usable": self.usable,
            "runtime_base": self.runtime_base,
            "simulated": self.simulated,
        }


# ---------------------------------------------------------------------------------------------


def fused_attention(s: ModelSizes, m: Machine) -> bool:
    """Whether prompt attention runs in a fused kernel (no T x T score matrix in memory):
    MLX's Metal/CUDA SDPA covers head dims 64, 80 and 128; elsewhere it composes ops."""
    return m.backend in ("metal", "cuda") and s.max_head_dim in (64, 80, 128)


def activation_bytes(s: ModelSizes, context: int, m: Machine, chunk: int = PREFILL_CHUNK) -> int:
    """Transient memory of one prefill step of `chunk` tokens at `context` (the peak of a
    session: decode steps need far less). One layer's buffers are live at a time."""
    act = s.float_bytes
    c = min(chunk, context)
    resid = 6 * c * s.hidden_size * act  # residual, norm out, attention out, copies
    widest = c * s.widest_per_token * act
    scores = 0
    if not fused_attention(s, m) and s.kv:
        span = max(k.tokens(context, c) for k in s.kv)
        # one [Hq, C, T] score matrix of one layer is live at a time (measured on MLX's CPU
        # fallback); attention sinks (gpt_oss) concatenate and re-split it: three copies
        copies = 3 if s.architecture == "gpt_oss" else 1
        scores = copies * s.q_heads * c * span * act
    # Mamba-2 chunked scan: ~3 live [heads, step, step] fp32 matrices (segsum, decay, CB).
    # MLX evaluates the chunk's graph as a whole, so layers' transients can overlap: add them.
    ssm = 3 * s.ssm_heads * min(c, SSM_STEP) ** 2 * 4
    logits = 2 * s.vocab_size * 4  # the last token's logits (fp32) and the sampler's copy
    return resid + widest + scores + ssm + logits + widened_expert_bytes(s, m)


def widened_expert_bytes(s: ModelSizes, m: Machine) -> int:
    """One MoE layer's routed codes widened to 8 bits for a prefill call (expert_widen.py:
    CUDA's default; one layer's copy at a time), else 0."""
    bits = s.widths.routed.bits
    if m.backend != "cuda" or not s.moe_layers or bits is None or bits >= 8:
        return 0
    return s.experts_per_layer * s.params_per_expert


def prefill_chunk(
    s: ModelSizes, m: Machine, context: int, headroom: int, modes: dict | str = "fp16"
) -> tuple[int, str]:
    """The largest prefill step in PREFILL_CHUNKS whose memory beyond the smallest step's
    (activations, and sliding-window caches that briefly hold a step more) fits in `headroom`
    bytes, the memory a plan leaves unused; with the reason."""

    def extra(chunk: int) -> int:
        return (
            activation_bytes(s, context, m, chunk)
            + s.kv_bytes(context, modes, chunk)
            - activation_bytes(s, context, m, PREFILL_CHUNK)
            - s.kv_bytes(context, modes, PREFILL_CHUNK)
        )

    for chunk in PREFILL_CHUNKS[:-1]:
        if extra(chunk) <= headroom:
            return chunk, (
                f"prefill in {chunk}-token steps: {gb(extra(chunk))} more than "
                f"{PREFILL_CHUNK}-token steps, {gb(headroom)} to spare"
            )
    return PREFILL_CHUNK, (
        f"prefill in {PREFILL_CHUNK}-token steps: {PREFILL_CHUNKS[-2]}-token "
        f"steps need {gb(extra(PREFILL_CHUNKS[-2]))} more, "
        f"{gb(max(headroom, 0))} to spare"
    )


def min_expert_budget(s: ModelSizes) -> int:
    """The least the pager can run with: one token's experts in every MoE layer (pinned for
    the step) plus one whole layer's experts (a long prompt can route to all of them)."""
    if not s.moe_layers:
        return 0
    need = s.active_expert_bytes + s.experts_per_layer * s.bytes_per_expert
    return min(need, s.expert_bytes)


def expert_budget_for_speed(s: ModelSizes, m: Machine, left: int, reasons: list[str]) -> int:
    """The expert budget (at most `left`) that maximises expected decode tok/s (the cost model
    in offload.speed on trace-like routing), not hit rate: the smallest budget within 1% of
    the best, since past the hit curve's knee the pool only holds records that the OS page
    cache would serve from memory anyway."""
    from dataclasses import replace

    from .offload.speed import BACKEND_COSTS, records_pin, step_seconds, trace_hit_rate

    top = min(left, s.expert_bytes)
    need = min_expert_budget(s)
    if not s.moe_layers or top >= s.expert_bytes or top <= need:
        return top  # all resident (no read-backs), or no room to choose
    active = s.resident_bytes - s.embedding_bytes + s.active_expert_bytes
    costs, memory = BACKEND_COSTS[m.backend], top
    device_route = m.backend == "cuda" and records_pin(s.expert_bytes, m.available or m.ram)
    if device_route:  # no read-backs, and every miss a copy from host memory over the bus
        costs, memory = replace(costs, readback_s=0.0), s.expert_bytes

    def tps(b: int) -> float:
        return 1.0 / step_seconds(
            b,
            memory,
            s.expert_bytes,
            active,
            s.moe_layers,
            s.experts_per_token,
            s.bytes_per_expert,
            costs,
        )

    steps = 64
    cands = [need + (top - need) * i // steps for i in range(steps + 1)]
    best = tps(top)
    pick = next(b for b in cands if tps(b) >= 0.99 * best)
    hit = trace_hit_rate(pick / s.expert_bytes)
    if device_route:
        reasons.append(
            f"expert budget {gb(pick)}: expected {tps(pick):.1f} tok/s ({hit:.0%} hits on "
            "trace-like routing); the record files fit in half the host's memory, so they are "
            "page-locked and misses are resolved on the GPU, copied over the bus"
        )
    elif pick < top:
        reasons.append(
            f"expert budget {gb(pick)} for an expected {tps(pick):.1f} tok/s ({hit:.0%} hits on "
            f"trace-like routing); all {gb(top)} would give {best:.1f} tok/s: the rest stays "
            "with the OS, whose page cache serves those misses from memory"
        )
    else:
        reasons.append(
            f"expert budget {gb(pick)}: expected {best:.1f} tok/s ({hit:.0%} hits on "
            "trace-like routing; every byte of pool still pays)"
        )
    return pick


@dataclass(frozen=True)
class Plan:
    """A plan for one model on one machine. Checks its own arithmetic."""

    model: str
    architecture: str
    machine: Machine
    widths: RoleWidths
    widths_fixed: bool  # the model is converted: its widths cannot change without reconverting
    paging: bool
    expert_budget: int  # bytes of routed experts kept resident
    expert_bytes: int  # bytes of all routed experts
    min_expert_budget: int
    kv_modes: dict  # layer kind ("full", "sliding", "mla") -> KV mode
    context_limit: int
    target_context: int
    attention_share: ShareSource
    peak: dict  # part -> bytes; see PEAK_PARTS
    reasons: tuple = ()
    sizes: ModelSizes | None = field(default=None, compare=False, repr=False)
    prefill_chunk: int = PREFILL_CHUNK  # tokens per prefill step; peak["activations"] assumes it
    prefill_reason: str = ""

    PEAK_PARTS = (
        "dense_weights",
        "resident_experts",
        "kv_cache",
        "recurrent_state",
        "activations",
        "runtime",
        "os_gui_reserve",
    )

    def __post_init__(self):
        if tuple(self.peak) != self.PEAK_PARTS or any(v < 0 for v in self.peak.values()):
            raise ValueError(f"peak needs the parts {self.PEAK_PARTS}, none negative")
        if self.paging != (self.expert_budget < self.expert_bytes):
            raise ValueError(
                "paging must be on exactly when the budget holds fewer than all experts"
            )
        if self.paging and self.expert_budget < self.min_expert_budget:
            raise ValueError("expert budget is below what the pager needs")
        if self.peak["resident_experts"] != self.expert_budget:
            raise ValueError("resident experts must equal the expert budget")
        for kind, mode in self.kv_modes.items():
            if mode not in self.machine.kv_modes:
                raise ValueError(f"KV mode {mode} is not available on {self.machine.backend}")
            if kind != "full" and mode != kvcache.FLOAT:
                raise ValueError(f"{kind} layers stay fp16")
        if not 1 <= self.context_limit <= self.target_context:
            raise ValueError("context limit must be within 1..target context")
        if self.process_peak > self.machine.usable:
            raise ValueError(
                f"expected peak {gb(self.process_peak)} exceeds usable {gb(self.machine.usable)}"
            )
        if self.total_peak > self.machine.ram:
            raise ValueError("expected peak with the reserve exceeds RAM")
        if self.prefill_chunk not in PREFILL_CHUNKS:
            raise ValueError(f"prefill chunk must be one of {PREFILL_CHUNKS}")

    @property
    def process_peak(self) -> int:
        """The engine process at its peak (everything but the OS/GUI reserve)."""
        return sum(v for k, v in self.peak.items() if k != "os_gui_reserve")

    @property
    def total_peak(self) -> int:
        return sum(self.peak.values())

    @property
    def kv_mode(self) -> str:
        """The mode of the compressible (full-attention) layers, fp16 where there are none."""
        return self.kv_modes.get("full", kvcache.FLOAT)

    def quality(self) -> dict:
        """What the user gives up: weight bits per role, KV precision per kind, context."""
        return {
            "widths": {r: self.widths[r].bits or 16 for r in ROLES},
            "kv": {k: kv_quality(m) for k, m in self.kv_modes.items()},
            "context": self.context_limit,
        }

    def at_least_as_good_as(self, other: Plan) -> bool:
        """The quality order: every component at least as good (a partial order)."""
        a, b = self.quality(), other.quality()
        return (
            all(a["widths"][r] >= b["widths"][r] for r in ROLES)
            and all(a["kv"][k] >= b["kv"].get(k, 0) for k in a["kv"])
            and a["context"] >= b["context"]
        )

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "architecture": self.architecture,
            "machine": self.machine.to_dict(),
            "widths": self.widths.to_dict(),
            "widths_fixed": self.widths_fixed,
            "paging": self.paging,
            "expert_budget": self.expert_budget,
            "expert_bytes": self.expert_bytes,
            "min_expert_budget": self.min_expert_budget,
            "kv_modes": dict(self.kv_modes),
            "context_limit": self.context_limit,
            "target_context": self.target_context,
            "attention_share": {
                "share": round(self.attention_share.share, 4),
                "context": self.attention_share.context,
                "measured": self.attention_share.measured,
                "detail": self.attention_share.detail,
            },
            "peak": dict(self.peak),
            "prefill_chunk": self.prefill_chunk,
            "process_peak": self.process_peak,
            "total_peak": self.total_peak,
            "reasons": list(self.reasons),
        }

    def summary(self) -> str:
        w = self.widths
        lines = [
            f"Plan for {self.model} ({self.architecture}) on {self.machine.ram // GiB} GB "
            f"{self.machine.backend}{' (simulated)' if self.machine.simulated else ''}",
            "  widths: "
            + ", ".join(
                f"{r} {_bits(w[r])}"
                for r in ROLES
                if r == "dense" or (self.sizes and self.sizes.params[r]) and r != "keep_float"
            )
            + f", norms/routers float{' (fixed by conversion)' if self.widths_fixed else ''}",
            f"  experts: {'paged, ' if self.paging else 'all resident, '}budget {gb(self.expert_budget)}"
            f" of {gb(self.expert_bytes)}"
            if self.expert_bytes
            else "  experts: none (dense model)",
            "  KV: "
            + ", ".join(f"{k} {m}" for k, m in self.kv_modes.items())
            + f"; context limit {self.context_limit}",
            f"  expected peak {gb(self.process_peak)} (+ {gb(self.peak['os_gui_reserve'])} OS/GUI reserve"
            f" = {gb(self.total_peak)} of {gb(self.machine.ram)}):",
        ]
        lines += [f"    {k.replace('_', ' '):18s} {gb(v)}" for k, v in self.peak.items()]
        lines.append("  reasons:")
        lines += [f"    - {r}" for r in self.reasons]
        return "\n".join(lines)


def _bits(w) -> str:
    return "float" if w.bits is None else f"{w.bits}-bit/g{w.group_size}"


# ---------------------------------------------------------------------------------------------


@dataclass
class _Budget:
    """The arithmetic of one candidate: what is fixed, KV and what is left for experts."""

    s: ModelSizes
    m: Machine
    resident: int

    def fixed(self, context: int) -> int:
        return (
            self.resident
            + self.s.recurrent_state_bytes
            + activation_bytes(self.s, context, self.m)
            + self.m.runtime_base
            + COMPUTE_ALLOWANCE
        )

    def left_for_experts(self, context: int, modes: dict) -> int:
        return self.m.usable - self.fixed(context) - self.s.kv_bytes(context, modes, PREFILL_CHUNK)


def kv_quality(mode: str) -> int:
    """KV precision for the quality order: lossless modes rank above lossy ones."""
    return 2 if kvcache.mode(mode).lossless else 1


def _full_layers(s: ModelSizes, mode: str) -> dict:
    """`mode` on the full-attention layers, float on the others (bounded or latent caches)."""
    return {k.kind: (mode if k.kind == "full" else kvcache.FLOAT) for k in s.kv}


def _compressed(s: ModelSizes, m: Machine, prefer_lossless: bool) -> dict:
    """KV modes with the full-attention layers compressed: the table's lossless choice
    (ZipFusion, 0.75x) where the backend runs it and it is enough, else its compact one
    (IsoQuant 3-bit, ~0.2x)."""
    lossless = kvcache.mode(kvcache.modes.AUTO_LOSSLESS).runs_on(m.backend)
    auto = (
        kvcache.modes.AUTO_LOSSLESS if prefer_lossless and lossless else kvcache.modes.AUTO_COMPACT
    )
    return _full_layers(s, auto)


def _kv_mode_refusal(mode: str, m: Machine) -> str:
    offered = ", ".join(kvcache.names(offered=True))
    if mode not in kvcache.MODES:
        return f"unknown KV mode {mode!r}; modes are {offered}"
    if not kvcache.mode(mode).offered:
        return f"KV mode {mode} is a research variant (benchmarks only); modes are {offered}"
    return f"{kvcache.needs(mode)}; this plan is for {m.backend}"


def _fp16(s: ModelSizes) -> dict:
    return {k.kind: kvcache.FLOAT for k in s.kv}


@dataclass
class _Request:
    """One make_plan call: what was asked, and the reasons collected as decisions are made."""

    s: ModelSizes
    m: Machine
    context: int | None  # as asked (None: the planner's default)
    target: int
    kv_mode: str | None
    expert_budget: int | str | None
    widths_fixed: bool
    share: ShareSource | None
    search_smallest: bool
    reasons: list = field(default_factory=list)

    def too_large(
        self, setting: str, reason: str, needed: int, available: int | None = None
    ) -> PlanRefused:
        """A refusal that names the smallest standard machine that would run the request."""
        smallest = (
            _smallest_ram(
                self.s, self.m, self.context, self.kv_mode, self.expert_budget,
                self.widths_fixed, self.share,
            )
            if self.search_smallest
            else None
        )  # fmt: skip
        cls = ModelTooLarge if setting == "model" else PlanRefused
        return cls(
            setting, reason, needed, self.m.usable if available is None else available, smallest
        )


def make_plan(
    sizes: ModelSizes,
    machine: Machine,
    context: int | None = None,
    *,
    kv_mode: str | None = None,
    expert_budget: int | str | None = None,
    widths_fixed: bool = False,
    share: ShareSource | None = None,
    _search_smallest: bool = True,
) -> Plan:
    """Plan `sizes` (a model at its widths) on `machine`. `context` is the wanted context
    (given: it must be honoured; None: DEFAULT_CONTEXT, reduced if memory is short).
    `kv_mode` / `expert_budget` are overrides, refused with PlanRefused if they cannot fit."""
    s = sizes
    r = _Request(
        s, machine, context, _target_context(s, context), kv_mode, expert_budget, widths_fixed,
        share, _search_smallest,
    )  # fmt: skip
    resident = _resident_weights(r)  # 1. weights
    r.share = share or estimate_share(s, r.target)
    modes = _choose_kv_modes(r)  # 2. KV mode per layer kind
    b = _Budget(s, machine, resident)
    modes, context_limit = _fit_kv(r, b, modes)  # 3. compress, else cut the context
    budget = _choose_expert_budget(r, b.left_for_experts(context_limit, modes))  # 4. experts
    _note_experts(r, budget)
    _note_machine(r, b, context_limit, budget)
    chunk, chunk_reason = _choose_prefill_chunk(r, b, context_limit, modes, budget)
    return Plan(
        model=s.name,
        architecture=s.architecture,
        machine=machine,
        widths=s.widths,
        widths_fixed=widths_fixed,
        paging=budget < s.expert_bytes,
        expert_budget=budget,
        expert_bytes=s.expert_bytes,
        min_expert_budget=min_expert_budget(s),
        kv_modes=modes,
        context_limit=context_limit,
        target_context=r.target,
        attention_share=r.share,
        peak=_peak(b, budget, modes, context_limit, chunk),
        reasons=tuple(r.reasons),
        sizes=s,
        prefill_chunk=chunk,
        prefill_reason=chunk_reason,
    )


def _target_context(s: ModelSizes, context: int | None) -> int:
    """The context to plan for: the asked one, else the default within the model's maximum."""
    target = (
        context if context is not None else min(DEFAULT_CONTEXT, s.max_context or DEFAULT_CONTEXT)
    )
    if target < 1:
        raise PlanRefused("context", f"context must be at least 1 token, got {target}")
    if s.max_context and target > s.max_context:
        raise PlanRefused(
            "context", f"{s.name} supports at most {s.max_context} tokens, asked for {target}"
        )
    return target


def _resident_weights(r: _Request) -> int:
    """Bytes of the always-resident weights: on disk if the model is there, else from the config."""
    s = r.s
    resident = (
        max(s.weights_on_disk - s.expert_bytes, 0)
        if s.weights_on_disk is not None
        else s.resident_bytes
    )
    r.reasons.append(
        (
            "widths fixed by the conversion"
            if r.widths_fixed
            else "default widths by role: " + _default_widths_text(s)
            if s.widths == RoleWidths()
            else "widths as requested"
        )
        + f": {gb(resident + s.expert_bytes)} of weights, {gb(resident)} always resident"
    )
    return resident


def _choose_kv_modes(r: _Request) -> dict:
    """The KV mode per layer kind: the override, else the ">20% rule" at the target context."""
    s, m, share, target = r.s, r.m, r.share, r.target
    compressible = any(k.kind == "full" for k in s.kv)
    if r.kv_mode is not None:
        if r.kv_mode not in m.kv_modes:
            raise PlanRefused("kv-mode", _kv_mode_refusal(r.kv_mode, m))
        if r.kv_mode != kvcache.FLOAT and not compressible:
            raise PlanRefused(
                "kv-mode",
                f"{s.name} has no full-attention KV to compress (its layers: {', '.join(k.kind for k in s.kv) or 'none'})",
            )
        r.reasons.append(f"KV mode {r.kv_mode} as requested")
        return _full_layers(s, r.kv_mode)
    if not s.kv:
        r.reasons.append("no attention KV cache (recurrent layers only)")
        return {}
    modes = _fp16(s)
    if compressible and share.share > SHARE_THRESHOLD:
        if m.fused_kernels:
            modes = _compressed(s, m, prefer_lossless=True)
            r.reasons.append(
                f"KV attention is {share.share:.0%} of decode time at {target} tokens "
                f"({share.label}: {share.detail}) > {SHARE_THRESHOLD:.0%}: compress full-attention KV ({modes['full']})"
            )
        else:
            r.reasons.append(
                f"KV attention is {share.share:.0%} of decode time at {target} tokens ({share.label}), "
                f"but {m.backend} has no fused IsoQuant kernels, so compressing would not speed decode: fp16"
            )
    else:
        r.reasons.append(
            f"KV attention is {share.share:.0%} of decode time at {target} tokens "
            f"({share.label}: {share.detail}) <= {SHARE_THRESHOLD:.0%}: KV stays fp16"
        )
    if any(k.kind != "full" for k in s.kv):
        kinds = ", ".join(f"{k.layers} {k.kind}" for k in s.kv if k.kind != "full")
        r.reasons.append(f"{kinds} layers keep fp16 KV (bounded window or latent cache)")
    return modes


def _fit_kv(r: _Request, b: _Budget, modes: dict) -> tuple[dict, int]:
    """Whether the KV fits beside the weights and the pager's minimum: if not, compress it
    (when the mode is the planner's), then cut the context (when it was not asked for).
    Returns (modes, context limit)."""
    s, m, target = r.s, r.m, r.target
    need_min = min_expert_budget(s)

    def fits(ctx: int, md: dict) -> bool:
        return b.left_for_experts(ctx, md) >= need_min

    fixed_min = b.fixed(min(target, MIN_CONTEXT))
    if fixed_min + need_min > m.usable:
        raise r.too_large(
            "model",
            f"{s.name}'s always-resident weights ({gb(b.resident)}), runtime and the pager's minimum "
            f"expert set ({gb(need_min)}) do not fit",
            fixed_min + need_min,
        )
    if fits(target, modes):
        return modes, target
    kv_need = s.kv_bytes(target, modes, PREFILL_CHUNK)
    compressible = any(k.kind == "full" for k in s.kv)
    if r.kv_mode is None and compressible and modes.get("full") == kvcache.FLOAT:
        comp = _compressed(s, m, prefer_lossless=True)
        if not fits(target, comp):
            comp = _compressed(s, m, prefer_lossless=False)
        r.reasons.append(
            f"fp16 KV at {target} tokens ({gb(kv_need)}) would not fit beside the weights: "
            f"compress full-attention KV ({comp['full']}, {gb(s.kv_bytes(target, comp, PREFILL_CHUNK))})"
        )
        modes = comp
    if fits(target, modes):
        return modes, target
    if r.context is not None:
        raise r.too_large(
            "context",
            f"KV for {target} tokens ({', '.join(f'{k} {v}' for k, v in modes.items())}) does not fit beside the weights",
            b.fixed(target) + s.kv_bytes(target, modes, PREFILL_CHUNK) + need_min,
            m.usable,
        )
    context_limit = _largest_context(target, lambda c: fits(c, modes))
    if context_limit < MIN_CONTEXT:
        raise r.too_large(
            "model" if r.kv_mode is None else "kv-mode",
            f"not even {MIN_CONTEXT} tokens of KV fit beside the weights",
            b.fixed(MIN_CONTEXT) + s.kv_bytes(MIN_CONTEXT, modes, PREFILL_CHUNK) + need_min,
        )
    r.reasons.append(
        f"context limited to {context_limit} tokens (the KV for {target} does not fit)"
    )
    return modes, context_limit


def _choose_expert_budget(r: _Request, left: int) -> int:
    """The resident expert budget: what is left after weights and KV, or the override if it fits."""
    s = r.s
    if r.expert_budget is None:
        return expert_budget_for_speed(s, r.m, left, r.reasons)
    need_min = min_expert_budget(s)
    want = parse_size(r.expert_budget) if isinstance(r.expert_budget, str) else int(r.expert_budget)
    if not s.moe_layers:
        raise PlanRefused("expert-budget", f"{s.name} has no routed experts")
    if want > left:
        raise r.too_large(
            "expert-budget",
            f"a {gb(want)} expert budget does not fit beside the weights and KV",
            want,
            left,
        )
    if want < need_min:
        raise PlanRefused(
            "expert-budget",
            f"a {gb(want)} expert budget is below the pager's minimum ({gb(need_min)}: one token's "
            f"{s.experts_per_token} experts x {s.moe_layers} layers + one whole layer)",
            need_min,
            want,
        )
    budget = min(want, s.expert_bytes)
    r.reasons.append(f"expert budget {gb(budget)} as requested")
    return budget


def _note_experts(r: _Request, budget: int) -> None:
    """Say whether the routed experts are paged, and what fixed state recurrent layers hold."""
    s = r.s
    if s.moe_layers:
        if budget < s.expert_bytes:
            frac = budget / s.expert_bytes
            r.reasons.append(
                f"routed experts ({gb(s.expert_bytes)}) do not fit: page them from SSD with a "
                f"{gb(budget)} LRU budget ({frac:.0%} of experts resident; one token uses "
                f"{s.experts_per_token} of {s.experts_per_layer} per layer)"
            )
        else:
            r.reasons.append(f"all routed experts fit in memory ({gb(s.expert_bytes)}): paging off")
    if s.recurrent_state_bytes:
        r.reasons.append(
            f"{s.recurrent_layers} recurrent layers hold {gb(s.recurrent_state_bytes)} of fixed state"
        )


def _note_machine(r: _Request, b: _Budget, context_limit: int, budget: int) -> None:
    """What this machine adds: Metal's working-set cap, free memory now, disk to convert."""
    s, m = r.s, r.m
    if m.backend == "metal" and m.working_set is not None:
        r.reasons.append(
            f"Metal working set {gb(m.working_set)}{' (estimated)' if m.simulated else ''} caps the engine below RAM less the reserve"
        )
    if m.available is not None and m.available < b.fixed(context_limit) + budget:
        r.reasons.append(
            f"only {gb(m.available)} is free right now: close other apps before loading"
        )
    if s.weights_on_disk is None and m.free_disk is not None and m.free_disk < s.total_bytes:
        r.reasons.append(f"converting needs {gb(s.total_bytes)} of disk, {gb(m.free_disk)} free")


def _choose_prefill_chunk(
    r: _Request, b: _Budget, context_limit: int, modes: dict, budget: int
) -> tuple[int, str]:
    """5. The prefill step: larger where the memory the plan leaves unused covers it."""
    s, m = r.s, r.m
    headroom = (
        m.usable - b.fixed(context_limit) - s.kv_bytes(context_limit, modes, PREFILL_CHUNK) - budget
    )
    chunk, why = prefill_chunk(s, m, context_limit, headroom, modes)
    r.reasons.append(why)
    return chunk, why


def _peak(b: _Budget, budget: int, modes: dict, context_limit: int, chunk: int) -> dict:
    """The expected peak memory by part (Plan.PEAK_PARTS), prefilling `chunk` tokens a step."""
    s, m = b.s, b.m
    return {
        "dense_weights": b.resident,
        "resident_experts": budget,
        "kv_cache": s.kv_bytes(context_limit, modes, chunk),
        "recurrent_state": s.recurrent_state_bytes,
        "activations": activation_bytes(s, context_limit, m, chunk),
        "runtime": m.runtime_base + COMPUTE_ALLOWANCE,
        "os_gui_reserve": m.reserve,
    }


def prefill_chunk_for(
    model: str | os.PathLike | dict,
    machine: Machine | None = None,
    context: int | None = None,
    expert_budget: int | None = None,
) -> tuple[int, str]:
    """Tokens per prefill step for a model (folder, config name or config dict) on this machine,
    as its plan would choose; the smallest step where no plan fits."""
    try:
        if isinstance(model, dict):
            plan = make_plan(
                compute(model, name=model.get("model_type", "")),
                machine or Machine.detect(),
                context,
                expert_budget=expert_budget,
            )
        else:
            plan = plan_model(model, machine, context, expert_budget=expert_budget)
    except (PlanRefused, ValueError, OSError) as e:
        return PREFILL_CHUNK, f"prefill in {PREFILL_CHUNK}-token steps: no plan fits ({e})"
    return plan.prefill_chunk, plan.prefill_reason


def _largest_context(target: int, ok) -> int:
    """The largest multiple of 256 tokens <= target that passes `ok` (binary search)."""
    lo, hi = 0, target // 256
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid * 256):
            lo = mid
        else:
            hi = mid - 1
    return lo * 256


def _smallest_ram(s, m, context, kv_mode, expert_budget, widths_fixed, share) -> int | None:
    for g in STANDARD_RAM_GIB:
        if g * GiB <= m.ram:
            continue
        try:
            make_plan(
                s,
                m.with_ram(g * GiB),
                context,
                kv_mode=kv_mode,
                expert_budget=expert_budget,
                widths_fixed=widths_fixed,
                share=share,
                _search_smallest=False,
            )
        except PlanRefused:
            continue
        return g * GiB
    return None


def plan_model(
    model: str | os.PathLike,
    machine: Machine | None = None,
    context: int | None = None,
    *,
    kv_mode: str | None = None,
    expert_budget: int | str | None = None,
    widths: RoleWidths | str | None = None,
) -> Plan:
    """Plan a model folder, a config.json or a known config name (see sizes.load_config).
    A converted folder's widths are fixed; a measured attention profile is used if cached."""
    machine = machine or Machine.detect()
    config, name, path = load_config(model)
    folder = path.parent if path.name == "config.json" and Path(model).is_dir() else None
    converted = folder is not None and _is_converted(folder)
    if isinstance(widths, str):
        widths = RoleWidths.parse(widths)
    base = sizes_for(model)
    if widths is not None and converted and widths != base.widths:
        raise PlanRefused(
            "widths",
            f"{name} is converted at {_describe(base.widths)}; other widths need a new conversion",
        )
    s = base if widths is None else compute(config, widths, name=name)
    target = (
        context if context is not None else min(DEFAULT_CONTEXT, s.max_context or DEFAULT_CONTEXT)
    )
    share = None
    if folder is not None and not machine.simulated:
        # a measured profile applies only to the machine it was measured on
        from .backend import detect

        b = detect()
        share = share_for(s, target, folder, b.name, b.device)
    return make_plan(
        s,
        machine,
        context,
        kv_mode=kv_mode,
        expert_budget=expert_budget,
        widths_fixed=converted,
        share=share,
    )


def _is_converted(folder: Path) -> bool:
    from .manifest import Manifest

    try:
        man = Manifest.load(folder)
    except Exception:
        return False
    return man is not None and bool(man.roles)


def _default_widths_text(s: ModelSizes) -> str:
    """The default widths of the roles this model has (no shared experts for most MoEs)."""
    parts = {
        "dense": "dense 4-bit",
        "routed": "routed experts 2-bit",
        "shared": "shared experts 8-bit",
        "keep_float": "norms/routers float",
    }
    return ", ".join(t for r, t in parts.items() if s.params.get(r, 0) > 0)


def _describe(w: RoleWidths) -> str:
    return ", ".join(f"{r} {_bits(w[r])}" for r in ROLES)
