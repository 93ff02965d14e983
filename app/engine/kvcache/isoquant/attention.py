"""Attention over an IsoQuant cache in compressed space, as a reference in plain MLX ops.

The fused kernels (issue 3) are held to `isoquant_attention_reference`: same inputs, same
output to a stated tolerance. Packed format: packing.py; rotation arrays: rotation.py.

Per KV head h with rotation R (GQA: the G = Hq/Hkv query heads of group h share it):
    q̃ = R q                                        once per query
    s_j = scale · (norm_j/√D) · <q̃, levels[c_j]>    compressed keys j < T_c
    s_j = scale · <q, k_j>                          float keys (sink prefix, prefill, recent window)
    α = softmax(s + mask [, sink])                  one softmax over both segments
    õ = Σ_{j<T_c} α_j (norm_j/√D) levels[c'_j]      value codes, rotated space
    o = Rᵀ õ + Σ_{j≥T_c} α_j v_j                    one inverse rotation per head and step
K and V are never reconstructed; only the 2**bits-entry level tables are looked up.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import mlx.core as mx

from .packing import V_LAYOUTS, code_words, pack_codes, unpack_v_codes
from .quantizer import Quantizer
from .rotation import Rotation


@dataclass(frozen=True, eq=False)
class IsoQuantTensor:
    """K or V of one layer as the cache hands it to attention (a view, not a copy)."""

    codes: mx.array  # [B, Hkv, T_c, D*bits/8] uint8 ("rows"); [B, Hkv, ceil16(T_c), ..] ("tc16")
    norms: mx.array  # [B, Hkv, T_c] float16: T_c, the compressed token count, is norms.shape[2]
    fp: mx.array | None  # [B, Hkv, T_f, D] model dtype; None when T_f = 0
    quantizer: Quantizer
    rotation: Rotation
    # Optional levels[codes] of the compressed rows, kept by a cache built with
    # decoded_shadow=True so CPU benchmarks skip the per-step unpack; same numbers exactly.
    decoded: mx.array | None = None  # [B, Hkv, T_c, D] float32
    # The first tokens of the sequence kept in float (attention sinks): positions [0, T_p).
    prefix: mx.array | None = None  # [B, Hkv, T_p, D] model dtype; None when T_p = 0
    # How `codes` is laid out (packing.py): "rows" (one packed row per token) or "tc16" (V
    # codes in chunks of 16 tokens for the tensor-core kernel; rows T_c.. are padding).
    layout: str = "rows"
    # Rows of a batch that hold different token counts (batch.py): row b's compressed tokens
    # are [0, lens[b]) and its float tokens [fp_start[b], T_f); None: every row holds all.
    lens: mx.array | None = None  # [B] int32
    fp_start: mx.array | None = None  # [B] int32
    # The codes as words and the words' three columns (code_words()), where a compiled step
    # hands them in (it cannot take views of `codes` itself); None: made from `codes`.
    words: tuple[mx.array, ...] | None = None

    def __post_init__(self):
        if self.layout not in V_LAYOUTS:
            raise ValueError(
                f"unknown IsoQuant layout {self.layout!r}; expected one of {V_LAYOUTS}"
            )

    def buffers(self) -> tuple[mx.array, mx.array]:
        """(codes, norms) as the kernels read them: arrays whose rows [0, compressed_len) are
        this tensor's (the kernels index by strides and take the row count as a parameter)."""
        return self.codes, self.norms

    def codes_unpacked(self) -> mx.array:
        """The codes as [B, Hkv, T_c, D] uint8, whatever the layout."""
        codes = unpack_v_codes(self.codes, self.quantizer.bits, self.layout)
        return codes[:, :, : self.compressed_len] if self.layout == "tc16" else codes

    def code_words(self) -> tuple[mx.array, ...] | None:
        """(words [B, Hkv, T_c, D/32, 3] uint32, and its columns W0, W1, W2 [.., D/32, 1]) of
        codes the quantizer looks up by word (3-bit, D % 32 == 0, rows layout), else None.
        Views: no copy where the codes' rows are contiguous."""
        if self.words is not None:
            return self.words
        if self.layout != "rows" or self.quantizer.grid is None:
            return None
        return _word_columns(code_words(self.codes))

    def levels(self) -> mx.array:
        """levels[codes]: [B, Hkv, T_c, D] float32 unit-variance coordinates (rotated space)."""
        if self.decoded is not None:
            return self.decoded
        words = self.code_words()
        if words is not None:
            return self.quantizer.lookup_words(*words)
        return self.quantizer.lookup(self.codes_unpacked())

    def as_rows(self) -> IsoQuantTensor:
        """The same tensor with its codes in the "rows" layout (self when they already are)."""
        if self.layout == "rows":
            return self
        return replace(
            self, codes=pack_codes(self.codes_unpacked(), self.quantizer.bits), layout="rows"
        )

    @property
    def compressed_len(self) -> int:
        """T_c, the compressed tokens (norms.shape[2]; the tc16 codes have ceil16(T_c) rows)."""
        return self.norms.shape[2]

    @property
    def fp_len(self) -> int:
        return 0 if self.fp is None else self.fp.shape[2]

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix is None else self.prefix.shape[2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h = self.norms.shape[:2]
        t = self.prefix_len + self.compressed_len + self.fp_len
        return (b, h, t, self.quantizer.dim)

    @property
    def dtype(self):
        return self.norms.dtype if self.fp is None else self.fp.dtype


def _word_columns(words: mx.array) -> tuple[mx.array, ...]:
    return (words, words[..., 0:1], words[..., 1:2], words[..., 2:3])


def _lazy_field(name: str, i: int):
    def get(self):
        d = self.__dict__
        if name not in d:
            d[name] = self._view(i)
        return d[name]

    def put(self, value):  # the dataclass __init__ (dataclasses.replace) sets it
        self.__dict__[name] = value

    return property(get, put)


class CacheView(IsoQuantTensor):
    """An IsoQuantTensor over the cache's buffers: the views attention reads (codes and norms of
    the first `rows` rows, the float window fp[:, :, lo:hi]) are sliced only when read: the
    kernels take the buffers themselves (buffers(), the window by its row offset), so their
    step slices nothing. Read by anything else (the references) it is the IsoQuantTensor it
    stands for; dataclasses.replace gives a plain one."""

    codes = _lazy_field("_codes", 0)
    norms = _lazy_field("_norms", 1)
    fp = _lazy_field("_fp", 2)

    def __init__(self, *args, src=None, lens=None, fp_start=None, **kw):
        if src is None:
            IsoQuantTensor.__init__(self, *args, lens=lens, fp_start=fp_start, **kw)
            return
        quantizer, rotation, layout = args
        d = self.__dict__
        d["_src"] = src  # (codes buffer, code rows, norms buffer, rows, float buffer, lo, hi)
        d["quantizer"], d["rotation"], d["layout"] = quantizer, rotation, layout
        d["decoded"] = d["prefix"] = d["words"] = None
        d["lens"], d["fp_start"] = lens, fp_start  # a batch's rows (batch.py), else None

    def _view(self, i: int):
        cb, cr, nb, rows, fb, lo, hi = self._src
        if i == 0:
            return cb[:, :, :cr]
        if i == 1:
            return nb[:, :, :rows]
        return fb[:, :, lo:hi] if hi > lo else None

    def code_words(self) -> tuple[mx.array, ...] | None:
        """As IsoQuantTensor.code_words, viewed from the whole code buffer (contiguous: the
        view copies nothing) and then its rows sliced."""
        src = self.__dict__.get("_src")
        if src is None or self.layout != "rows" or self.quantizer.grid is None:
            return super().code_words()
        got = self.__dict__.get("_words")
        if got is None:
            got = self.__dict__["_words"] = _word_columns(code_words(src[0])[:, :, : src[1]])
        return got

    def buffers(self) -> tuple[mx.array, mx.array]:
        """The cache's code and norm buffers themselves, unsliced (rows past compressed_len are
        codes written ahead, or spare capacity): a decode step slices nothing for the kernels."""
        src = self.__dict__.get("_src")
        return super().buffers() if src is None else (src[0], src[2])

    @property
    def compressed_len(self) -> int:
        src = self.__dict__.get("_src")
        return self.norms.shape[2] if src is None else src[3]

    @property
    def fp_len(self) -> int:
        src = self.__dict__.get("_src")
        if src is None:
            return 0 if self.fp is None else self.fp.shape[2]
        return max(0, src[6] - src[5])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        src = self.__dict__.get("_src")
        if src is None:
            return super().shape
        b, h = src[2].shape[:2]
        return (b, h, self.prefix_len + src[3] + self.fp_len, self.quantizer.dim)

    @property
    def dtype(self):
        src = self.__dict__.get("_src")
        if src is None:
            return super().dtype
        return src[2].dtype if src[6] <= src[5] else src[4].dtype


def _scores_mask(mask, qlen: int, klen: int, hkv: int, groups: int):
    """mlx-lm's mask forms -> something broadcastable to scores [B, Hkv, G, L, T], or None."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        q_pos = mx.arange(klen - qlen, klen)
        return q_pos[:, None] >= mx.arange(klen)[None]  # [L, T]
    if mask.ndim >= 4:
        b, hm = mask.shape[0], mask.shape[1]
        if hm == hkv * groups and hm > 1:
            return mask.reshape(b, hkv, groups, *mask.shape[2:])
        return mx.expand_dims(mask, -3)
    return mask  # [L, T] or [1, L, T]: broadcasts from the right


# Score elements one reference call materializes at most (4 MiB of float32): a longer prompt
# chunk is attended in blocks of queries, so a chunked prefill's temporaries stay below what
# mlx-lm's float attention takes for the same chunk. A query row's scores, softmax and sums do
# not depend on the other rows: blocks change its output by float rounding (BLAS blocking) only.
SCORE_BLOCK = 1 << 20


def _mask_rows(mask, lo: int, hi: int, qlen: int, klen: int):
    """Rows [lo, hi) of the queries' mask (mask forms as _scores_mask takes them)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        q_pos = mx.arange(klen - qlen + lo, klen - qlen + hi)
        return q_pos[:, None] >= mx.arange(klen)[None]  # [hi - lo, T]
    if mask.shape[-2] == 1:
        return mask  # one row for every query
    return mask[..., lo:hi, :]


# The last batch's rows mask, kept for the lens / fp_start arrays it came from: every layer of
# a step passes the batch cache's same arrays (~20 nodes a layer saved).
_ROWS_MASK: list = [(None, None, None, None)]


def rows_mask(keys: IsoQuantTensor, qlen: int, mask):
    """The mask of a batch whose rows hold different token counts (keys.lens / keys.fp_start):
    bool [B, 1, L, T], each row's own tokens, causal over the float tail when `mask` is (any
    mask but None: the batch cache's own mask can be older than a compression in the same
    step, so only its presence is read). Other tensors: `mask` unchanged."""
    if keys.lens is None and keys.fp_start is None:
        return mask
    tp, tc, tf = keys.prefix_len, keys.compressed_len, keys.fp_len
    b = keys.norms.shape[0]
    shape = (b, tp, tc, tf, qlen, mask is not None and qlen > 1)
    lens, start, got, m = _ROWS_MASK[0]
    if lens is keys.lens and start is keys.fp_start and got == shape:
        return m
    m = _rows_mask(keys, qlen, mask, tp, tc, tf, b)
    _ROWS_MASK[0] = (keys.lens, keys.fp_start, shape, m)
    return m


def _rows_mask(keys: IsoQuantTensor, qlen: int, mask, tp: int, tc: int, tf: int, b: int):
    t = tp + tc + tf
    cols = mx.arange(t)[None, None, :]  # [1, 1, T]
    ok = []
    if keys.lens is not None:  # codes [tp, tp + lens[b])
        ok.append((cols < tp) | (cols >= tp + tc) | (cols < tp + keys.lens.reshape(b, 1, 1)))
    if keys.fp_start is not None:  # float tail [tp + tc + fp_start[b], T)
        ok.append((cols < tp + tc) | (cols >= tp + tc + keys.fp_start.reshape(b, 1, 1)))
    if mask is not None and qlen > 1:  # query l sees the float tail up to tf - L + l
        ok.append(cols <= mx.arange(t - qlen, t)[None, :, None])
    m = ok[0] if len(ok) == 1 else functools.reduce(mx.logical_and, ok)
    return mx.broadcast_to(m[:, None], (b, 1, qlen, t))


def isoquant_attention_reference(
    queries: mx.array,
    keys: IsoQuantTensor,
    values: IsoQuantTensor,
    scale: float,
    mask=None,
    sinks: mx.array | None = None,
) -> mx.array:
    """queries: [B, Hq, L, D] -> [B, Hq, L, D] (queries' dtype); mask as mlx-lm passes it
    (None, "causal", bool or additive [.., L, T]); sinks: [Hq] extra logits (gpt-oss).
    Problems of more than SCORE_BLOCK scores run in blocks of query rows."""
    b, hq, qlen, _ = queries.shape
    t_all = keys.prefix_len + keys.compressed_len + keys.fp_len
    mask = rows_mask(keys, qlen, mask)
    rows = max(1, SCORE_BLOCK // max(1, b * hq * t_all))
    if qlen <= rows:
        return _attend(queries, keys, values, scale, mask, sinks)
    # block outputs are evaluated one at a time: the lazy graph would otherwise keep every
    # block's scores alive until the concatenation runs
    outs = []
    for lo in range(0, qlen, rows):
        hi = min(qlen, lo + rows)
        o = _attend(queries[:, :, lo:hi], keys, values, scale,
                    _mask_rows(mask, lo, hi, qlen, t_all), sinks)  # fmt: skip
        mx.eval(o)
        outs.append(o)
    return mx.concatenate(outs, axis=2)


_ROWS: dict = {}  # (thread, lo, hi) -> arange(lo, hi): made once a step, read by every layer


def _rows_index(lo: int, hi: int) -> mx.array:
    """arange(lo, hi) as int32, shared by every layer of a step. Kept per thread: an array is
    evaluated on the stream of the thread that made it."""
    key = (threading.get_ident(), lo, hi)
    a = _ROWS.get(key)
    if a is None:
        if len(_ROWS) >= 32:
            _ROWS.clear()
        a = _ROWS[key] = mx.arange(lo, hi, dtype=mx.int32)
    return a


def _columns(tp: int, tc: int, tf: int) -> tuple[mx.array, ...]:
    """The columns of the scores each present segment (float prefix, codes, float tail) holds,
    as index arrays; the compiled step takes them as inputs, so its trace follows the token
    counts."""
    cols, lo = [], 0
    for n in (tp, tc, tf):
        if n:
            cols.append(_rows_index(lo, lo + n))
        lo += n
    return tuple(cols)


def _attend(queries, keys, values, scale, mask, sinks, cols=None) -> mx.array:
    # Token counts enter only through array shapes, never through a reshape or a slice (the
    # segments' columns are taken by index, `cols` as _columns makes them): the decode step
    # runs this as a shapeless trace.
    b, hq, qlen, d = queries.shape
    hkv = keys.norms.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    g = hq // hkv
    tp, tc, tf = keys.prefix_len, keys.compressed_len, keys.fp_len
    if (values.prefix_len, values.compressed_len, values.fp_len) != (tp, tc, tf):
        raise ValueError("keys and values of an IsoQuant cache cover different tokens")
    rot_k, rot_v = keys.rotation, values.rotation
    inv_sqrt_d = 1.0 / math.sqrt(d)

    # The G query heads of a group are folded into rows so K/V are read once per KV head.
    q = queries.astype(mx.float32).reshape(b, hkv, g * qlen, d)  # [B, Hkv, G*L, D]
    parts = []  # scores of the segments in position order: float prefix, codes, float tail
    if tp:
        parts.append((q * scale) @ keys.prefix.astype(mx.float32).swapaxes(-1, -2))  # [.., Tp]
    if tc:
        q_rot = rot_k.forward(q)  # [B, Hkv, G*L, D]
        k_lv = keys.levels()  # [B, Hkv, Tc, D]
        k_scale = keys.norms.astype(mx.float32) * (inv_sqrt_d * scale)  # [B, Hkv, Tc]
        parts.append((q_rot @ k_lv.swapaxes(-1, -2)) * k_scale[:, :, None, :])  # [B, Hkv, G*L, Tc]
    if tf:
        k_fp = keys.fp.astype(mx.float32)  # [B, Hkv, Tf, D]
        parts.append((q * scale) @ k_fp.swapaxes(-1, -2))  # [B, Hkv, G*L, Tf]
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    t_all = tp + tc + tf
    scores = mx.unflatten(scores, 2, (g, qlen))  # [B, Hkv, G, L, T]

    m = _scores_mask(mask, qlen, t_all, hkv, g)
    if m is not None:
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.finfo(mx.float32).min)
        else:
            scores = scores + m.astype(mx.float32)
    if sinks is not None:
        sink = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, hkv, g, 1, 1), (*scores.shape[:-1], 1)
        )
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)
        probs = probs[..., :-1]
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)  # [B, Hkv, G, L, T]

    probs = mx.flatten(probs, 2, 3)  # [B, Hkv, G*L, T]
    cols = _columns(tp, tc, tf) if cols is None else cols
    seg = dict(zip([n for n, t in (("p", tp), ("c", tc), ("f", tf)) if t], cols, strict=True))
    out = None
    if tc:
        v_lv = values.levels()  # [B, Hkv, Tc, D]
        v_scale = values.norms.astype(mx.float32) * inv_sqrt_d  # [B, Hkv, Tc]
        p_c = mx.take(probs, seg["c"], axis=-1) * v_scale[:, :, None, :]
        out = rot_v.inverse(p_c @ v_lv)  # [B, Hkv, G*L, D]
    for name, v in (("p", values.prefix), ("f", values.fp)):
        if name in seg:
            o_f = mx.take(probs, seg[name], axis=-1) @ v.astype(mx.float32)  # [B, Hkv, G*L, D]
            out = o_f if out is None else out + o_f
    if out is None:
        raise ValueError("attention over an empty IsoQuant cache")
    return out.reshape(b, hq, qlen, d).astype(queries.dtype)


# The reference's decode step as one compiled graph. A step's graph is ~60 MLX calls a layer
# op by op (unpacking the codes, rotations, two segments, softmax), each a call from Python;
# compiled with shapeless=True it is traced once per structure and replayed in C++ as the token
# count grows (_attend reads token counts only from array shapes). Same ops, same numbers
# (tested bit-identical). ROTARYQUANT_COMPILE=0 (or COMPILE_REFERENCE = False) runs op by op.
COMPILE_REFERENCE = os.environ.get("ROTARYQUANT_COMPILE", "1") != "0"
_TRACES: dict = {}
_TRACES_MAX = 64
_NOT_STATIC = ("seed", "layer")  # a rotation's provenance: its arrays already say it


def _spec(obj) -> tuple:
    """(array field names, the other fields' values) of a Rotation or Quantizer: its arrays are
    the compiled step's inputs (one trace serves every layer), the rest is part of the key."""
    spec = obj.__dict__.get("_rq_spec")
    if spec is None:
        names, static = [], [type(obj)]
        for f in fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, mx.array):
                names.append(f.name)
            elif f.name not in _NOT_STATIC:
                static.append((f.name, v))
        spec = (tuple(names), tuple(static))
        object.__setattr__(obj, "_rq_spec", spec)  # frozen dataclasses: set once
    return spec


def compiled_eligible(queries, keys, values, mask, sinks) -> bool:
    """Whether isoquant_attention runs this call as the compiled step: no mask (mlx-lm passes
    none for one query; a batch's rows of different lengths carry theirs in the tensors), no
    sinks, V codes as rows, one block of scores."""
    if not COMPILE_REFERENCE or mask is not None or sinks is not None:
        return False
    if keys.layout != "rows" or values.layout != "rows":
        return False
    b, hq, qlen, _ = queries.shape
    t_all = keys.prefix_len + keys.compressed_len + keys.fp_len
    return qlen <= max(1, SCORE_BLOCK // max(1, b * hq * t_all))


def _attend_compiled(queries, keys: IsoQuantTensor, values: IsoQuantTensor, scale) -> mx.array:
    """_attend(queries, keys, values, scale, None, None) as a shapeless compiled graph (with a
    batch's rows of different lengths, their mask, rows_mask, is one more input)."""
    objs = (keys.rotation, values.rotation, keys.quantizer, values.quantizer)
    uniq, where = [], []
    for o in objs:
        for i, u in enumerate(uniq):
            if u is o:
                where.append(i)
                break
        else:
            where.append(len(uniq))
            uniq.append(o)
    specs = tuple(_spec(o) for o in uniq)
    # a CacheView's codes, norms and window are read as slices of its buffers: taking the rows
    # by index inside the trace instead is a gather of every row, which on a CPU cost 20-25% of
    # a one-token step at 512-2K tokens and 40-50% over a batch's 8 rows (kv_host_step.py)
    # codes looked up by word enter as their words and the words' columns (code_words: views
    # the trace cannot take itself)
    codes = [_codes_in(t) for t in (keys, values)]
    tensors = (keys.norms, keys.fp, keys.decoded, keys.prefix)
    tensors += (values.norms, values.fp, values.decoded, values.prefix)
    present = tuple(a is not None for a in tensors)
    rows = rows_mask(keys, queries.shape[2], None)
    n_codes = tuple(len(c) for c in codes)
    key = (
        queries.shape, queries.dtype, float(scale), keys.prefix_len > 0, keys.compressed_len > 0,
        keys.fp_len > 0, present, n_codes, tuple(where), specs, rows is not None,
    )  # fmt: skip
    fn = _TRACES.get(key)
    if fn is None:
        n_cols = sum(1 for n in (keys.prefix_len, keys.compressed_len, keys.fp_len) if n)
        fn = _trace(uniq, specs, tuple(where), present, n_codes, float(scale), n_cols,
                    rows is not None)  # fmt: skip
        if len(_TRACES) >= _TRACES_MAX:
            _TRACES.clear()
        _TRACES[key] = fn
    arrays = [*codes[0], *codes[1]]
    arrays.extend(a for a in tensors if a is not None)
    arrays.extend(_columns(keys.prefix_len, keys.compressed_len, keys.fp_len))
    for o, (names, _) in zip(uniq, specs, strict=True):
        arrays.extend(getattr(o, n) for n in names)
    if rows is not None:
        arrays.append(rows)
    return fn(queries, *arrays)


def _codes_in(t: IsoQuantTensor) -> tuple[mx.array, ...]:
    """What the compiled step takes for a tensor's codes: (codes,), or its words and their
    columns; () where a decoded shadow stands in for them."""
    if t.decoded is not None:
        return ()
    return t.code_words() or (t.codes,)


def _trace(uniq, specs, where, present, n_codes, scale, n_cols, masked=False):
    n_c, n_t = sum(n_codes), sum(present)

    def step(q, *arrays):
        mask = arrays[-1] if masked else None
        arrays = arrays[:-1] if masked else arrays
        kc, vc = arrays[: n_codes[0]], arrays[n_codes[0] : n_c]
        arrays = arrays[n_c:]
        it = iter(arrays[:n_t])
        t = [next(it) if p else None for p in present]
        cols = arrays[n_t : n_t + n_cols]
        rest, objs = list(arrays[n_t + n_cols :]), []
        for o, (names, _) in zip(uniq, specs, strict=True):
            vals, rest = rest[: len(names)], rest[len(names) :]
            objs.append(replace(o, **dict(zip(names, vals, strict=True))))
        rk, rv, kq, vq = (objs[i] for i in where)
        keys = _traced(kc, t[:4], kq, rk)
        values = _traced(vc, t[4:], vq, rv)
        return _attend(q, keys, values, scale, mask, None, cols)

    return mx.compile(step, shapeless=True)


def _traced(codes, t, quantizer, rotation) -> IsoQuantTensor:
    """The tensor a compiled step rebuilds from its inputs (codes as _codes_in gives them; t:
    norms, fp, decoded, prefix)."""
    norms, fp, decoded, prefix = t
    words = codes if len(codes) == 4 else None
    c = codes[0] if codes else None  # with a decoded shadow nothing reads the codes
    return IsoQuantTensor(c, norms, fp, quantizer, rotation, decoded, prefix, words=words)


# A fused implementation (Metal/CUDA, issue 3) registers itself here with the same signature.
_kernel: Callable | None = None


def register_kernel(fn: Callable | None) -> None:
    """Install (or with None remove) the fused attention used when use_kernel is not False."""
    global _kernel
    _kernel = fn


def isoquant_attention(
    queries,
    keys: IsoQuantTensor,
    values: IsoQuantTensor,
    scale,
    mask=None,
    sinks=None,
    use_kernel=None,
):
    """The public entry: the registered fused kernel where present, else the reference.
    Kernels implement format v1 (codes + float tail); a float sink prefix uses the reference.
    A registered kernel is handed V codes in either layout (values.layout; as_rows() converts)."""
    if keys.prefix is not None and not getattr(_kernel, "supports_prefix", False):
        if use_kernel is True:
            raise RuntimeError("the fused IsoQuant kernel does not take a float sink prefix")
        use_kernel = False
    if keys.fp_start is not None:  # rows with float padding: the kernels take lens only
        if use_kernel is True:
            raise RuntimeError("the fused IsoQuant kernel does not take rows' float padding")
        use_kernel = False
    if use_kernel is not False and _kernel is not None:
        if keys.lens is not None:  # rows' own lengths replace the batch cache's mask
            mask = None if queries.shape[2] == 1 or mask is None else "causal"
            return _kernel(queries, keys, values, scale=scale, mask=mask, sinks=sinks,
                           lens=keys.lens)  # fmt: skip
        return _kernel(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if use_kernel is True:
        raise RuntimeError("no fused IsoQuant attention kernel is registered on this backend")
    if compiled_eligible(queries, keys, values, mask, sinks):
        return _attend_compiled(queries, keys, values, scale)
    return isoquant_attention_reference(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
