"""Loading a converted folder with every expert resident: the safetensors through mlx-lm, the
routed experts stacked back from their records (`app.engine.offload.records`).

A converted folder keeps routed experts only in `experts/*.bin` (the pager's format), so plain
mlx-lm loading would miss them; `load_converted` is the fully resident path, and the pager
replaces the expert modules instead.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from ..errors import ModelLoadError
from ..offload.records import ExpertRecordError, ExpertStore


def is_converted(folder: str | os.PathLike) -> bool:
    """Whether `folder` keeps its routed experts in records (needs `load_converted`)."""
    from ..manifest import Manifest

    m = Manifest.load(folder)
    return bool(m is not None and m.experts)


def expert_weights(folder: str | os.PathLike, section: dict | None = None,
                   verify: bool = False) -> dict:
    """All routed experts of a converted folder as mlx-lm parameters (stacked per module)."""
    out = {}
    with ExpertStore(folder, section) as store:
        for layer in store.layers:
            if verify:
                for e in range(store.layout(layer).num_experts):
                    store.verify(layer, e)
            module = store.layout(layer).module
            for name, arr in store.read_layer(layer).items():
                out[f"{module}.{name}"] = arr
    return out


def load_converted(folder: str | os.PathLike, lazy: bool = False, verify: bool = False):
    """Load a converted folder fully resident -> `LoadedModel`; folders without expert records
    go through `app.engine.loader.load` unchanged."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    from ..loader import LoadedModel, check_folder, load

    path = Path(folder).resolve()
    config, manifest = check_folder(path)
    if manifest is None or not manifest.experts:
        return load(path, lazy=lazy)
    try:
        # strict=False: the routed experts are not in the safetensors; the strict check below
        # covers dense and experts together.
        model, config = load_model(path, lazy=True, strict=False)
        weights = {}
        for wf in sorted(glob.glob(str(path / "model*.safetensors"))):
            weights.update(mx.load(wf))
        if hasattr(model, "sanitize"):
            weights = model.sanitize(weights)
        weights.update(expert_weights(path, manifest.experts, verify=verify))
        model.load_weights(list(weights.items()), strict=True)
    except ExpertRecordError:
        raise
    except ValueError as e:
        raise ModelLoadError(f"weights do not match config.json: {e}", str(path)) from e
    except (OSError, RuntimeError) as e:
        raise ModelLoadError(f"could not read weights: {e}", str(path)) from e
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizers raise many types; all mean the same to the user
        raise ModelLoadError(f"could not load the tokenizer: {e}", str(path)) from e
    return LoadedModel(model, tokenizer, config, path, manifest)
