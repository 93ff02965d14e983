"""A converted folder's routed experts as mlx-lm parameters, stacked back from their records
(`app.engine.offload.records`).

A converted folder keeps routed experts only in `experts/*.bin` (the pager's format), so plain
mlx-lm loading would miss them: `loader.load` adds these parameters (every expert resident),
and the pager replaces the expert modules instead.
"""

from __future__ import annotations

import os

from ..offload.records import ExpertStore


def is_converted(folder: str | os.PathLike) -> bool:
    """Whether `folder` keeps its routed experts in records (stacked back by `loader.load`)."""
    from ..manifest import Manifest

    m = Manifest.load(folder)
    return bool(m is not None and m.experts)


def expert_weights(
    folder: str | os.PathLike, section: dict | None = None, verify: bool = True
) -> dict:
    """All routed experts of a converted folder as mlx-lm parameters (stacked per module)."""
    out = {}
    with ExpertStore(folder, section) as store:
        for layer in store.layers:
            module = store.layout(layer).module
            for name, arr in store.read_layer(layer, verify=verify).items():
                out[f"{module}.{name}"] = arr
    return out
