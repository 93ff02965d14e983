"""Pager statistics, per MoE layer and in total, as plain numbers (the worker streams them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

_SUMMED = (
    "hits",
    "misses",
    "reads",
    "bytes_read",
    "read_s",
    "readback_s",
    "readbacks",
    "host_s",
    "evictions",
    "resident",
    "split_calls",
)


@dataclass
class LayerStats:
    # Hits and misses count routed (token, expert) pairs: a pair is a miss when its expert had
    # to be read for the call that routed it (a prompt's pairs share one read per expert).
    hits: int = 0
    misses: int = 0
    reads: int = 0  # expert records read from disk
    bytes_read: int = 0
    read_s: float = 0.0  # host time stalled on reads (pread, CRC, copy into the slot)
    readback_s: float = 0.0  # host time waiting for the router's indices (`.tolist()` sync)
    readbacks: int = 0  # index read-backs (zero on the all-resident path)
    host_s: float = 0.0  # host time in the pager's bookkeeping (pins, LRU, slot remap)
    evictions: int = 0  # experts of this layer evicted to make room
    resident: int = 0  # experts of this layer resident now
    split_calls: int = 0  # calls whose experts exceeded the pool: run in groups of experts

    def to_dict(self, slot_bytes: int) -> dict:
        d = asdict(self)
        d["resident_bytes"] = self.resident * slot_bytes
        pairs = self.hits + self.misses
        d["hit_rate"] = self.hits / pairs if pairs else None
        return d


def total(layers: dict[int, LayerStats], slot_bytes: dict[int, int]) -> dict:
    """Sum of the per-layer figures (resident_bytes with each layer's own slot size)."""
    out: dict = {k: 0 for k in _SUMMED}
    out["resident_bytes"] = 0
    for layer, st in layers.items():
        for k in _SUMMED:
            out[k] += getattr(st, k)
        out["resident_bytes"] += st.resident * slot_bytes[layer]
    pairs = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / pairs if pairs else None
    return out


def per_token(out: dict, tokens: int, token_s: float) -> dict:
    """Per forward pass: ms by part (reads, read-backs, the pager's host bookkeeping and the
    rest: graph building and compute not waited for in read-backs), MB/s of reads."""
    if not tokens:
        return {"tokens": 0, "ms_per_token": None, "read_MBps": None}
    parts = {"reads": out["read_s"], "readbacks": out["readback_s"], "pager_host": out["host_s"]}
    ms = {k: 1000 * v / tokens for k, v in parts.items()}
    ms["rest"] = max(0.0, 1000 * token_s / tokens - sum(ms.values()))
    ms["total"] = 1000 * token_s / tokens
    return {
        "tokens": tokens,
        "ms_per_token": ms,
        "read_MBps": out["bytes_read"] / out["read_s"] / 1e6 if out["read_s"] else None,
    }
