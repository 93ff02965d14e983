"""mlx-lm cache protocol over the ZipFusion store, and the attention dispatch that reads it.

One `ZipFusionCache` per layer, all sharing one `ZipStore`. Prefill (several tokens, one sequence)
returns dense K/V and runs mlx-lm's own attention; decode (one token per sequence, a batch of
sequences of different lengths) runs the fused paged kernel through `zipfusion_sdpa`, which
`install_attention(model)` puts into the model's modules (they import
`scaled_dot_product_attention` by name from `mlx_lm.models.base`).
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from .store import ZipStore

_base_sdpa = mlx_base.scaled_dot_product_attention


class ZipFusionCache(_BaseCache):
    """Layer `layer` of a ZipStore. `store.begin(seq_ids)` selects the sequences of a forward
    pass and `store.commit()` writes it; between the two the model calls this cache."""

    def __init__(self, store: ZipStore, layer: int):
        self.store = store
        self.layer = layer

    @property
    def offset(self):
        # Tokens staged at this layer before its update are the previous (uncommitted) step's.
        st = self.store.staged[self.layer]
        pending = st[0].shape[2] if st is not None else 0
        lengths = [n + pending for n in self.store.lengths]
        if len(lengths) == 1:
            return lengths[0]
        return mx.array(lengths, dtype=mx.int32)  # per-sequence RoPE offsets

    def update_and_fetch(self, keys, values):
        if self.layer == 0 and self.store.auto_sid is not None:
            self.store.auto_step()  # single-sequence use through mlx-lm's own generate loop
        self.store.stage(self.layer, keys, values)
        if keys.shape[2] == 1:
            return keys, values  # decode: zipfusion_sdpa reads the pages, these are unused
        return self.store.dense_kv(self.layer)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("ZipFusion does not support sliding-window attention layers")
        if N > 1 and len(self.store.lengths) != 1:
            raise ValueError("ZipFusion prefills one sequence at a time")
        return create_attention_mask(N, self.offset if N > 1 else 0, return_array, None)

    def is_trimmable(self):
        return False

    def empty(self):
        return all(self.store.seqs[s].length == 0 for s in self.store.active)

    @property
    def nbytes(self):
        # The pool is shared: each layer reports its share so sums over layers are honest.
        return self.store.nbytes // self.store.cfg.n_layers

    @property
    def state(self):
        # mlx-lm evaluates `state` after each prefill chunk: evaluating the staged K/V is what
        # lets the next commit write the pool in place. The pool itself is not saved.
        staged = self.store.staged[self.layer]
        return list(staged) if staged is not None else []

    @state.setter
    def state(self, v):
        raise NotImplementedError("a ZipFusion cache cannot be restored from a saved state")


def _make_dispatch(fallback):
    def zipfusion_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        """mlx-lm's `scaled_dot_product_attention`, dispatching ZipFusion caches to the pages."""
        if isinstance(cache, ZipFusionCache) and queries.shape[2] == 1:
            if sinks is not None:
                raise ValueError("ZipFusion attention does not support attention sinks")
            return cache.store.attend(cache.layer, queries, scale)
        kw = {"sinks": sinks} if sinks is not None else {}
        return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    zipfusion_sdpa.zipfusion_fallback = fallback
    return zipfusion_sdpa


zipfusion_sdpa = _make_dispatch(_base_sdpa)


def install_attention(model) -> list[str]:
    """Point every model module that imported mlx-lm's attention at a ZipFusion dispatch that
    falls back to whatever was there (mlx-lm's, or another KV mode's dispatch). Idempotent;
    returns the module names patched."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    patched = []
    for name in sorted(names):
        mod = sys.modules.get(name)
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if fn is None or hasattr(fn, "zipfusion_fallback"):
            continue
        mod.scaled_dot_product_attention = (
            zipfusion_sdpa if fn is _base_sdpa else _make_dispatch(fn)
        )
        patched.append(name)
    return patched
