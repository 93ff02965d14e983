"""Expert parallelism: every rank runs every layer, each holds a contiguous share of every MoE
layer's routed experts, and each MoE block's partial output is summed over the ranks.

The combining is mlx-lm's: the MoE blocks that mlx-lm's `shard()` can split (qwen3_moe, gpt_oss,
qwen3_next, deepseek_v3…) end in `if self.sharding_group is not None: y = mx.distributed.all_sum(y, …)`. mlx-lm's
`shard()` splits each expert's hidden width over the ranks (tensor parallelism, every rank
reads a slice of every routed expert); here each rank keeps whole experts instead — rank r owns
experts [lo_r, hi_r) of every MoE layer — so that a rank loads, and pages, only its own records:

- the expert module (`SwitchGLU` / `SwitchMLP`, or the pager's twin) holds only the rank's
  experts, renumbered 0 … hi-lo-1, and is wrapped in `LocalExperts`, which maps the router's
  global indices onto it and zeroes the rows of experts another rank owns (those rows still
  run, on local expert 0: at most one more expert read per layer, which a Mac's decode pays in
  bandwidth and the routing would often read anyway);
- the block weights the rows by the router's scores, sums them, and its `sharding_group` hook
  all_sums the partial outputs: every rank then holds the same hidden state (a sum over two
  ranks is the same either way round; a ring sums each chunk once and hands it on), samples
  the same token, and needs nothing more.

Dense weights, the embedding and head, the KV cache (FP16 or IsoQuant; deepseek_v3's MLA layers
keep a float cache under IsoQuant) and any recurrent state (nemotron_h's Mamba, qwen3_next's
Gated DeltaNet) are replicated: each rank runs them in full, unchanged. A block with shared
experts (nemotron_h, qwen3_next, deepseek_v3) adds them before its output is summed, so only
rank 0 adds them: on the other ranks the shared expert's call returns zeros (its weights stay
loaded, unused; qwen3_next's `sigmoid(shared_expert_gate(x))` then scales zeros). A block
without mlx-lm's hook (nemotron_h) gets the same sum from a subclass whose call all_sums the
block's output (the module tree and parameter paths stay as mlx-lm built them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .stage import Traffic, layer_list

SHARED = ("shared_expert", "shared_experts", "shared_mlp")  # added once, by rank 0
_SWAPPED: dict[tuple[type, str], type] = {}


def _swap(module: nn.Module, kind: str, call) -> None:
    """Give `module` a subclass of its class whose `__call__` is `call` (made once per class)."""
    cls = type(module)
    key = (cls, kind)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(
            cls.__name__,
            (cls,),
            {"__call__": call, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    module.__class__ = _SWAPPED[key]


def _zeros_call(self, x, *args, **kwargs):
    return mx.zeros_like(x)


def _summed_call(self, *args, **kwargs):
    y = type(self).__mro__[1].__call__(self, *args, **kwargs)
    return mx.distributed.all_sum(y, group=self.rq_group)


def combine_over_ranks(block: nn.Module, group, rank: int) -> None:
    """Make `block` sum its output over the ranks, its shared experts added by rank 0 only."""
    if rank != 0:
        for s in SHARED:
            shared = getattr(block, s, None)
            if isinstance(shared, nn.Module):
                _swap(shared, "zeros", _zeros_call)
    if "sharding_group" in vars(block):
        block.sharding_group = group  # mlx-lm's hook: the block all_sums its output
    else:
        block.rq_group = group
        _swap(block, "summed", _summed_call)


def expert_ranges(num_experts: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's experts, rank 0 first; the low ranks get the extra ones."""
    if size < 1 or size > num_experts:
        raise ValueError(f"cannot split {num_experts} experts over {size} ranks")
    base, extra = divmod(num_experts, size)
    out, lo = [], 0
    for r in range(size):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass
class ExpertStage:
    """Where this rank sits in an expert split: every layer local, a share of every MoE layer's
    experts (`experts`: layer -> [lo, hi)). Same interface as `stage.Stage`."""

    rank: int
    size: int
    num_layers: int
    experts: dict[int, tuple[int, int]] = field(default_factory=dict)
    traffic: Traffic = field(default_factory=Traffic)
    split: str = "experts"

    def __post_init__(self):
        self.start, self.end = 0, self.num_layers

    def local(self, layer: int) -> bool:
        return True

    def to_dict(self) -> dict:
        ranges = sorted({tuple(v) for v in self.experts.values()})
        return {
            "rank": self.rank,
            "size": self.size,
            "split": "experts",
            "layers": [0, self.num_layers],
            "experts": [list(r) for r in ranges] if len(ranges) > 1 else list(ranges[0]),
            "moe_layers": len(self.experts),
        }


class LocalExperts(nn.Module):
    """This rank's share [lo, hi) of one layer's experts behind the router's global indices:
    rows routed elsewhere come out as zeros, so the block's all_sum adds each row once."""

    def __init__(self, inner: nn.Module, lo: int, hi: int, size: int, traffic: Traffic):
        super().__init__()
        self.inner = inner
        self._lo, self._hi, self._size, self._traffic = lo, hi, size, traffic

    def __call__(self, x, indices):
        mine = (indices >= self._lo) & (indices < self._hi)
        local = mx.where(mine, indices - self._lo, mx.zeros_like(indices))
        y = self.inner(x, local)
        y = y * mx.expand_dims(mine, -1).astype(y.dtype)
        # the block all_sums its [..., hidden] output: a ring moves 2 (N-1) / N of it per rank
        n = self._size
        self._traffic.sent += 2 * (n - 1) * (x.size * y.dtype.size) // n
        self._traffic.steps += 1
        return y


def expert_modules(model) -> list[tuple[int, str, nn.Module, nn.Module]]:
    """(layer, path, expert module, its MoE block) of every routed-expert module."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    from ..errors import EngineError

    arch = type(model).__module__.rsplit(".", 1)[-1]
    layers = layer_list(model)
    found = []
    for i, layer in enumerate(layers):
        for name, mod in layer.named_modules():
            if not isinstance(mod, (SwitchGLU, SwitchMLP)):
                continue
            parent_name = name.rpartition(".")[0]
            block = dict(layer.named_modules())[parent_name] if parent_name else layer
            found.append((i, f"{_prefix(model, layers)}{i}.{name}", mod, block))
    if not found:
        raise EngineError(f"{arch}: no routed experts to split: use the pipeline split")
    return found


def _prefix(model, layers) -> str:
    """The parameter path of the layer list ("model.layers.", "backbone.layers.", …)."""
    for name, mod in model.named_modules():
        if mod is layers[0]:
            return name.rpartition(".")[0] + "."
    raise ValueError("layer list not found among the model's modules")


def num_experts_of(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())[0][1].shape[0]


def share_section(section: dict, experts: dict[int, tuple[int, int]]) -> dict:
    """A converted folder's `experts` manifest section viewed as this rank's share: each layer's
    experts [lo, hi), renumbered from 0, read from the same files."""
    from ..offload.records import LayerLayout

    layers = {}
    for k, v in section["layers"].items():
        lo, hi = experts[int(k)]
        layers[k] = LayerLayout.from_dict(v).share(lo, hi).to_dict()
    return dict(section, layers=layers)


def _slice_module(module: nn.Module, lo: int, hi: int) -> None:
    """Keep experts [lo, hi) of a stacked expert module (lazy: nothing is read)."""
    from mlx.utils import tree_map

    module.update(tree_map(lambda a: a[lo:hi], module.parameters()))


def load_expert_shard(path, group, expert_budget: int | None = None):
    """Load every layer of `path` with this rank's share of each MoE layer's routed experts
    (a converted folder's records resident, or paged within `expert_budget` bytes on this rank)
    -> `LoadedModel` with `model.rq_stage` an `ExpertStage`."""

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

    config, manifest = check_folder(path)
    section = manifest.experts if manifest is not None and manifest.experts else None
    if expert_budget is not None and section is None:
        raise ModelLoadError(
            "an expert budget needs a converted MoE model (rotaryquant convert)", str(path)
        )
    rank, size = group.rank(), group.size()
    with weight_errors(path, keep=(BudgetError, EngineError)):
        model, config, weights = sanitized_weights(path)
        found = expert_modules(model)
        stage = ExpertStage(rank, size, len(layer_list(model)))
        for layer, mpath, mod, _ in found:
            n = num_experts_of(mod)
            try:
                stage.experts[layer] = expert_ranges(n, size)[rank]
            except ValueError as e:
                raise EngineError(f"layer {layer}: {e}") from e
            lo, hi = stage.experts[layer]
            _slice_module(mod, lo, hi)
            for k in [k for k in weights if k.startswith(mpath + ".")]:
                weights[k] = weights[k][lo:hi]  # a plain folder's stacked experts
        pager = None
        if section is not None:
            mine = share_section(section, stage.experts)
            if expert_budget is None:
                from ..quant.converted import expert_weights

                weights.update(expert_weights(path, mine))
            else:
                from ..offload.layers import install
                from ..offload.pager import ExpertPager, PagerOptions
                from ..offload.records import ExpertStore

                pager = ExpertPager(ExpertStore(path, mine), int(expert_budget), PagerOptions())
                install(model, pager)
        load_exact(model, weights)
    model.eval()
    mx.eval(model.parameters())
    modules = dict(model.named_modules())
    for layer, mpath, _, block in found:
        parent, _, attr = mpath.rpartition(".")
        lo, hi = stage.experts[layer]
        setattr(modules[parent], attr, LocalExperts(modules[mpath], lo, hi, size, stage.traffic))
        combine_over_ranks(block, group, rank)
    model.rq_stage = stage
    if pager is not None:
        model.rq_pager = pager
    return LoadedModel(model, folder_tokenizer(path, config), config, path, manifest)
