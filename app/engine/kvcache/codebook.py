"""Lloyd–Max scalar codebooks for the coordinates of a rotated, normalized KV vector.

After a random rotation, a vector divided by its L2 norm is (close to) a uniform point on the
unit sphere S^{d-1}; one coordinate x then has density ∝ (1 - x²)^((d-3)/2) on [-1, 1]. We scale
by √d so coordinates have unit variance, t = √d·x, density ∝ (1 - t²/d)^((d-3)/2) on [-√d, √d],
and fit the 2^bits-level Lloyd–Max quantizer (minimum MSE) to that density once per (d, bits).

Levels are sorted ascending; code i means level i. Thresholds are the midpoints between
consecutive levels (the Lloyd–Max optimality condition), so quantizing is counting how many
thresholds a value exceeds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

_GRID = 200_001  # integration points: levels converge to ~1e-9, far below fp16 resolution
_TAIL = 12.0  # |t| beyond 12 has probability < 1e-30 for every d ≥ 16: cut the grid there


@dataclass(frozen=True)
class Codebook:
    dim: int
    bits: int
    levels: tuple[float, ...]  # ascending, len 2**bits
    thresholds: tuple[float, ...]  # midpoints, len 2**bits - 1

    def __post_init__(self):
        if len(self.levels) != 2**self.bits or len(self.thresholds) != 2**self.bits - 1:
            raise ValueError(f"codebook for {self.bits} bits has the wrong number of levels")
        if any(b <= a for a, b in zip(self.levels[:-1], self.levels[1:], strict=True)):
            raise ValueError("codebook levels must be strictly ascending")

    def mse(self) -> float:
        """Expected squared error per unit-variance coordinate (for reports and tests)."""
        t, w = _density(self.dim)
        lv = np.asarray(self.levels)
        idx = np.searchsorted(np.asarray(self.thresholds), t)
        return float(np.sum(w * (t - lv[idx]) ** 2))


def _density(dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Grid points t and normalized weights of √d·x for one coordinate x of a unit vector."""
    if dim < 4:
        raise ValueError(f"head dim {dim} is too small for a sphere-coordinate codebook")
    half = min(np.sqrt(dim), _TAIL)
    t = np.linspace(-half, half, _GRID)
    with np.errstate(divide="ignore"):
        logw = 0.5 * (dim - 3) * np.log(np.clip(1.0 - t * t / dim, 0.0, None))
    w = np.exp(logw - logw.max())
    return t, w / w.sum()


@functools.cache
def lloyd_max(dim: int, bits: int) -> Codebook:
    """The 2**bits-level Lloyd–Max codebook for unit-variance coordinates in dimension `dim`."""
    if bits not in (2, 3, 4):
        raise ValueError(f"IsoQuant codebooks exist for 2, 3 or 4 bits, not {bits}")
    t, w = _density(dim)
    n = 2**bits
    # Start from equal-probability cells: the iteration then converges monotonically.
    cdf = np.cumsum(w)
    levels = np.interp((np.arange(n) + 0.5) / n, cdf, t)
    cw, cwt = np.concatenate([[0.0], cdf]), np.concatenate([[0.0], np.cumsum(w * t)])
    for _ in range(2000):
        thr = 0.5 * (levels[1:] + levels[:-1])
        edges = np.concatenate([[0], np.searchsorted(t, thr), [len(t)]])
        mass = cw[edges[1:]] - cw[edges[:-1]]
        new = (cwt[edges[1:]] - cwt[edges[:-1]]) / mass
        new = 0.5 * (new - new[::-1])  # the density is symmetric: keep the codebook exactly so
        done = np.max(np.abs(new - levels)) < 1e-12
        levels = new
        if done:
            break
    thr = 0.5 * (levels[1:] + levels[:-1])
    return Codebook(dim, bits, tuple(float(v) for v in levels), tuple(float(v) for v in thr))
