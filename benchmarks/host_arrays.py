"""What a CUDA kernel pays to read a small parameter array that Python built for the call.

MLX's CUDA allocator gives arrays made from host data (mx.array([...])) unified memory: 8 bytes
or less from a shared pool the GPU reads remotely, larger ones managed allocations that the CPU
writes and the GPU then reads. A kernel whose first instruction reads such an array (a split
count, a scale) waits for that read before anything else. This times one small kernel
(y = x + p[0], 4096 floats) on the GPU clock (gpu_clock.py) with p:

  fresh_4B, fresh_32B   a new mx.array per call (what a library that builds its parameters per
                        call does), 4 bytes (the shared pool) and 32 bytes (its own allocation)
  cached_4B, cached_32B one array made once and reused (it stays where the GPU last read it)
  gpu_made_32B          a new array per call computed by a GPU op (device memory)

    python benchmarks/host_arrays.py [--out benchmarks/results/host_arrays.json]
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_clock  # noqa: E402
import mlx.core as mx  # noqa: E402

_SRC = r"""
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = x[i] + p[0];
"""


def _add(x: mx.array, p: mx.array) -> mx.array:
    k = gpu_clock._kernel(
        "rq_add_param", name="rq_add_param", input_names=["x", "p"], output_names=["y"],
        source=_SRC,
    )  # fmt: skip
    return k(
        inputs=[x, p], template=[("N", x.size)], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[x.shape], output_dtypes=[x.dtype],
    )[0]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_arrays.json"))
    args = ap.parse_args()
    if not gpu_clock.available():
        sys.exit("needs MLX's CUDA backend")
    xs = [mx.random.normal((4096,)) for _ in range(4)]
    mx.eval(xs)
    cached = {n: mx.array([1.0] * n, mx.float32) for n in (1, 8)}
    mx.eval(list(cached.values()))
    ones8 = mx.ones((8,), mx.float32)
    mx.eval(ones8)
    cases = {
        "fresh_4B": lambda i, x: _add(x, mx.array([1.0], mx.float32)),
        "fresh_32B": lambda i, x: _add(x, mx.array([1.0] * 8, mx.float32)),
        "cached_4B": lambda i, x: _add(x, cached[1]),
        "cached_32B": lambda i, x: _add(x, cached[8]),
        "gpu_made_32B": lambda i, x: _add(x, ones8 * float(i + 1)),
        "no_param_op": lambda i, x: x * 1.0,
    }
    rows = []
    for name, call in cases.items():
        g = gpu_clock.gpu_us(call, xs, n=32, trials=5)
        rows.append({"case": name, "gpu_us": round(g, 2)})
        print(f"{name:14s} {g:8.2f} µs", flush=True)
    info = {}
    try:
        info = {k: str(v) for k, v in mx.device_info().items()}
    except Exception:
        pass
    out = {
        "what": __doc__.split("\n\n")[0],
        "machine": {"device": info.get("device_name", "?"), "mlx": mx.__version__,
                    "platform": platform.platform()},
        "command": "python benchmarks/host_arrays.py",
        "records": rows,
    }  # fmt: skip
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("host_arrays", out, out.pop("machine"), Path(args.out))


if __name__ == "__main__":
    main()
