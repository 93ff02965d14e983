"""Cache policies for the expert pool, compared by simulation on routing traces (plain Python).

The pager's pool is shared by every MoE layer, so a policy sees (layer, expert) keys in decode
order: for each token, layer after layer, that layer's k experts (all of one layer's experts
are pinned together, so a layer's own keys are never evicted by each other).
- lru: least recently used (what `ExpertLRU` does),
- slru: segmented LRU, frequency-aware: a key used again while resident moves to a protected
  segment (80% of the slots, less if probation would hold under two tokens' keys); new keys
  enter probation and are evicted first,
- os: no slot pool beyond the step: the OS page cache holds the same bytes (Linux and macOS
  keep active / inactive lists, an SLRU of about half and half), and every use, hit or not,
  is a copy out of it (`copy_s` per record in `token_seconds`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

POLICIES = ("lru", "slru", "os")


class _LRU:
    def __init__(self, slots: int):
        self.slots, self.d = slots, OrderedDict()

    def access(self, key) -> bool:
        if key in self.d:
            self.d.move_to_end(key)
            return True
        self.d[key] = None
        if len(self.d) > self.slots:
            self.d.popitem(last=False)
        return False


class _SLRU:
    """What `lru.ExpertSLRU` does (without pins): all slots shared, probation evicted first."""

    def __init__(self, slots: int, protected: float, probation_min: int = 1):
        # probation must outlive a token's keys, or nothing is ever used twice in it
        self.slots = slots
        self.cap_p = max(0, min(slots - probation_min, int(slots * protected)))
        self.prob, self.prot = OrderedDict(), OrderedDict()

    def access(self, key) -> bool:
        if key in self.prot:
            self.prot.move_to_end(key)
            return True
        if key in self.prob:
            del self.prob[key]
            self.prot[key] = None
            while len(self.prot) > self.cap_p:  # demoted: probation's newest
                old, _ = self.prot.popitem(last=False)
                self.prob[old] = None
            return True
        if len(self.prob) + len(self.prot) >= self.slots:
            (self.prob if self.prob else self.prot).popitem(last=False)
        self.prob[key] = None
        return False


def make_cache(policy: str, slots: int, per_token: int = 1):
    """`per_token`: keys one token uses (all layers): probation holds at least two tokens'."""
    if slots < 1:
        raise ValueError(f"a cache needs at least one slot, got {slots}")
    if policy == "lru":
        return _LRU(slots)
    if policy == "slru":
        return _SLRU(slots, 0.8, 2 * per_token)
    if policy == "os":
        return _SLRU(slots, 0.5, 2 * per_token)
    raise ValueError(f"unknown policy {policy!r} (have {POLICIES})")


@dataclass(frozen=True)
class SimResult:
    policy: str
    slots: int
    hit_rate: float
    misses_per_token: float  # records read from the disk per token
    copies_per_token: float  # records copied out of the page cache per token (os only)


def simulate(policy: str, traces: dict[int, np.ndarray], slots: int, warmup: int = 0) -> SimResult:
    """Run `traces` (layer -> [steps, k]) through one pool of `slots` experts; hit rate over
    the steps after `warmup`."""
    layers = sorted(traces)
    cache = make_cache(policy, slots, sum(traces[x].shape[1] for x in layers))
    steps = min(len(t) for t in traces.values())
    hits = total = 0
    for t in range(steps):
        for lay in layers:
            for e in traces[lay][t].tolist():
                hit = cache.access((lay, e))
                if t >= warmup:
                    total += 1
                    hits += hit
    n = max(1, steps - warmup)
    misses = (total - hits) / n
    return SimResult(
        policy, slots, hits / total if total else 0.0, misses, hits / n if policy == "os" else 0.0
    )


def token_seconds(
    r: SimResult, base_s: float, record_bytes: int, disk_Bps: float, copy_Bps: float
) -> float:
    """Expected seconds per token: the rest of the step plus reads from the disk and copies
    out of the page cache."""
    return (
        base_s
        + r.misses_per_token * record_bytes / disk_Bps
        + r.copies_per_token * record_bytes / copy_Bps
    )
