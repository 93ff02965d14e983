"""Routed experts on disk: the record format (`records`) and the LRU pager (`load_paged`)."""


def load_paged(folder, budget_bytes, **options):
    """See `app.engine.offload.load.load_paged` (imported lazily: MLX loads on first use)."""
    from .load import load_paged as _load_paged

    return _load_paged(folder, budget_bytes, **options)
