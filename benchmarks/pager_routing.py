"""Routing modes for the pager benchmarks: the experts each MoE layer uses, forced.

    trace   skewed, temporally correlated choices (app.engine.offload.trace: a per-layer LRU
            of 16/32/64/128 of 512 hits 49/59/68/71%)
    random  k distinct experts uniformly at random per token: the worst case for any cache
    model   the model's own router (a random model fed random tokens routes near-randomly)

`force_routing(model, experts_section, mode)` wraps every expert module (mlx-lm's SwitchGLU /
SwitchMLP or the pager's twin) so that its indices come from the mode's stream; the router's
gate scores stay the model's. The forced indices keep a data dependency on the router's
output (`+ 0 * indices`), so a paged step still waits for the router as it would.
The same seed gives the same experts to the resident and the paged model.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from app.engine.offload.trace import expert_trace

MODES = ("trace", "random", "model")


def expert_stream(mode: str, num_experts: int, k: int, steps: int, seed: int) -> np.ndarray:
    """[steps, k] expert ids of one layer."""
    if mode == "trace":
        return expert_trace(num_experts, k, steps, seed=seed)
    if mode == "random":
        rng = np.random.default_rng(seed)
        return np.stack([rng.choice(num_experts, k, replace=False) for _ in range(steps)])
    raise ValueError(f"unknown routing mode {mode!r} (have {MODES})")


class ForcedRouting(nn.Module):
    """An expert module whose (x, indices) calls use the next rows of `stream` instead
    (None: the router's own indices)."""

    def __init__(self, inner, stream: np.ndarray | None):
        super().__init__()
        self.inner = inner
        self.restart(stream)

    def restart(self, stream: np.ndarray | None) -> None:
        self._stream = None if stream is None else stream.astype(np.uint32)
        self._t = 0

    def __call__(self, x, indices):
        if self._stream is None:
            return self.inner(x, indices)
        n = int(np.prod(indices.shape[:-1]))
        rows = np.take(self._stream, np.arange(self._t, self._t + n), axis=0, mode="wrap")
        self._t += n
        forced = mx.array(rows).reshape(indices.shape) + indices.astype(mx.uint32) * 0
        return self.inner(x, forced)


def force_routing(model, experts_section: dict, mode: str, steps: int = 4096, seed: int = 0) -> int:
    """Route every layer in `experts_section` (the manifest's) by `mode` from the stream's
    start (again on every call: the same experts for every run); returns how many layers.
    `model` (or "off") hands routing back to the model's router."""
    modules = dict(model.named_modules())
    n = 0
    for key, lay in experts_section["layers"].items():
        path = lay["module"]
        mod = modules[path]
        stream = (
            None
            if mode in ("model", "off")
            else expert_stream(
                mode, int(lay["num_experts"]), _top_k(model, path), steps, seed * 100003 + int(key)
            )
        )
        if isinstance(mod, ForcedRouting):
            mod.restart(stream)
        else:
            parent_path, _, attr = path.rpartition(".")
            parent = modules[parent_path] if parent_path else model
            setattr(parent, attr, ForcedRouting(mod, stream))
        n += 1
    return n


def _top_k(model, path: str) -> int:
    args = getattr(model, "args", None)
    for name in ("num_experts_per_tok", "top_k", "moe_top_k"):
        v = getattr(args, name, None)
        if v:
            return int(v)
    raise ValueError(f"{path}: cannot tell how many experts a token uses")
