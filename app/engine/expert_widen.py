"""The resident routed experts' call: quantized weights widened for prefill calls, constant
gather indices for decode calls.

MLX's affine quantization stores w = scale * q + bias with codes q of `bits` bits packed in
uint32 words. The same scales and biases with the same codes written at 8 bits give the very
same dequantized weights, and on CUDA (MLX 0.32, H200) one Qwen3-30B-A3B MoE layer's gathered
quantized matmuls at prefill take 25.3 ms at 8 bits against 44.4 at 2 bits and 64.9 at 3
(benchmarks/gather_qmm_bits.py). Decode calls are ~0.1 ms at every width.

So a resident expert layer (mlx-lm's QuantizedSwitchLinear) widens its codes to 8 bits for the
call when the call has many (token, expert) rows (MIN_ROWS: prefill chunks) and runs
gather_qmm at 8 bits; smaller calls (decode, verify) run as mlx-lm runs them. The widened copy
is transient: made in the call's graph, freed once its matmul has run, never kept. It depends
on the layer's input (mx.depends), so MLX computes it just before its matmul rather than all
layers' copies up front. On CUDA that alone did not bound the peak (the host queued every
layer's copy before the device freed the first: +15 GB for a 2048-token chunk of
Qwen3-30B-A3B), so compiled blocks holding widening experts sync once a layer on prefill calls
(sync_compiled_blocks).

`ROTARYQUANT_EXPERT_PREFILL_BITS`: `8` (the default on CUDA), `4` (codes narrower than 4 bits
widened to 4), `off` (the default on the CPU and Metal, where it was not measured). Read when a
call is built: inside a compiled block (compiled.py) that is when the block is traced for a
shape, so a change needs fresh traces (compiled.use_traces).

The same call hands `mx.gather_qmm` its default left indices (`arange` of the call's rows,
broadcast against the experts' indices) as a constant on unsorted calls (decode, short verify
steps), made once per shape: otherwise the op builds them itself, an Arange node per call
(three a MoE layer every decode step) and a Broadcast for the gate and up projections.

Paged expert layers (offload/) have their own classes and are not touched.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import EngineError

ENV = "ROTARYQUANT_EXPERT_PREFILL_BITS"
# (token, expert) rows from which a call widens: 64 tokens at top-8 (mlx-lm sorts from 64
# rows). A guess, not measured: the repack reads every expert of the layer, a small call a few.
MIN_ROWS = 512
SOURCE_BITS = (2, 3, 4)  # widths whose codes are widened
TARGET_BITS = (4, 8)


def prefill_bits(backend: str | None = None) -> int | None:
    """The width prefill calls widen expert codes to (None: off), from the env override or
    the backend's default (8 on CUDA, off elsewhere)."""
    v = os.environ.get(ENV, "").strip().lower()
    if not v:
        if backend is None:
            from .backend import detect

            backend = detect().name
        return 8 if backend == "cuda" else None
    if v in ("off", "0", "none"):
        return None
    if v.isdigit() and int(v) in TARGET_BITS:
        return int(v)
    raise EngineError(f"{ENV}={v!r}: expected 8, 4 or off")


def _codes(w: mx.array, bits: int) -> mx.array:
    """Packed words [..., W] -> codes [..., W * 32 / bits] (uint32)."""
    if 32 % bits == 0:
        per = 32 // bits
        shifts = mx.arange(per, dtype=mx.uint32) * bits
        c = (w[..., None] >> shifts) & ((1 << bits) - 1)
        return c.reshape(*w.shape[:-1], w.shape[-1] * per)
    if bits == 3:  # 8 codes in each 3 bytes, a little-endian bit stream
        b = mx.view(w, mx.uint8).reshape(*w.shape[:-1], -1, 3).astype(mx.uint32)
        u = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        c = (u[..., None] >> (mx.arange(8, dtype=mx.uint32) * 3)) & 7
        return c.reshape(*w.shape[:-1], -1)
    raise ValueError(f"codes of {bits} bits are not widened")


def _pack(codes: mx.array, to: int) -> mx.array:
    """Codes [..., N] (each < 2**to) -> words [..., N * to / 32] at `to` bits, as mx.quantize."""
    per = 32 // to
    c = codes.reshape(*codes.shape[:-1], -1, per)
    out = c[..., 0]
    for j in range(1, per):
        out = out | (c[..., j] << (to * j))
    return out


def _widen_words(w: mx.array, bits: int, to: int) -> mx.array:
    """Widths that divide 32 (2 -> 4/8, 4 -> 8): each output word built from one input word's
    shifts and masks, elementwise (one fused kernel once compiled), no code array in between."""
    per_out = 32 // to
    ratio = to // bits  # output words per input word
    mask = (1 << bits) - 1
    x = w[..., None]  # [..., W, 1] against [ratio]
    first = mx.arange(ratio, dtype=mx.uint32) * (bits * per_out)  # first code of each out word
    out = (x >> first) & mask
    for j in range(1, per_out):
        out = out | (((x >> (first + bits * j)) & mask) << (to * j))
    return out.reshape(*w.shape[:-1], w.shape[-1] * ratio)


@functools.cache
def _widener(bits: int, to: int):
    if 32 % bits == 0:
        return mx.compile(functools.partial(_widen_words, bits=bits, to=to))
    return mx.compile(lambda w: _pack(_codes(w, bits), to))


def widen(w: mx.array, bits: int, to: int = 8) -> mx.array:
    """Packed affine-quantized weights (uint32, [..., in * bits / 32]) at `bits` -> the same
    codes packed at `to` bits ([..., in * to / 32]): with the same scales, biases and group size,
    mx.dequantize gives the same weights bit for bit. Lazy, like any MLX op."""
    if bits == to:
        return w
    if bits not in SOURCE_BITS or to not in TARGET_BITS or to < bits:
        raise ValueError(f"cannot widen {bits}-bit codes to {to} bits")
    return _widener(bits, to)(w)


_LHS: dict[tuple, mx.array] = {}  # gather_qmm's default left indices, per (x, indices) shape


def _lhs_indices(batch: tuple, shape: tuple) -> mx.array:
    """What mx.gather_qmm builds for itself when given only right indices: arange(prod(batch))
    as uint32 of shape `batch` (x's batch dims), broadcast against the right indices' `shape`.
    Made once per shape, contiguous and evaluated, it is a constant: the step has neither the
    Arange (one a call, three a MoE layer a decode step) nor the left side's Broadcast node."""
    key = (batch, shape)
    a = _LHS.get(key)
    if a is None:
        if len(_LHS) >= 64:
            _LHS.clear()
        rows = np.arange(int(np.prod(batch)), dtype=np.uint32).reshape(batch)
        full = np.broadcast_shapes(batch, shape)
        a = _LHS[key] = mx.array(np.ascontiguousarray(np.broadcast_to(rows, full)))
        mx.eval(a)
    return a


def _widened_call(self, x, indices, sorted_indices=False):
    """QuantizedSwitchLinear's call: its codes widened when the call has many rows; unsorted
    calls (decode, short verify steps) with gather_qmm's left indices passed as a constant.
    Either way the same products as mlx-lm's call."""
    bits = self.bits
    w = self["weight"]
    if indices.size >= MIN_ROWS and is_widening(self):
        to = prefill_bits()
        if to is not None and to > bits:
            # depends on x: computed when the layer's input is, not with every layer's up front
            w, bits = widen(mx.depends(w, x), bits, to), to
    if sorted_indices and bits == self.bits:
        return type(self)._rq_widen_original.__call__(self, x, indices, sorted_indices)
    # unsorted: the left indices gather_qmm would make itself (the GatherQMM node is the same:
    # its sorted flags are false either way); sorted and widened: mlx-lm's own arguments
    lhs = None if sorted_indices else _lhs_indices(tuple(x.shape[:-2]), tuple(indices.shape))
    y = mx.gather_qmm(
        x,
        w,
        self["scales"],
        self.get("biases"),
        lhs_indices=lhs,
        rhs_indices=indices,
        transpose=True,
        group_size=self.group_size,
        bits=bits,
        mode=self.mode,
        global_scale=getattr(self, "global_scale", None),
        sorted_indices=sorted_indices,
    )
    if "bias" in self:
        y = y + mx.expand_dims(self["bias"][indices], -2)
    return y


_SUBCLASSES: dict[type, type] = {}


def _subclass(cls: type) -> type:
    from .compiled import call_subclass

    return call_subclass(cls, _widened_call, "_rq_widen_original", _SUBCLASSES)


def is_installed(m: nn.Module) -> bool:
    return "_rq_widen_original" in type(m).__dict__


def is_widening(m: nn.Module) -> bool:
    """An installed expert layer whose codes widen for prefill calls (affine, 2-4 bits)."""
    return is_installed(m) and getattr(m, "mode", "affine") == "affine" and m.bits in SOURCE_BITS


def install(model: nn.Module) -> int:
    """Give every resident quantized expert layer (mlx-lm's QuantizedSwitchLinear) the
    engine's call; returns how many of them widen for prefill (affine, 2-4 bits). Idempotent;
    parameters and paths unchanged."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    n = 0
    for _, m in model.named_modules():
        if not is_installed(m) and isinstance(m, QuantizedSwitchLinear):
            m.__class__ = _subclass(type(m))
        n += is_widening(m)
    return n


def sync_compiled_blocks(model: nn.Module) -> int:
    """Mark the compiled blocks holding widening experts: their prefill calls sync once a layer
    (compiled._compiled_call), so the transient copies do not pile up ahead of the device.
    Returns how many."""
    from .compiled import is_compiled

    n = 0
    for _, m in model.named_modules():
        if is_compiled(m) and any(is_widening(c) for _, c in m.named_modules()):
            object.__setattr__(m, "_rq_prefill_sync", True)
            n += 1
    return n


def uninstall(model: nn.Module) -> int:
    """Put the expert layers back to their mlx-lm class; returns how many."""
    from .compiled import restore_classes

    return restore_classes(model, "_rq_widen_original")
