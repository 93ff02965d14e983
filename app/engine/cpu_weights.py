"""Dense weights in float32 on the CPU backend.

MLX's CPU build has no fast quantized matmul: on SmolLM2-135M (4-bit, group 32) prompt
processing runs at ~11 tok/s quantized and ~210 tok/s with the same weights dequantized to
float32 (OpenBLAS sgemm), decode at 6.7 vs 12.6 tok/s (benchmarks/results/generate.json). So
where the float copy is small, the CPU backend dequantizes the dense layers once at load.
Routed experts stay quantized (gather_qmm works in every dtype; they are what the pager pages).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

DEFAULT_LIMIT = 1 << 30  # float32 copy at most 1 GiB: the embedded model and small dense models


def _float_size(mod) -> int:
    rows, packed = mod.weight.shape[-2:]
    return rows * packed * 32 // mod.bits * 4


def dequantize_dense(model, limit_bytes: int = DEFAULT_LIMIT) -> int:
    """Replace QuantizedLinear / QuantizedEmbedding with float32 Linear / Embedding when all of
    them together fit in `limit_bytes` as float32. Returns the bytes of float weights made (0
    when nothing was changed)."""
    mods = [
        (p, m)
        for p, m in model.named_modules()
        if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding)
    ]
    total = sum(_float_size(m) for _, m in mods)
    if not mods or total > limit_bytes:
        return 0
    repl = []
    for path, m in mods:
        w = mx.dequantize(
            m.weight, m.scales, getattr(m, "biases", None), m.group_size, m.bits, mode=m.mode
        ).astype(mx.float32)
        if isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(*w.shape)
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        new.weight = w
        repl.append((path, new))
    model.update_modules(tree_unflatten(repl))
    mx.eval(model.parameters())
    return total
