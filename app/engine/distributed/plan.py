"""Planning one model over a list of machines: where to split, what still pages, how fast.

Built on the single-machine planner: `make_plan` on the first host decides the KV mode and the
context (its rules do not change with the split), `Machine` gives each host's usable memory,
`activation_bytes` a rank's transients, and the per-tensor size list (`sizes.tensors`) gives
each layer's bytes. A pipeline rank holds its layers, their KV and state, and a copy of the
embedding, final norm and head (mlx-lm's sharded_load keeps them on every stage).

Expected speed, one sequence, decode: the ranks run one after another, so a token takes the
sum over ranks of (bytes read / memory bandwidth + expert misses / SSD bandwidth), plus the
link: 2 (N-1) messages per token (N-1 sends of the hidden state, then an N-1-step ring
all_gather), each costing the link's latency plus its bytes over the link's bandwidth.
Misses assume uniform routing (an LRU holding a fraction f of a layer's experts misses 1 - f
of the time): real routing is skewed, so paging estimates are a floor on tok/s.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from ..planner import (
    COMPUTE_ALLOWANCE,
    GiB,
    Machine,
    PlanRefused,
    activation_bytes,
    gb,
    make_plan,
    parse_size,
)
from ..sizes import ModelSizes, load_config, sizes_for, tensors
from .hosts import SPLITS, Hosts

_LAYER = re.compile(r"layers\.(\d+)\.")
# An M4 Pro Mac mini (the 32 GB Mac of Apple's TN3205 cluster): 273 GB/s unified memory
# (Apple's spec) and ~5 GB/s reads from its internal SSD (measured figures in reviews).
DEFAULT_MEM_GBPS = 273.0
DEFAULT_SSD_GBPS = 5.0
EXHAUSTIVE_RANKS = 4  # up to this many hosts every split is tried; above, memory-proportional


@dataclass(frozen=True)
class Link:
    name: str
    gbps: float  # bits per second / 1e9 the link carries
    latency_us: float  # one message, one hop, as published
    source: str = ""

    def __post_init__(self):
        if self.gbps <= 0 or self.latency_us < 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0 and latency >= 0")

    def seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)


LINKS = {
    # ring backend: TCP/IP over the Thunderbolt bridge
    "thunderbolt5": Link(
        "thunderbolt5",
        80.0,
        300.0,
        "TCP/IP over Thunderbolt ~300 us per message (Apple TN3205 coverage, exo); "
        "Thunderbolt 5: 80 Gb/s",
    ),
    # JACCL: RDMA over Thunderbolt 5 (macOS 26.2+)
    "thunderbolt5-rdma": Link(
        "thunderbolt5-rdma",
        80.0,
        50.0,
        "RDMA over Thunderbolt 5 under 50 us (Apple TN3205 coverage; "
        "~3 us reported by exo's cluster tests)",
    ),
    "ethernet-10g": Link("ethernet-10g", 10.0, 100.0, "10GbE TCP, typical round trip / 2"),
    "ethernet-1g": Link("ethernet-1g", 1.0, 150.0, "1GbE TCP, typical round trip / 2"),
}


def link_for(hosts: Hosts) -> Link:
    spec = hosts.link
    if isinstance(spec, dict):
        return Link(
            spec.get("name", "custom"),
            float(spec["gbps"]),
            float(spec["latency_us"]),
            spec.get("source", "from hosts.json"),
        )
    name = str(spec)
    if name == "thunderbolt5" and hosts.backend.startswith("jaccl"):
        name = "thunderbolt5-rdma"
    if name not in LINKS:
        raise ValueError(
            f"unknown link {name!r}; presets: {', '.join(LINKS)} "
            '(or {"gbps": .., "latency_us": ..})'
        )
    return LINKS[name]


@dataclass(frozen=True)
class LayerBytes:
    dense: int  # everything of the layer but its routed experts
    experts: int  # all its routed experts
    active: int  # the experts one token uses
    min_experts: int  # top-k plus one whole layer, as min_expert_budget counts
    kv: int  # KV at the plan's context and modes
    state: int  # recurrent (Mamba / DeltaNet) state


def layer_bytes(
    config: dict, s: ModelSizes, context: int, kv_modes: dict
) -> tuple[list[LayerBytes], int]:
    """Bytes of each layer and of what every rank keeps (embedding, final norm, head)."""
    ts, _, _ = tensors(config)
    n = s.layers
    dense, experts = [0] * n, [0] * n
    attn, recur = [False] * n, [False] * n
    replicated = 0
    for t in ts:
        m = _LAYER.search(t.name)
        nbytes = t.nbytes(s.widths[t.role], s.float_bytes)
        if m is None:
            replicated += nbytes
            continue
        i = int(m.group(1))
        if t.expert:
            experts[i] += nbytes
        else:
            dense[i] += nbytes
        attn[i] |= t.name.endswith(("q_proj", "kv_a_proj_with_mqa", "q_a_proj"))
        recur[i] |= ".conv1d" in t.name
    types = config.get("layer_types") or (config.get("text_config") or {}).get("layer_types") or []
    kv_of = {k.kind: k for k in s.kv}
    kv = [0] * n
    for i in range(n):
        if not attn[i] or not kv_of:
            continue
        kind = (
            "sliding"
            if i < len(types) and "sliding" in str(types[i]) and "sliding" in kv_of
            else ("full" if "full" in kv_of else next(iter(kv_of)))
        )
        k = kv_of[kind]
        mode = kv_modes.get(kind, "fp16") if k.compressible(kv_modes.get(kind, "fp16")) else "fp16"
        kv[i] = k.nbytes(context, mode) // max(k.layers, 1)
    per_state = s.recurrent_state_bytes // max(s.recurrent_layers, 1)
    per_expert = s.bytes_per_expert
    out = []
    for i in range(n):
        moe = experts[i] > 0
        out.append(
            LayerBytes(
                dense=dense[i],
                experts=experts[i],
                active=s.experts_per_token * per_expert if moe else 0,
                min_experts=(s.experts_per_token * per_expert) if moe else 0,
                kv=kv[i],
                state=per_state if recur[i] else 0,
            )
        )
    return out, replicated


@dataclass(frozen=True)
class HostSpec:
    label: str
    machine: Machine
    mem_gbps: float = DEFAULT_MEM_GBPS
    ssd_gbps: float = DEFAULT_SSD_GBPS


@dataclass(frozen=True)
class StagePlan:
    rank: int
    host: str
    layers: tuple[int, int]  # [start, end)
    ram: int
    usable: int
    fixed: int  # dense + replicated + KV + state + activations + runtime
    expert_bytes: int
    expert_budget: int
    min_expert_budget: int
    read_per_token: int  # bytes from memory per decoded token
    miss_per_token: int  # expected bytes from SSD per decoded token (uniform routing)
    seconds_per_token: float
    experts: tuple[int, int] | None = None  # an expert split: [lo, hi) of each MoE layer's

    @property
    def paging(self) -> bool:
        return self.expert_budget < self.expert_bytes

    @property
    def peak(self) -> int:
        return self.fixed + self.expert_budget

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "host": self.host,
            "layers": list(self.layers),
            "ram": self.ram,
            "usable": self.usable,
            "fixed_bytes": self.fixed,
            "expert_bytes": self.expert_bytes,
            "expert_budget": self.expert_budget,
            "paging": self.paging,
            "expected_peak": self.peak,
            "read_bytes_per_token": self.read_per_token,
            "ssd_bytes_per_token": self.miss_per_token,
            "seconds_per_token": self.seconds_per_token,
            **({"experts": list(self.experts)} if self.experts else {}),
        }


@dataclass(frozen=True)
class DistPlan:
    model: str
    stages: tuple[StagePlan, ...]  # rank 0 first
    link: Link
    kv_modes: dict
    context: int
    link_bytes_per_token: int
    link_seconds_per_token: float
    reasons: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)
    kind: str = "pipeline"  # or "experts": every rank runs every layer with a share of experts

    def __post_init__(self):
        covered = sorted(s.layers for s in self.stages)
        if self.kind == "experts":
            if any(c != covered[-1] or c[0] != 0 for c in covered):
                raise ValueError(f"an expert split runs every layer on every rank: {covered}")
        elif any(a[1] != b[0] for a, b in itertools.pairwise(covered)) or covered[0][0] != 0:
            raise ValueError(f"stages {covered} do not cover the layers contiguously")
        for s in self.stages:
            if s.peak > s.usable:
                raise ValueError(f"{s.host}: expected peak {gb(s.peak)} exceeds {gb(s.usable)}")

    @property
    def split(self) -> list[int] | str:
        """Layers per rank (rank 0 first), or "experts"."""
        if self.kind == "experts":
            return "experts"
        return [s.layers[1] - s.layers[0] for s in self.stages]

    @property
    def paging(self) -> bool:
        return any(s.paging for s in self.stages)

    @property
    def seconds_per_token(self) -> float:
        # a pipeline's ranks run one after another; an expert split's side by side
        ranks = [s.seconds_per_token for s in self.stages]
        combine = max if self.kind == "experts" else sum
        return combine(ranks) + self.link_seconds_per_token

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds_per_token

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "ranks": len(self.stages),
            "split": self.split,
            "split_kind": self.kind,
            "paging": self.paging,
            "kv_modes": dict(self.kv_modes),
            "context": self.context,
            "link": {
                "name": self.link.name,
                "gbps": self.link.gbps,
                "latency_us": self.link.latency_us,
                "source": self.link.source,
            },
            "link_bytes_per_token": self.link_bytes_per_token,
            "link_seconds_per_token": self.link_seconds_per_token,
            "expected_tok_s": round(self.tok_s, 2),
            "stages": [s.to_dict() for s in self.stages],
            "reasons": list(self.reasons),
            **self.extra,
        }

    def summary(self) -> str:
        lines = [
            f"Plan for {self.model} over {len(self.stages)} machines "
            f"({self.link.name}, {self.link.latency_us:g} us per message)",
            f"  split (layers per rank, rank 0 first): {self.split}"
            if self.kind == "pipeline"
            else "  split: experts (every rank runs every layer with a share of each MoE "
            "layer's routed experts)",
            f"  KV: {', '.join(f'{k} {m}' for k, m in self.kv_modes.items()) or 'none'}; "
            f"context {self.context}",
            f"  expected decode: {self.tok_s:.1f} tok/s",
        ]
        for s in self.stages:
            where = (
                f"experts {s.experts[0]}-{s.experts[1] - 1} of each MoE layer"
                if s.experts
                else f"layers {s.layers[0]}-{s.layers[1] - 1}"
            )
            lines.append(
                f"  rank {s.rank} {s.host}: {where}, "
                f"experts {'paged' if s.paging else 'resident'} {gb(s.expert_budget)} of "
                f"{gb(s.expert_bytes)}, peak {gb(s.peak)} of {gb(s.usable)} usable, "
                f"{s.seconds_per_token * 1e3:.1f} ms/token"
            )
        lines.append("  reasons:")
        lines += [f"    - {r}" for r in self.reasons]
        return "\n".join(lines)


def _stage(
    rank: int,
    host: HostSpec,
    lo: int,
    hi: int,
    layers: list[LayerBytes],
    replicated: int,
    overhead: int,
    embedding: int = 0,
) -> StagePlan | None:
    """The stage of `host` for layers [lo, hi); None when its pager's minimum does not fit."""
    part = layers[lo:hi]
    experts = sum(x.experts for x in part)
    fixed = replicated + sum(x.dense + x.kv + x.state for x in part) + overhead
    need = sum(x.min_experts for x in part) + max((x.experts for x in part), default=0)
    left = host.machine.usable - fixed
    budget = min(max(left, 0), experts)
    if experts and budget < min(need, experts) or left < 0:
        return None
    active = sum(x.active for x in part)
    frac = budget / experts if experts else 1.0
    miss = int(active * (1.0 - frac))
    # every rank reads its layers; the head is computed on all ranks at once (counted once)
    read = sum(x.dense + x.kv + 2 * x.state for x in part) + active - miss
    if rank == 0:
        read += replicated - embedding  # the embedding: one row per token
    t = read / (host.mem_gbps * 1e9) + miss / (host.ssd_gbps * 1e9)
    return StagePlan(
        rank,
        host.label,
        (lo, hi),
        host.machine.ram,
        host.machine.usable,
        fixed,
        experts,
        budget,
        min(need, experts),
        read,
        miss,
        t,
    )


def _splits(n_layers: int, hosts: list[HostSpec]):
    """Candidate splits (layers per rank, rank 0 first)."""
    n = len(hosts)
    if n <= EXHAUSTIVE_RANKS:
        for cuts in itertools.combinations(range(1, n_layers), n - 1):
            bounds = (0, *cuts, n_layers)
            yield [bounds[i + 1] - bounds[i] for i in range(n)][::-1]
        return
    usable = [h.machine.usable for h in hosts]
    share = [max(1, round(n_layers * u / sum(usable))) for u in usable]
    share[0] += n_layers - sum(share)
    yield share


# Architectures whose expert split is built and tested (experts.py: the block's output summed
# over the ranks, a shared expert added by rank 0 only). Not deepseek_v2 (its MoE block is
# deepseek_v3's, but sizes and the converter do not read it), nor qwen3_5_moe (untested).
EXPERT_SPLIT_ARCHS = ("qwen3_moe", "gpt_oss", "nemotron_h", "qwen3_next", "deepseek_v3")


def expert_split_refusal(config: dict, s: ModelSizes, n_hosts: int) -> str | None:
    """Why `config` cannot be split by experts over `n_hosts` ranks; None when it can."""
    arch = config.get("model_type", "?")
    if not s.moe_layers:
        return f"{arch} has no routed experts"
    if arch not in EXPERT_SPLIT_ARCHS:
        return f"{arch}: the expert split is built for {', '.join(EXPERT_SPLIT_ARCHS)}"
    if s.experts_per_layer < n_hosts:
        return f"{s.experts_per_layer} experts per layer for {n_hosts} hosts"
    return None


def _basis(model: str, hosts: list[HostSpec], context: int | None, kv_mode: str | None):
    """What both kinds of split share: sizes, KV modes and context, per-layer bytes."""
    config, name, _ = load_config(model)
    s = sizes_for(model)
    # KV mode and context: the single-machine rules on the first host
    try:
        base = make_plan(s, hosts[0].machine, context, kv_mode=kv_mode)
        modes, ctx = dict(base.kv_modes), base.context_limit
    except PlanRefused:  # the model may fit only when split: keep the wanted context, fp16
        modes, ctx = {k.kind: "fp16" for k in s.kv}, context or 8192
    layers, replicated = layer_bytes(config, s, ctx, modes)
    return config, name, s, modes, ctx, layers, replicated


def _overhead(s: ModelSizes, ctx: int, host: HostSpec) -> int:
    return activation_bytes(s, ctx, host.machine) + host.machine.runtime_base + COMPUTE_ALLOWANCE


def plan_split(
    model: str,
    hosts: list[HostSpec],
    link: Link,
    context: int | None = None,
    kv_mode: str | None = None,
    split: list[int] | str | None = None,
) -> DistPlan:
    """The plan of `model` over `hosts` (rank 0 first): `split` "pipeline" (the best layer
    split), layers per rank, "experts", or "auto"/None: the faster of the two that fit."""
    if split is None or split == "auto":
        return _plan_auto(model, hosts, link, context, kv_mode)
    if split == "experts":
        return plan_experts(model, hosts, link, context, kv_mode)
    if isinstance(split, str) and split != "pipeline":
        raise ValueError(f"unknown split {split!r}: {', '.join(SPLITS)} or layers per rank")
    return plan_pipeline(
        model, hosts, link, context, kv_mode, None if split == "pipeline" else split
    )


def _plan_auto(model, hosts, link, context, kv_mode) -> DistPlan:
    from dataclasses import replace

    pipe = err = None
    try:
        pipe = plan_pipeline(model, hosts, link, context, kv_mode)
    except PlanRefused as e:
        err = e
    if len(hosts) == 1:
        if pipe is None:
            raise err
        return pipe
    config, _, _ = load_config(model)
    why_not = expert_split_refusal(config, sizes_for(model), len(hosts))
    exp = None
    if why_not is None:
        try:
            exp = plan_experts(model, hosts, link, context, kv_mode)
        except PlanRefused as e:
            why_not = f"does not fit: {e.reason}"
    if exp is None:
        if pipe is None:
            raise err
        return replace(pipe, reasons=(*pipe.reasons, f"expert split not chosen: {why_not}"))
    if pipe is None or exp.tok_s > pipe.tok_s:
        why = (
            f"the pipeline does not fit ({err.reason})"
            if pipe is None
            else f"{exp.tok_s:.1f} tok/s against the pipeline's {pipe.tok_s:.1f}: the ranks "
            f"read (and page) their experts side by side, which pays more than "
            f"{exp.link_seconds_per_token * 1e3:.2f} ms of all_sums costs"
        )
        return replace(exp, reasons=(*exp.reasons, f"expert split chosen: {why}"))
    return replace(
        pipe,
        reasons=(
            *pipe.reasons,
            f"pipeline chosen over the expert split ({exp.tok_s:.1f} tok/s expected): its "
            f"{exp.extra['all_sums_per_token']} all_sums per token cost "
            f"{exp.link_seconds_per_token * 1e3:.2f} ms on this link, more than reading the "
            "experts side by side saves",
        ),
    )


def plan_pipeline(
    model: str,
    hosts: list[HostSpec],
    link: Link,
    context: int | None = None,
    kv_mode: str | None = None,
    split: list[int] | None = None,
) -> DistPlan:
    """The best pipeline split of `model` over `hosts` (rank 0 first), or the given `split`."""
    config, name, s, modes, ctx, layers, replicated = _basis(model, hosts, context, kv_mode)
    if len(hosts) > s.layers:
        raise PlanRefused("hosts", f"{len(hosts)} hosts for {s.layers} layers")
    act_bytes = s.float_bytes * s.hidden_size  # one token's hidden state
    best = None
    for cand in [split] if split else _splits(s.layers, hosts):
        stages, hi = [], s.layers
        for r, host in enumerate(hosts):
            lo = hi - cand[r]
            overhead = _overhead(s, ctx, host)
            st = _stage(r, host, lo, hi, layers, replicated, overhead, s.embedding_bytes)
            if st is None:
                break
            stages.append(st)
            hi = lo
        if len(stages) != len(hosts):
            continue
        t = sum(x.seconds_per_token for x in stages)
        # ties (nothing pages, same bytes): keep the most headroom on the fullest host
        key = (round(t, 6), max(x.peak / x.usable for x in stages))
        if best is None or key < best[0]:
            best = (key, stages, cand)
    if best is None:
        total = sum(h.machine.usable for h in hosts)
        raise PlanRefused(
            "hosts",
            f"{name} does not fit on these {len(hosts)} machines with any "
            f"split (usable together {gb(total)}; always-resident weights "
            f"{gb(s.resident_bytes)} + the pagers' minimum)",
        )
    _, stages, cand = best
    n = len(hosts)
    msgs = 2 * (n - 1)
    link_bytes = 2 * (n - 1) * act_bytes  # each rank's send, and the all_gather's N-1 blocks
    link_s = msgs * link.latency_us * 1e-6 + link_bytes * 8 / (link.gbps * 1e9)
    plan = DistPlan(
        name,
        tuple(stages),
        link,
        modes,
        ctx,
        link_bytes,
        link_s,
        extra={"weights_bytes": s.total_bytes, "expert_bytes": s.expert_bytes},
    )
    return _with_reasons(plan, s, replicated)


def _expert_stage(
    rank: int,
    host: HostSpec,
    share: tuple[int, int],
    s: ModelSizes,
    layers: list[LayerBytes],
    replicated: int,
    overhead: int,
) -> StagePlan | None:
    """Rank `rank` of an expert split: every layer's dense part, KV and state, the embedding
    and head, and experts [lo, hi) of each MoE layer; None when its pager's minimum does not
    fit. Its experts' share of a token's routed experts is k * n / E (uniform routing), plus
    one: the rows routed to other ranks run on a local expert and are zeroed (experts.py)."""
    lo, hi = share
    n_e, E, k = hi - lo, s.experts_per_layer, s.experts_per_token
    per = s.bytes_per_expert
    moe = [x for x in layers if x.experts]
    experts = sum(x.experts * n_e // E for x in moe)
    fixed = replicated + sum(x.dense + x.kv + x.state for x in layers) + overhead
    need = len(moe) * min(k, n_e) * per + max((x.experts * n_e // E for x in moe), default=0)
    left = host.machine.usable - fixed
    budget = min(max(left, 0), experts)
    if left < 0 or budget < min(need, experts):
        return None
    active = int(len(moe) * min(n_e, k * n_e / E + 1) * per)
    frac = budget / experts if experts else 1.0
    miss = int(active * (1.0 - frac))
    read = sum(x.dense + x.kv + 2 * x.state for x in layers) + active - miss
    read += replicated - s.embedding_bytes  # every rank computes the head (side by side)
    t = read / (host.mem_gbps * 1e9) + miss / (host.ssd_gbps * 1e9)
    n = len(layers)
    return StagePlan(
        rank,
        host.label,
        (0, n),
        host.machine.ram,
        host.machine.usable,
        fixed,
        experts,
        budget,
        min(need, experts),
        read,
        miss,
        t,
        experts=share,
    )


def plan_experts(
    model: str,
    hosts: list[HostSpec],
    link: Link,
    context: int | None = None,
    kv_mode: str | None = None,
) -> DistPlan:
    """`model` split by experts over `hosts`: every rank holds every layer's dense weights and
    KV, and experts [lo_r, hi_r) of each MoE layer (experts.expert_ranges); each MoE layer
    ends in one all_sum of the hidden state. Ranks run side by side: a token costs the slowest
    rank plus the all_sums (a ring: 2 (N-1) messages of 1/N of the state each)."""
    config, name, s, modes, ctx, layers, replicated = _basis(model, hosts, context, kv_mode)
    n = len(hosts)
    why_not = expert_split_refusal(config, s, n)
    if why_not:
        raise PlanRefused("hosts", f"no expert split for {name}: {why_not}")
    E = s.experts_per_layer
    base, extra = divmod(E, n)
    stages, lo = [], 0
    for r, host in enumerate(hosts):
        hi = lo + base + (1 if r < extra else 0)
        st = _expert_stage(r, host, (lo, hi), s, layers, replicated, _overhead(s, ctx, host))
        if st is None:
            raise PlanRefused(
                "hosts",
                f"{name} split by experts does not fit {host.label} ({gb(host.machine.usable)} "
                f"usable): each rank keeps every dense weight, the KV and its share of experts",
            )
        stages.append(st)
        lo = hi
    act_bytes = s.float_bytes * s.hidden_size
    sums = s.moe_layers
    msgs = sums * 2 * (n - 1)
    link_bytes = sums * 2 * (n - 1) * act_bytes  # all ranks: 2 (N-1)/N of the state each
    link_s = msgs * link.latency_us * 1e-6 + sums * 2 * (n - 1) * act_bytes / n * 8 / (
        link.gbps * 1e9
    )
    plan = DistPlan(
        name,
        tuple(stages),
        link,
        modes,
        ctx,
        link_bytes,
        link_s,
        extra={
            "weights_bytes": s.total_bytes,
            "expert_bytes": s.expert_bytes,
            "all_sums_per_token": sums,
            "messages_per_token": msgs,
        },
        kind="experts",
    )
    return _with_reasons(plan, s, replicated)


def _with_reasons(p: DistPlan, s: ModelSizes, replicated: int) -> DistPlan:
    from dataclasses import replace

    r = [
        f"{gb(s.total_bytes)} of weights ({gb(s.expert_bytes)} routed experts) over "
        f"{len(p.stages)} machines, {gb(sum(x.usable for x in p.stages))} usable together",
        f"pipeline split {p.split} (rank 0 runs the last layers, as mlx-lm); every rank keeps "
        f"the embedding, final norm and head ({gb(replicated)})"
        if p.kind == "pipeline"
        else f"expert split: every rank runs every layer (dense weights, embedding, head and "
        f"KV on each, {gb(p.stages[0].fixed)} with runtime) with 1/{len(p.stages)} of each MoE "
        f"layer's routed experts; the ranks run side by side",
    ]
    for x in p.stages:
        if x.expert_bytes == 0:
            r.append(f"{x.host}: no routed experts in its layers")
        elif x.paging:
            r.append(
                f"{x.host}: its experts ({gb(x.expert_bytes)}) do not fit beside "
                f"{gb(x.fixed)} of weights, KV and runtime: page them with a "
                f"{gb(x.expert_budget)} budget ({x.expert_budget / x.expert_bytes:.0%} resident)"
            )
        else:
            r.append(
                f"{x.host}: all its experts resident ({gb(x.expert_bytes)}), "
                f"{gb(x.usable - x.peak)} to spare"
            )
    msgs = p.extra.get("messages_per_token", 2 * (len(p.stages) - 1))
    if p.kind == "experts":
        r.append(
            f"{p.extra['all_sums_per_token']} all_sums per token (one per MoE layer), a ring's "
            f"2 (N-1) messages each: pays only where a message is cheap (RDMA) or where the "
            "ranks page, since their SSDs then read side by side"
        )
    r.append(
        f"link {p.link.name}: {msgs} messages per token "
        f"({p.link_bytes_per_token} bytes) at {p.link.latency_us:g} us = "
        f"{p.link_seconds_per_token * 1e3:.2f} ms per token ({p.link.source})"
    )
    mem = sum(x.read_per_token for x in p.stages)
    ssd = sum(x.miss_per_token for x in p.stages)
    r.append(
        f"per token: {gb(mem)} read from memory"
        + (" (all ranks, side by side)" if p.kind == "experts" else "")
        + (f", {gb(ssd)} from SSD (uniform routing: a floor on speed)" if ssd else "")
        + f" -> {p.tok_s:.1f} tok/s expected"
    )
    return replace(p, reasons=tuple(r))


def host_specs(hosts: Hosts, backend: str = "metal", ram: str | None = None) -> list[HostSpec]:
    """Each host as a simulated machine (the planner's Machine) with its bandwidths."""
    out = []
    for i, h in enumerate(hosts.hosts):
        size = h.ram if h.ram is not None else (parse_size(ram) if ram else None)
        if size is None:
            raise PlanRefused(
                "hosts",
                f"host {h.label} has no `ram` in {hosts.path or 'hosts.json'} (or pass --ram)",
            )
        raw = hosts.raw.get("hosts", [{}] * len(hosts))[i] if hosts.raw else {}
        out.append(
            HostSpec(
                h.label,
                Machine.simulate(size, backend),
                float(raw.get("mem_gbps", DEFAULT_MEM_GBPS)),
                float(raw.get("ssd_gbps", DEFAULT_SSD_GBPS)),
            )
        )
    return out


def plan_hosts(
    model: str,
    hosts: Hosts,
    context: int | None = None,
    kv_mode: str | None = None,
    backend: str = "metal",
    ram: str | None = None,
    split: str | None = None,
) -> DistPlan:
    """`split`: auto (default: hosts.json's `split`, else the faster), pipeline or experts."""
    return plan_split(
        model,
        host_specs(hosts, backend, ram),
        link_for(hosts),
        context,
        kv_mode,
        split or hosts.split,
    )


def single_host_tok_s(model: str, host: HostSpec, context: int | None = None) -> tuple[float, dict]:
    """One machine's plan (make_plan) and its expected tok/s by the same arithmetic."""
    plan = make_plan(sizes_for(model), host.machine, context)
    config, _, _ = load_config(model)
    s = sizes_for(model)
    layers, replicated = layer_bytes(config, s, plan.context_limit, plan.kv_modes)
    overhead = (
        activation_bytes(s, plan.context_limit, host.machine)
        + host.machine.runtime_base
        + COMPUTE_ALLOWANCE
    )
    st = _stage(0, host, 0, s.layers, layers, replicated, overhead, s.embedding_bytes)
    if st is None:
        raise PlanRefused(
            "model", f"{s.name} does not fit one {host.machine.ram // GiB} GB machine"
        )
    return 1.0 / st.seconds_per_token, {"plan": plan.to_dict(), "stage": st.to_dict()}
