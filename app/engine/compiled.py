"""Compiled feed-forward blocks: less host work per decode step.

A decode step is built op by op in Python (each op a call into MLX), and on a GPU that host
work is most of a step. A MoE block is ~15 ops a layer (router, softmax, top-k, gathers,
weighting) on shapes that never change during decode, so each block's `__call__` is wrapped in
`mx.compile`: traced once per input shape, replayed in C++, elementwise ops fused.

The module tree, parameter paths and call signature stay as mlx-lm built them: the block's
class is swapped for a subclass whose `__call__` runs the compiled function, with the block's
arrays passed as captured inputs (so a later `update` of its weights is seen). Only blocks made
wholly of MLX / mlx-lm modules are compiled: the pager's expert layers read routes on the host.

Attention modules of the architectures whose `__call__` is known (ATTENTION_CALLS) get the same
treatment for their part before the cache: a decode step's q/k/v projections, q/k norms, head
reshapes and RoPE are one compiled call, with RoPE's offset passed as an array (so the trace is
not tied to a position). The cache update, the attention op (whatever the model module's
`scaled_dot_product_attention` is at call time: IsoQuant's dispatch included) and the output
projection run as mlx-lm runs them. Multi-token calls (prefill, verify) run mlx-lm's own code.
"""

from __future__ import annotations

import functools
import os
import sys

import mlx.core as mx
import mlx.nn as nn

COMPILE_ENV = "ROTARYQUANT_COMPILE"  # "0": leave every block as mlx-lm built it
BLOCK_NAMES = ("mlp", "block_sparse_moe", "feed_forward")  # a decoder layer's feed-forward
ATTENTION_NAMES = ("self_attn",)
# RoPE classes that hand their offset to mx.fast.rope untouched (an array offset works);
# DynamicNTKScalingRoPE does host arithmetic on it, so its modules stay as mlx-lm built them
ROPE_CLASSES = ("RoPE", "Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")
# mlx-lm attention classes whose __call__ is: q/k/v projections, heads reshaped, (q/k norms,)
# transposed, RoPE at cache.offset, cache.update_and_fetch, the module's
# scaled_dot_product_attention, transpose, reshape, o_proj. Module -> whether it has q/k norms.
ATTENTION_CALLS = {"mlx_lm.models.qwen3_moe": True, "mlx_lm.models.qwen3": True,
                   "mlx_lm.models.llama": False}  # fmt: skip
_PURE_MODULES = ("mlx.nn.", "mlx_lm.models.")
_SUBCLASSES: dict[type, type] = {}


def enabled() -> bool:
    return os.environ.get(COMPILE_ENV, "1") != "0"


def compilable(block: nn.Module) -> bool:
    """A block whose every module is MLX's or mlx-lm's own (pure array code), not sharded."""
    for _, m in block.named_modules():
        if not type(m).__module__.startswith(_PURE_MODULES):
            return False
        if getattr(m, "sharding_group", None) is not None:
            return False
    return True


PREFILL_SYNC_TOKENS = 64  # a block that widens expert codes syncs on calls this large


def _compiled_call(self, x):
    out = self._rq_compiled_fn(x)
    if self.__dict__.get("_rq_prefill_sync") and x.size >= PREFILL_SYNC_TOKENS * x.shape[-1]:
        # a prefill call whose experts widened their codes (expert_widen.py): the host would
        # otherwise queue every layer's transient widened copy before the device frees the
        # first (on CUDA a 2048-token chunk of Qwen3-30B-A3B held +15 GB); one sync a layer
        # bounds it to about one layer's copy, at ~0.1 ms against a ~30 ms layer
        mx.eval(out)
    return out


def call_subclass(cls: type, call, marker: str, cache: dict) -> type:
    """`cls` with `call` as its __call__ (made once per class, kept in `cache`): swapped into
    an instance's __class__. `marker` names the original class; __module__ is kept, so the
    subclass still reads as mlx-lm's module (compilable() and repr see the original)."""
    if cls not in cache:
        cache[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__call__": call,
                marker: cls,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
    return cache[cls]


def _subclass(cls: type, call=_compiled_call) -> type:
    return call_subclass(cls, call, "_rq_original", _SUBCLASSES)


_OFFSETS: dict[int, mx.array] = {}  # RoPE offsets as arrays: one per position, shared by layers


def _offset_array(offset) -> mx.array:
    if isinstance(offset, mx.array):
        return offset
    a = _OFFSETS.get(offset)
    if a is None:
        if len(_OFFSETS) >= 64:
            _OFFSETS.clear()
        a = _OFFSETS[offset] = mx.array(offset, mx.int32)
    return a


def _attention_pre(self, x, offset):
    """The module's decode step up to its cache: (queries, keys, values), as mlx-lm's code."""
    b, n, _ = x.shape
    queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    queries = queries.reshape(b, n, self.n_heads, -1)
    keys = keys.reshape(b, n, self.n_kv_heads, -1)
    if ATTENTION_CALLS[type(self)._rq_original.__module__]:
        queries, keys = self.q_norm(queries), self.k_norm(keys)
    queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
    values = values.reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return self.rope(queries, offset=offset), self.rope(keys, offset=offset), values


def _attention_call(self, x, mask=None, cache=None):
    b, n, _ = x.shape
    if cache is None or n != 1:
        return type(self)._rq_original.__call__(self, x, mask=mask, cache=cache)
    queries, keys, values = self._rq_compiled_fn(x, _offset_array(cache.offset))
    keys, values = cache.update_and_fetch(keys, values)
    sdpa = sys.modules[type(self).__module__].scaled_dot_product_attention
    output = sdpa(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(b, n, -1))


def attention_compilable(module: nn.Module) -> bool:
    """An attention module of a known class (ATTENTION_CALLS) with a RoPE that takes an array
    offset, made wholly of MLX / mlx-lm modules, not sharded."""
    cls = type(module)
    cls = cls.__dict__.get("_rq_original", cls)
    if cls.__name__ != "Attention" or cls.__module__ not in ATTENTION_CALLS:
        return False
    return type(getattr(module, "rope", None)).__name__ in ROPE_CLASSES and compilable(module)


def compile_block(block: nn.Module) -> None:
    original = type(block)
    if "_rq_compiled_fn" not in block.__dict__:  # kept by uncompile(): its traces stay valid
        fn = mx.compile(functools.partial(original.__call__, block), inputs=block)
        object.__setattr__(block, "_rq_compiled_fn", fn)
    block.__class__ = _subclass(original)


def compile_attention(module: nn.Module) -> None:
    original = type(module)
    module.__class__ = _subclass(original, _attention_call)
    if "_rq_compiled_fn" not in module.__dict__:
        fn = mx.compile(functools.partial(_attention_pre, module), inputs=module)
        object.__setattr__(module, "_rq_compiled_fn", fn)


def use_traces(model: nn.Module, key) -> int:
    """Switch every compiled feed-forward block to its set of traces named `key` (a fresh
    compiled function the first time), keeping the current set under its own key; returns how
    many. A setting read while a block is traced (the experts' prefill width, expert_widen.py)
    can then be compared side by side in one process, each side traced once."""
    n = 0
    for _, m in model.named_modules():
        if type(m).__dict__.get("__call__") is not _compiled_call:
            continue
        d = m.__dict__
        sets = d.get("_rq_trace_sets")
        if sets is None:
            sets = {}
            object.__setattr__(m, "_rq_trace_sets", sets)
        sets[d.get("_rq_trace_key")] = d["_rq_compiled_fn"]
        fn = sets.get(key)
        if fn is None:
            fn = mx.compile(functools.partial(type(m)._rq_original.__call__, m), inputs=m)
        object.__setattr__(m, "_rq_compiled_fn", fn)
        object.__setattr__(m, "_rq_trace_key", key)
        n += 1
    return n


def is_compiled(block: nn.Module) -> bool:
    return "_rq_original" in type(block).__dict__


def restore_classes(model: nn.Module, marker: str) -> int:
    """Put every module swapped by call_subclass(..., marker, ...) back to its original class;
    returns how many."""
    n = 0
    for _, m in model.named_modules():
        original = type(m).__dict__.get(marker)
        if original is not None:
            m.__class__ = original
            n += 1
    return n


def uncompile(model: nn.Module) -> int:
    """Put every compiled block back to its mlx-lm class (side-by-side benchmarks); returns
    how many. compile_blocks() turns them back on without tracing again."""
    return restore_classes(model, "_rq_original")


def compile_blocks(model: nn.Module) -> list[str]:
    """Compile each decoder layer's feed-forward block where it is pure, and its attention
    module's part before the cache where the architecture is known; returns their paths.
    Idempotent; a no-op with ROTARYQUANT_COMPILE=0."""
    if not enabled():
        return []
    done = []
    for path, m in model.named_modules():
        name = path.rpartition(".")[2]
        if ".layers." not in f".{path}" or name not in BLOCK_NAMES + ATTENTION_NAMES:
            continue
        if is_compiled(m):
            done.append(path)
        elif name in BLOCK_NAMES and compilable(m):
            compile_block(m)
            done.append(path)
        elif name in ATTENTION_NAMES and attention_compilable(m):
            compile_attention(m)
            done.append(path)
    return sorted(done)
