"""IsoQuantKVCache: mlx-lm's cache protocol over a compressed prefix and a float tail.

Attention reads tokens [0, compressed) compressed (the first `sink` of them from a float sink
buffer, the rest as packed codes + fp16 norms, packing.py) and tokens [compressed, offset) in
the model's dtype. The window is exact: every update's first query sees exactly `window` float
tokens (itself included); the queries of a multi-token update (a prefill chunk, a speculative
verify) also see each other in float. Codes are written ahead in batches of `compress_every`
tokens (`encoded` >= `compressed`), so the window stays exact while the encoder runs once a
batch. Multi-token updates encode what the next step reads compressed and release the float
copies, so a chunked prefill holds the prompt compressed as it goes. The float copies of the
last TRIM_EXACT compressed tokens are kept, so a speculative trim of up to that many tokens
leaves exactly the cache that never saw them.

V codes are stored in the layout `v_layout` ("rows" or "tc16", packing.py), chosen once per
cache (packing.preferred_v_layout unless given) and kept through state round trips; K codes are
always "rows". A tc16 cache rewrites whole 16-token chunks of V codes when it encodes.

A layer IsoQuant cannot code (unequal K/V head dims as in MLA models, head dims the codebook
does not take) runs as mlx-lm's float KVCache inside this cache, with `fallback_reason` set.
"""

from __future__ import annotations

import json
import logging
import os

import mlx.core as mx
import mlx_lm.models.cache as _mlx_cache
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from .attention import CacheView, IsoQuantTensor, isoquant_attention
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
from .quantizer import Quantizer, decode, encode
from .rotation import KINDS, Rotation


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


log = logging.getLogger(__name__)

# Decode-time encoding batch (tokens): measured on the H200 (benchmarks/results/
# isoquant_step_profile*.json), one encoding is ~30 small kernels, ~250 µs per layer when it
# ran for every token; in batches of 16 it costs a sixteenth of that per token.
COMPRESS_EVERY = 16
# Float copies kept behind the window: a trim of up to this many tokens (speculative decoding's
# rejected drafts) restores exactly the cache that never saw them.
TRIM_EXACT = 16
FP_STEP = 32  # float tail capacity step: small, since on CPU a float token is ~10 coded ones
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


# The fused one-token step over a cache's buffers (kernel_path.install registers
# kernels.window_attention where the backend has kernels): (q, kc, kn, vc, vn, fk, fv, lo, tc, tf,
# kq, vq, rotation, v_layout, scale) -> output, or None for inputs it does not take.
_STEP_KERNEL = None
STEP_SLOTS = 64  # counter slots a cache keeps for it: one per (row, KV head) block of a step


def register_step_kernel(fn) -> None:
    """Install (or, with None, remove) the fused attention of attend_step."""
    global _STEP_KERNEL
    _STEP_KERNEL = fn


def _compiled_encoder(rotation: Rotation, quantizer: Quantizer):
    return mx.compile(lambda x: quantizer.encode_rotated(rotation.forward(x)))


class IsoQuantKVCache(_BaseCache):
    step = 256  # grow code buffers in steps so decode doesn't reallocate each token

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
        # Codes are written `compress_every` tokens at a time, ahead of the window's edge.
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
        self.compressed = 0  # tokens attention reads compressed (sink buffer, then codes)
        self.encoded = 0  # tokens written to the sink buffer / codes (>= compressed)
        self.rotation: Rotation | None = None  # built on first update (needs Hkv and D)
        self.kq: Quantizer | None = None
        self.vq: Quantizer | None = None
        # positions < sink are in sink_keys, code row r is position sink + r; capacity grows
        # by `step`
        self.k_codes = self.k_norms = self.v_codes = self.v_norms = None
        # (rows, the four code/norm views, the decoded views) handed to attention: rebuilt
        # only when the rows attention reads change, not every step
        self._views = None
        # float tokens: fp_keys[:, :, i] is absolute position fp_start + i (fp_start <= encoded)
        self.fp_keys = self.fp_values = None
        self.fp_start = 0
        # a layer IsoQuant cannot code runs as mlx-lm's float cache (why: fallback_reason)
        self.fallback_reason: str | None = None
        self._float: KVCache | None = None
        # the fused step's counter slots (kernels.window_attention), zeroed, reset by each call
        self._slots: mx.array | None = None

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

    def _adopt(self, other: IsoQuantKVCache) -> None:
        """Set up as `other` is (same settings, already set up): its rotation, codebooks and
        encoders, shared. A batch's extracted rows take their layer's this way: _setup makes
        the rotation anew, ~0.3-0.5 ms a layer on a CPU, on every finished request."""
        self.rotation, self.kq, self.vq = other.rotation, other.kq, other.vq
        self._enc_k, self._enc_v = other._enc_k, other._enc_v
        if self.v_layout is None:
            self.v_layout = other.v_layout

    def _unsupported(self, n_heads: int, head_dim: int, v_head_dim: int) -> str | None:
        """Why this layer's K/V cannot be coded (None: they can)."""
        if v_head_dim != head_dim:
            return f"K and V head dims differ ({head_dim}/{v_head_dim}, an MLA-style cache)"
        try:
            Rotation.make(self.rotation_kind, head_dim, 1, self.seed, self.layer)
            Quantizer.make(head_dim, max(self.key_bits, self.value_bits))
        except ValueError as e:
            return str(e)
        return None

    def _fall_back(self, reason: str) -> None:
        self.rotation = self.kq = self.vq = None
        self.fallback_reason = reason
        self._float = KVCache()
        log.warning("KV layer %d keeps a float cache: %s", self.layer, reason)

    # ---- protocol ----------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys, values: [B, Hkv, L, D]
        b, h, n, d = keys.shape
        if self.rotation is None and self._float is None:
            reason = self._unsupported(h, d, values.shape[-1])
            if reason:
                self._fall_back(reason)
            else:
                self._setup(h, d, values.shape[-1])
        if self._float is not None:
            out = self._float.update_and_fetch(keys, values)
            self.offset = self._float.offset
            return out
        self._advance(keys, values)
        out = self._fetch(lazy=n == 1)
        if n > 1:
            # what the next step reads compressed is encoded now and its float released, so a
            # chunked prefill never holds the whole prompt in float
            self._encode_to(min(self.offset, self.offset + 1 - self.window))
            self._release_fp(self.offset + 1 - self.window)
        return out

    def _advance(self, keys: mx.array, values: mx.array) -> None:
        """Append an update's tokens and move the split attention reads at."""
        n = keys.shape[2]
        before = self.offset
        # the first query sees `window` float tokens, itself included; a multi-token update's
        # queries see each other in float (deferred prefill within a chunk)
        first = before + 1 - self.window
        split = max(0, first if n == 1 else min(before, first))
        self._append_fp(keys, values, split)
        split = max(split, self.fp_start)  # float copies gone after a deep trim stay compressed
        if split > self.encoded:
            # a batch of codes ahead of the split (the kernels mask a tc16 chunk's rows past it)
            self._encode_to(min(self.offset, max(split, self.encoded + self.compress_every)))
        self.compressed = split

    def attend_step(self, queries, keys, values, scale, mask=None):
        """update_and_fetch and the attention op of a one-token decode step in one call, the
        fused kernel reading the cache's buffers in place (kernels.window_attention: no views,
        its launch taken once per step for all layers, planned per block of steps). None, with
        the cache untouched, where the step takes the general path (no kernels, a float sink
        prefix, a float-only cache, an array mask, more than one token); the caller then calls
        update_and_fetch."""
        if (
            _STEP_KERNEL is None
            or keys.shape[2] != 1
            or self.rotation is None
            or self.sink
            or self.decoded_shadow
            or self.offset + 1 - self.window <= 0
            or not (mask is None or isinstance(mask, str))
        ):
            return None
        self._advance(keys, values)
        lo, hi = self.compressed - self.fp_start, self.offset - self.fp_start
        if self._slots is None:
            self._slots = mx.zeros((STEP_SLOTS,), mx.int32)
        out = _STEP_KERNEL(
            queries, self.k_codes, self.k_norms, self.v_codes, self.v_norms, self.fp_keys,
            self.fp_values, lo, self.compressed, hi - lo, self.kq, self.vq, self.rotation,
            self.v_layout, scale, self._slots,
        )  # fmt: skip
        if out is None:
            k, v = self._fetch(lazy=True)
            out = isoquant_attention(queries, k, v, scale, mask)
        return out

    def finish_prefill(self) -> None:
        """Compress all but the recent window now (the prompt's KV in bulk) and release its
        float copies."""
        if self._float is not None or self.fp_keys is None:
            return
        split = max(self.compressed, self.offset - self.window)
        self._encode_to(split)
        self.compressed = split
        self._release_fp(split)

    def _keep_from(self, split: int) -> int:
        """First position whose float copy is kept when attention's next split is `split`."""
        return max(self.fp_start, min(self.encoded, split - TRIM_EXACT))

    def _append_fp(self, keys: mx.array, values: mx.array, split: int) -> None:
        n = keys.shape[2]
        end = self.offset + n - self.fp_start  # buffer index one past the new tokens
        if self.fp_keys is None or end > self.fp_keys.shape[2]:
            self._realloc_fp(self._keep_from(split), n, keys, values)
            end = self.offset + n - self.fp_start
        self.fp_keys[:, :, end - n : end] = keys
        self.fp_values[:, :, end - n : end] = values
        self.offset += n

    def _realloc_fp(self, keep: int, extra: int, keys=None, values=None) -> None:
        """A float buffer holding positions [keep, offset) with room for `extra` more."""
        ref_k = self.fp_keys if keys is None else keys
        ref_v = self.fp_values if values is None else values
        lo, hi = keep - self.fp_start, self.offset - self.fp_start
        cap = _round_up(max(hi - lo + extra, 1), FP_STEP)
        b, h = ref_k.shape[:2]
        new_k = mx.zeros((b, h, cap, ref_k.shape[-1]), ref_k.dtype)
        new_v = mx.zeros((b, h, cap, ref_v.shape[-1]), ref_v.dtype)
        if self.fp_keys is not None and hi > lo:
            new_k[:, :, : hi - lo] = self.fp_keys[:, :, lo:hi]
            new_v[:, :, : hi - lo] = self.fp_values[:, :, lo:hi]
        self.fp_keys, self.fp_values, self.fp_start = new_k, new_v, keep

    def _release_fp(self, split: int) -> None:
        keep = self._keep_from(split)
        if keep - self.fp_start >= FP_STEP:
            self._realloc_fp(keep, 0)

    @property
    def _n_sink(self) -> int:
        return min(self.sink, self.compressed)

    @property
    def _n_rows(self) -> int:
        """Code rows attention reads."""
        return self.compressed - self._n_sink

    @property
    def _enc_rows(self) -> int:
        """Code rows written."""
        return self.encoded - min(self.sink, self.encoded)

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
        rows = self._enc_rows
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

    def _encode_to(self, upto: int) -> None:
        """Write float tokens [encoded, upto) into the sink buffer, then codes (their float
        copies stay until released)."""
        c = self.encoded
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
            kc, kn, vc, vn = self.encode_rows(
                self.fp_keys[:, :, lo:hi], self.fp_values[:, :, lo:hi]
            )
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
        self.encoded = upto

    def encode_rows(self, fk: mx.array, fv: mx.array):
        """Float K/V [B, Hkv, n, D] -> (K codes, K norms, V codes, V norms), V codes in "rows"
        layout. Per token: a token's codes do not depend on when or beside what it is encoded."""
        fused = None
        if _ENCODER is not None and self._enc_k is None:  # compiled: an explicit opt-in
            fused = _ENCODER(fk, fv, self.rotation, self.kq, self.vq)
        if fused is not None:
            return fused
        if self._enc_k is not None and fk.shape[2] <= _COMPILED_MAX_TOKENS:
            return (*self._enc_k(fk), *self._enc_v(fv))
        return (*encode(fk, self.rotation, self.kq), *encode(fv, self.rotation, self.vq))

    def dequantized(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """What attention reads for these float K/V [B, Hkv, n, D] once they are compressed:
        (K̂, V̂) float32 in the original space, x̂ = Rᵀ ŷ (benchmarks and tests; the cache itself
        never materializes them). Sets the cache up on first use; holds nothing."""
        if self.rotation is None:
            self._setup(keys.shape[1], keys.shape[-1], values.shape[-1])
        kc, kn, vc, vn = self.encode_rows(keys, values)
        return decode(kc, kn, self.rotation, self.kq), decode(vc, vn, self.rotation, self.vq)

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batch protocol: one batch cache of these caches (batch.py)."""
        from .batch import BatchIsoQuantKVCache

        return BatchIsoQuantKVCache.merge(caches)

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

    def _fetch(self, lazy: bool = False):
        r = self._n_rows
        if lazy and r and not self.decoded_shadow and not self._n_sink:
            # A single-token step (nothing is written before attention reads it): the views are
            # sliced only if read; the kernels read the buffers as they are.
            lo, hi = self.compressed - self.fp_start, self.offset - self.fp_start
            keys = CacheView(
                self.kq, self.rotation, "rows",
                src=(self.k_codes, r, self.k_norms, r, self.fp_keys, lo, hi),
            )  # fmt: skip
            values = CacheView(
                self.vq, self.rotation, self.v_layout,
                src=(self.v_codes, self._v_rows(r), self.v_norms, r, self.fp_values, lo, hi),
            )  # fmt: skip
            return keys, values
        fk, fv = self._fp_view()
        pk, pv = self._sink_view()
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
        if self._float is not None:
            n = self._float.trim(n)
            self.offset = self._float.offset
            return n
        n = min(self.offset, n)
        self.offset -= n
        # Codes and float copies past offset are dead; the next update recomputes the split
        # (exactly, while the float copies of the window are still held: TRIM_EXACT).
        self.fp_start = min(self.fp_start, self.offset)
        if self.encoded > max(self.offset, self.fp_start):
            dead = self._v_rows(self._enc_rows)
            self.encoded = max(self.offset, self.fp_start)
            self._views = None
            r = self._enc_rows
            if self._tc16:
                # dead rows become zero codes again, as a fresh cache has them
                if r % TC16_CHUNK:
                    self._write_v_tc16(r, r, None)
                c1 = _round_up(r, TC16_CHUNK)
                if dead > c1:
                    self.v_codes[:, :, c1:dead] = mx.zeros((), mx.uint8)
        # as after a single-token step at this offset (the float copies allowing)
        self.compressed = max(self.fp_start, min(self.encoded, self.offset - self.window))
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's kv_bits path: refused, IsoQuant's codes are already quantized."""
        raise ValueError(
            f"this KV cache is IsoQuant {self.key_bits}/{self.value_bits}-bit already; mlx-lm's "
            f"kv_bits={bits} does not apply to it (pick the KV mode instead)"
        )

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def _arrays(self):
        arrays = (self.k_codes, self.k_norms, self.v_codes, self.v_norms, self.fp_keys)
        arrays += (self.fp_values, self.sink_keys, self.sink_values, self.k_dec, self.v_dec)
        return [a for a in arrays if a is not None]

    @property
    def capacity_nbytes(self) -> int:
        """Bytes of every buffer this cache has allocated, spare capacity included."""
        if self._float is not None:
            return self._float.nbytes
        return sum(a.nbytes for a in self._arrays())

    @property
    def nbytes(self) -> int:
        """Bytes of what the cache holds (no spare capacity), at the dtypes it is stored in:
        codes and norms of the encoded tokens, the float tail (with its trim reserve) and
        sink, and the decoded shadow if kept."""
        if self._float is not None:
            f = self._float
            return 0 if f.keys is None else (f.keys[..., : f.offset, :].nbytes * 2)
        if self.rotation is None or self.fp_keys is None:
            return 0
        b, h = self.fp_keys.shape[:2]
        kd, vd = self.fp_keys.shape[-1], self.fp_values.shape[-1]
        per_row = self.kq.row_bytes + 2 * 2  # K codes + two fp16 norms
        r = self._enc_rows
        v_codes = self._v_rows(r) * self.vq.row_bytes  # tc16: whole chunks
        fp_tok = kd * self.fp_keys.itemsize + vd * self.fp_values.itemsize
        n_float = self.offset - self.fp_start + min(self.sink, self.encoded)
        shadow = r * (self.kq.dim + self.vq.dim) * 4 if self.decoded_shadow else 0
        return b * h * (r * per_row + v_codes + n_float * fp_tok + shadow)

    used_nbytes = nbytes  # the name the engine's statistics read

    # ---- persistence -------------------------------------------------------------------
    @property
    def state(self):
        """(k_codes, k_norms, v_codes, v_norms, fp_k, fp_v, sink_k, sink_v, meta_state): the
        live arrays and, last, the JSON meta (so mlx-lm's save/load_prompt_cache round-trip)."""
        if self.rotation is None and self._float is None:
            return (None,) * 8 + (self.meta_state,)  # a cache never used: its settings only
        if self._float is not None:
            f = self._float
            k = v = None
            if f.keys is not None and f.offset:
                k, v = f.keys[..., : f.offset, :], f.values[..., : f.offset, :]
            return (None, None, None, None, k, v, None, None, self.meta_state)
        r = self._enc_rows
        lo, hi = 0, self.offset - self.fp_start
        fk = fv = None
        if hi > lo:
            fk, fv = self.fp_keys[:, :, lo:hi], self.fp_values[:, :, lo:hi]
        ns = min(self.sink, self.encoded)
        pk = pv = None
        if ns:
            pk, pv = self.sink_keys[:, :, :ns], self.sink_values[:, :, :ns]
        if r == 0:
            return (None, None, None, None, fk, fv, pk, pv, self.meta_state)
        kc, kn, vn = (a[:, :, :r] for a in (self.k_codes, self.k_norms, self.v_norms))
        vc = self.v_codes[:, :, : self._v_rows(r)]  # tc16: whole chunks (meta_state says so)
        return (kc, kn, vc, vn, fk, fv, pk, pv, self.meta_state)

    @state.setter
    def state(self, v):
        self.k_dec = self.v_dec = None
        self._views = None
        if not v or all(a is None for a in list(v)[:8]):
            self.k_codes = self.k_norms = self.v_codes = self.v_norms = None
            self.fp_keys = self.fp_values = self.sink_keys = self.sink_values = None
            self.offset = self.compressed = self.encoded = self.fp_start = 0
            return
        v = list(v)
        meta = json.loads(v[8]) if len(v) > 8 and isinstance(v[8], str) else {}
        v = v[:8] + [None] * (8 - len(v[:8]))  # states saved before the sink prefix had 6
        if meta.get("float_fallback"):
            self._fall_back(meta["float_fallback"])
            if v[4] is not None:
                self._float.state = (v[4], v[5], v[4].shape[2])
            self.offset = self._float.offset
            return
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
        if ns:  # full-size sink buffers, so encoding can keep filling them
            b, h, _, d = pk.shape
            self.sink_keys = mx.zeros((b, h, self.sink, d), pk.dtype)
            self.sink_values = mx.zeros((b, h, self.sink, d), pv.dtype)
            self.sink_keys[:, :, :ns] = pk
            self.sink_values[:, :, :ns] = pv
        self.encoded = ns + rows
        n_fp = 0 if self.fp_keys is None else self.fp_keys.shape[2]
        # states saved before the encode-ahead: the float tail starts where the codes end
        self.fp_start = meta.get("fp_start", self.encoded)
        self.compressed = meta.get("compressed", self.encoded)
        self.offset = self.fp_start + n_fp
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
                "encoded": self.encoded,
                "fp_start": self.fp_start,
                "v_layout": self.v_layout,  # None: not chosen yet (a cache never set up)
                "float_fallback": self.fallback_reason,
            }
        )

    @classmethod
    def from_state(cls, state, meta_state: str | None = None):
        """meta_state: given, or the JSON the state carries last (mlx-lm's load_prompt_cache
        calls from_state(state) alone)."""
        state = list(state)
        if meta_state is None:
            if len(state) < 9 or not isinstance(state[8], str):
                raise ValueError("IsoQuant cache state carries no meta_state")
            meta_state = state[8]
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
        state = state[:8] + [meta_state]
        if meta.get("float_fallback"):
            obj.state = state
        elif meta["heads_dim"] is not None:
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
            live = mx.arange(codes.shape[2]) < self._enc_rows
            codes = mx.where(live[:, None], codes, mx.zeros((), mx.uint8))
            self.v_codes = pack_v_codes(codes, self.vq.bits, layout)
        self.v_layout = layout


# mlx-lm's load_prompt_cache finds cache classes by name in its cache module.
setattr(_mlx_cache, IsoQuantKVCache.__name__, IsoQuantKVCache)
