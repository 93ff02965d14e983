"""One rank's stage of a pipeline split: its contiguous layers, loaded alone, wired to the others.

The convention is mlx-lm's (`models/pipeline.py`): rank r runs the layers after those of ranks
r+1 … N-1, so rank N-1 runs the first layers and rank 0 the last. mlx-lm's own pipeline lives
in each model's `__call__` (qwen3_moe, qwen3_next, not gpt_oss or nemotron_h), so instead of
editing models the stage swaps modules in the model's layer list, keeping every call signature:

- a layer of another rank becomes a `RemoteLayer` (no weights; returns its input);
- the first local layer receives the hidden state from rank r+1 (`recv_like`), the last local
  one sends it to rank r-1 (`send`), and the model's last layer ends in an `all_gather` so that
  every rank holds rank 0's final hidden state: norm, head and sampling run everywhere and all
  ranks draw the same token.

Caches: a remote layer's slot in the prompt cache is filled by a local cache of the same kind
(the model builds its masks from fixed slots, e.g. gpt_oss `cache[ga_idx]`, and every cache of a
rank has the same offset), so KV and Mamba state exist only where their layer runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # as mlx-lm's sharded_load matches them
_INNER = ("model", "backbone", "language_model")  # where mlx-lm models keep `.layers`


def even_split(num_layers: int, size: int) -> list[int]:
    """Layers per rank, rank 0 first; the low ranks get the extra layers (mlx-lm's rule)."""
    if size < 1 or size > num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {size} ranks")
    base, extra = divmod(num_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def stage_range(split: list[int], rank: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s layers under `split` (layers per rank, rank 0 first)."""
    if any(s <= 0 for s in split):
        raise ValueError(f"split {split}: every rank needs at least one layer")
    start = sum(split[rank + 1 :])
    return start, start + split[rank]


def layer_of_key(name: str) -> int | None:
    m = _LAYER_KEY.search(name)
    return int(m.group(1)) if m else None


def layer_list(model) -> list:
    """The model's own list of decoder layers (mutable: the stage swaps entries in place)."""
    for name in _INNER:
        inner = getattr(model, name, None)
        if inner is not None and isinstance(getattr(inner, "layers", None), list):
            return inner.layers
        if inner is not None and isinstance(getattr(inner, "model", None), nn.Module):
            layers = getattr(inner.model, "layers", None)
            if isinstance(layers, list):
                return layers
    raise ValueError(f"{type(model).__module__}: no list of layers found to split")


def _plain_attrs(layer) -> dict:
    """Scalar attributes models read while looping (nemotron_h `block_type`, qwen3_next
    `is_linear`): the stand-ins carry them."""
    return {
        k: v
        for k, v in vars(layer).items()
        if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None)))
    }


class RemoteLayer(nn.Module):
    """A layer that runs on another rank: no weights, the hidden state passes through."""

    def __init__(self, like: nn.Module):
        from ..kvcache.reach import attention_class

        super().__init__()
        for k, v in _plain_attrs(like).items():
            object.__setattr__(self, k, v)
        # the KV modes judge a layer by its attention, which runs on the layer's own rank
        object.__setattr__(self, "rq_attention_class", attention_class(like))

    def __call__(self, x, *args, **kwargs):
        return x


@dataclass
class Traffic:
    """Bytes this rank puts on the link, counted as the graph is built (shapes are known)."""

    sent: int = 0
    steps: int = 0
    tokens: int = 0


class StageLayer(nn.Module):
    """A layer of this rank (or the model's last, remote or not) with the pipeline's transfers
    around it: receive before, send after, gather the final hidden state after the last."""

    def __init__(
        self,
        layer: nn.Module,
        group,
        recv_from: int | None,
        send_to: int | None,
        gather: bool,
        traffic: Traffic,
    ):
        super().__init__()
        self.layer = layer
        for k, v in _plain_attrs(layer).items():
            object.__setattr__(self, k, v)
        self._group = group
        self._recv_from, self._send_to, self._gather = recv_from, send_to, gather
        self._traffic = traffic

    def __call__(self, x, *args, **kwargs):
        g = self._group
        if self._recv_from is not None:
            x = mx.distributed.recv_like(x, self._recv_from, group=g)
            self._traffic.steps += 1
            self._traffic.tokens += x.shape[0] * x.shape[1]
        x = self.layer(x, *args, **kwargs)
        if self._send_to is not None:
            x = mx.distributed.send(x, self._send_to, group=g)
            self._traffic.sent += x.nbytes
            # mlx-lm's prefill evaluates only the cache states, which on this rank do not depend
            # on the send: run it now or the next rank waits for ever (a prefill chunk of one
            # token looks like a decode step, so every step does it)
            mx.eval(x)
        if self._gather:
            # ring all_gather: each rank forwards the N-1 other ranks' blocks once
            self._traffic.sent += (g.size() - 1) * x.nbytes
            x = mx.distributed.all_gather(x, group=g)[: x.shape[0]]
        return x


@dataclass
class Stage:
    """Where this rank sits in the pipeline."""

    rank: int
    size: int
    split: list[int]
    num_layers: int
    traffic: Traffic = field(default_factory=Traffic)

    def __post_init__(self):
        if len(self.split) != self.size:
            raise ValueError(
                f"split {self.split} has {len(self.split)} entries for {self.size} ranks"
            )
        if sum(self.split) != self.num_layers:
            raise ValueError(f"split {self.split} must sum to {self.num_layers} layers")
        self.start, self.end = stage_range(self.split, self.rank)

    def local(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "size": self.size,
            "split": list(self.split),
            "layers": [self.start, self.end],
        }


def drop_remote_layers(model, stage: Stage) -> None:
    """Replace every layer outside the stage by a weightless stand-in (before weights load)."""
    layers = layer_list(model)
    for i, layer in enumerate(layers):
        if not stage.local(i):
            layers[i] = RemoteLayer(layer)


def wire(model, stage: Stage, group) -> None:
    """Put the transfers around the stage's first and last layers and the model's last (after
    weights load: the wrapper moves parameter paths)."""
    layers = layer_list(model)
    r, n, last = stage.rank, stage.size, len(layers) - 1
    ends = {stage.start, stage.end - 1, last}
    for i in sorted(ends):
        layers[i] = StageLayer(
            layers[i],
            group,
            recv_from=r + 1 if i == stage.start and r < n - 1 else None,
            send_to=r - 1 if i == stage.end - 1 and r > 0 else None,
            gather=i == last and n > 1,
            traffic=stage.traffic,
        )


def cache_owners(model, n_caches: int) -> list[int]:
    """The layer index of each prompt-cache slot (nemotron_h keeps slots only for its Mamba and
    attention blocks; other models one per layer)."""
    layers = layer_list(model)
    if n_caches == len(layers):
        return list(range(n_caches))
    owners = [
        i for i, layer in enumerate(layers) if getattr(layer, "block_type", None) in ("M", "*")
    ]
    if len(owners) != n_caches:
        raise ValueError(f"cannot map {n_caches} cache slots onto {len(layers)} layers")
    return owners


class RemoteCache:
    """The slot of a remote layer when this rank has no cache of that kind: holds nothing; the
    model still builds a (then unused) mask from it."""

    offset = 0

    def make_mask(self, *args, **kwargs):
        return None

    @property
    def state(self):
        return []

    @property
    def nbytes(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return n


def localize_cache(model, stage: Stage, caches: list) -> list:
    """The prompt cache with each remote slot filled by a local cache of the same kind."""
    owners = cache_owners(model, len(caches))
    local = [c for c, i in zip(caches, owners, strict=True) if stage.local(i)]
    out = []
    for c, i in zip(caches, owners, strict=True):
        if stage.local(i):
            out.append(c)
            continue
        twin = next((x for x in local if _kind(x) == _kind(c)), None)
        out.append(twin if twin is not None else RemoteCache())
    return out


def _kind(c) -> tuple:
    return type(c).__name__, getattr(c, "max_size", None)


def local_caches(model, stage: Stage, caches: list) -> list:
    """The caches whose layers run here (each once): what this rank's KV bytes are."""
    owners = cache_owners(model, len(caches))
    return [c for c, i in zip(caches, owners, strict=True) if stage.local(i)]


def experts_section(section: dict, stage: Stage) -> dict:
    """A converted folder's `experts` manifest section restricted to the stage's layers."""
    layers = {k: v for k, v in section["layers"].items() if stage.local(int(k))}
    return dict(section, layers=layers)


def load_stage(
    path: str | Path,
    group,
    split: list[int] | str | None = None,
    expert_budget: int | None = None,
):
    """Load only this rank's layers of the model folder `path` (plain mlx-lm or converted;
    converted experts resident or paged within `expert_budget` bytes on this rank); `split`:
    layers per rank, rank 0 first (default even), or "experts": every layer with this rank's
    share of each MoE layer's experts (experts.py) -> `LoadedModel` with `model.rq_stage`."""

    from ..errors import EngineError, ModelLoadError
    from ..loader import (
        LoadedModel,
        check_folder,
        folder_tokenizer,
        load_exact,
        sanitized_weights,
        weight_errors,
    )
    from ..offload.pager import BudgetError

    path = Path(path).resolve()
    if split == "experts":
        from .experts import load_expert_shard

        return load_expert_shard(path, group, expert_budget)
    if split == "pipeline":
        split = None
    if isinstance(split, str):
        raise EngineError(f"unknown split {split!r}: pipeline, experts or layers per rank")
    config, manifest = check_folder(path)
    section = manifest.experts if manifest is not None and manifest.experts else None
    if expert_budget is not None and section is None:
        raise ModelLoadError(
            "an expert budget needs a converted MoE model (rotaryquant convert)", str(path)
        )
    with weight_errors(path, keep=(BudgetError,)):
        model, config, weights = sanitized_weights(path)
        n = len(layer_list(model))
        size = group.size()
        try:
            stage = Stage(group.rank(), size, list(split) if split else even_split(n, size), n)
        except ValueError as e:  # the user's split, not the weights
            raise EngineError(str(e)) from e
        drop_remote_layers(model, stage)
        weights = {
            k: v for k, v in weights.items() if (i := layer_of_key(k)) is None or stage.local(i)
        }
        pager = None
        if section is not None:
            mine = experts_section(section, stage)
            if expert_budget is None:
                from ..quant.converted import expert_weights

                weights.update(expert_weights(path, mine))
            elif mine["layers"]:
                from ..offload.layers import install
                from ..offload.pager import ExpertPager, PagerOptions
                from ..offload.records import ExpertStore

                pager = ExpertPager(ExpertStore(path, mine), int(expert_budget), PagerOptions())
                install(model, pager)
        load_exact(model, weights)
    model.eval()
    mx.eval(model.parameters())
    wire(model, stage, group)
    model.rq_stage = stage
    if pager is not None:
        model.rq_pager = pager
    return LoadedModel(model, folder_tokenizer(path, config), config, path, manifest)
