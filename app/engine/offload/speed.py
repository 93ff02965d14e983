"""Expected decode speed of a paged model at an expert budget (the planner's cost model).

step = resident step (the bytes a token reads / memory bandwidth)
     + one index read-back per MoE layer while paging (the host must learn the experts)
     + misses copied out of the OS page cache + misses read from the disk.
Records the pool drops stay in the page cache while memory allows: pool and page cache
together act as one cache of everything the process leaves free (`memory`), so misses of
the pool that the larger cache would hit are copies, the rest disk reads.
Plain Python: no MLX.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# hit rate of the shared pool (segmented LRU, the pager's policy) at a fraction of all experts
# on trace routing (8 layers of 512 experts, 10 a token; policy.simulate("slru", ...) after
# 150 warm-up tokens)
TRACE_HITS = (
    (0.0, 0.0),
    (0.02, 0.371),
    (0.05, 0.561),
    (0.1, 0.658),
    (0.25, 0.744),
    (0.5, 0.823),
    (0.75, 0.897),
    (0.9, 0.941),
    (1.0, 1.0),
)


@dataclass(frozen=True)
class Costs:
    mem_Bps: float  # bytes a decode step reads per second (resident step)
    readback_s: float  # one router read-back while paging
    copy_Bps: float  # a record out of the OS page cache
    disk_Bps: float  # a record from the SSD (parallel preads)


# readback: mlx-lm issue 1438 (Metal: 63% of a 58 ms token over 48 layers), the H200 (41 ms
# a token over 48 layers); bandwidths are conservative figures for each kind of machine (CUDA's
# copy: the pinned record files' driver copies, 25-29 GB/s on the H200, docs/pager.md)
BACKEND_COSTS = {
    "metal": Costs(mem_Bps=200e9, readback_s=0.75e-3, copy_Bps=20e9, disk_Bps=5e9),
    "cuda": Costs(mem_Bps=2000e9, readback_s=0.85e-3, copy_Bps=20e9, disk_Bps=2e9),
    "cpu": Costs(mem_Bps=30e9, readback_s=0.05e-3, copy_Bps=5e9, disk_Bps=2e9),
}


def records_pin(file_bytes: int, available: int) -> bool:
    """Whether the pager page-locks the record files on CUDA (PagerOptions.pin_records left
    at None): they must fit in half the host's available memory. Where they do, misses are
    resolved on the GPU (device-resolved paging) and copied from host memory over the bus."""
    return file_bytes <= available // 2


def trace_hit_rate(fraction: float) -> float:
    """Interpolated TRACE_HITS at `fraction` of all experts resident (clamped to [0, 1])."""
    f = min(1.0, max(0.0, fraction))
    xs = [x for x, _ in TRACE_HITS]
    i = bisect.bisect_left(xs, f)
    if xs[i] == f:
        return TRACE_HITS[i][1]
    (x0, y0), (x1, y1) = TRACE_HITS[i - 1], TRACE_HITS[i]
    return y0 + (y1 - y0) * (f - x0) / (x1 - x0)


def step_seconds(
    budget: int,
    memory: int,
    expert_bytes: int,
    active_bytes: int,
    moe_layers: int,
    experts_per_token: int,
    record_bytes: int,
    costs: Costs,
) -> float:
    """Expected seconds per decoded token with `budget` bytes of experts resident and
    `memory` >= budget bytes left free by the process (pool + page cache)."""
    t = active_bytes / costs.mem_Bps
    if budget >= expert_bytes:
        return t
    pairs = moe_layers * experts_per_token
    miss_pool = (1 - trace_hit_rate(budget / expert_bytes)) * pairs
    miss_all = (1 - trace_hit_rate(memory / expert_bytes)) * pairs
    return (
        t
        + moe_layers * costs.readback_s
        + (miss_pool - miss_all) * record_bytes / costs.copy_Bps
        + miss_all * record_bytes / costs.disk_Bps
    )
