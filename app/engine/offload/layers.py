"""Paged replacements for mlx-lm's stacked expert layers, installed by swapping modules.

`PagedSwitchGLU(x, indices)` / `PagedSwitchMLP(x, indices)` keep the call signature and the
arithmetic of mlx-lm's `SwitchGLU` / `SwitchMLP` (same projection order, the same sort of
(token, expert) pairs from 64 pairs up, `gather_qmm` / `gather_mm` with the same options), but
gather from the pager's slot tensors with indices remapped to slots. Every output row is the
same computation on the same weights as in the resident model, so outputs are bit-identical.

MLX's CUDA gather_qmm / gather_mm (0.32: mlx/backend/cuda/device/qmm_naive.cuh, qmm_sm80.cuh,
gemm_sm70.cuh) offset the gathered weight matrix by `rhs_index * N * K` in 32-bit arithmetic,
so a slot tensor holding more than 2^31 weight elements is read wrongly past that point (the
resident model's per-layer tensors stay below it). On CUDA a call therefore gathers from a
window of the slot tensors (a view starting at its lowest slot) and, where the pairs span more
than a window, runs one call per window; a split call with 8 or more pairs pads each part to 8
rows, since below 8 rows MLX CUDA switches to its matrix-vector kernel (other rounding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import (
    SwitchGLU,
    SwitchMLP,
    _gather_sort,
    _scatter_unsort,
)

from .pager import INDEX_LIMIT, ExpertPager, Route

SORT_FROM = 64  # mlx-lm sorts (token, expert) pairs by expert from this many pairs on
QMV_ROWS = 8  # MLX CUDA gather_qmm: a matrix-vector kernel below this many rows (M * B)


def _index_limit() -> int | None:
    """Weight elements one gathered call may span; None: no limit (CPU, Metal)."""
    return INDEX_LIMIT if mx.cuda.is_available() else None


@dataclass(frozen=True)
class _Proj:
    name: str  # "gate_proj", "fc1", ...
    quant: dict | None  # {"bits", "group_size", "mode"}; None: float weights
    bias: bool


class _PagedSwitch(nn.Module):
    """Shared plumbing; subclasses define `_experts(x, idx, sorted_)` like mlx-lm's layer."""

    PROJS: tuple[str, ...] = ()

    def __init__(self, pager: ExpertPager, layer: int, activation):
        super().__init__()
        self.activation = activation
        self._pager = pager  # plain attributes: not parameters of the model
        self._layer = layer
        names = {t.name for t in pager.store.layout(layer).tensors}
        quant = pager.quantization(layer)
        self._projs = {p: _Proj(p, quant.get(p), f"{p}.bias" in names) for p in self.PROJS}
        for p in self.PROJS:
            if f"{p}.weight" not in names:
                raise ValueError(
                    f"layer {layer}: expert records have no {p}.weight (have {sorted(names)})"
                )
            if (
                quant.get(p) is not None
                and quant[p].get("mode", "affine") == "affine"
                and f"{p}.scales" not in names
            ):
                raise ValueError(f"layer {layer}: quantized {p} without scales in the records")
        self._window = self._window_slots(pager, layer)

    def _window_slots(self, pager: ExpertPager, layer: int) -> int | None:
        """Slots one call may span on this backend (None: the whole pool)."""
        limit = _index_limit()
        if limit is None:
            return None
        window = max(1, (limit - 1) // pager.store.layout(layer).slot_elements)
        return None if window >= pager.pool_of[layer].num_slots else window

    def _proj(self, name: str, x, idx, sorted_: bool, arrays: dict):
        p = self._projs[name]
        w = arrays[f"{name}.weight"]
        if p.quant is not None:
            x = mx.gather_qmm(
                x,
                w,
                arrays[f"{name}.scales"],
                arrays.get(f"{name}.biases"),
                rhs_indices=idx,
                transpose=True,
                group_size=p.quant["group_size"],
                bits=p.quant["bits"],
                mode=p.quant.get("mode", "affine"),
                sorted_indices=sorted_,
            )
        else:
            x = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sorted_)
        if p.bias:
            x = x + mx.expand_dims(arrays[f"{name}.bias"][idx], -2)
        return x

    def __call__(self, x, indices) -> mx.array:
        dtype = x.dtype  # the slots keep their stored dtype; the output follows the model's
        out = self._call(x, indices)
        return out if out.dtype == dtype else out.astype(dtype)

    def _call(self, x, indices) -> mx.array:
        pager = self._pager
        if pager.device is not None:
            return self._call_device(x, indices)
        route = pager.route(self._layer, indices)
        if route.slot_idx is None:
            return self._call_groups(x, indices, route)
        t0 = time.perf_counter()
        try:
            return self._call_route(x, indices, route)
        finally:
            pager.host_parts["graph"] += time.perf_counter() - t0

    def _call_route(self, x, indices, route: Route) -> mx.array:
        pager = self._pager
        arrays = pager.arrays(self._layer)
        idx = route.slot_idx
        if self._window is not None:
            if pager.no_readback:  # this layer's experts: slots base .. base + n - 1
                base = pager.base[self._layer]
                n = pager.pool_of[self._layer].num_experts[self._layer]
                arrays, idx = _view(arrays, base, base + n), indices
            else:
                slots = route.slots.reshape(-1)
                lo, hi = int(slots.min()), int(slots.max())
                if hi - lo >= self._window:
                    return self._call_windows(x, indices, slots)
                arrays, idx = _view(arrays, lo, hi + 1), idx - lo
        return self._gather(x, idx, indices.shape, arrays)

    def _gather(self, x, idx, shape, arrays) -> mx.array:
        """One pass of the call's pairs on slots `idx` [..., k] of `arrays`, as mlx-lm's layer
        runs it (pairs sorted by slot from SORT_FROM on); the output is tracked."""
        x = mx.expand_dims(x, (-2, -3))  # [..., H] -> [..., 1, 1, H]
        do_sort = idx.size >= SORT_FROM
        inv_order = None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, idx)
        x = self._experts(x, idx, do_sort, arrays)
        if do_sort:
            x = _scatter_unsort(x, inv_order, shape)
        out = x.squeeze(-2)
        self._pager.track(out)
        return out

    def _call_device(self, x, indices) -> mx.array:
        """Device-resolved paging: the step gives slots in this layer's share, lazily (no
        read-back on CUDA); a call with more pairs than the share runs in groups."""
        pager, layer = self._pager, self._layer
        pager.tick(layer)
        state = pager.device[layer]
        if indices.size > state.share:
            return self._call_device_groups(x, indices, state)
        t0 = time.perf_counter()
        ids = indices.flatten().astype(mx.uint32)
        idx = pager.device_step(layer, ids).reshape(indices.shape)
        arrays = _view(pager.arrays(layer), state.lo, state.lo + state.share)
        out = self._gather(x, idx, indices.shape, arrays)
        pager.host_parts["graph"] += time.perf_counter() - t0
        return out

    def _call_device_groups(self, x, indices, state) -> mx.array:
        """A call with more (token, expert) pairs than the layer's share (a prompt): its
        experts are read back, then loaded by the device step in groups of at most the share
        (padded to it: one kernel shape)."""
        from .device_route import SKIP

        pager, layer = self._pager, self._layer
        mx.eval(indices)
        flat = np.asarray(indices).reshape(-1).astype(np.int64)
        uniq = np.unique(flat)
        n = state.share
        pager.layer_stats[layer].split_calls += 1

        def load(group: np.ndarray, rows) -> np.ndarray:
            ids = np.full(n, SKIP, dtype=np.uint32)
            ids[: len(group)] = group
            local = pager.device_step(layer, mx.array(ids))
            mx.eval(local)
            table = np.full(state.experts, -1, dtype=np.int64)
            table[group] = np.asarray(local)[: len(group)].astype(np.int64) + state.lo
            return table

        groups = [uniq[i : i + n] for i in range(0, len(uniq), n)]
        rows = [np.nonzero(np.isin(flat, g))[0] for g in groups]
        return self._run_groups(x, indices, flat, zip(groups, rows, strict=True), load)

    def _rows(self, xf, k: int, rows: np.ndarray, slots: np.ndarray, n_call: int):
        """Pairs `rows` (positions in the call's flattened pairs) on `slots` (host, slot per
        row) -> [(rows, out [n, 1, N])]: ascending slots, one call per window of slots."""
        order = np.argsort(slots, kind="stable")  # sorted_indices needs ascending slots
        rows, slots = rows[order], slots[order]
        arrays = self._pager.arrays(self._layer)
        spans = [(0, len(rows))]
        if self._window is not None:
            starts = [0]
            while True:  # each window starts at the lowest slot the previous ones left
                nxt = int(np.searchsorted(slots, slots[starts[-1]] + self._window))
                if nxt >= len(rows):
                    break
                starts.append(nxt)
            spans = list(zip(starts, starts[1:] + [len(rows)], strict=True))
        out = []
        for a, b in spans:
            r, s = rows[a:b], slots[a:b]
            lo = int(s[0]) if self._window is not None else 0
            arr = _view(arrays, lo, int(s[-1]) + 1) if self._window is not None else arrays
            pad = QMV_ROWS - len(r) if n_call >= QMV_ROWS > len(r) else 0
            rp = np.concatenate([r, np.repeat(r[-1:], pad)]) if pad else r
            sp = np.concatenate([s, np.repeat(s[-1:], pad)]) if pad else s
            part = self._experts(
                xf[mx.array(rp // k)], mx.array((sp - lo).astype(np.uint32)), True, arr
            )
            out.append((r, part[: len(r)] if pad else part))
        return out

    def _call_windows(self, x, indices, slots: np.ndarray) -> mx.array:
        """Resident slots spread wider than a window (CUDA): one call per window."""
        k = indices.shape[-1]
        xf = mx.expand_dims(x, (-2, -3)).flatten(0, -3)  # [tokens, 1, H]
        parts = self._rows(xf, k, np.arange(slots.size), slots.astype(np.int64), slots.size)
        out = _unpermute(parts, indices.shape)
        self._pager.track(out)
        return out

    def _call_groups(self, x, indices, route: Route) -> mx.array:
        """More experts than slots: run the pairs of each group of experts, evaluated before
        the next group reuses the slots, then put the rows back in order."""
        pager, layer = self._pager, self._layer
        flat = route.flat
        groups = ((g.experts, g.rows) for g in route.groups)

        def load(experts, rows) -> np.ndarray:
            return pager.acquire(layer, experts, flat[rows])

        return self._run_groups(x, indices, flat, groups, load, pager.release)

    def _run_groups(self, x, indices, flat, groups, load, done=None) -> mx.array:
        """Groups [(experts, rows)] of a call's pairs one after another: `load(experts, rows)`
        makes them resident and returns the expert -> slot table, the group's rows are evaluated
        (then `done()`) before the next group may reuse the slots; the rows back in order."""
        k = indices.shape[-1]
        xf = mx.expand_dims(x, (-2, -3)).flatten(0, -3)  # [tokens, 1, H]
        parts = []
        for experts, rows in groups:
            table = load(experts, rows)
            got = self._rows(xf, k, rows, table[flat[rows]], flat.size)
            mx.eval([p for _, p in got])
            if done is not None:
                done()
            parts.extend(got)
        return _unpermute(parts, indices.shape)


def _view(arrays: dict, lo: int, hi: int) -> dict:
    """Slots lo .. hi - 1 of every slot tensor (views: no copy)."""
    return {name: a[lo:hi] for name, a in arrays.items()}


def _unpermute(parts, shape) -> mx.array:
    """[(rows, out [n, 1, N])] covering every pair once -> [..., k, N] in pair order."""
    rows = np.concatenate([r for r, _ in parts])
    inv = np.argsort(rows, kind="stable")
    y = mx.concatenate([p for _, p in parts], axis=0)[mx.array(inv)]
    return mx.unflatten(y, 0, shape).squeeze(-2)


class PagedSwitchGLU(_PagedSwitch):
    PROJS = ("gate_proj", "up_proj", "down_proj")

    def _experts(self, x, idx, sorted_, arrays):
        x_up = self._proj("up_proj", x, idx, sorted_, arrays)
        x_gate = self._proj("gate_proj", x, idx, sorted_, arrays)
        return self._proj("down_proj", self.activation(x_up, x_gate), idx, sorted_, arrays)


class PagedSwitchMLP(_PagedSwitch):
    PROJS = ("fc1", "fc2")

    def _experts(self, x, idx, sorted_, arrays):
        x = self._proj("fc1", x, idx, sorted_, arrays)
        x = self.activation(x)
        return self._proj("fc2", x, idx, sorted_, arrays)


def _check_shapes(orig, pager: ExpertPager, layer: int, projs) -> None:
    """The records must hold what the original module would: shapes minus the expert axis."""
    from mlx.utils import tree_flatten

    specs = {t.name: t.shape for t in pager.store.layout(layer).tensors}
    for name, p in tree_flatten(orig.parameters()):
        if name.split(".")[0] not in projs or name.rsplit(".", 1)[-1] not in (
            "weight",
            "scales",
            "biases",
            "bias",
        ):
            continue
        if name not in specs:
            raise ValueError(
                f"layer {layer}: the model expects {name} but the expert records do not have it"
            )
        if tuple(p.shape[1:]) != specs[name] or p.shape[0] != pager.store.layout(layer).num_experts:
            raise ValueError(
                f"layer {layer}: {name} is {list(p.shape)} in the model, "
                f"{list(specs[name])} per expert in the records"
            )


def paged_module(orig, pager: ExpertPager, layer: int) -> _PagedSwitch:
    """The paged twin of mlx-lm's expert module `orig` for MoE layer `layer`."""
    if isinstance(orig, SwitchGLU):
        cls = PagedSwitchGLU
    elif isinstance(orig, SwitchMLP):
        cls = PagedSwitchMLP
    else:
        raise TypeError(
            f"layer {layer}: cannot page expert module {type(orig).__name__} "
            "(SwitchGLU and SwitchMLP are supported)"
        )
    _check_shapes(orig, pager, layer, cls.PROJS)
    return cls(pager, layer, orig.activation)


def install(model, pager: ExpertPager) -> list[str]:
    """Swap every expert module named in the records for its paged twin; returns the paths."""
    modules = dict(model.named_modules())
    done = []
    for layer in pager.store.layers:
        path = pager.store.layout(layer).module
        if path not in modules:
            raise ValueError(
                f"layer {layer}: the model has no module {path!r} "
                "(records from another architecture?)"
            )
        parent_path, _, attr = path.rpartition(".")
        parent = modules[parent_path] if parent_path else model
        setattr(parent, attr, paged_module(modules[path], pager, layer))
        done.append(path)
    return done
