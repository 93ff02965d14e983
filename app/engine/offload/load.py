"""`load_paged`: a converted folder with its routed experts paged from disk (SPEC §3)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from ..errors import ModelLoadError
from .layers import install
from .pager import BudgetError, ExpertPager, PagerOptions
from .records import ExpertRecordError, ExpertStore


def load_paged(folder: str | os.PathLike, budget_bytes: int, **options):
    """Load the converted model at `folder` with at most `budget_bytes` of routed experts
    resident -> `LoadedModel`; `model.rq_pager` is the `ExpertPager` (`.stats()`).
    Options: the fields of `PagerOptions` (verify, read_threads, always_resolve, zero_copy,
    drop_page_cache)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, load_tokenizer

    from ..loader import LoadedModel, check_folder

    opts = PagerOptions(**options)
    path = Path(folder).resolve()
    config, manifest = check_folder(path)
    if manifest is None or not manifest.experts:
        raise ModelLoadError("not a converted model with expert records (experts/*.bin): "
                             "convert it first, or load it fully resident", str(path))
    store = ExpertStore(path, manifest.experts)
    try:
        # lazy + strict=False: the routed experts are not in the safetensors, and their
        # randomly initialised stand-ins are dropped unevaluated when the modules are swapped
        model, config = load_model(path, lazy=True, strict=False)
        weights = {}
        for wf in sorted(glob.glob(str(path / "model*.safetensors"))):
            weights.update(mx.load(wf))
        if hasattr(model, "sanitize"):
            weights = model.sanitize(weights)
        pager = ExpertPager(store, budget_bytes, opts)
        install(model, pager)
        expected = {k for k, _ in tree_flatten(model.parameters())}
        missing = sorted(expected - set(weights))
        extra = sorted(set(weights) - expected)
        if missing or extra:
            what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
            raise ValueError(f"{what} ({len(missing)} missing, {len(extra)} unexpected)")
        model.load_weights(list(weights.items()), strict=True)
    except (ExpertRecordError, BudgetError):
        raise
    except ValueError as e:
        raise ModelLoadError(f"weights do not match config.json: {e}", str(path)) from e
    except (OSError, RuntimeError) as e:
        raise ModelLoadError(f"could not read weights: {e}", str(path)) from e
    model.eval()
    mx.eval(model.parameters())
    model.rq_pager = pager
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizers raise many types; all mean the same to the user
        raise ModelLoadError(f"could not load the tokenizer: {e}", str(path)) from e
    return LoadedModel(model, tokenizer, config, path, manifest)
