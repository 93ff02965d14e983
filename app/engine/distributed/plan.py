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
from .hosts import Hosts

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

    def __post_init__(self):
        covered = sorted(s.layers for s in self.stages)
        if any(a[1] != b[0] for a, b in itertools.pairwise(covered)) or covered[0][0] != 0:
            raise ValueError(f"stages {covered} do not cover the layers contiguously")
        for s in self.stages:
            if s.peak > s.usable:
                raise ValueError(f"{s.host}: expected peak {gb(s.peak)} exceeds {gb(s.usable)}")

    @property
    def split(self) -> list[int]:
        return [s.layers[1] - s.layers[0] for s in self.stages]

    @property
    def paging(self) -> bool:
        return any(s.paging for s in self.stages)

    @property
    def seconds_per_token(self) -> float:
        return sum(s.seconds_per_token for s in self.stages) + self.link_seconds_per_token

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds_per_token

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "ranks": len(self.stages),
            "split": self.split,
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
            f"  split (layers per rank, rank 0 first): {self.split}",
            f"  KV: {', '.join(f'{k} {m}' for k, m in self.kv_modes.items()) or 'none'}; "
            f"context {self.context}",
            f"  expected decode: {self.tok_s:.1f} tok/s",
        ]
        for s in self.stages:
            lines.append(
                f"  rank {s.rank} {s.host}: layers {s.layers[0]}-{s.layers[1] - 1}, "
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


def plan_split(
    model: str,
    hosts: list[HostSpec],
    link: Link,
    context: int | None = None,
    kv_mode: str | None = None,
    split: list[int] | None = None,
) -> DistPlan:
    """The best pipeline split of `model` over `hosts` (rank 0 first), or the given `split`."""
    config, name, _ = load_config(model)
    s = sizes_for(model)
    if len(hosts) > s.layers:
        raise PlanRefused("hosts", f"{len(hosts)} hosts for {s.layers} layers")
    # KV mode and context: the single-machine rules on the first host
    try:
        base = make_plan(s, hosts[0].machine, context, kv_mode=kv_mode)
        modes, ctx = dict(base.kv_modes), base.context_limit
    except PlanRefused:  # the model may fit only when split: keep the wanted context, fp16
        modes, ctx = {k.kind: "fp16" for k in s.kv}, context or 8192
    layers, replicated = layer_bytes(config, s, ctx, modes)
    act_bytes = s.float_bytes * s.hidden_size  # one token's hidden state
    best = None
    for cand in [split] if split else _splits(s.layers, hosts):
        stages, hi = [], s.layers
        for r, host in enumerate(hosts):
            lo = hi - cand[r]
            overhead = (
                activation_bytes(s, ctx, host.machine)
                + host.machine.runtime_base
                + COMPUTE_ALLOWANCE
            )
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


def _with_reasons(p: DistPlan, s: ModelSizes, replicated: int) -> DistPlan:
    from dataclasses import replace

    r = [
        f"{gb(s.total_bytes)} of weights ({gb(s.expert_bytes)} routed experts) over "
        f"{len(p.stages)} machines, {gb(sum(x.usable for x in p.stages))} usable together",
        f"pipeline split {p.split} (rank 0 runs the last layers, as mlx-lm); every rank keeps "
        f"the embedding, final norm and head ({gb(replicated)})",
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
    r.append(
        f"link {p.link.name}: {2 * (len(p.stages) - 1)} messages per token "
        f"({p.link_bytes_per_token} bytes) at {p.link.latency_us:g} us = "
        f"{p.link_seconds_per_token * 1e3:.2f} ms per token ({p.link.source})"
    )
    mem = sum(x.read_per_token for x in p.stages)
    ssd = sum(x.miss_per_token for x in p.stages)
    r.append(
        f"per token: {gb(mem)} read from memory"
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
) -> DistPlan:
    return plan_split(model, host_specs(hosts, backend, ram), link_for(hosts), context, kv_mode)


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
