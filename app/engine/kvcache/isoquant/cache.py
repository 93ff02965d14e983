"""IsoQuantKVCache: mlx-lm's cache protocol over a compressed prefix and a float tail.

Tokens [sink, compressed) are stored as packed codes + fp16 norms (packing.py); tokens
[compressed, offset) — and the first `sink` tokens, if asked — in the model's dtype. Deferred prefill: multi-token updates (the prompt)
only append float K/V, so the prompt attends to itself exactly as with mlx-lm's KVCache; the
first single-token update (or finish_prefill()) compresses all but the last `window` tokens in
bulk, and from then on each decoded token pushes the oldest float token into the codes.

V codes are stored in the layout `v_layout` ("rows" or "tc16", packing.py), chosen once per
cache (packing.preferred_v_layout unless given) and kept through state round trips; K codes are
always "rows". A tc16 cache rewrites whole 16-token chunks of V codes when it compresses.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from .attention import IsoQuantTensor
from .packing import (
    FORMAT_VERSION,
    TC16_CHUNK,
    V_LAYOUTS,
    check_tc16,
    pack_codes_tc16,
    pack_v_codes,
    preferred_v_layout,
    unpack_codes,
    unpack_codes_tc16,
    unpack_v_codes,
)
from .quantizer import Quantizer, encode
from .rotation import KINDS, Rotation


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


# Decode-time compression batch (tokens): measured on the H200 (benchmarks/results/
# isoquant_step_profile*.json), one compression is ~30 small kernels, ~250 µs per layer when it
# ran for every token; in batches of 16 it costs a sixteenth of that per token.
COMPRESS_EVERY = 16
_COMPILED_MAX_TOKENS = 64  # appends up to this many tokens use the compiled encoder
COMPILE_ENV = "ROTARYQUANT_KV_COMPILE"  # 1 turns the compiled per-token encoders on


def compile_encoders() -> bool:
    """Whether caches compile their decode-time encoders (rotation + codes + packing fused by
    mx.compile; bit-identical to the op-by-op path, tested). Off unless ROTARYQUANT_KV_COMPILE=1:
    on the H200 the compiled encoder alone ran 2.7x faster (240 vs 656 µs a step), but each
    layer's closure compiles its own kernels on first use (a ~35 s stall over 32 layers on
    MLX-CUDA), and with decode batches of 16 end-to-end decode gained nothing (68.4 vs 73.6 tok/s
    at 32K; benchmarks/results/e2e_decode_isoquant.json)."""
    return os.environ.get(COMPILE_ENV) == "1"


# The fused encoder (kernel_path.install registers kernels.encode_pair where the backend has
# kernels): (keys, values, rotation, kq, vq) -> (kc, kn, vc, vn), or None for inputs it does
# not take. One launch per compression instead of ~100 small MLX ops, each of which costs host
# time on every decode step that compresses.
_ENCODER = None


def register_encoder(fn) -> None:
    """Install (or, with None, remove) the fused K/V encoder the caches compress with."""
    global _ENCODER
    _ENCODER = fn


_TC16_PACKER = None


def register_tc16_packer(fn) -> None:
    """Install (or, with None, remove) fn(vc, old, off) -> tc16 chunks or None: the fused write
    of rows-format V codes vc into whole tc16 chunks (after `off` rows of the chunk `old`), which
    the MLX ops of _write_v_tc16 do in ~40 small ops a layer."""
    global _TC16_PACKER
    _TC16_PACKER = fn


def _compiled_encoder(rotation: Rotation, quantizer: Quantizer):
    return mx.compile(lambda x: quantizer.encode_rotated(rotation.forward(x)))


class IsoQuantKVCache(_BaseCache):
    step = 256  # grow buffers in steps so decode doesn't reallocate each token

    def __init__(
        self,
        rotation_kind: str = "v3",
        key_bits: int = 3,
        value_bits: int = 3,
        window: int = 64,
        seed: int = 0,
        layer: int = 0,
        decoded_shadow: bool = False,
        sink: int = 0,
        compress_every: int | None = None,
        v_layout: str | None = None,
    ):
        if rotation_kind not in KINDS:
            raise ValueError(f"unknown rotation {rotation_kind!r}; expected one of {KINDS}")
        if key_bits not in (3, 4) or value_bits not in (3, 4):
            raise ValueError(f"IsoQuant stores 3- or 4-bit codes, not K{key_bits}/V{value_bits}")
        if window < 0:
            raise ValueError(f"the float window must be ≥ 0 tokens, got {window}")
        if sink < 0:
            raise ValueError(f"the float sink prefix must be ≥ 0 tokens, got {sink}")
        compress_every = COMPRESS_EVERY if compress_every is None else compress_every
        if compress_every < 1:
            raise ValueError(f"compress_every must be ≥ 1 token, got {compress_every}")
        if v_layout is not None and v_layout not in V_LAYOUTS:
            raise ValueError(f"unknown V layout {v_layout!r}; expected one of {V_LAYOUTS}")
        # Named key_bits/value_bits, never `bits`: mlx-lm's attention treats any cache with a
        # `bits` attribute as its own QuantizedKVCache.
        self.rotation_kind, self.key_bits, self.value_bits = rotation_kind, key_bits, value_bits
        self.window, self.seed, self.layer = window, seed, layer
        # Decode compresses aged-out tokens in batches of `compress_every`: the float tail holds
        # window .. window + compress_every - 1 tokens, and the ~30 small kernels of one
        # compression run once per batch instead of once per token.
        self.compress_every = compress_every
        # Layout of the V codes (packing.py): given, or preferred_v_layout's at _setup.
        self.v_layout = v_layout
        # The first `sink` tokens stay in float: attention sinks draw much of every query's mass.
        self.sink = sink
        self.sink_keys = self.sink_values = None  # [B, Hkv, sink, D] model dtype
        # Benchmark aid on CPU: also keep levels[codes] in float32 (counted in nbytes).
        self.decoded_shadow = decoded_shadow
        self.k_dec = self.v_dec = None  # [B, Hkv, cap_c, D] float32
        self.offset = 0
        self.compressed = 0
        self.rotation: Rotation | None = None  # built on first update (needs Hkv and D)
        self.kq: Quantizer | None = None
        self.vq: Quantizer | None = None
        # tokens [0, compressed) left the float tail: positions < sink are in sink_keys, code
        # row r is position sink + r; code capacity grows by `step`
        self.k_codes = self.k_norms = self.v_codes = self.v_norms = None
        # (rows, the four code/norm views, the decoded views) handed to attention: rebuilt
        # only when the codes change (a compression, growth, a new state), not every step
        self._views = None
        # float tokens: fp_keys[:, :, i] is absolute position fp_start + i
        self.fp_keys = self.fp_values = None
        self.fp_start = 0

    # ---- setup -------------------------------------------------------------------------
    def _setup(self, n_heads: int, head_dim: int, v_head_dim: int) -> None:
        if v_head_dim != head_dim:
            raise ValueError(f"IsoQuant needs equal K and V head dims, got {head_dim}/{v_head_dim}")
        self.rotation = Rotation.make(self.rotation_kind, head_dim, n_heads, self.seed, self.layer)
        self.kq = Quantizer.make(head_dim, self.key_bits)
        self.vq = Quantizer.make(head_dim, self.value_bits)
        if self.v_layout is None:
            self.v_layout = preferred_v_layout(head_dim, self.value_bits)
        elif self.v_layout == "tc16":
            check_tc16(head_dim, self.value_bits)
        # decode-time appends (a few tokens): one compiled graph per tensor instead of ~25 ops
        self._enc_k = self._enc_v = None
        if compile_encoders():
            self._enc_k = _compiled_encoder(self.rotation, self.kq)
            self._enc_v = _compiled_encoder(self.rotation, self.vq)

    # ---- protocol ----------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys, values: [B, Hkv, L, D]
        b, h, n, d = keys.shape
        if self.rotation is None:
            self._setup(h, d, values.shape[-1])
        self._append_fp(keys, values)
        if n == 1 and self.offset - self.window - self.compressed >= self.compress_every:
            self._compress_to(self.offset - self.window)
        return self._fetch()

    def finish_prefill(self) -> None:
        """Compress all but the recent window now (the engine calls it after the prompt)."""
        self._compress_to(self.offset - self.window)

    def _append_fp(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        end = self.offset + n - self.fp_start  # buffer index one past the new tokens
        if self.fp_keys is None or end > self.fp_keys.shape[2]:
            # Reallocate from `compressed` on: drops float tokens that have been compressed.
            lo, hi = self.compressed - self.fp_start, self.offset - self.fp_start
            cap = _round_up(self.offset - self.compressed + n, self.step)
            b, h, _, d = keys.shape
            new_k = mx.zeros((b, h, cap, d), keys.dtype)
            new_v = mx.zeros((b, h, cap, values.shape[-1]), values.dtype)
            if self.fp_keys is not None and hi > lo:
                new_k[:, :, : hi - lo] = self.fp_keys[:, :, lo:hi]
                new_v[:, :, : hi - lo] = self.fp_values[:, :, lo:hi]
            self.fp_keys, self.fp_values, self.fp_start = new_k, new_v, self.compressed
            end = self.offset + n - self.fp_start
        self.fp_keys[:, :, end - n : end] = keys
        self.fp_values[:, :, end - n : end] = values
        self.offset += n

    @property
    def _n_sink(self) -> int:
        return min(self.sink, self.compressed)

    @property
    def _n_rows(self) -> int:
        return self.compressed - self._n_sink

    @property
    def _tc16(self) -> bool:
        return self.v_layout == "tc16"

    def _v_rows(self, rows: int) -> int:
        """Rows of the V codes array that hold `rows` tokens (whole chunks in tc16)."""
        return _round_up(rows, TC16_CHUNK) if self._tc16 else rows

    def _grow_codes(self, needed: int) -> None:
        b, h = self.fp_keys.shape[:2]
        k_cap = 0 if self.k_codes is None else self.k_codes.shape[2]
        v_cap = 0 if self.v_codes is None else self.v_codes.shape[2]
        if needed <= k_cap and self._v_rows(needed) <= v_cap:
            return
        new_cap = self._v_rows(_round_up(needed, self.step))
        rows = self._n_rows
        self._views = None

        def grow(a, shape_tail, dtype, n=rows):
            z = mx.zeros((b, h, new_cap, *shape_tail), dtype)
            if a is not None and n:
                z[:, :, :n] = a[:, :, :n]
            return z

        self.k_codes = grow(self.k_codes, (self.kq.row_bytes,), mx.uint8)
        # tc16: whole chunks, the last one's codes of rows < `rows` included
        self.v_codes = grow(self.v_codes, (self.vq.row_bytes,), mx.uint8, self._v_rows(rows))
        self.k_norms = grow(self.k_norms, (), mx.float16)
        self.v_norms = grow(self.v_norms, (), mx.float16)
        if self.decoded_shadow:
            self.k_dec = grow(self.k_dec, (self.kq.dim,), mx.float32)
            self.v_dec = grow(self.v_dec, (self.vq.dim,), mx.float32)

    def _compress_to(self, upto: int) -> None:
        """Move float tokens [compressed, upto) out of the tail: into the sink, then codes."""
        start = c = self.compressed
        if upto <= c:
            return
        if c < self.sink:
            s_hi = min(upto, self.sink)
            if self.sink_keys is None:
                b, h, _, d = self.fp_keys.shape
                self.sink_keys = mx.zeros((b, h, self.sink, d), self.fp_keys.dtype)
                self.sink_values = mx.zeros((b, h, self.sink, d), self.fp_values.dtype)
            lo, hi = c - self.fp_start, s_hi - self.fp_start
            self.sink_keys[:, :, c:s_hi] = self.fp_keys[:, :, lo:hi]
            self.sink_values[:, :, c:s_hi] = self.fp_values[:, :, lo:hi]
            c = s_hi
        if upto > c:
            lo, hi = c - self.fp_start, upto - self.fp_start
            fk, fv = self.fp_keys[:, :, lo:hi], self.fp_values[:, :, lo:hi]
            fused = None
            if _ENCODER is not None and self._enc_k is None:  # compiled: an explicit opt-in
                fused = _ENCODER(fk, fv, self.rotation, self.kq, self.vq)
            if fused is not None:
                kc, kn, vc, vn = fused
            elif self._enc_k is not None and hi - lo <= _COMPILED_MAX_TOKENS:
                kc, kn = self._enc_k(fk)
                vc, vn = self._enc_v(fv)
            else:
                kc, kn = encode(fk, self.rotation, self.kq)
                vc, vn = encode(fv, self.rotation, self.vq)
            r0, r1 = c - self.sink, upto - self.sink
            self._views = None  # before the writes: a live view would keep the old buffers
            self._grow_codes(r1)
            self.k_codes[:, :, r0:r1] = kc
            self.k_norms[:, :, r0:r1] = kn
            if self._tc16:
                self._write_v_tc16(r0, r1, vc)
            else:
                self.v_codes[:, :, r0:r1] = vc
            self.v_norms[:, :, r0:r1] = vn
            if self.decoded_shadow:  # decoded from the packed bytes, as attention would
                self.k_dec[:, :, r0:r1] = self.kq.levels[unpack_codes(kc, self.kq.bits)]
                self.v_dec[:, :, r0:r1] = self.vq.levels[unpack_codes(vc, self.vq.bits)]
        self.compressed = upto
        if upto - start > self.step:
            # A bulk compression (end of prefill): release the prompt's float buffer now.
            self._shrink_fp()

    def _write_v_tc16(self, r0: int, r1: int, vc: mx.array | None) -> None:
        """Store rows-format V codes vc of rows [r0, r1) into the tc16 V codes: the chunks
        [r0 // 16, ceil16(r1) / 16) are repacked whole, from the codes of rows [c0, r0) already
        there, vc, and zero codes up to the chunk end."""
        c0, c1 = r0 - r0 % TC16_CHUNK, _round_up(r1, TC16_CHUNK)
        bits = self.vq.bits
        if _TC16_PACKER is not None and vc is not None and r1 > r0:
            old = self.v_codes[:, :, c0 : c0 + TC16_CHUNK] if r0 > c0 else None
            chunks = _TC16_PACKER(vc, old, r0 - c0)
            if chunks is not None:
                self.v_codes[:, :, c0:c1] = chunks
                return
        parts = []
        if r0 > c0:
            old = unpack_codes_tc16(self.v_codes[:, :, c0 : c0 + TC16_CHUNK], bits)
            parts.append(old[:, :, : r0 - c0])
        if r1 > r0:
            parts.append(unpack_codes(vc, bits))
        if c1 > r1:
            b, h = self.v_codes.shape[:2]
            parts.append(mx.zeros((b, h, c1 - r1, self.vq.dim), mx.uint8))
        codes = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
        self.v_codes[:, :, c0:c1] = pack_codes_tc16(codes, bits)

    def _shrink_fp(self) -> None:
        lo, hi = self.compressed - self.fp_start, self.offset - self.fp_start
        b, h, _, d = self.fp_keys.shape
        cap = _round_up(max(hi - lo, 1), self.step)
        new_k = mx.zeros((b, h, cap, d), self.fp_keys.dtype)
        new_v = mx.zeros((b, h, cap, self.fp_values.shape[-1]), self.fp_values.dtype)
        if hi > lo:
            new_k[:, :, : hi - lo] = self.fp_keys[:, :, lo:hi]
            new_v[:, :, : hi - lo] = self.fp_values[:, :, lo:hi]
        self.fp_keys, self.fp_values, self.fp_start = new_k, new_v, self.compressed

    def _fp_view(self):
        lo, hi = self.compressed - self.fp_start, self.offset - self.fp_start
        if hi <= lo:
            return None, None
        return self.fp_keys[:, :, lo:hi], self.fp_values[:, :, lo:hi]

    def _sink_view(self):
        ns = self._n_sink
        if ns == 0:
            return None, None
        return self.sink_keys[:, :, :ns], self.sink_values[:, :, :ns]

    def _fetch(self):
        fk, fv = self._fp_view()
        pk, pv = self._sink_view()
        r = self._n_rows
        if r == 0:
            # No codes yet: plain arrays (prompt, or sink only), mlx-lm's own attention.
            if pk is None:
                return fk, fv
            if fk is None:
                return pk, pv
            return mx.concatenate([pk, fk], axis=2), mx.concatenate([pv, fv], axis=2)
        if self._views is None or self._views[0] != r:
            kd = vd = None
            if self.decoded_shadow:
                kd, vd = self.k_dec[:, :, :r], self.v_dec[:, :, :r]
            kc, kn, vn = (a[:, :, :r] for a in (self.k_codes, self.k_norms, self.v_norms))
            vc = self.v_codes[:, :, : self._v_rows(r)]  # tc16: whole chunks
            self._views = (r, kc, kn, vc, vn, kd, vd)
        _, kc, kn, vc, vn, kd, vd = self._views
        keys = IsoQuantTensor(kc, kn, fk, self.kq, self.rotation, kd, pk)
        values = IsoQuantTensor(vc, vn, fv, self.vq, self.rotation, vd, pv, layout=self.v_layout)
        return keys, values

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        if self.compressed > self.offset:
            # Codes past offset are dead; the (empty) float segment restarts at offset.
            self.compressed = self.fp_start = self.offset
            r = self._n_rows
            if self._tc16 and r % TC16_CHUNK:
                # the last chunk's dead rows become zero codes again, as a fresh cache has them
                self._views = None
                self._write_v_tc16(r, r, None)
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def _arrays(self):
        arrays = (self.k_codes, self.k_norms, self.v_codes, self.v_norms, self.fp_keys)
        arrays += (self.fp_values, self.sink_keys, self.sink_values, self.k_dec, self.v_dec)
        return [a for a in arrays if a is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of every KV buffer this cache holds (capacity included), exactly."""
        return sum(a.nbytes for a in self._arrays())

    @property
    def used_nbytes(self) -> int:
        """Bytes the cached tokens need (no spare capacity): what bits-per-value counts."""
        if self.rotation is None or self.fp_keys is None:
            return 0
        b, h, _, d = self.fp_keys.shape
        per_row = self.kq.row_bytes + 2 * 2  # K codes + two fp16 norms
        fp_tok = d * (self.fp_keys.itemsize + self.fp_values.itemsize)
        n_float = self.offset - self.compressed + self._n_sink
        r = self._n_rows
        v_codes = self._v_rows(r) * self.vq.row_bytes  # tc16: whole chunks
        return b * h * (r * per_row + v_codes + n_float * fp_tok)

    # ---- persistence -------------------------------------------------------------------
    @property
    def state(self):
        """Live arrays: (k_codes, k_norms, v_codes, v_norms, fp_k, fp_v, sink_k, sink_v)."""
        if self.rotation is None:
            return ()
        r = self._n_rows
        fk, fv = self._fp_view()
        pk, pv = self._sink_view()
        if r == 0:
            return (None, None, None, None, fk, fv, pk, pv)
        kc, kn, vn = (a[:, :, :r] for a in (self.k_codes, self.k_norms, self.v_norms))
        vc = self.v_codes[:, :, : self._v_rows(r)]  # tc16: whole chunks (meta_state says so)
        return (kc, kn, vc, vn, fk, fv, pk, pv)

    @state.setter
    def state(self, v):
        self.k_dec = self.v_dec = None
        self._views = None
        if not v:
            self.k_codes = self.k_norms = self.v_codes = self.v_norms = None
            self.fp_keys = self.fp_values = self.sink_keys = self.sink_values = None
            self.offset = self.compressed = self.fp_start = 0
            return
        v = tuple(v) + (None, None) * (len(v) == 6)  # states saved before the sink prefix
        self.k_codes, self.k_norms, self.v_codes, self.v_norms, self.fp_keys, self.fp_values = v[:6]
        pk, pv = v[6:8]
        ns = 0 if pk is None else pk.shape[2]
        rows = 0 if self.k_codes is None else self.k_codes.shape[2]
        if rows and ns != self.sink:
            raise ValueError(f"IsoQuant state has {ns} sink tokens, its meta says {self.sink}")
        if rows:
            if self.v_layout is None:  # a cache never set up: only the shapes can tell
                self.v_layout = "rows" if self.v_codes.shape[2] == rows else "tc16"
            if self.v_codes.shape[2] != self._v_rows(rows):
                raise ValueError(
                    f"IsoQuant state has {self.v_codes.shape[2]} rows of V codes for {rows} "
                    f"tokens: not the {self.v_layout!r} layout of this cache"
                )
        self.sink_keys = self.sink_values = None
        if ns:  # full-size sink buffers, so compression can keep filling them
            b, h, _, d = pk.shape
            self.sink_keys = mx.zeros((b, h, self.sink, d), pk.dtype)
            self.sink_values = mx.zeros((b, h, self.sink, d), pv.dtype)
            self.sink_keys[:, :, :ns] = pk
            self.sink_values[:, :, :ns] = pv
        self.compressed = ns + rows
        self.fp_start = self.compressed
        n_fp = 0 if self.fp_keys is None else self.fp_keys.shape[2]
        self.offset = self.compressed + n_fp
        if self.decoded_shadow and rows:
            self.k_dec = self.kq.levels[unpack_codes(self.k_codes, self.kq.bits)]
            v = unpack_v_codes(self.v_codes, self.vq.bits, self.v_layout)
            self.v_dec = self.vq.levels[v[:, :, :rows]]

    @property
    def meta_state(self) -> str:
        """Everything besides the arrays, as JSON with the format version."""
        shape = None if self.rotation is None else [self.rotation.n_heads, self.rotation.head_dim]
        return json.dumps(
            {
                "format": "isoquant-kv",
                "format_version": FORMAT_VERSION,
                "rotation": self.rotation_kind,
                "key_bits": self.key_bits,
                "value_bits": self.value_bits,
                "window": self.window,
                "sink": self.sink,
                "compress_every": self.compress_every,
                "seed": self.seed,
                "layer": self.layer,
                "heads_dim": shape,
                "offset": self.offset,
                "compressed": self.compressed,
                "v_layout": self.v_layout,  # None: not chosen yet (a cache never set up)
            }
        )

    @classmethod
    def from_state(cls, state, meta_state: str):
        meta = json.loads(meta_state)
        if meta.get("format") != "isoquant-kv" or meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"IsoQuant cache state has format {meta.get('format')!r} version "
                f"{meta.get('format_version')!r}; this build reads version {FORMAT_VERSION}"
            )
        obj = cls(
            meta["rotation"],
            meta["key_bits"],
            meta["value_bits"],
            meta["window"],
            meta["seed"],
            meta["layer"],
            sink=meta.get("sink", 0),
            compress_every=meta.get("compress_every", 1),
            # states saved before the tc16 layout hold "rows" V codes
            v_layout=meta.get("v_layout", None if meta["heads_dim"] is None else "rows"),
        )
        if meta["heads_dim"] is not None:
            h, d = meta["heads_dim"]
            obj._setup(h, d, d)
            obj.state = state
            if (obj.offset, obj.compressed) != (meta["offset"], meta["compressed"]):
                raise ValueError("IsoQuant cache state arrays disagree with its recorded lengths")
            # a state saved where the other layout is read (e.g. on CUDA, loaded on a Mac): its
            # V codes are repacked once here rather than by every attention call
            obj.relayout(preferred_v_layout(d, obj.value_bits))
        return obj

    def relayout(self, layout: str) -> None:
        """Store the V codes in `layout` from now on (packing.py), repacking those held."""
        if layout not in V_LAYOUTS:
            raise ValueError(f"unknown V layout {layout!r}; expected one of {V_LAYOUTS}")
        if self.rotation is None:  # not set up yet: chosen, nothing held
            self.v_layout = layout
            return
        if layout == self.v_layout:
            return
        if layout == "tc16":
            check_tc16(self.vq.dim, self.vq.bits)
        self._views = None
        if self.v_codes is not None:  # (to tc16: the capacity in whole chunks)
            codes = unpack_v_codes(self.v_codes, self.vq.bits, self.v_layout)
            # rows past the held ones (dead after a trim) as zero codes, as tc16 keeps them
            live = mx.arange(codes.shape[2]) < self._n_rows
            codes = mx.where(live[:, None], codes, mx.zeros((), mx.uint8))
            self.v_codes = pack_v_codes(codes, self.vq.bits, layout)
        self.v_layout = layout
