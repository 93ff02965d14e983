"""Trace routing: expert choices that look like a real router's, for pager benchmarks.

A random model fed random tokens routes uniformly at random, the worst case for any cache.
Real routers are skewed (a few experts take much of the traffic) and repeat across
neighbouring tokens. A trace draws each token's k distinct experts of one layer from three
sources:
- repeat: one of the previous token's experts (temporal correlation),
- hot: a per-layer hot set (Zipf-weighted within it: skew),
- tail: any expert not used in the last `tail_gap` tokens (rare experts recur only after long
  gaps, so a bigger cache gains little from them).
The defaults are fitted so that a per-layer LRU of 16 / 32 / 64 / 128 of 512 experts with 10
routed per token hits 49 / 59 / 68 / 71% (flash-moe's measured router; tests/test_trace.py
checks it). Other expert counts scale the hot set and the gap by the same fractions.
Plain Python and numpy: no MLX.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

CALIBRATION = {16: 0.49, 32: 0.59, 64: 0.68, 128: 0.71}  # LRU slots of 512 -> hit rate, k=10
REF_EXPERTS, REF_K = 512, 10


@dataclass(frozen=True)
class TraceParams:
    repeat: float = 0.35  # share of picks that repeat one of the previous token's experts
    hot: float = 0.36  # share drawn from the layer's hot set
    hot_size: int = 48  # of 512 experts
    hot_skew: float = 1.0  # Zipf exponent inside the hot set
    tail_gap: int = 64  # tokens before a tail expert may recur (512 experts, k = 10)

    def __post_init__(self):
        if not (0 <= self.repeat and 0 <= self.hot and self.repeat + self.hot <= 1):
            raise ValueError("repeat and hot are shares: each >= 0, together <= 1")


def expert_trace(
    num_experts: int, k: int, steps: int, seed: int = 0, params: TraceParams | None = None
) -> np.ndarray:
    """[steps, k] expert ids of one layer, distinct within each row."""
    p = params or TraceParams()
    if not 0 < k <= num_experts:
        raise ValueError(f"k must be in 1..{num_experts}, got {k}")
    rng = np.random.default_rng(seed)
    scale = num_experts / REF_EXPERTS
    hot_size = max(1, min(num_experts - k, round(p.hot_size * scale)))
    # the tail must leave experts to draw: at most half of the non-hot ones excluded
    tail_draws = max(1.0, (1 - p.repeat - p.hot) * k)
    gap = int(min(round(p.tail_gap * scale * REF_K / k), (num_experts - hot_size) / 2 / tail_draws))
    hot = rng.permutation(num_experts)[:hot_size]
    w = 1.0 / np.arange(1, hot_size + 1) ** p.hot_skew
    cdf = np.cumsum(w / w.sum())
    last = np.full(num_experts, -(1 << 30))
    out = np.empty((steps, k), dtype=np.int64)
    prev = None
    for t in range(steps):
        row: list[int] = []
        u = rng.random(8 * k)  # source choices; more are drawn if a row needs them
        i = 0
        while len(row) < k:
            if i == len(u):
                u, i = rng.random(8 * k), 0
            x, i = u[i], i + 1
            if prev is not None and x < p.repeat:
                e = int(prev[rng.integers(k)])
            elif x < p.repeat + p.hot:
                e = int(hot[min(hot_size - 1, int(np.searchsorted(cdf, rng.random())))])
            else:
                e = int(rng.integers(num_experts))
                if t - last[e] < gap:
                    continue
            if e not in row:
                row.append(e)
        out[t] = row
        last[row] = t
        prev = out[t]
    return out


def lru_hit_rate(trace: np.ndarray, slots: int) -> float:
    """Hit rate of a per-layer LRU of `slots` experts on `trace` [steps, k]."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for row in trace.tolist():
        for e in row:
            total += 1
            if e in cache:
                cache.move_to_end(e)
                hits += 1
            else:
                cache[e] = None
                if len(cache) > slots:
                    cache.popitem(last=False)
    return hits / total if total else 0.0


def model_traces(
    layers: list[int], num_experts: int, k: int, steps: int, seed: int = 0
) -> dict[int, np.ndarray]:
    """One independent trace per MoE layer (layer index -> [steps, k])."""
    return {lay: expert_trace(num_experts, k, steps, seed=seed * 100003 + lay) for lay in layers}
