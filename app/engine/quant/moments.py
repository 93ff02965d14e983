"""Streaming excess kurtosis: central moments per block, merged exactly (Pébay 2008), so a
role's κ over billions of weights never needs them in memory at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

_BLOCK = 1 << 20  # elements per float32 reduction: accurate sums, ~20 MB of temporaries


@dataclass
class Moments:
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0  # sums of (x - mean)^k
    m3: float = 0.0
    m4: float = 0.0

    def merge(self, o: Moments) -> Moments:
        if o.n == 0:
            return self
        if self.n == 0:
            self.n, self.mean, self.m2, self.m3, self.m4 = o.n, o.mean, o.m2, o.m3, o.m4
            return self
        na, nb = self.n, o.n
        n = na + nb
        d = o.mean - self.mean
        d2 = d * d
        m4 = (
            self.m4
            + o.m4
            + d2 * d2 * na * nb * (na * na - na * nb + nb * nb) / n**3
            + 6 * d2 * (na * na * o.m2 + nb * nb * self.m2) / n**2
            + 4 * d * (na * o.m3 - nb * self.m3) / n
        )
        m3 = (
            self.m3
            + o.m3
            + d2 * d * na * nb * (na - nb) / n**2
            + 3 * d * (na * o.m2 - nb * self.m2) / n
        )
        m2 = self.m2 + o.m2 + d2 * na * nb / n
        self.n, self.mean, self.m2, self.m3, self.m4 = n, self.mean + d * nb / n, m2, m3, m4
        return self

    def add(self, x) -> Moments:
        """Add the values of an mx.array (any float dtype, any shape)."""
        import mlx.core as mx

        flat = x.reshape(-1)
        for s in range(0, flat.size, _BLOCK):
            b = flat[s : s + _BLOCK].astype(mx.float32)
            mean = mx.mean(b)
            d = b - mean
            d2 = d * d
            sums = mx.stack([mean, mx.sum(d2), mx.sum(d2 * d), mx.sum(d2 * d2)]).tolist()
            self.merge(Moments(int(b.size), *sums))
        return self

    @property
    def variance(self) -> float:
        return self.m2 / self.n if self.n else math.nan

    @property
    def excess_kurtosis(self) -> float:
        """κ = E[(x-μ)^4] / σ^4 - 3 (0 for a Gaussian)."""
        if self.n == 0 or self.m2 == 0:
            return math.nan
        return self.n * self.m4 / (self.m2 * self.m2) - 3.0
