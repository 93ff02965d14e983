"""Loading a converted folder with every expert resident: the safetensors through mlx-lm, the
routed experts stacked back from their records (`app.engine.offload.records`).

A converted folder keeps routed experts only in `experts/*.bin` (the pager's format), so plain
mlx-lm loading would miss them; `load_converted` is the fully resident path, and the pager
replaces the expert modules instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..offload.records import ExpertStore


def is_converted(folder: str | os.PathLike) -> bool:
    """Whether `folder` keeps its routed experts in records (needs `load_converted`)."""
    from ..manifest import Manifest

    m = Manifest.load(folder)
    return bool(m is not None and m.experts)


def expert_weights(folder: str | os.PathLike, section: dict | None = None,
                   verify: bool = True) -> dict:
    """All routed experts of a converted folder as mlx-lm parameters (stacked per module);
    `verify` checks every record's CRC as it is read (no second pass over the files)."""
    out = {}
    with ExpertStore(folder, section) as store:
        for layer in store.layers:
            module = store.layout(layer).module
            for name, arr in store.read_layer(layer, verify=verify).items():
                out[f"{module}.{name}"] = arr
    return out


def load_converted(folder: str | os.PathLike, lazy: bool = False, verify: bool = True):
    """Load a converted folder fully resident -> `LoadedModel`; folders without expert records
    go through `app.engine.loader.load` unchanged."""
    import mlx.core as mx

    from ..loader import (
        LoadedModel,
        check_folder,
        folder_tokenizer,
        load,
        sanitized_weights,
        weight_errors,
    )

    path = Path(folder).resolve()
    config, manifest = check_folder(path)
    if manifest is None or not manifest.experts:
        return load(path, lazy=lazy)
    # the strict load covers dense and experts together
    with weight_errors(path):
        model, config, weights = sanitized_weights(path)
        weights.update(expert_weights(path, manifest.experts, verify=verify))
        model.load_weights(list(weights.items()), strict=True)
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    return LoadedModel(model, folder_tokenizer(path, config), config, path, manifest)
