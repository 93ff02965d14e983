"""Install IsoQuant attention into a model's own mlx-lm module.

Each mlx-lm model module does `from .base import scaled_dot_product_attention`, so the name
must be replaced in that module. The replacement calls compressed-space attention when the
cache handed back IsoQuantTensor K/V and otherwise calls whatever was installed before it
(mlx-lm's function, or another wrapper), so every other cache behaves exactly as before.
"""

from __future__ import annotations

import functools
import sys

from .attention import IsoQuantTensor, isoquant_attention

_ATTR = "scaled_dot_product_attention"


def make_dispatch(previous):
    @functools.wraps(previous)
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(keys, IsoQuantTensor):
            return isoquant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        return previous(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._isoquant_dispatch = True
    return scaled_dot_product_attention


def _installed(fn) -> bool:
    while fn is not None:
        if getattr(fn, "_isoquant_dispatch", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def install(model) -> list[str]:
    """Idempotently install the dispatch in every module that defines a layer of `model`.
    Returns the names of the modules that use it."""
    names = sorted({type(m).__module__ for m in model.modules()})
    used = []
    for name in names:
        mod = sys.modules.get(name)
        fn = getattr(mod, _ATTR, None)
        if fn is None:
            continue
        if not _installed(fn):
            setattr(mod, _ATTR, make_dispatch(fn))
        used.append(name)
    return used
