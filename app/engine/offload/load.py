"""`load_paged`: a converted folder with its routed experts paged from disk (SPEC §3)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelLoadError
from .layers import install
from .pager import BudgetError, ExpertPager, PagerOptions
from .records import ExpertStore


def load_paged(folder: str | os.PathLike, budget_bytes: int, **options):
    """Load the converted model at `folder` with at most `budget_bytes` of routed experts
    resident -> `LoadedModel`; `model.rq_pager` is the `ExpertPager` (`.stats()`).
    Options: the fields of `PagerOptions` (verify, read_threads, always_resolve, zero_copy,
    drop_page_cache)."""
    import mlx.core as mx

    from ..loader import (
        LoadedModel,
        check_folder,
        folder_tokenizer,
        load_exact,
        sanitized_weights,
        weight_errors,
    )

    opts = PagerOptions(**options)
    path = Path(folder).resolve()
    config, manifest = check_folder(path)
    if manifest is None or not manifest.experts:
        raise ModelLoadError(
            "not a converted model with expert records (experts/*.bin): "
            "convert it first, or load it fully resident",
            str(path),
        )
    store = ExpertStore(path, manifest.experts)
    # BudgetError is a ValueError but the user's to mend, not a weights mismatch
    with weight_errors(path, keep=(BudgetError,)):
        # the routed experts' randomly initialised stand-ins (lazy) are dropped unevaluated
        # when the modules are swapped
        model, config, weights = sanitized_weights(path)
        pager = ExpertPager(store, budget_bytes, opts)
        install(model, pager)
        load_exact(model, weights)
    model.eval()
    mx.eval(model.parameters())
    model.rq_pager = pager
    return LoadedModel(model, folder_tokenizer(path, config), config, path, manifest)
