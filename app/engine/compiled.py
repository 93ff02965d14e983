"""Compiled feed-forward blocks: less host work per decode step.

A decode step is built op by op in Python (each op a call into MLX), and on a GPU that host
work is most of a step. A MoE block is ~15 ops a layer (router, softmax, top-k, gathers,
weighting) on shapes that never change during decode, so each block's `__call__` is wrapped in
`mx.compile`: traced once per input shape, replayed in C++, elementwise ops fused.

The module tree, parameter paths and call signature stay as mlx-lm built them: the block's
class is swapped for a subclass whose `__call__` runs the compiled function, with the block's
arrays passed as captured inputs (so a later `update` of its weights is seen). Only blocks made
wholly of MLX / mlx-lm modules are compiled: the pager's expert layers read routes on the host.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import mlx.nn as nn

COMPILE_ENV = "ROTARYQUANT_COMPILE"  # "0": leave every block as mlx-lm built it
BLOCK_NAMES = ("mlp", "block_sparse_moe", "feed_forward")  # a decoder layer's feed-forward
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


def _compiled_call(self, x):
    return self._rq_compiled_fn(x)


def _subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__call__": _compiled_call,
                "_rq_original": cls,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
    return _SUBCLASSES[cls]


def compile_block(block: nn.Module) -> None:
    original = type(block)
    if "_rq_compiled_fn" not in block.__dict__:  # kept by uncompile(): its traces stay valid
        fn = mx.compile(functools.partial(original.__call__, block), inputs=block)
        object.__setattr__(block, "_rq_compiled_fn", fn)
    block.__class__ = _subclass(original)


def is_compiled(block: nn.Module) -> bool:
    return "_rq_original" in type(block).__dict__


def uncompile(model: nn.Module) -> int:
    """Put every compiled block back to its mlx-lm class (side-by-side benchmarks); returns
    how many. compile_blocks() turns them back on without tracing again."""
    n = 0
    for _, m in model.named_modules():
        if is_compiled(m):
            m.__class__ = type(m).__dict__["_rq_original"]
            n += 1
    return n


def compile_blocks(model: nn.Module) -> list[str]:
    """Compile each decoder layer's feed-forward block where it is pure; returns their paths.
    Idempotent; a no-op with ROTARYQUANT_COMPILE=0."""
    if not enabled():
        return []
    done = []
    for path, m in model.named_modules():
        if path.rpartition(".")[2] not in BLOCK_NAMES or ".layers." not in f".{path}":
            continue
        if is_compiled(m):
            done.append(path)
        elif compilable(m):
            compile_block(m)
            done.append(path)
    return sorted(done)
