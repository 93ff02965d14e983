"""GPU time per call for MLX on CUDA, read from the GPU's own clock (%globaltimer).

Timing a queue of MLX calls with the host clock adds the host's work (graph building, MLX's
per-node dispatch, CUDA-graph launches every MLX_MAX_OPS_PER_BUFFER nodes) to every figure,
while torch's CUDA events time the GPU stream. For a like-for-like kernel comparison each call
is bracketed by two small kernels that read %globaltimer (ns):

- the first runs after the previous bracket's end stamp (it takes that stamp as an input) and
  passes the call's query through (a copy), so the call's kernels wait for it;
- the second takes the call's outputs as inputs, so it waits for them.

The dependencies are real buffer reads: MLX's CUDA graphs order nodes by the buffers they
touch, so `mx.depends` alone (no buffer) does not order them. A bracket's span is the call's
kernels plus the launch gaps between them; the span of an empty bracket (pass-through, then the
end stamp) is subtracted. The median over calls drops brackets that straddle a CUDA-graph
boundary while the GPU waited for the host.

    gpu_us(lambda i, q: fn(q, k[i], v[i]), [q0, q1, ...]) -> µs per call
"""

from __future__ import annotations

import statistics

import mlx.core as mx

_READ = r"""
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    stamp[0] = (uint32_t)(t & 0xffffffffull);
    stamp[1] = (uint32_t)(t >> 32);
"""
_PASS = (
    r"""
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i == 0) {"""
    + _READ
    + r"""  }
  if (i < N) y[i] = x[i];
"""
)
_END = "  {" + _READ + "  }\n"
_KERNELS: dict = {}


def available() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def _kernel(key, **kw):
    if key not in _KERNELS:
        _KERNELS[key] = mx.fast.cuda_kernel(**kw)
    return _KERNELS[key]


def start(x: mx.array, after: mx.array) -> tuple[mx.array, mx.array]:
    """(stamp, copy of x): the stamp is read once `after` is computed; whatever reads the copy
    runs after the stamp."""
    k = _kernel(
        "pass", name="rq_clock_pass", input_names=["x", "after"],
        output_names=["stamp", "y"], source=_PASS,
    )  # fmt: skip
    n = x.size
    stamp, y = k(
        inputs=[x, after],
        template=[("N", n)],
        grid=(max(256, -(-n // 256) * 256), 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(2,), x.shape],
        output_dtypes=[mx.uint32, x.dtype],
    )
    return stamp, y


def end(deps: list[mx.array]) -> mx.array:
    """A stamp read once every array in `deps` is computed."""
    names = [f"dep{i}" for i in range(len(deps))]
    k = _kernel(
        ("end", len(deps)), name=f"rq_clock_end{len(deps)}", input_names=names,
        output_names=["stamp"], source=_END,
    )  # fmt: skip
    return k(
        inputs=deps, grid=(1, 1, 1), threadgroup=(1, 1, 1),
        output_shapes=[(2,)], output_dtypes=[mx.uint32],
    )[0]  # fmt: skip


def _ns(pair) -> int:
    lo, hi = (int(x) for x in pair.tolist())
    return (hi << 32) | lo


def spans_ns(call, xs: list[mx.array], n: int) -> tuple[list[int], list[int]]:
    """Spans (ns) of `n` bracketed calls and of `n` empty brackets. call(i, x) -> array or list
    of arrays, where x is the pass-through copy of xs[i % len(xs)]."""
    out = []
    for empty in (False, True):
        prev = mx.zeros((2,), mx.uint32)
        pairs = []
        for i in range(n):
            t0, x = start(xs[i % len(xs)], prev)
            res = x if empty else call(i, x)
            t1 = end(res if isinstance(res, list) else [res])
            pairs.append((t0, t1))
            prev = t1
        mx.eval([t for p in pairs for t in p])
        out.append([_ns(t1) - _ns(t0) for t0, t1 in pairs])
    return out[0], out[1]


def gpu_us(call, xs: list[mx.array], n: int = 24, trials: int = 3) -> float:
    """GPU µs per call: median over `trials` runs of (median bracket span - median empty
    bracket span) over `n` calls, after a warm-up run."""
    spans_ns(call, xs, min(n, 4))  # JIT builds, allocations
    per = []
    for _ in range(trials):
        full, empty = spans_ns(call, xs, n)
        per.append((statistics.median(full) - statistics.median(empty)) / 1e3)
    return statistics.median(per)


def _self_check() -> None:
    """On the GPU: a bandwidth-bound op timed by the clock and by the host, side by side."""
    import time

    for n_mb in (4, 64, 1024):
        xs = [mx.random.normal((n_mb << 18,)) for _ in range(4)]  # fp32: n_mb MB each
        mx.eval(xs)
        g = gpu_us(lambda i, x: x * 2.0, xs)
        mx.eval([x * 2.0 for x in xs])
        t0 = time.perf_counter()
        mx.eval([xs[i % 4] * 2.0 for i in range(24)])
        mx.synchronize()
        h = (time.perf_counter() - t0) / 24 * 1e6
        gbs = 2 * (n_mb << 20) / (g * 1e-6) / 1e9
        print(
            f"x * 2 on {n_mb:5d} MB: gpu clock {g:8.1f} us ({gbs:6.0f} GB/s)  host queue {h:8.1f} us"
        )


if __name__ == "__main__":
    _self_check()
