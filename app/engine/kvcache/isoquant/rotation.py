"""Orthogonal rotations applied to keys, values and queries before scalar quantization.

Kinds (one rotation per layer and KV head, seeded):
- "v3" (IsoQuant default): R = B ∘ H. H is the normalized Walsh–Hadamard transform in Sylvester
  (natural) order, exactly `mx.hadamard_transform(x, scale=1/√D)`; B is block-diagonal with one
  4×4 block per 4 consecutive coordinates, v ↦ q_L · v · conj(q_R) (a full SO(4) element).
- "v2": B alone (SO(4) blocks, no WHT).
- "v1": blocks v ↦ q · v · conj(q) (SO(3): coordinate 0 of each block is left unrotated), no WHT.
- "dense": a Haar-random dense D×D orthogonal matrix (the TurboQuant-style baseline).

Arrays for kernels: `blocks` [Hkv, D/4, 4, 4] float32 with y[4b:4b+4] = blocks[h, b] @ x[4b:4b+4]
(the two quaternion products pre-combined into one matrix), `dense` [Hkv, D, D] float32 with
y = dense[h] @ x. The inverse is Rᵀ = H · Bᵀ (H is symmetric and its own inverse).

Quaternion convention: a block (v0, v1, v2, v3) is v0 + v1·i + v2·j + v3·k.
Head dims: any multiple of 4 whose Hadamard transform MLX implements (2^k, and 12·2^k, 20·2^k,
28·2^k); the packed format further needs a multiple of 8. Other dims raise ValueError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

KINDS = ("v3", "v2", "v1", "dense")


def quat_left(q: np.ndarray) -> np.ndarray:
    """q: [..., 4] -> [..., 4, 4] matrix of v ↦ q·v."""
    a, b, c, d = np.moveaxis(q, -1, 0)
    return np.stack(
        [
            np.stack([a, -b, -c, -d], -1),
            np.stack([b, a, -d, c], -1),
            np.stack([c, d, a, -b], -1),
            np.stack([d, -c, b, a], -1),
        ],
        -2,
    )


def quat_right(p: np.ndarray) -> np.ndarray:
    """p: [..., 4] -> [..., 4, 4] matrix of v ↦ v·p."""
    a, b, c, d = np.moveaxis(p, -1, 0)
    return np.stack(
        [
            np.stack([a, -b, -c, -d], -1),
            np.stack([b, a, d, -c], -1),
            np.stack([c, -d, a, b], -1),
            np.stack([d, c, -b, a], -1),
        ],
        -2,
    )


def quat_conj(q: np.ndarray) -> np.ndarray:
    return q * np.array([1.0, -1.0, -1.0, -1.0])


def _unit_quaternions(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    q = rng.standard_normal((*shape, 4))  # normalized Gaussian: uniform on S^3
    return q / np.linalg.norm(q, axis=-1, keepdims=True)


def _check_dim(dim: int, wht: bool) -> None:
    if dim % 4:
        raise ValueError(f"head dim {dim} is not a multiple of 4: no 4-dim rotation blocks")
    if wht:
        try:
            mx.eval(mx.hadamard_transform(mx.zeros((1, dim))))
        except Exception as e:  # MLX names the supported sizes in its message
            raise ValueError(f"head dim {dim} has no Walsh–Hadamard transform in MLX: {e}") from e


@dataclass(frozen=True, eq=False)
class Rotation:
    """The rotation of one layer: all its KV heads. Apply with forward/inverse."""

    kind: str
    head_dim: int
    n_heads: int
    seed: int
    layer: int
    blocks: mx.array | None  # [Hkv, D/4, 4, 4] float32 (v1, v2, v3)
    dense: mx.array | None  # [Hkv, D, D] float32 (dense)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown rotation kind {self.kind!r}; expected one of {KINDS}")
        d, h = self.head_dim, self.n_heads
        if self.kind == "dense":
            if self.dense is None or tuple(self.dense.shape) != (h, d, d):
                raise ValueError(f"dense rotation needs a [{h}, {d}, {d}] matrix")
        elif self.blocks is None or tuple(self.blocks.shape) != (h, d // 4, 4, 4):
            raise ValueError(f"block rotation needs [{h}, {d // 4}, 4, 4] blocks")

    @property
    def wht(self) -> bool:
        return self.kind == "v3"

    @classmethod
    def make(cls, kind: str, head_dim: int, n_heads: int, seed: int = 0, layer: int = 0):
        """Deterministic in (kind, seed, layer, n_heads, head_dim)."""
        _check_dim(head_dim, kind == "v3")
        rng = np.random.default_rng([seed, layer, head_dim, n_heads])
        nb = head_dim // 4
        blocks = dense = None
        if kind == "dense":
            g = rng.standard_normal((n_heads, head_dim, head_dim))
            qm, r = np.linalg.qr(g)
            qm = qm * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[:, None, :]  # Haar measure
            dense = mx.array(qm.astype(np.float32))
        elif kind == "v1":
            q = _unit_quaternions(rng, (n_heads, nb))
            blocks = quat_left(q) @ quat_right(quat_conj(q))
        elif kind in ("v2", "v3"):
            ql = _unit_quaternions(rng, (n_heads, nb))
            qr = _unit_quaternions(rng, (n_heads, nb))
            blocks = quat_left(ql) @ quat_right(quat_conj(qr))
        else:
            raise ValueError(f"unknown rotation kind {kind!r}; expected one of {KINDS}")
        if blocks is not None:
            blocks = mx.array(blocks.astype(np.float32))
        return cls(kind, head_dim, n_heads, seed, layer, blocks, dense)

    @property
    def nbytes(self) -> int:
        a = self.dense if self.dense is not None else self.blocks
        return a.nbytes

    def _blockwise(self, x: mx.array, m: mx.array) -> mx.array:
        # x: [B, Hkv, N, D]; m: [Hkv, D/4, 4, 4] -> [B, Hkv, N, D]
        b, h, n, d = x.shape
        xb = x.reshape(b, h, n, d // 4, 4).transpose(0, 1, 3, 2, 4)  # [B, Hkv, D/4, N, 4]
        y = xb @ m.swapaxes(-1, -2)  # row-vector form of blocks @ x
        return y.transpose(0, 1, 3, 2, 4).reshape(b, h, n, d)

    def _apply(self, x: mx.array, inverse: bool) -> mx.array:
        # x: [B, Hkv, ..., D] with any dims between heads and D; computed in float32
        shape = x.shape
        if shape[1] != self.n_heads or shape[-1] != self.head_dim:
            raise ValueError(
                f"rotation for {self.n_heads} heads × {self.head_dim} got shape {tuple(shape)}"
            )
        x = x.astype(mx.float32).reshape(shape[0], shape[1], -1, shape[-1])
        scale = 1.0 / math.sqrt(self.head_dim)
        if self.kind == "dense":
            m = self.dense[None]  # [1, Hkv, D, D]
            y = x @ (m if inverse else m.swapaxes(-1, -2))
        elif inverse:
            y = self._blockwise(x, self.blocks.swapaxes(-1, -2))
            if self.wht:
                y = mx.hadamard_transform(y, scale=scale)
        else:
            y = mx.hadamard_transform(x, scale=scale) if self.wht else x
            y = self._blockwise(y, self.blocks)
        return y.reshape(shape)

    def forward(self, x: mx.array) -> mx.array:
        """y = R x. x: [B, Hkv, ..., D] -> same shape, float32."""
        return self._apply(x, inverse=False)

    def inverse(self, y: mx.array) -> mx.array:
        """x = Rᵀ y. y: [B, Hkv, ..., D] -> same shape, float32."""
        return self._apply(y, inverse=True)

    def matrix(self) -> mx.array:
        """The explicit rotation [Hkv, D, D] (tests and kernels' oracles): y = M[h] @ x."""
        eye = mx.broadcast_to(
            mx.eye(self.head_dim), (1, self.n_heads, self.head_dim, self.head_dim)
        )
        return self.forward(eye)[0].swapaxes(-1, -2)
