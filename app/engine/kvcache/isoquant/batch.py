"""BatchIsoQuantKVCache: IsoQuant caches of several requests in one batch (mlx-lm's batch
protocol: merge, extract, filter, extend, prepare, finalize), for BatchGenerator.

Every row is one token sequence laid out as [codes | float tail]:
    codes  [B, Hkv, C, ..]  packed K/V codes ("rows" layout) + fp16 norms; row i's compressed
                            tokens are [0, lens[i]), the rest of its C rows unused
    float  [B, Hkv, Tf, D]  the recent tokens in the model's dtype; row i's are [pad[i], Tf)
Both live in buffers with spare capacity: the codes in rows [0, C) of buffers grown `code_step`
rows at a time, the float tail in rows [f0, f0 + Tf) of its buffers. A compression writes its
codes in place and moves f0 past the tokens it took; nothing is reallocated or copied but when
a buffer is full (or, for the float tail, much larger than the tokens it holds). Attention gets
the buffers themselves (attention.CacheView) with the row counts, so a step slices nothing.
The code/float boundary is shared, so a row that holds codes has exactly Tf float tokens
(pad[i] = 0); when rows with different float tails meet, the longer tails compress their oldest
tokens (a token's codes do not depend on when it is encoded, so this is what the row's own cache
would store once it compressed that far). Only rows without codes have float padding (a row
shorter than the others, left-padded as in mlx-lm's BatchKVCache).

Attention reads each row's own tokens from the tensors' lens / fp_start (attention.py), not from
a mask: rows of different lengths then take the fused kernels, which take per-row code counts
(`lens`). Rows with float padding (rare: a row without codes beside rows with codes, or a
left-padded prompt) take the reference attention.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from .attention import CacheView
from .cache import IsoQuantKVCache, _round_up
from .packing import pack_codes, unpack_v_codes

_CONFIG = ("rotation_kind", "key_bits", "value_bits", "window", "seed", "layer", "compress_every")


@dataclass
class _Row:
    """One row's tokens: codes (kc, kn, vc rows layout, vn) [1, H, n, ..] and float [1, H, t, D]."""

    codes: tuple | None
    fk: mx.array | None
    fv: mx.array | None

    @property
    def n(self) -> int:
        return 0 if self.codes is None else self.codes[1].shape[2]

    @property
    def t(self) -> int:
        return 0 if self.fk is None else self.fk.shape[2]


@functools.lru_cache(maxsize=8)
def _write_rows(lens: tuple[int, ...], k: int) -> mx.array:
    """[B, 1, k] code rows lens[i] .. lens[i] + k: where a compression writes each row's codes.
    One scatter a buffer instead of a slice write a row (one index for every layer of a step:
    the layers' rows have the same lengths). Rows of different lengths compress every 16
    tokens; the per-row writes were 4 x B ops a layer, ~10 ms of host time a step at 8 rows and
    48 layers on an H200, against ~2 ms for rows of equal lengths."""
    return mx.array(lens, mx.int32)[:, None, None] + mx.arange(k, dtype=mx.int32)


def _cat(a, b):
    return b if a is None else mx.concatenate([a, b], axis=2)


def _config(c) -> dict:
    return {k: getattr(c, k) for k in _CONFIG}


def _row_of_single(c: IsoQuantKVCache) -> _Row:
    if c.sink or c.decoded_shadow:
        raise ValueError("batched IsoQuant caches keep no float sink and no decoded shadow")
    if getattr(c, "_float", None) is not None:
        raise ValueError(f"a layer fell back to a float cache ({c.fallback_reason})")
    if c.rotation is None or c.offset == 0:
        return _Row(None, None, None)
    kc, kn, vc, vn, fk, fv = c.state[:6]
    # the single cache may hold codes ahead of what attention reads compressed, and float
    # copies behind it (exact trims): a row is codes [0, compressed) and float after that
    n = c.compressed
    codes = None
    if kc is not None and n:
        v = unpack_v_codes(vc, c.vq.bits, c.v_layout)[:, :, :n]
        codes = (kc[:, :, :n], kn[:, :, :n], pack_codes(v, c.vq.bits), vn[:, :, :n])
    if fk is not None:
        lo = n - c.fp_start
        fk, fv = (fk[:, :, lo:], fv[:, :, lo:]) if lo < fk.shape[2] else (None, None)
    return _Row(codes, fk, fv)


class BatchIsoQuantKVCache(_BaseCache):
    step = 256  # grow the float tail in steps so decode doesn't reallocate each token
    code_step = 256  # likewise the codes: a compression writes into spare rows

    def __init__(self, config: dict, pad: list[int]):
        self.config = dict(config)
        self.proto = IsoQuantKVCache(**self.config, v_layout="rows")  # rotation, quantizers
        self.pad = list(pad)  # per row: float positions before the row's first token
        self.lens = [0] * len(pad)  # per row: its compressed tokens, codes [0, lens[i])
        self.codes = None  # (k_codes, k_norms, v_codes, v_norms) [B, H, cap, ..] or None
        self.c = 0  # code rows in use: C = max(lens)
        self.fp_keys = self.fp_values = None  # [B, H, cap, D]; tokens [f0, f0 + tf) live
        self.f0 = 0
        self.tf = 0
        self.offset = mx.array([-p for p in pad])  # per row: real position of the next token
        self._right = None  # right padding of the prefill in flight (prepare -> finalize)
        self._rows_arrays = None  # (lens, fp_start) as attention reads them, until they change

    # ---- shape -------------------------------------------------------------------------
    @property
    def n_codes(self) -> int:
        return self.c

    @property
    def batch_size(self) -> int:
        return len(self.pad)

    def size(self) -> int:
        return self.n_codes + self.tf

    def empty(self) -> bool:
        return self.size() == 0

    # ---- the forward pass -------------------------------------------------------------
    def _setup(self, h: int, d: int, dv: int) -> None:
        if self.proto.rotation is None:
            self.proto._setup(h, d, dv)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys, values: [B, Hkv, L, D]
        b, h, n, d = keys.shape
        self._setup(h, d, values.shape[-1])
        if self.fp_keys is None:
            cap = _round_up(n, self.step)
            self.fp_keys = mx.zeros((b, h, cap, d), keys.dtype)
            self.fp_values = mx.zeros((b, h, cap, values.shape[-1]), values.dtype)
        elif self.f0 + self.tf + n > self.fp_keys.shape[2]:
            self._move_float(_round_up(self.tf + n, self.step))
        end = self.f0 + self.tf
        self.fp_keys[:, :, end : end + n] = keys
        self.fp_values[:, :, end : end + n] = values
        self.tf += n
        self.offset = self.offset + n
        p = self.proto
        if n == 1 and self.tf - p.window >= p.compress_every:
            self._compress(self.tf - p.window)
        return self._fetch()

    def _compress(self, k: int) -> None:
        """Move the oldest k float positions of every row into the codes: row i's own tokens
        among them go to its codes [lens[i], ..), its padding among them is dropped."""
        f0 = self.f0
        enc = self.proto.encode_rows(
            self.fp_keys[:, :, f0 : f0 + k], self.fp_values[:, :, f0 : f0 + k]
        )
        c = self.c
        if all(p == 0 for p in self.pad) and all(n == c for n in self.lens):
            self._reserve(enc, c + k)
            for a, e in zip(self.codes, enc, strict=True):
                a[:, :, c : c + k] = e
            self.lens = [n + k for n in self.lens]
        elif all(p == 0 for p in self.pad):  # rows of different lengths, each after its own
            self._reserve(enc, max(self.lens) + k)
            idx = _write_rows(tuple(self.lens), k)
            self.codes = tuple(
                mx.put_along_axis(a, idx if a.ndim == 3 else idx[..., None], e, axis=2)
                for a, e in zip(self.codes, enc, strict=True)
            )
            self.lens = [n + k for n in self.lens]
        else:  # rows with float padding: a row's padding among the k is dropped
            skips = [min(p, k) for p in self.pad]
            self._reserve(enc, max(n + k - s for n, s in zip(self.lens, skips, strict=True)))
            for i, skip in enumerate(skips):
                n = self.lens[i]
                if skip < k:
                    for a, e in zip(self.codes, enc, strict=True):
                        a[i : i + 1, :, n : n + k - skip] = e[i : i + 1, :, skip:k]
                self.lens[i] = n + k - skip
                self.pad[i] -= skip
        self.c = max(self.lens)
        self._rows_arrays = None
        self.f0, self.tf = f0 + k, self.tf - k
        need = _round_up(self.tf + self.proto.compress_every, self.step)
        if self.fp_keys.shape[2] > need:  # after a long prefill: give the memory back
            self._move_float(need)

    def _reserve(self, enc, rows: int) -> None:
        """Code buffers of at least `rows` rows (like enc's arrays), rows [0, C) kept."""
        if self.codes is not None and self.codes[1].shape[2] >= rows:
            return
        cap = _round_up(rows, self.code_step)
        new = []
        for i, e in enumerate(enc):
            a = mx.zeros((self.batch_size, e.shape[1], cap, *e.shape[3:]), e.dtype)
            if self.codes is not None and self.c:
                a[:, :, : self.c] = self.codes[i][:, :, : self.c]
            new.append(a)
        self.codes = tuple(new)

    def _move_float(self, cap: int) -> None:
        """The live float tokens into new buffers of `cap` rows, from row 0."""
        b, h, _, d = self.fp_keys.shape
        new_k = mx.zeros((b, h, cap, d), self.fp_keys.dtype)
        new_v = mx.zeros((b, h, cap, self.fp_values.shape[-1]), self.fp_values.dtype)
        if self.tf:
            lo, hi = self.f0, self.f0 + self.tf
            new_k[:, :, : self.tf] = self.fp_keys[:, :, lo:hi]
            new_v[:, :, : self.tf] = self.fp_values[:, :, lo:hi]
        self.fp_keys, self.fp_values, self.f0 = new_k, new_v, 0

    def _rows(self) -> tuple[mx.array | None, mx.array | None]:
        """(lens, fp_start) for the tensors: None where every row holds them all."""
        if self._rows_arrays is None:
            c = self.n_codes
            lens = None if all(n == c for n in self.lens) else mx.array(self.lens, mx.int32)
            pad = None if all(p == 0 for p in self.pad) else mx.array(self.pad, mx.int32)
            self._rows_arrays = (lens, pad)
        return self._rows_arrays

    def _fetch(self):
        lo, hi = self.f0, self.f0 + self.tf
        if self.codes is None:  # no codes yet: plain arrays, mlx-lm's own attention (with the mask)
            if not self.tf:
                return None, None
            return self.fp_keys[:, :, lo:hi], self.fp_values[:, :, lo:hi]
        kc, kn, vc, vn = self.codes
        p, c = self.proto, self.c
        lens, start = self._rows()
        return (
            CacheView(p.kq, p.rotation, "rows", src=(kc, c, kn, c, self.fp_keys, lo, hi),
                      lens=lens, fp_start=start),
            CacheView(p.vq, p.rotation, "rows", src=(vc, c, vn, c, self.fp_values, lo, hi),
                      lens=lens, fp_start=start),
        )  # fmt: skip

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if window_size is not None:
            raise ValueError("IsoQuant caches hold full attention, not a sliding window")
        if self.codes is not None:
            # attention masks each row by the tensors' lens / fp_start (a compression in this
            # step's update moves tokens after this mask is made): causal or nothing
            if N == 1:
                return None
            if not return_array:
                return "causal"
            return create_causal_mask(N, offset=self.size())
        if max(self.pad, default=0) == 0:
            if N == 1:
                return None  # nothing to hide: the fused decode kernel can run
            if not return_array:
                return "causal"
            return create_causal_mask(N, offset=self.size())
        return create_causal_mask(N, offset=self.size(), left_padding=mx.array(self.pad))

    # ---- rows <-> batch ------------------------------------------------------------------
    def _row(self, i: int, right: int = 0) -> _Row:
        """Row i's own tokens (`right` padding tokens dropped from its float end)."""
        n, tf = self.lens[i], self.tf - right
        codes = tuple(a[i : i + 1, :, :n] for a in self.codes) if n else None
        if self.pad[i] >= tf:
            return _Row(codes, None, None)
        lo, hi = self.f0 + self.pad[i], self.f0 + tf
        fk = self.fp_keys[i : i + 1, :, lo:hi]
        fv = self.fp_values[i : i + 1, :, lo:hi]
        return _Row(codes, fk, fv)

    def _load_rows(self, rows: list[_Row]) -> None:
        """Lay `rows` out as this batch: equalize the float tails, codes from position 0."""
        p = self.proto
        with_codes = [r.t for r in rows if r.n]
        tf = min(with_codes) if with_codes else max((r.t for r in rows), default=0)
        out = []
        for r in rows:
            if r.t > tf:  # the oldest float tokens join the codes
                k = r.t - tf
                enc = p.encode_rows(r.fk[:, :, :k], r.fv[:, :, :k])
                codes = enc if r.codes is None else tuple(map(_cat, r.codes, enc))
                r = _Row(codes, r.fk[:, :, k:], r.fv[:, :, k:])
            elif r.n and r.t < tf:
                raise AssertionError("a row with codes has a shorter float tail")
            out.append(r)
        c = max((r.n for r in out), default=0)
        b = len(out)
        self.lens = [r.n for r in out]
        self.pad = [tf - r.t for r in out]
        self.offset = mx.array([r.n + r.t for r in out])
        self.tf, self.f0, self.c = tf, 0, c
        self.codes = None
        self._rows_arrays = None
        if c:
            ref = next(r.codes for r in out if r.codes is not None)
            if all(r.n == c for r in out):
                self.codes = tuple(
                    mx.concatenate(a, axis=0) for a in zip(*(r.codes for r in out), strict=True)
                )
            else:
                arrays = [mx.zeros((b, *a.shape[1:2], c, *a.shape[3:]), a.dtype) for a in ref]
                for i, r in enumerate(out):
                    if r.codes is not None:
                        for a, src in zip(arrays, r.codes, strict=True):
                            a[i : i + 1, :, : r.n] = src
                self.codes = tuple(arrays)
        self.fp_keys = self.fp_values = None
        ref = next((r for r in out if r.fk is not None), None)
        if ref is not None:
            cap = _round_up(max(tf, 1), self.step)
            h, d, dv = ref.fk.shape[1], ref.fk.shape[3], ref.fv.shape[3]
            self.fp_keys = mx.zeros((b, h, cap, d), ref.fk.dtype)
            self.fp_values = mx.zeros((b, h, cap, dv), ref.fv.dtype)
            for i, r in enumerate(out):
                if r.t:
                    self.fp_keys[i : i + 1, :, tf - r.t : tf] = r.fk
                    self.fp_values[i : i + 1, :, tf - r.t : tf] = r.fv

    @classmethod
    def merge(cls, caches: list[IsoQuantKVCache]) -> BatchIsoQuantKVCache:
        configs = [_config(c) for c in caches]
        if any(cfg != configs[0] for cfg in configs):
            raise ValueError("IsoQuant caches with different settings cannot share a batch")
        batch = cls(configs[0], [0] * len(caches))
        ready = next((c for c in caches if c.rotation is not None), None)
        if ready is not None:  # its rotation and codebooks, shared (the proto keeps rows)
            batch.proto._adopt(ready)
        rows = [_row_of_single(c) for c in caches]
        if any(r.n or r.t for r in rows):
            batch._load_rows(rows)
        return batch

    def extract(self, idx: int) -> IsoQuantKVCache:
        """Row idx as a cache of its own, V codes as rows (the batch's layout). mlx-lm extracts
        every finished row (its prompt cache), which is then dropped or merged into a batch
        again; repacking it into another layout here (tc16 where CUDA's kernels prefer it) cost
        ~40 MLX ops a layer, ~50 ms of host time a row at 48 layers, stalling the batch's
        other rows. A row that goes on decoding alone can relayout() itself. The copies are
        lazy (a row nobody reads costs no device work) and the row shares the batch's rotation
        and codebooks."""
        r = self._row(idx)
        c = IsoQuantKVCache(**self.config, v_layout="rows")
        if self.proto.rotation is None or not (r.n or r.t):
            return c
        c._adopt(self.proto)
        codes = r.codes or (None, None, None, None)
        c.state = (*(mx.contiguous(a) if a is not None else None for a in codes),
                   None if r.fk is None else mx.contiguous(r.fk),
                   None if r.fv is None else mx.contiguous(r.fv), None, None)  # fmt: skip
        return c

    def filter(self, batch_indices) -> None:
        """Keep just these rows (in place)."""
        keep = [int(i) for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist")
                                 else batch_indices)]  # fmt: skip
        if not keep:
            self.__init__(self.config, [])
            return
        rows = [self._row(i) for i in keep]
        if any(r.n or r.t for r in rows):
            self._load_rows(rows)
        else:
            self.pad, self.lens = [0] * len(keep), [0] * len(keep)
            self.offset = mx.zeros((len(keep),), mx.int32)
            self.codes = self.fp_keys = self.fp_values = None
            self.tf = self.f0 = self.c = 0

    def extend(self, other: BatchIsoQuantKVCache) -> None:
        """Append other's rows after this batch's rows (in place)."""
        if other.config != self.config:
            raise ValueError("IsoQuant caches with different settings cannot share a batch")
        if self.proto.rotation is None and other.proto.rotation is not None:
            self.proto = other.proto
        rows = [self._row(i) for i in range(self.batch_size)]
        rows += [other._row(i) for i in range(other.batch_size)]
        if any(r.n or r.t for r in rows):
            self._load_rows(rows)
        else:
            self.pad, self.lens = self.pad + other.pad, self.lens + other.lens
            self.offset = mx.concatenate([self.offset, other.offset])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None:
            if not self.empty():
                raise ValueError("left padding can only be added to an empty batch cache")
            self.pad = [p + int(lp) for p, lp in zip(self.pad, left_padding, strict=True)]
            self.offset = self.offset - mx.array(list(left_padding))
        if right_padding is not None and max(right_padding) > 0:
            self._right = [int(r) for r in right_padding]

    def finalize(self) -> None:
        """After a right-padded prefill: drop each row's padding tokens from its float end."""
        if self._right is None:
            return
        rows = [self._row(i, r) for i, r in enumerate(self._right)]
        self._right = None
        self._load_rows(rows)

    # ---- the rest of the protocol ---------------------------------------------------------
    @property
    def state(self):
        codes = tuple(a[:, :, : self.c] for a in self.codes or ()) or (None,) * 4
        lo, hi = self.f0, self.f0 + self.tf
        fk = None if self.fp_keys is None else self.fp_keys[:, :, lo:hi]
        fv = None if self.fp_values is None else self.fp_values[:, :, lo:hi]
        return tuple(a for a in (*codes, fk, fv, self.offset) if a is not None)

    def is_trimmable(self) -> bool:
        return False  # a batch never rewinds: speculative decoding runs one request at a time

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (spare rows included): what the batch has allocated."""
        arrays = (*(self.codes or ()), self.fp_keys, self.fp_values)
        return sum(a.nbytes for a in arrays if a is not None)

    capacity_nbytes = nbytes

    @property
    def used_nbytes(self) -> int:
        """Bytes of the rows in use: codes [0, C) and the float tail's tf tokens."""
        total = sum(a.nbytes // a.shape[2] * self.c for a in self.codes or ())
        for a in (self.fp_keys, self.fp_values):
            if a is not None:
                total += a.nbytes // a.shape[2] * self.tf
        return total
