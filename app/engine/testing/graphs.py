"""The primitives of a lazy MLX graph, for counting what a step builds (tests, benchmarks)."""

from __future__ import annotations

import re
import tempfile

import mlx.core as mx

# primitives that make a view of their input (no kernel launch on a GPU, as a rule)
VIEWS = frozenset(
    "Broadcast Reshape Slice ExpandDims Squeeze Transpose Flatten Unflatten StopGradient "
    "Depends AsStrided Split".split()
)


def primitives(*outputs: mx.array) -> list[str]:
    """The primitive name of every node in the graph behind `outputs` (nothing evaluated),
    one entry a node: a compiled function's fused kernel is one "Compiled..." entry."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return re.findall(r'label ="([^"]*)"', f.read())
