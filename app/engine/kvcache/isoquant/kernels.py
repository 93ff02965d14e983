"""IsoQuant attention kernels: source factory, kernels built once at import, references,
launchers and public functions (STYLE "Kernels").

Kernels (bodies in isoquant_body.h, shared by Metal and CUDA; prologues in
metal_prologue.py and cuda_prologue.py):
  A iq_qk_dot          packed K -> scores (query rotated in the kernel)
  B iq_softmax         scores -> probabilities (lengths, causal float segment, sinks)
  C iq_value_word      probabilities x packed V -> õ, word-parallel (T < 512)
    iq_value_dim       the same, dimension-parallel over token splits (T >= 512)
  D iq_rotate_inverse  o = Rᵀ õ (+ the float segment's output)
  iq_fused_scalar      A+B+C in one launch: split-K with an online softmax per warp
  iq_fused_tc          its CUDA tensor-core twin (3-bit, D 64/128; isoquant_tc.cuh); its
                       threadgroups merge their warps' partials, and with TC_FOLD the last
                       threadgroup of a row block also does the combine (one launch)
  iq_combine           log-sum-exp merge of the splits, Rᵀ once per row, float segment added
  iq_encode            the cache's decode-time compression of K and V rows (one launch)
Shapes: q [B, Hq, L, D]; codes [B, Hkv, Tc, D*bits/8] uint8; norms [B, Hkv, Tc] fp16;
fp K/V [B, Hkv, Tf, D]; rows r = g*L + l per KV head (query head h*G + g, position l).
"""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import cuda_prologue, metal_prologue
from .attention import IsoQuantTensor, isoquant_attention_reference
from .codebook import kv_codebook
from .packing import unpack_codes
from .rotation import Rotation

# -- source factory ------------------------------------------------------------------------

_DIR = Path(__file__).parent
BODY_PATH = _DIR / "isoquant_body.h"
TC_PATH = _DIR / "isoquant_tc.cuh"
_SECTION = re.compile(r"^// @(header|kernel (\w+))\s*$(.*?)^// @end\s*$", re.M | re.S)


def sections(text: str) -> tuple[str, dict[str, str]]:
    """("@header" text, {kernel name: body}) of a kernel source file."""
    header, bodies = "", {}
    for m in _SECTION.finditer(text):
        if m.group(1) == "header":
            header += m.group(3)
        else:
            bodies[m.group(2)] = m.group(3)
    return header, bodies


SHARED_HEADER, SHARED_BODIES = sections(BODY_PATH.read_text())
TC_HEADER, TC_BODIES = sections(TC_PATH.read_text())

_FUSED_IN = [
    "q", "k_codes", "k_norms", "v_codes", "v_norms", "k_fp", "v_fp", "rot", "lv_k", "lv_v",
    "lens", "iparams", "fparams",
]  # fmt: skip
_PART_OUT = ["part_o", "part_m", "part_l"]
# name -> (inputs, outputs); every body takes its template values at call time (MLX puts them
# in the compiled kernel's name), and the q/fp dtype is part of our name (see _kernel_name).
SPECS: dict[str, tuple[list[str], list[str]]] = {
    "iq_fused_scalar": (_FUSED_IN, _PART_OUT),
    # (its level tables come in iparams: tc_table_words)
    "iq_fused_tc": (
        [n for n in _FUSED_IN if n not in ("lv_k", "lv_v")] + ["sinks", "counters"],
        _PART_OUT + ["out"],
    ),
    "iq_combine": (["part_o", "part_m", "part_l", "rot", "sinks", "iparams", "fparams"], ["out"]),
    "iq_qk_dot": (["q", "k_codes", "k_norms", "rot", "lv_k", "iparams", "fparams"], ["scores"]),
    "iq_softmax": (["scores", "sinks", "lens", "iparams"], ["probs"]),
    "iq_value_word": (["probs", "v_codes", "v_norms", "lv_v", "lens", "iparams"], ["out"]),
    "iq_value_dim": (["probs", "v_codes", "v_norms", "lv_v", "lens", "iparams"], ["part"]),
    "iq_rotate_inverse": (["acc", "add", "rot", "iparams"], ["out"]),
    "iq_encode": (["x_k", "x_v", "rot", "thr_k", "thr_v", "iparams"], ["kc", "kn", "vc", "vn"]),
    "iq_tc16_pack": (["vc", "old", "iparams"], ["chunks"]),
}
CUDA_ONLY = ("iq_fused_tc", "iq_tc16_pack")
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def source(name: str, backend: str) -> tuple[str, str]:
    """(header, body) of kernel `name` without the backend prologue."""
    if name in TC_BODIES:
        if backend != "cuda":
            raise ValueError(f"{name} is a CUDA-only kernel")
        return SHARED_HEADER + TC_HEADER, TC_BODIES[name]
    return SHARED_HEADER, SHARED_BODIES[name]


def _kernel_name(name: str, dtype: str) -> str:
    # v3: packed format 2; v4: the tensor-core kernel's stream; v5: its 32-token tiles; v6: its
    # float window's vector loads and threadgroup order; v7: its P V weights' scale on the partial,
    # int8 row scales from the rotation; v8: its V levels as fp16 subnormals (VSN); v9: its set-up
    # loads in one round trip, the fold rotating per warp; v10: the fold's merge 8 splits per round
    # trip, its place recomputed after the tile loop; v11: the query's int8 fragments from the warp
    # rotation, padded rows skipped; v12: its row blocks' splits spread over the grid; v13: its
    # grid as row blocks x splits, level tables from the host, query rows in 16-byte loads; v14: its
    # inputs without the level arrays it no longer reads; v15: P V on the int8 tensor cores (PV8);
    # (v16: a cluster fold, not kept) v17: PV8's exponents with kmul fused, P' in two
    # instructions a value, nu's growth voted before the maximum; v18: PV8's selectors' shift kept
    # on the masked word (iq_shl4); v19: P' parts picked by the pack's byte permutes, the warps'
    # merge with per-lane offsets (one barrier less), the fold without integer divisions; v20: the
    # partial's place and scale recomputed after the tile loop, the fold's chunks of compressed
    # splits without the float part; v21: V codes in the tc16 layout read as selectors (VIL).
    # MLX caches builds by name, so a changed body gets a new name: a side-by-side run of the
    # previous code never shares a build.
    return f"{name}_{dtype}_v21"


# -- kernels built once at import ----------------------------------------------------------


def _backend() -> str | None:
    if cuda_prologue.available():
        return "cuda"
    if metal_prologue.available():
        return "metal"
    return None


BACKEND = _backend()
_KERNELS: dict[tuple[str, str], object] = {}
if BACKEND is not None:
    _prologue = cuda_prologue if BACKEND == "cuda" else metal_prologue
    for _name, (_ins, _outs) in SPECS.items():
        if _name in CUDA_ONLY and BACKEND != "cuda":
            continue
        _hdr, _body = source(_name, BACKEND)
        for _dt in DTYPES:
            _KERNELS[(_name, _dt)] = _prologue.build(
                _kernel_name(_name, _dt), _ins, _outs, _body, _hdr
            )


def kernels_available() -> bool:
    return bool(_KERNELS)


_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _dtype_name(dt) -> str:
    try:
        return _DTYPE_NAMES[dt]
    except KeyError:
        raise ValueError(
            f"IsoQuant kernels take float16, bfloat16 or float32 queries, not {dt}"
        ) from None


# -- problem description -------------------------------------------------------------------

KIND_CODES = {"v3": 0, "v2": 1, "v1": 1, "dense": 2}
HEAD_DIMS = (64, 128, 256, 512)
TC_HEAD_DIMS = (64, 128)
# (query lo part, P' lo part) of the tensor-core kernel; see isoquant_tc.cuh
TC_PRECISION = tuple(
    os.environ.get("ROTARYQUANT_ISOQUANT_TC_PRECISION", "10")[i] == "1" for i in (0, 1)
)
# tensor-core kernel: Q fragments in shared memory (100-104 registers, 4 threadgroups per SM)
# instead of registers (134, 3): 2-14% faster on the H200 at 9 of 11 shapes (attention_decode.py's variant columns)
TC_QS = os.environ.get("ROTARYQUANT_ISOQUANT_TC_QS", "1") == "1"
# tensor-core kernel: the combine folded into the split kernel's last threadgroup per row block
# (one launch per call instead of two; its warps merge and rotate their own rows, loading 8 splits
# at a time) or a separate iq_combine launch. H200, side by side (docs/kernels.md), combine
# launch vs folded: B1 T2K 10.5 -> 10.0 µs (+ 64 float tokens
# 12.9 -> 12.4), B8 T2K 17.1 -> 15.7, B8 T8K 30.3 -> 30.3, B8 T32K 84.1 -> 83.9, B8 T128K 299.0 ->
# 297.7, B32 T8K 88.1 -> 84.5, B32 T32K 302 -> 299. (An earlier fold lost at 32K and above: its
# build kept the threadgroup's place and a float parameter live through the tile loop, which ptxas
# then scheduled ~2% slower.) ROTARYQUANT_ISOQUANT_FOLD=0 takes the launch.
TC_FOLD = os.environ.get("ROTARYQUANT_ISOQUANT_FOLD", "1") == "1"


# tensor-core kernel: each warp issues its first tiles' loads before the threadgroup loads and
# rotates the query (their DRAM latency overlaps that set-up) instead of after; within noise on
# the H200 at every shape (attention_decode.py's prefetch_off column)
TC_PREFETCH = os.environ.get("ROTARYQUANT_ISOQUANT_TC_PREFETCH", "1") == "1"
# tensor-core kernel: Q K^T on the int8 tensor cores when the K codebook is on the int8 grid (the
# cache's 3-bit codebook is: codebook.kv_codebook): four K codes per byte permute into an exact
# int8 table instead of one per code into fp16, the query in two int8 parts (row-scaled), half
# the mma of the fp16 path
TC_KI8 = os.environ.get("ROTARYQUANT_ISOQUANT_TC_KI8", "1") == "1"
# tensor-core kernel: P V with the V levels as fp16 subnormals (one byte permute per A register;
# isoquant_tc.cuh, VSN) when the V codebook is on the int8 grid, instead of the fp16 level table
# (two permutes per register and the token pairing)
TC_VSN = os.environ.get("ROTARYQUANT_ISOQUANT_TC_VSN", "1") == "1"
# tensor-core kernel: P V on the int8 tensor cores as well (isoquant_tc.cuh, PV8) when Q K^T is
# (KI8), the V codebook is on the int8 grid and a (sequence, KV head) has at most 4 query rows
# (decode with up to 4 query heads per KV head): one byte permute per 4 V codes instead of 2,
# half the mma; P' quantized in two int8 parts
TC_PV8 = os.environ.get("ROTARYQUANT_ISOQUANT_TC_PV8", "1") == "1"
# PV8's int32 accumulators hold up to 127 * 128 per token and part (part 2 reaches -128): tokens per
# warp below this
PV8_MAX_SPLIT = 1 << 17


def tc_options() -> tuple:
    """The tensor-core kernel's switches (_launch's opts) from the settings."""
    return (*TC_PRECISION, TC_QS, TC_FOLD, TC_PREFETCH, TC_KI8, TC_VSN, TC_PV8)


# Warps the default split plan aims for (one per split), by the number of (sequence, KV head,
# row block) rows and the compressed tokens per row: chosen on GPU time (benchmarks/gpu_clock.py)
# from side-by-side sweeps on the H200 (docs/kernels.md; attention_decode.json
# "split_plan_sweep" with the tc16 layout). With <= 8 rows (batch 1) 1024 (against 1536: B1 T16K 17.5 vs 19.4 µs, T32K
# 22.9 vs 24.9); else 2048: 512 threadgroups of four equal splits at 64 and 256 rows, one full
# wave at 4 per SM, where 3072 gave 768 (1.45 waves) and 1536 at 256 rows 512 with two warps idle
# (after the cheaper set-up: B32 T8K 91.1 -> 87.6 µs, B16 T8K 52.3 -> 48.6, B8 T32K
# 86.0 -> 84.9, B8 T128K 306.7 -> 300.9, B8 T8K and B32 T2K / T32K equal); except with more than
# 64 rows of over 32K tokens, 3072 (B32 T128K 1115 vs 1136 µs). The tensor-core kernel with <= 8
# rows of <= 2K compressed tokens and a float window (decode at B1, short context) aims for 256
# (64-token splits instead of 32: half the threadgroups and partials; side by side:
# B1 T2K + 64 float 11.85 -> 10.7 µs, + 72 12.1 -> 10.55; without the window
# 9.3 -> 9.4 and at T8K + 64 14.2 -> 15.8, so neither takes it).
# A set value (ROTARYQUANT_ISOQUANT_SPLIT_WARPS, or the benchmark's sweep) applies to every shape.
SPLIT_WARPS: int | None = int(os.environ.get("ROTARYQUANT_ISOQUANT_SPLIT_WARPS") or 0) or None


def split_warps(rows: int, tokens: int = 0, float_tokens: int = 0) -> int:
    """Warps the default split plan aims for with `rows` (sequence, KV head, row block) rows of
    `tokens` compressed tokens each; `float_tokens`: the float window's, for the tensor-core
    kernel's plan (0 for the scalar kernel's)."""
    if SPLIT_WARPS:
        return SPLIT_WARPS
    if rows <= 8:
        return 256 if float_tokens and tokens <= 2048 else 1024
    return 3072 if rows > 64 and tokens > 32768 else 2048


NW = 4  # warps per threadgroup (IQ_NW)
COMBINE_THREADS = 256  # threads of iq_combine's threadgroup (CT in its body)
TC_RB = 8  # query rows per threadgroup of the tensor-core kernel
TC_TILE = 32  # tokens per tile of the tensor-core kernel (IQ_TILE)
# float-window tokens per warp of the tensor-core kernel, at least (the default window of 64
# tokens: all four warps of one threadgroup; a warp walks its tokens one per lane)
TC_FLOAT_SPLIT = 16
# With at most this many (sequence, KV head, row block) rows, the float window's tokens aim for
# two threadgroups per row, not one: the decode tail holds 64-79 tokens (the window plus up to 15
# awaiting the next batch of compressions), and 65-79 of them in one threadgroup gave its warps
# 32-token splits. H200, GPU us, side by side: B1 T2K with
# 72 / 79 float tokens 14.8 / 14.9 -> 13.7 / 13.7; B8 T8K 36.3-38.0 either way; B32 T8K 108.5 ->
# 113.6 (twice the float threadgroups' set-up).
TC_FLOAT_GROUP_ROWS = 8
# rows per threadgroup of the scalar kernels: keeps RB * D/32 accumulators per lane at <= 32
SCALAR_RB = {64: 8, 128: 8, 256: 4, 512: 2}
LOG2E = 1.4426950408889634


class Unsupported(ValueError):
    """This input needs the reference (the dispatcher falls back; a forced kernel raises)."""


class _ProblemFields(NamedTuple):
    b: int
    hq: int
    hkv: int
    length: int  # L: queries per head
    dim: int
    tc: int
    tf: int
    kb: int
    vb: int
    kind: int
    causal: bool


class Problem(_ProblemFields):
    """A call's shapes and widths. A named tuple, not a dataclass: a decode step's cache
    lengths change every step, so one is made (and hashed, as the launch cache's key) per
    layer and step."""

    __slots__ = ()

    def __new__(cls, *args, **kw):
        self = super().__new__(cls, *args, **kw)
        if self.hq % self.hkv:
            raise ValueError(f"{self.hq} query heads are not a multiple of {self.hkv} KV heads")
        if self.dim not in HEAD_DIMS:
            raise Unsupported(f"IsoQuant kernels take head dims {HEAD_DIMS}, not {self.dim}")
        if self.causal and self.tf < self.length:
            raise Unsupported("causal queries must lie in the float segment")
        return self

    @property
    def g(self) -> int:
        return self.hq // self.hkv

    @property
    def rows(self) -> int:
        return self.g * self.length

    @classmethod
    def of(cls, q: mx.array, keys: IsoQuantTensor, values: IsoQuantTensor, mask) -> Problem:
        b, hq, length, d = q.shape
        if keys.compressed_len != values.compressed_len or keys.fp_len != values.fp_len:
            raise ValueError("keys and values of an IsoQuant cache cover different tokens")
        if keys.rotation is not values.rotation and keys.rotation.kind != values.rotation.kind:
            raise Unsupported("keys and values use different rotations")
        if mask is not None and not isinstance(mask, str):
            raise Unsupported("array masks are handled by the reference")
        if isinstance(mask, str) and mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        causal = mask == "causal" and length > 1
        return cls(
            b, hq, keys.shape[1], length, d, keys.compressed_len, keys.fp_len,
            keys.quantizer.bits, values.quantizer.bits, KIND_CODES[keys.rotation.kind], causal,
        )  # fmt: skip


def _rot_array(rot: Rotation) -> mx.array:
    return rot.dense if rot.kind == "dense" else rot.blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad8(a: mx.array) -> mx.array:
    # Metal passes arrays of fewer than 8 elements in the constant address space: keep 8+.
    return a if a.size >= 8 else mx.concatenate([a.reshape(-1), mx.zeros((8 - a.size,), a.dtype)])


# Small parameter arrays are cached: building one is a host-to-device copy per call, which
# costs more than the kernels at short contexts.
@functools.lru_cache(maxsize=256)
def _full_lens(b: int, tc: int) -> mx.array:
    return _pad8(mx.full((b,), tc, mx.int32))


# A batch's per-row code counts as the kernels read them, kept for the array they came from:
# every layer of a step passes the batch cache's same `lens` array (three ops a layer saved).
_LENS: list = [(None, 0, None)]


def _lens(p: Problem, lens) -> mx.array:
    if lens is None:
        return _full_lens(p.b, p.tc)
    src, tc, out = _LENS[0]
    if src is lens and tc == p.tc:
        return out
    a = mx.array(lens, mx.int32).reshape(-1)
    if a.shape[0] != p.b:
        raise ValueError(f"lens has {a.shape[0]} entries for a batch of {p.b}")
    out = _pad8(mx.minimum(a, p.tc))
    if isinstance(lens, mx.array):
        _LENS[0] = (lens, p.tc, out)
    return out


@functools.lru_cache(maxsize=8)
def _no_sinks() -> mx.array:
    return mx.zeros((8,), mx.float32)


def _sinks(p: Problem, sinks) -> mx.array:
    if sinks is None:
        return _no_sinks()
    return _pad8(sinks.astype(mx.float32).reshape(-1))


# Ticket counters of the tensor-core kernel's folded combine: each call draws a fresh range of
# slots (one per KV head and row block) from a zeroed ring, so calls that run concurrently never
# share one; the last threadgroup of a row block sets its slot back to 0. A slot comes round
# again only after COUNTER_RING slots of later calls, long after its call has finished.
COUNTER_RING = 1 << 20
_ring: list = [None, 0]  # [the ring, next free slot]


def _counters(n: int) -> mx.array:
    ring, pos = _ring
    if ring is None or ring.size != COUNTER_RING:
        ring, pos = mx.zeros((COUNTER_RING,), mx.int32), 0
        mx.eval(ring)
    if pos + n > COUNTER_RING:
        pos = 0
    _ring[0], _ring[1] = ring, pos + n
    return ring[pos : pos + n]


@functools.lru_cache(maxsize=1)
def _no_counters() -> mx.array:
    return mx.zeros((8,), mx.int32)


@functools.lru_cache(maxsize=16)
def _dummy_fp(dim: int, dtype) -> mx.array:
    return mx.zeros((1, 1, 1, dim), dtype)


def _iparams(p: Problem, **kw) -> mx.array:
    return _iparams_cached(p, tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=1024)
def _iparams_cached(p: Problem, kw: tuple) -> mx.array:
    return mx.array(_iparams_words(p, kw), mx.int32)


def _iparams_words(p: Problem, kw: tuple) -> list[int]:
    v = [0] * 24
    v[0], v[1], v[2], v[3], v[4], v[7], v[11], v[13] = (
        p.tc, p.tf, p.length, p.rows, p.g, p.hkv, p.hq, p.b,
    )  # fmt: skip
    names = {"sl": 5, "ncb": 6, "nsp": 8, "nspc": 9, "slf": 10, "sinks": 12}
    for k, val in kw:
        if k == "tab":  # IQ_P_TAB: the tensor-core kernel's level tables (tc_table_words)
            v[16:24] = np.asarray(val, np.uint32).view(np.int32).tolist()
        else:
            v[names[k]] = int(val)
    return v


def tc_table_words(levels, form: str) -> tuple[int, ...]:
    """The tensor-core kernel's level table of 8 levels as 4 uint32 words (isoquant_tc.cuh):
    "fp16": the levels' fp16 bits as byte planes (words 0-1 the low bytes of levels 0-7, 2-3 the
    high bytes); "int8": the integer levels as bytes (word 0 levels 0-3, word 1 levels 4-7);
    "vsn": the integer levels + 128 as bytes. Rounding as the GPU's (to nearest, ties to even)."""
    lv = np.asarray([float(x) for x in levels], np.float32)
    if form == "fp16":
        h = lv.astype(np.float16).view(np.uint16)
        planes = np.concatenate([h & 0xFF, h >> 8])
    else:
        planes = (np.rint(lv).astype(np.int64) + (128 if form == "vsn" else 0)) & 0xFF
        planes = np.concatenate([planes, np.zeros(8, np.int64)])
    return tuple(int(w) for w in planes.astype("<u1").view("<u4"))


@functools.lru_cache(maxsize=1024)
def _fparams(scale: float, kinv: float = 1.0, vinv: float = 1.0) -> mx.array:
    return mx.array([scale, scale * LOG2E, LOG2E, kinv, vinv, 0, 0, 0], mx.float32)


@functools.cache
def _fp16_level_scale(levels: tuple[float, ...]) -> float:
    """s in [1, 2) that puts s * levels closest to fp16 values (max relative rounding error);
    the tensor-core kernel keeps its level table in fp16."""
    lv = np.abs(np.asarray(levels, np.float64))
    s = np.linspace(1.0, 2.0, 20001)
    x = s[:, None] * lv[None]
    err = np.max(np.abs(x.astype(np.float16).astype(np.float64) - x) / x, axis=1)
    return float(s[int(err.argmin())])


@functools.lru_cache(maxsize=32)
def _tc_levels_cached(dim: int, bits: int) -> tuple[mx.array, float, bool]:
    """The tensor-core kernel's level table, scaled by s, 1/s (which the kernel applies to the
    norms) and whether the table holds int8 values. Codebooks on the int8 grid: s = 1/scale, so
    the table holds the integers themselves (exact in int8 and fp16); others: the s in [1, 2)
    that rounds best to fp16."""
    cb = kv_codebook(dim, bits)  # host copy of quantizer.levels: no device sync
    if cb.scale is not None:
        return mx.array([v / cb.scale for v in cb.levels], mx.float32), cb.scale, True
    s = _fp16_level_scale(cb.levels)
    return mx.array([v * s for v in cb.levels], mx.float32), 1.0 / s, False


# A decode step's cache lengths change every step, so its launch is planned anew each step
# (_launch); the parts that depend only on the head dim and widths are computed once here.
@functools.lru_cache(maxsize=64)
def _vsn_ok(dim: int, bits: int) -> bool:
    return vsn_table_ok(_tc_levels_cached(dim, bits)[0].tolist())


@functools.lru_cache(maxsize=64)
def _tc_tables(dim: int, kb: int, vb: int, kform: str, vform: str) -> tuple[int, ...]:
    """The tensor-core kernel's K then V level tables (tc_table_words) for these widths."""
    lvk, lvv = _tc_levels_cached(dim, kb)[0], _tc_levels_cached(dim, vb)[0]
    return tc_table_words(lvk.tolist(), kform) + tc_table_words(lvv.tolist(), vform)


def vsn_table_ok(levels) -> bool:
    """Whether the tensor-core kernel can take V levels as fp16 subnormals (VSN, isoquant_tc.cuh):
    8 integers in [-127, 127], the four lowest negative and the four highest positive (byte L +
    128 below 128 for codes 0-3, at or above it for codes 4-7)."""
    lv = [float(x) for x in levels]
    return (
        len(lv) == 8
        and all(x == round(x) and -127 <= x <= 127 for x in lv)
        and all(x < 0 for x in lv[:4])
        and all(x > 0 for x in lv[4:])
    )


def _use_kernel(use_kernel: bool | None) -> bool:
    if use_kernel is None:
        return kernels_available()
    if use_kernel and not kernels_available():
        raise RuntimeError("IsoQuant kernels need MLX's Metal or CUDA backend")
    return bool(use_kernel)


# -- references ------------------------------------------------------------------------------
# q: [B, Hq, L, D]; every reference computes in float32 from the same codes.


def qk_dot_reference(q: mx.array, keys: IsoQuantTensor, scale: float) -> mx.array:
    """Kernel A: scores [B*Hkv, R, Tc] = scale * norm/√D * <R q, levels[codes]>."""
    b, hq, length, d = q.shape
    hkv = keys.codes.shape[1]
    qr = keys.rotation.forward(q.astype(mx.float32).reshape(b, hkv, hq // hkv * length, d))
    lv = keys.quantizer.levels[unpack_codes(keys.codes, keys.quantizer.bits)]  # [B, Hkv, Tc, D]
    s = qr @ lv.swapaxes(-1, -2)  # [B, Hkv, R, Tc]
    s = s * (keys.norms.astype(mx.float32) * (scale / math.sqrt(d)))[:, :, None, :]
    return s.reshape(b * hkv, -1, keys.compressed_len)


def softmax_reference(
    scores: mx.array, p: Problem, lens=None, sinks: mx.array | None = None
) -> mx.array:
    """Kernel B: scores [B*Hkv, R, Tc + Tf] -> probabilities with the kernel's masks."""
    t = p.tc + p.tf
    j = mx.arange(t)
    ln = mx.array([p.tc] * p.b if lens is None else list(lens), mx.int32)
    ln = mx.repeat(mx.minimum(ln, p.tc), p.hkv)[:, None, None]  # [B*Hkv, 1, 1]
    ok = mx.where(j < p.tc, j < ln, True)
    if p.causal:
        lpos = (mx.arange(p.rows) % p.length)[:, None]
        ok = ok & ((j < p.tc) | (j - p.tc <= p.tf - p.length + lpos))
    s = mx.where(ok, scores, -mx.inf)
    if sinks is not None:
        sk = mx.repeat(sinks.astype(mx.float32).reshape(p.hkv, p.g), p.length, axis=1)  # [Hkv, R]
        sk = mx.broadcast_to(sk[None], (p.b, p.hkv, p.rows)).reshape(-1, p.rows, 1)
        return mx.softmax(mx.concatenate([s, sk], axis=-1), axis=-1, precise=True)[..., :-1]
    return mx.softmax(s, axis=-1, precise=True)


def value_accum_reference(probs: mx.array, values: IsoQuantTensor) -> mx.array:
    """Kernel C: õ [B*Hkv, R, D] = Σ_j probs[:, :, j] norm_j/√D levels[codes_j] (j < Tc)."""
    values = values.as_rows()
    b, hkv, tc, _ = values.codes.shape
    d = values.quantizer.dim
    lv = values.quantizer.levels[unpack_codes(values.codes, values.quantizer.bits)]
    lv = lv * (values.norms.astype(mx.float32) / math.sqrt(d))[..., None]  # [B, Hkv, Tc, D]
    pr = probs[..., :tc].reshape(b, hkv, -1, tc)
    return (pr @ lv).reshape(b * hkv, -1, d)


def rotate_inverse_reference(acc: mx.array, rot: Rotation, p: Problem, add=None, dtype=None):
    """Kernel D: [B*Hkv, R, D] rotated-space rows -> [B, Hq, L, D] = Rᵀ acc (+ add)."""
    o = rot.inverse(acc.reshape(p.b, p.hkv, p.rows, p.dim)).reshape(p.b, p.hq, p.length, p.dim)
    if add is not None:
        o = o + add.astype(mx.float32)
    return o if dtype is None else o.astype(dtype)


def attention_reference(q, keys, values, scale, mask=None, sinks=None, lens=None) -> mx.array:
    """The cache's oracle, batch element by element when lengths are ragged."""
    values = values.as_rows()
    if lens is None:
        return isoquant_attention_reference(q, keys, values, scale=scale, mask=mask, sinks=sinks)

    def part(t: IsoQuantTensor, i: int, n: int) -> IsoQuantTensor:
        fp = None if t.fp is None else t.fp[i : i + 1]
        return IsoQuantTensor(
            t.codes[i : i + 1, :, :n], t.norms[i : i + 1, :, :n], fp, t.quantizer, t.rotation
        )

    outs = []
    for i, n in enumerate(list(lens)):
        n = min(int(n), keys.compressed_len)
        k, v = part(keys, i, n), part(values, i, n)
        outs.append(isoquant_attention_reference(q[i : i + 1], k, v, scale, mask, sinks))
    return mx.concatenate(outs, axis=0)


# -- launchers -------------------------------------------------------------------------------


def _kernel(name: str, dtype) -> object:
    try:
        return _KERNELS[(name, _dtype_name(dtype))]
    except KeyError:
        raise RuntimeError(f"kernel {name} is not built on this backend ({BACKEND})") from None


def split_plan(
    p: Problem,
    rows_per_block: int,
    split_len: int | None = None,
    warps: int | None = None,
    merged: bool = False,
) -> dict:
    """Token splits of the fused kernels: one warp per split, NW warps per threadgroup.
    Default: enough warps to fill a large GPU, splits no shorter than 64/256 tokens so the
    partials stay small against the KV they summarize; with at most 16K compressed tokens in
    all, 32 for the tensor-core kernel (two tiles a warp: there the threadgroups' latency is
    the call's time; H200, attention_decode.py: B1 T2K 12.3 vs 13.5 µs, while at B1 T8K and
    B8 T2K, 4x and 8x the tokens, 32-token splits lost, 24.1 vs 17.4 and 30.2 vs 21.8 µs).
    merged: the threadgroup merges its warps' compressed splits into one partial (the
    tensor-core kernel)."""
    nrb = _cdiv(p.rows, rows_per_block)
    heads = p.b * p.hkv * nrb
    if split_len is None:
        tokens = p.tc * p.b * p.hkv
        min_len = 256 if tokens > 1 << 18 else (32 if merged and tokens <= 1 << 14 else 64)
        aim = warps or split_warps(heads, p.tc, p.tf if merged else 0)
        split_len = max(min_len, _cdiv(p.tc, _cdiv(aim, heads)))
    g = TC_TILE if merged else 32  # tokens: the tensor-core kernel's tile, the scalar kernel's warp
    sl = max(g, _cdiv(split_len, g) * g)
    ncb = _cdiv(_cdiv(p.tc, sl), NW)
    fg = TC_FLOAT_SPLIT if merged else 32
    ftg = 2 if merged and heads <= TC_FLOAT_GROUP_ROWS else 1  # float threadgroups aimed for
    slf = min(256, max(fg, _cdiv(_cdiv(p.tf, NW * ftg), fg) * fg))
    nfb = _cdiv(p.tf, NW * slf)
    nspc = ncb if merged else ncb * NW
    return dict(nrb=nrb, sl=sl, ncb=ncb, slf=slf, nfb=nfb, nsp=nspc + nfb * NW, nspc=nspc)


class _Launch(NamedTuple):
    """Everything about a fused call that depends only on shapes and options (cached)."""

    kern: str  # kernel name (objects are looked up per call: tests swap them)
    template: tuple  # hashable: a baked kernel's key (jit.BakedKernel)
    grid: tuple
    out_shapes: list
    ip: mx.array
    fp: mx.array
    fp_combine: mx.array
    slots: int  # counter slots of the folded combine (tensor-core kernel), else 0
    tc16: bool = False  # the kernel reads V codes in the tc16 layout (else they come as rows)
    words: tuple = ()  # ip's words (window_attention writes its own lengths and offset)


def _launch(
    p: Problem,
    variant: str,
    split_len,
    has_sinks: bool,
    scale: float,
    opts: tuple,
    warps: int,
    dtype=mx.float32,
    tc16: bool = False,
):
    """opts: the tensor-core kernel's (QLO, PLO, QS, FOLD, PF, KI8, VSN, PV8) template switches;
    dtype: the output's (the tensor-core kernel writes it when it folds the combine in); tc16:
    the V codes come in packing.py's tc16 layout (read as they are with the int8 V table, PV8 or
    VSN: VIL; the other paths take them repacked as rows: _Launch.tc16).
    A decode step's cache lengths change every step (the compressed part grows by a token
    once the window is full), which changes the split plan only every few dozen tokens and
    two parameters every step: the rest is made once per split plan (_launch_base). Not cached
    itself: _plan keeps the launch of each call's shapes."""
    base, words = _launch_words(p, variant, split_len, has_sinks, scale, opts, warps, dtype, tc16)
    return base._replace(ip=mx.array(words, mx.int32), words=words)


def _launch_words(
    p: Problem, variant, split_len, has_sinks, scale, opts, warps, dtype, tc16
) -> tuple[_Launch, tuple]:
    """_launch's record without its parameters array (ip None), and the parameters' words."""
    rb = TC_RB if variant == "tc" else min(SCALAR_RB[p.dim], 1 << max(0, (p.rows - 1).bit_length()))
    plan = split_plan(p, rb, split_len, warps, merged=variant == "tc")
    base, words = _launch_base(
        p._replace(tc=0, tf=0), rb, tuple(plan.items()), variant, has_sinks, scale, opts, dtype,
        tc16,
    )  # fmt: skip
    words = list(words)
    words[0], words[1] = p.tc, p.tf  # IQ_P_TC, IQ_P_TF (_iparams_words' layout)
    return base, tuple(words)


@functools.lru_cache(maxsize=512)
def _launch_base(
    p: Problem, rb: int, plan_items: tuple, variant, has_sinks, scale, opts, dtype, tc16
) -> tuple[_Launch, tuple]:
    """_launch's launch record without its parameters array, and the parameters' words
    (p.tc and p.tf 0: the caller sets them)."""
    plan = dict(plan_items)
    nbh = p.b * p.hkv
    kinv, vinv, tab = 1.0, 1.0, ()
    vil = False
    if variant == "tc":
        (_, kinv, ki8), (_, vinv, vi8) = (
            _tc_levels_cached(p.dim, p.kb),
            _tc_levels_cached(p.dim, p.vb),
        )
        use_i8 = bool(opts[5] and ki8)
        use_pv8 = bool(
            opts[7] and use_i8 and vi8 and p.kind != KIND_CODES["dense"] and p.rows <= 4
            and plan["sl"] < PV8_MAX_SPLIT
        )  # fmt: skip
        use_vsn = bool(opts[6] and vi8 and _vsn_ok(p.dim, p.vb)) and not use_pv8
        tmpl = [("D", p.dim), ("KIND", p.kind), ("CAUSAL", p.causal)]
        tmpl += [("QLO", opts[0]), ("PLO", opts[1]), ("QS", opts[2]), ("TO", dtype)]
        tmpl += [("FOLD", opts[3]), ("PF", opts[4]), ("KI8", use_i8), ("VSN", use_vsn)]
        vil = bool(tc16 and (use_pv8 or use_vsn))  # (the fp16 table path reads rows)
        tmpl += [("PV8", use_pv8), ("VIL", vil)]
        vform = "int8" if use_pv8 else "vsn" if use_vsn else "fp16"
        tab = _tc_tables(p.dim, p.kb, p.vb, "int8" if use_i8 else "fp16", vform)
    else:
        tmpl = [("D", p.dim), ("RB", rb), ("KB", p.kb), ("VB", p.vb), ("KIND", p.kind)]
        tmpl += [("CAUSAL", p.causal)]
    kw = dict(
        sl=plan["sl"], ncb=plan["ncb"], nsp=plan["nsp"], nspc=plan["nspc"], slf=plan["slf"],
        sinks=has_sinks, **({"tab": tab} if tab else {}),
    )  # fmt: skip
    words = tuple(_iparams_words(p, tuple(sorted(kw.items()))))
    nsp = plan["nsp"]
    out_shapes = [(nbh, nsp, p.rows, p.dim), (nbh, nsp, p.rows), (nbh, nsp, p.rows)]
    if variant == "tc":
        out_shapes.append((p.b, p.hq, p.length, p.dim))
    run = _Launch(
        kern="iq_fused_tc" if variant == "tc" else "iq_fused_scalar",
        template=tuple(tmpl),
        grid=(
            (32 * NW * plan["nrb"] * nbh, plan["ncb"] + plan["nfb"], 1)
            if variant == "tc"
            else (32 * NW * (plan["ncb"] + plan["nfb"]), plan["nrb"], nbh)
        ),
        out_shapes=out_shapes,
        ip=None,
        fp=_fparams(scale, kinv, vinv),
        fp_combine=_fparams(scale),
        slots=nbh * plan["nrb"] if variant == "tc" and opts[3] else 0,
        tc16=bool(variant == "tc" and vil),
    )
    return run, words


def _fused_call(q, keys, values, p: Problem, run: _Launch, variant: str, lens, sinks):
    dt = q.dtype
    if values.layout == "tc16" and not run.tc16:
        values = values.as_rows()
    fpk = keys.fp if p.tf else _dummy_fp(p.dim, dt)
    fpv = values.fp if p.tf else _dummy_fp(p.dim, dt)
    fpk = fpk if fpk.dtype == dt else fpk.astype(dt)
    fpv = fpv if fpv.dtype == dt else fpv.astype(dt)
    # the scalar kernel reads the quantizers' levels; the tensor-core one its tables in run.ip
    lv = [] if variant == "tc" else [keys.quantizer.levels, values.quantizer.levels]
    (kc, kn), (vc, vn) = keys.buffers(), values.buffers()  # rows [0, p.tc) read, by strides
    inputs = [
        q, kc, kn, vc, vn, fpk, fpv,
        _rot_array(keys.rotation), *lv, _lens(p, lens), run.ip, run.fp,
    ]  # fmt: skip
    out_dtypes = [mx.float32] * 3
    if variant == "tc":
        inputs += [_sinks(p, sinks), _counters(run.slots) if run.slots else _no_counters()]
        out_dtypes.append(dt)
    return _kernel(run.kern, dt)(
        inputs=inputs,
        template=run.template,
        grid=run.grid,
        threadgroup=(32 * NW, 1, 1),
        output_shapes=run.out_shapes,
        output_dtypes=out_dtypes,
    )


def fused_partials(q, keys, values, scale, mask=None, lens=None, variant=None, split_len=None):
    """The split partials (o [B*Hkv, NSP, R, D], m, l [B*Hkv, NSP, R]; log2 domain) — for tests."""
    p, variant, run = _plan(q, keys, values, scale, mask, None, variant, split_len)
    return _fused_call(q, keys, values, p, run, variant, lens, None)[:3]


def v_layout(dim: int, bits: int) -> str:
    """The layout (packing.py) a cache should store V codes of this head dim and width in for
    these kernels: "tc16" where the tensor-core kernel takes them with its int8 V table (CUDA,
    3-bit, D 64/128), which reads a tc16 word as 4 tokens' selectors at 2 coordinates where rows
    take a 4-token transpose (H200, side by side, the same codes: B8 T8K 23.5 -> 21.8 µs, B8
    T32K 65.8 -> 60.1, B32 T8K 66.4 -> 61.0; docs/kernels.md); else "rows". The int8 P V
    (PV8) takes at most 4 query rows a KV head, which a cache does not know, and VSN the rest: so
    tc16 only while VSN is on (else every call with more rows would repack the V codes)."""
    tc = BACKEND == "cuda" and bits == 3 and dim in TC_HEAD_DIMS
    return "tc16" if tc and TC_VSN else "rows"


def _variant(p: Problem) -> str:
    if BACKEND == "cuda" and p.kb == 3 and p.vb == 3 and p.dim in TC_HEAD_DIMS:
        return "tc"
    return "scalar"


# (shapes, dtypes, settings) of a call -> (Problem, variant, launch): a decode step's host work
# is then one dict lookup instead of building and hashing a Problem (the key changes as the
# cache grows, so the table is bounded by clearing it when full)
_PLANS: dict = {}
_PLANS_MAX = 1024


def _plan(q, keys, values, scale, mask, sinks, variant, split_len):
    opts = tc_options()
    key = (
        q.shape, q.dtype, keys.shape, values.shape, keys.compressed_len, values.compressed_len,
        keys.fp_len, values.fp_len,
        keys.quantizer.bits, values.quantizer.bits, keys.rotation.kind, values.rotation.kind,
        keys.rotation is values.rotation, mask, sinks is None, variant, split_len, float(scale),
        opts, SPLIT_WARPS, BACKEND, values.layout,
    )  # fmt: skip
    hit = _PLANS.get(key)
    if hit is None:
        p = Problem.of(q, keys, values, mask)
        v = variant or _variant(p)
        if v == "tc" and not (p.kb == 3 and p.vb == 3 and p.dim in TC_HEAD_DIMS):
            raise Unsupported("the tensor-core kernel takes 3-bit codes and head dims 64/128")
        run = _launch(
            p, v, split_len, sinks is not None, float(scale), opts, SPLIT_WARPS, q.dtype,
            values.layout == "tc16",
        )  # fmt: skip
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        hit = _PLANS[key] = (p, v, run)
    return hit


def fused_attention(
    q, keys, values, scale, mask=None, sinks=None, lens=None, variant=None, split_len=None
):
    """Single-pass split-K attention (A+B+C in one launch) + combine (folded into the same
    launch by the tensor-core kernel with TC_FOLD). variant: "tc" (CUDA tensor cores, 3-bit,
    D 64/128) or "scalar" (every backend); default picks tc where it applies."""
    if mask is not None and not isinstance(mask, str):
        Problem.of(q, keys, values, mask)  # raises: array masks are the reference's
    if sinks is None and lens is None and variant is None and split_len is None:
        src = _window_src(q, keys, values)
        out = None if src is None else window_attention(q, *src, scale)
        if out is not None:
            return out
    p, variant, run = _plan(q, keys, values, scale, mask, sinks, variant, split_len)
    part = _fused_call(q, keys, values, p, run, variant, lens, sinks)
    if run.slots:  # the tensor-core kernel merged its splits itself
        return part[3]
    return combine(part[:3], keys.rotation, p, run, q.dtype, sinks)


# -- a cache's decode step, its buffers read in place ----------------------------------------

IP_FLO = 14  # IQ_P_FLO: the float window's first row in the k_fp / v_fp buffers
IP_WORDS = 24  # a launch's parameter words (_iparams_words)
# The last step's launch: every layer of a decode step has the same lengths, so the first
# layer takes it (problem, launch, parameter views) from its block and the others reuse it.
# One (key, launch) pair, replaced whole (a reader on another thread sees one or the other).
_STEP: list = [(None, None)]
# The launches of a cache's next STEP_ROWS steps, planned together, their parameter words in
# one array: a step takes its row as a view. Planning a step's launch
# (problem, split plan, launch record, parameters) is ~0.3 ms of Python on the H200's host
# (tiny-width Qwen3-30B-A3B shapes, 48 layers: 3.68 ms a step built with the plan made anew
# against 3.38 with it kept); a block pays it once in STEP_ROWS steps. A full window moves by
# one token a step: step j of a block reads tc0 + j codes and the window from row lo0 + j of
# its buffer, tf tokens long.
# Block key -> (tc0, lo0, tf, rows, table), an entry replaced whole; a few keys (layers of
# other shapes, other caches) keep their own.
STEP_ROWS = 16
_BLOCKS: dict = {}


def _window_src(q, keys, values) -> tuple | None:
    """window_attention's arguments (but the scale) for a one-token step over a cache's
    CacheView pair (attention.CacheView: its buffers and bounds), else None."""
    ks, vs = keys.__dict__.get("_src"), values.__dict__.get("_src")
    if ks is None or vs is None or q.shape[2] != 1 or keys.rotation is not values.rotation:
        return None
    if keys.lens is not None or keys.fp_start is not None:  # a batch's rows of other lengths
        return None
    kc, kr, kn, tc, fk, lo, hi = ks
    vc, _, vn, vtc, fv, vlo, vhi = vs
    if (kr, vtc, vlo, vhi) != (tc, tc, lo, hi) or fk is None or fv is None:
        return None
    return (kc, kn, vc, vn, fk, fv, lo, tc, max(0, hi - lo), keys.quantizer, values.quantizer,
            keys.rotation, values.layout)  # fmt: skip


def window_attention(q, kc, kn, vc, vn, fk, fv, lo: int, tc: int, tf: int, kq, vq, rot, layout,
                     scale, counters=None):  # fmt: skip
    """One-token decode attention over a cache's own buffers: codes kc/vc and norms kn/vn whose
    rows [0, tc) are the compressed tokens, the float window fk/fv[:, :, lo : lo + tf] read in
    place at row offset `lo` (IQ_P_FLO), so nothing is sliced per layer. The same kernel launch
    as fused_attention on the sliced views (the same numbers). None where that launch does not
    apply (the caller takes the general path): a window in another dtype than the queries, V
    codes the kernel would need repacked.
    counters: the caller's own zeroed int32 slots for the folded combine (a cache's: its calls
    run one after another, each step's queries depending on the last step), else slots drawn
    from the ring per call."""
    dt = q.dtype
    key = (q.shape, dt, kc.shape, kn.shape, vc.shape, fk.shape, fk.dtype, fv.dtype, lo, tc, tf,
           kq.bits, vq.bits, rot.kind, layout, scale)  # fmt: skip
    last_key, step = _STEP[0]
    if last_key != key:
        if fk.dtype != dt or fv.dtype != dt or q.shape[2] != 1 or not tc:
            return None
        step = _block_step(key, q, kc, lo, tc, tf, kq, vq, rot, layout, scale)
        if step is None:
            return None
        _STEP[0] = (key, step)
    p, run, ip, lens, scalar = step
    lv, tail = ((kq.levels, vq.levels), ()) if scalar else ((), (_no_sinks(), _no_counters()))
    if run.slots:
        own = counters is not None and counters.size >= run.slots
        tail = (tail[0], counters if own else _counters(run.slots))
    fk = fk if tf else _dummy_fp(p.dim, dt)
    fv = fv if tf else _dummy_fp(p.dim, dt)
    part = _kernel(run.kern, dt)(
        inputs=[q, kc, kn, vc, vn, fk, fv, _rot_array(rot), *lv, lens, ip, run.fp, *tail],
        template=run.template,
        grid=run.grid,
        threadgroup=(32 * NW, 1, 1),
        output_shapes=run.out_shapes,
        output_dtypes=[mx.float32] * 3 + ([] if scalar else [dt]),
    )
    if run.slots:
        return part[3]
    return combine(part[:3], rot, p, run._replace(ip=ip), dt)


def _block_step(key, q, kc, lo, tc, tf, kq, vq, rot, layout, scale):
    """The step's (problem, launch, parameters view, lengths, scalar kernel?) from the block of
    steps it falls in (planned here when it does not); None where the kernel's launch does not
    take the cache's buffers as they are (V codes to repack)."""
    opts = tc_options()
    bkey = (*key[:8], *key[11:], opts, SPLIT_WARPS, BACKEND)  # the step's, less lo, tc, tf
    tc0, lo0, btf, rows, table = _BLOCKS.get(bkey, (0, 0, -1, (), None))
    i = tc - tc0
    if not (btf == tf and lo - lo0 == i and 0 <= i < len(rows)):
        b, hq, length, dim = q.shape
        rows, words = [], []
        for j in range(STEP_ROWS):
            p = Problem(b, hq, kc.shape[1], length, dim, tc + j, tf, kq.bits, vq.bits,
                        KIND_CODES[rot.kind], False)  # fmt: skip
            variant = _variant(p)
            run, w = _launch_words(p, variant, None, False, float(scale), opts, SPLIT_WARPS,
                                   q.dtype, layout == "tc16")  # fmt: skip
            if layout == "tc16" and not run.tc16:
                return None
            w = list(w)
            w[IP_FLO] = lo + j
            rows.append((p, run, variant != "tc"))
            words += w
        table = mx.array(words, mx.int32)  # made from host data: evaluated already
        i = 0
        if len(_BLOCKS) >= 8:
            _BLOCKS.clear()
        _BLOCKS[bkey] = (tc, lo, tf, tuple(rows), table)
    p, run, scalar = rows[i]
    # the view is made by the step that reads it (on its thread's stream)
    ip = table[i * IP_WORDS : (i + 1) * IP_WORDS]
    return p, run, ip, _lens(p, None), scalar


def combine(part, rot: Rotation, p: Problem, run: _Launch, dtype, sinks=None) -> mx.array:
    """The split partials -> [B, Hq, L, D] (log-sum-exp merge, Rᵀ once per row)."""
    po, pm, pl = part
    return _kernel("iq_combine", dtype)(
        inputs=[po, pm, pl, _rot_array(rot), _sinks(p, sinks), run.ip, run.fp_combine],
        template=[("D", p.dim), ("KIND", p.kind), ("TO", dtype)],
        grid=(COMBINE_THREADS, p.rows, p.b * p.hkv),
        threadgroup=(COMBINE_THREADS, 1, 1),
        output_shapes=[(p.b, p.hq, p.length, p.dim)],
        output_dtypes=[dtype],
    )[0]


def qk_dot(q, keys: IsoQuantTensor, scale: float, p: Problem | None = None) -> mx.array:
    """Kernel A -> scores [B*Hkv, R, Tc] float32 (natural units)."""
    p = p or Problem.of(q, keys, keys, None)
    rb = min(SCALAR_RB[p.dim], 1 << max(0, (p.rows - 1).bit_length()))
    nrb = _cdiv(p.rows, rb)
    return _kernel("iq_qk_dot", q.dtype)(
        inputs=[
            q,
            keys.codes,
            keys.norms,
            _rot_array(keys.rotation),
            keys.quantizer.levels,
            _iparams(p),
            _fparams(scale),
        ],  # fmt: skip
        template=[("D", p.dim), ("RB", rb), ("KB", p.kb), ("KIND", p.kind)],
        grid=(32 * NW * _cdiv(p.tc, 32 * NW), nrb, p.b * p.hkv),
        threadgroup=(32 * NW, 1, 1),
        output_shapes=[(p.b * p.hkv, p.rows, p.tc)],
        output_dtypes=[mx.float32],
    )[0]


def softmax(scores: mx.array, p: Problem, lens=None, sinks=None) -> mx.array:
    """Kernel B: [B*Hkv, R, Tc + Tf] float32 scores -> probabilities."""
    ip = _iparams(p, sinks=sinks is not None)
    return _kernel("iq_softmax", mx.float32)(
        inputs=[scores.astype(mx.float32), _sinks(p, sinks), _lens(p, lens), ip],
        template=[("CAUSAL", p.causal)],
        grid=(32 * NW, p.rows, p.b * p.hkv),
        threadgroup=(32 * NW, 1, 1),
        output_shapes=[scores.shape],
        output_dtypes=[mx.float32],
    )[0]


WORD_DIM_SWITCH = 512  # T at which kernel C switches to the dimension-parallel schedule (SPEC §4)


def value_accum(probs: mx.array, values: IsoQuantTensor, p: Problem, lens=None, schedule=None):
    """Kernel C: probs [B*Hkv, R, Tp] (first Tc columns) -> õ [B*Hkv, R, D] float32."""
    schedule = schedule or ("word" if p.tc < WORD_DIM_SWITCH else "dim")
    values = values.as_rows()
    rb = min(4, 1 << max(0, (p.rows - 1).bit_length()))
    nrb = _cdiv(p.rows, rb)
    tp = probs.shape[-1]
    nbh = p.b * p.hkv
    args = [
        probs.astype(mx.float32),
        values.codes,
        values.norms,
        values.quantizer.levels,
        _lens(p, lens),
    ]
    tmpl = [("D", p.dim), ("RB", rb), ("VB", p.vb)]
    if schedule == "word":
        return _kernel("iq_value_word", mx.float32)(
            inputs=args + [_iparams(p, sl=tp)],
            template=tmpl,
            grid=(256, nrb, nbh),
            threadgroup=(256, 1, 1),
            output_shapes=[(nbh, p.rows, p.dim)],
            output_dtypes=[mx.float32],
        )[0]
    # enough splits to fill the GPU, at least 128 tokens each
    ns = max(1, min(_cdiv(p.tc, 128), _cdiv(1024, nbh * nrb)))
    sld = _cdiv(p.tc, ns)
    part = _kernel("iq_value_dim", mx.float32)(
        inputs=args + [_iparams(p, sl=tp, slf=sld)],
        template=tmpl,
        grid=(p.dim, nrb * ns, nbh),
        threadgroup=(p.dim, 1, 1),
        output_shapes=[(ns, nbh, p.rows, p.dim)],
        output_dtypes=[mx.float32],
    )[0]
    return part.sum(axis=0)


def rotate_inverse(
    acc: mx.array, rot: Rotation, p: Problem, add=None, dtype=mx.float32
) -> mx.array:
    """Kernel D: [B*Hkv, R, D] -> [B, Hq, L, D] = Rᵀ acc (+ add [B, Hq, L, D])."""
    has_add = add is not None
    add = add.astype(dtype) if has_add else mx.zeros((8,), dtype)
    return _kernel("iq_rotate_inverse", dtype)(
        inputs=[acc.astype(mx.float32), add, _rot_array(rot), _iparams(p)],
        template=[("D", p.dim), ("KIND", KIND_CODES[rot.kind]), ("ADD", has_add), ("TO", dtype)],
        grid=(p.dim, p.rows, p.b * p.hkv),
        threadgroup=(p.dim, 1, 1),
        output_shapes=[(p.b, p.hq, p.length, p.dim)],
        output_dtypes=[dtype],
    )[0]


def unfused_attention(q, keys, values, scale, mask=None, sinks=None, lens=None, schedule=None):
    """The paper's four-kernel path A -> B -> C -> D; the float segment's two small products
    run as MLX ops between them."""
    p = Problem.of(q, keys, values, mask)
    values = values.as_rows()  # (the value kernels read rows)
    s = qk_dot(q, keys, scale, p)
    if p.tf:
        qh = q.astype(mx.float32).reshape(p.b, p.hkv, p.rows, p.dim)
        sf = (qh * scale) @ keys.fp.astype(mx.float32).swapaxes(-1, -2)  # [B, Hkv, R, Tf]
        s = mx.concatenate([s, sf.reshape(p.b * p.hkv, p.rows, p.tf)], axis=-1)
    pr = softmax(s, p, lens, sinks)
    acc = value_accum(pr, values, p, lens, schedule)
    add = None
    if p.tf:
        pf = pr[..., p.tc :].reshape(p.b, p.hkv, p.rows, p.tf)
        add = (pf @ values.fp.astype(mx.float32)).reshape(p.b, p.hq, p.length, p.dim)
    return rotate_inverse(acc, keys.rotation, p, add, q.dtype)


# -- public function -------------------------------------------------------------------------

PATHS = ("fused", "unfused")
# From benchmarks/attention_decode.py on the H200: the fused single pass wins at every measured
# shape (one launch + a combine against four launches and two MLX products).
DEFAULT_PATH = os.environ.get("ROTARYQUANT_ISOQUANT_PATH", "fused")


def attention(q, keys, values, scale, mask=None, sinks=None, lens=None, use_kernel=None, path=None):
    """IsoQuant attention: q [B, Hq, L, D] -> [B, Hq, L, D] (q's dtype). Kernels where the
    backend has them (use_kernel=None), else the reference; path "fused" or "unfused"."""
    if not _use_kernel(use_kernel):
        return attention_reference(q, keys, values, scale, mask, sinks, lens)
    path = path or DEFAULT_PATH
    if path not in PATHS:
        raise ValueError(f"unknown IsoQuant attention path {path!r}; expected one of {PATHS}")
    if path == "fused":
        return fused_attention(q, keys, values, scale, mask, sinks, lens)
    return unfused_attention(q, keys, values, scale, mask, sinks, lens)


# -- decode-time compression -----------------------------------------------------------------

ENCODE_MAX_ROWS = 16384  # rows per launch (grid y); longer inputs go in chunks


@functools.lru_cache(maxsize=32)
def _thresholds(dim: int, bits: int) -> mx.array:
    """The codebook's thresholds (quantizer.thresholds' values), padded to 8+ entries."""
    return _pad8(mx.array(list(kv_codebook(dim, bits).thresholds), mx.float32))


@functools.lru_cache(maxsize=256)
def _encode_params(hkv: int, n: int) -> mx.array:
    return mx.array([hkv, n, 0, 0, 0, 0, 0, 0], mx.int32)


def encode_pair(keys: mx.array, values: mx.array, rotation: Rotation, kq, vq):
    """K and V rows [B, Hkv, N, D] -> (K codes, K norms, V codes, V norms) in the cache's
    format, one kernel launch (the MLX-ops encoder is ~50 small ops per tensor). The math of
    quantizer.encode; None where the kernel does not take the input (the caller encodes with
    MLX ops)."""
    if not kernels_available():
        return None
    b, h, n, d = keys.shape
    if values.shape != keys.shape or kq.dim != d or vq.dim != d or d not in HEAD_DIMS or n == 0:
        return None
    if n > ENCODE_MAX_ROWS:
        parts = [
            encode_pair(keys[:, :, i : i + ENCODE_MAX_ROWS], values[:, :, i : i + ENCODE_MAX_ROWS],
                        rotation, kq, vq)
            for i in range(0, n, ENCODE_MAX_ROWS)
        ]  # fmt: skip
        return tuple(mx.concatenate([p[j] for p in parts], axis=2) for j in range(4))
    if values.dtype != keys.dtype:
        values = values.astype(keys.dtype)
    return tuple(
        _kernel("iq_encode", keys.dtype)(
            inputs=[
                keys,
                values,
                _rot_array(rotation),
                _thresholds(d, kq.bits),
                _thresholds(d, vq.bits),
                _encode_params(h, n),
            ],
            template=[
                ("D", d),
                ("KIND", KIND_CODES[rotation.kind]),
                ("KB", kq.bits),
                ("VB", vq.bits),
                ("HT", mx.float16),
            ],
            grid=(d, n, b * h * 2),
            threadgroup=(d, 1, 1),
            output_shapes=[(b, h, n, kq.row_bytes), (b, h, n), (b, h, n, vq.row_bytes), (b, h, n)],
            output_dtypes=[mx.uint8, mx.float16, mx.uint8, mx.float16],
        )
    )


@functools.lru_cache(maxsize=256)
def _pack_params(hkv: int, n: int, off: int, nc: int) -> mx.array:
    return mx.array([hkv, n, off, nc, 0, 0, 0, 0], mx.int32)


def pack_tc16(vc: mx.array, old: mx.array | None, off: int):
    """The cache's tc16 write in one launch (packing.py): V codes vc [B, Hkv, N, 3D/8] as rows
    (the encoder's) for chunk rows [off, off + N), rows [0, off) from `old` (the tc16 chunk the
    cache holds there; None when off == 0), the rest code 0 -> [B, Hkv, 16 ceil((off + N) / 16),
    3D/8] in tc16. None where the kernel does not take it (the cache packs with MLX ops)."""
    if BACKEND != "cuda" or not kernels_available():
        return None
    b, h, n, rb = vc.shape
    d = rb * 8 // 3
    if d % 64 or not 0 <= off < 16 or (off and old is None) or n == 0:
        return None
    nc = (off + n + 15) // 16
    words = nc * 6 * d // 4
    return _kernel("iq_tc16_pack", mx.float32)(
        inputs=[vc, vc if old is None else old, _pack_params(h, n, off, nc)],
        template=[("D", d)],
        grid=(64 * _cdiv(words, 64), 1, b * h),
        threadgroup=(64, 1, 1),
        output_shapes=[(b, h, 16 * nc, rb)],
        output_dtypes=[mx.uint8],
    )[0]


def rel_error(out: mx.array, ref: mx.array) -> float:
    """‖out − ref‖ / ‖ref‖ in float32 (NaN when out has a NaN)."""
    a, b = out.astype(mx.float32), ref.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()
