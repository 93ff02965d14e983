"""IsoQuant attention problems for kernel tests and benchmarks: random queries over a packed
K/V pair with a float tail, in either V layout."""

from __future__ import annotations

import mlx.core as mx

from ..kvcache.isoquant.attention import IsoQuantTensor
from ..kvcache.isoquant.packing import pack_v_codes, unpack_codes
from ..kvcache.isoquant.quantizer import Quantizer, encode
from ..kvcache.isoquant.rotation import Rotation


def random_problem(
    b: int,
    hkv: int,
    g: int,
    length: int,
    dim: int,
    tc: int,
    tf: int = 0,
    kb: int = 3,
    vb: int = 3,
    kind: str = "v3",
    dtype=mx.bfloat16,
    seed: int = 0,
    encoded: bool = True,
    v_layout: str = "rows",
):
    """(q [B, Hq, L, D], keys, values) with tc packed and tf float tokens. encoded=True runs
    the cache's quantizer on Gaussian K/V; False draws random code bytes and norms directly
    (every byte pattern is a valid code stream: fast for benchmark-sized caches). v_layout:
    the V codes' layout (packing.py; "tc16" repacks the same codes)."""
    mx.random.seed(seed)
    rot = Rotation.make(kind, dim, hkv, seed=seed, layer=1)
    kq, vq = Quantizer.make(dim, kb), Quantizer.make(dim, vb)
    if encoded:
        kc, kn = encode(mx.random.normal((b, hkv, tc, dim)) * 2.0, rot, kq)
        vc, vn = encode(mx.random.normal((b, hkv, tc, dim)), rot, vq)
    else:
        kc = mx.random.randint(0, 256, (b, hkv, tc, kq.row_bytes)).astype(mx.uint8)
        vc = mx.random.randint(0, 256, (b, hkv, tc, vq.row_bytes)).astype(mx.uint8)
        kn = (mx.random.uniform(10.0, 30.0, (b, hkv, tc))).astype(mx.float16)
        vn = (mx.random.uniform(5.0, 15.0, (b, hkv, tc))).astype(mx.float16)
    fk = mx.random.normal((b, hkv, tf, dim)).astype(dtype) if tf else None
    fv = mx.random.normal((b, hkv, tf, dim)).astype(dtype) if tf else None
    q = (mx.random.normal((b, hkv * g, length, dim)) * 1.5).astype(dtype)
    if v_layout == "tc16":
        vc = pack_v_codes(unpack_codes(vc, vb), vb, "tc16")
    elif v_layout != "rows":
        raise ValueError(f"unknown V layout {v_layout!r}")
    keys = IsoQuantTensor(kc, kn, fk, kq, rot)
    return q, keys, IsoQuantTensor(vc, vn, fv, vq, rot, layout=v_layout)
