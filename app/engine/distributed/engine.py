"""`StageEngine`: the app's Engine on one rank of a pipeline (same generation API and events).

Every rank runs the same `generate` on the same prompt; the hidden state crosses ranks inside
the model call (see stage.py) and each rank samples the same token from the same logits.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx

from .. import kvcache
from ..generate import Engine, GenerationSettings, ModelInfo, _weight_bytes, prepare_model
from .stage import load_stage, local_caches, localize_cache


class StageEngine(Engine):
    def __init__(self, group):
        super().__init__()
        self.group = group

    def load(self, path, options: dict | None = None) -> ModelInfo:
        """`options`: split (layers per rank, rank 0 first), expert_budget (this rank's bytes),
        kv_mode, cpu_float_weights (default True, as Engine.load)."""
        from ..backend import detect

        options = dict(options or {})
        t0 = time.perf_counter()
        lm = load_stage(
            path, self.group, split=options.get("split"), expert_budget=options.get("expert_budget")
        )
        # blocks stay uncompiled: a stage's layers are swapped for stand-ins and transfers
        prepare_model(
            lm.model, float_dense=options.get("cpu_float_weights", True), compile_blocks=False
        )
        self.unload()
        self.loaded = lm
        self.default_kv_mode = options.get("kv_mode") or "fp16"
        stage = lm.model.rq_stage
        self.info = ModelInfo(
            path=str(lm.path),
            name=Path(lm.path).name,
            architecture=lm.architecture,
            num_layers=stage.num_layers,
            weight_bytes=_weight_bytes(lm.model),
            kv_modes=kvcache.names(detect().name, offered=True),
            backend=detect().name,
            load_seconds=time.perf_counter() - t0,
            extra={
                "stage": stage.to_dict(),
                "expert_budget": options.get("expert_budget"),
                "default_kv_mode": self.default_kv_mode,
            },
        )
        return self.info

    def make_cache(self, settings: GenerationSettings, tokens: int = 8192) -> list:
        model = self._require().model
        return localize_cache(model, model.rq_stage, super().make_cache(settings, tokens))

    @staticmethod
    def cache_nbytes(cache: list | None) -> int:
        # a remote slot repeats a local cache: count each cache object once
        seen = {id(c): c for c in cache or []}
        return Engine.cache_nbytes(list(seen.values()))

    def kv_stats(self) -> dict:
        # the last cache repeats local caches in remote slots: count this rank's own once
        full = self.last_cache
        self.last_cache = self.local_cache(full) if full else full
        try:
            return super().kv_stats()
        finally:
            self.last_cache = full

    def local_cache(self, cache: list) -> list:
        model = self._require().model
        return local_caches(model, model.rq_stage, cache)


def broadcast_ids(ids: list[int] | None, group) -> list[int]:
    """Rank 0's token ids on every rank (others pass None); [] ends the session."""
    root = group.rank() == 0
    n = mx.distributed.all_sum(
        mx.array([len(ids) if root and ids else 0], dtype=mx.int32), group=group
    ).item()
    if n == 0:
        return []
    arr = mx.array(ids if root else [0] * n, dtype=mx.int32)
    return mx.distributed.all_sum(arr, group=group).tolist()
