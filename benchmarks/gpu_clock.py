"""GPU time per call for MLX on CUDA, read from the GPU's own clock (%globaltimer).

Timing a queue of MLX calls with the host clock adds the host's work (graph building, MLX's
per-node dispatch, CUDA-graph launches every MLX_MAX_OPS_PER_BUFFER nodes) to every figure,
while torch's CUDA events time the GPU stream. For a like-for-like kernel comparison each call
here is bracketed by two one-thread kernels that write %globaltimer (ns): the first runs after
the previous bracket, the call's query depends on it, the second depends on the call's
outputs. A bracket's span is the call's kernels plus the launch gaps between them; the span of
an empty bracket (the two stamps back to back) is subtracted. The median over calls drops the
brackets that straddle a CUDA-graph boundary (where the GPU waited for the host).

    gpu_us(lambda i, dep: fn(mx.depends([q[i]], [dep])[0], ...), n) -> µs per call
"""

from __future__ import annotations

import os
import statistics

# Larger CUDA graphs: fewer brackets straddle a boundary. Read by MLX on first use, so this
# module is imported before anything evaluates (the benchmarks import it first).
os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "200")

import mlx.core as mx  # noqa: E402

_SOURCE = r"""
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  out[0] = (uint32_t)(t & 0xffffffffull);
  out[1] = (uint32_t)(t >> 32);
"""
_KERNEL = None


def available() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def stamp(dep: mx.array | list[mx.array]) -> mx.array:
    """[2] uint32 (low, high words of the GPU's ns clock), read after `dep` is computed."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.cuda_kernel(
            name="rq_globaltimer", input_names=["dep"], output_names=["out"], source=_SOURCE
        )
    deps = dep if isinstance(dep, list) else [dep]
    token = mx.depends([mx.zeros((1,), mx.uint32)], deps)[0]
    return _KERNEL(
        inputs=[token],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
        output_shapes=[(2,)],
        output_dtypes=[mx.uint32],
    )[0]


def _ns(pair) -> int:
    lo, hi = (int(x) for x in pair.tolist())
    return (hi << 32) | lo


def spans_ns(make_call, n: int) -> tuple[list[int], list[int]]:
    """Spans (ns) of `n` bracketed calls and of `n` empty brackets, in one graph each.
    make_call(i, dep) -> array or list of arrays; its inputs must depend on `dep`."""
    prev = mx.zeros((1,), mx.uint32)
    pairs = []
    for i in range(n):
        t0 = stamp(prev)
        out = make_call(i, t0)
        t1 = stamp(out if isinstance(out, list) else [out])
        pairs.append((t0, t1))
        prev = t1
    mx.eval([p for pr in pairs for p in pr])
    full = [_ns(t1) - _ns(t0) for t0, t1 in pairs]
    prev, pairs = mx.zeros((1,), mx.uint32), []
    for _ in range(n):
        t0 = stamp(prev)
        t1 = stamp(t0)
        pairs.append((t0, t1))
        prev = t1
    mx.eval([p for pr in pairs for p in pr])
    empty = [_ns(t1) - _ns(t0) for t0, t1 in pairs]
    return full, empty


def gpu_us(make_call, n: int = 24, trials: int = 3) -> float:
    """Median GPU µs per call (bracket span minus the empty bracket's), over `trials` runs of
    `n` calls after one warm-up run."""
    spans_ns(make_call, min(n, 4))  # warm-up: JIT builds, allocations
    per = []
    for _ in range(trials):
        full, empty = spans_ns(make_call, n)
        per.append((statistics.median(full) - statistics.median(empty)) / 1e3)
    return statistics.median(per)


def depend(x: mx.array, dep: mx.array) -> mx.array:
    """`x`, computed only after `dep` (no copy)."""
    return mx.depends([x], [dep])[0]
