"""ZipFusion's paged KV store: one pool of 256-byte rows shared by every layer and sequence.

During a forward pass the pool is only *read*: each layer stages its new K/V and attention reads
the pages plus the staged token. `commit()` runs after the step has been evaluated and writes
everything at once: tokens into raw pages, then every page that became full is compressed (the
prompt's pages and generated pages alike) and moved to a compressed extent. Writing the pool
only between steps, after `mx.synchronize()`, lets MLX update it in place (buffer donation)
instead of copying gigabytes.

  pool:       [rows, 128] uint16 (rows of 256 bytes)
  meta:       [L * n_ids, Hkv * 2 * MW] uint32, one row per (layer, page id); see codec.pack_meta
  page_table: [B, maxp] int32 page ids of the active sequences, built by `begin`
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from . import codec, kernels
from .memory import OutOfPages, PoolGeometry, ZipMemory

ROW_VALUES = codec.GRANULE // 2  # uint16 per pool row


@dataclass(frozen=True)
class ZipConfig:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    budget_bytes: int  # size of the page pool (metadata is counted on top, see nbytes)
    max_seqs: int = 64
    max_tokens_per_seq: int = 32768
    compress: bool = True  # False: full pages stay raw (the uncompressed paged baseline)
    pages_per_chunk: int = 16
    private_chunks: int = 1
    compress_reserve_chunks: int = 1

    def __post_init__(self):
        codec.check_head_dim(self.head_dim)
        if min(self.n_layers, self.n_kv_heads, self.max_seqs, self.max_tokens_per_seq) <= 0:
            raise ValueError(f"ZipConfig needs positive sizes: {self}")
        if (
            self.budget_bytes
            < self.raw_page_granules * codec.GRANULE * self.pages_per_chunk * self.n_layers
        ):
            raise ValueError(
                f"a KV budget of {self.budget_bytes} bytes cannot hold one chunk per layer "
                f"({self.n_layers} layers x {self.pages_per_chunk} pages of "
                f"{self.raw_page_granules * codec.GRANULE} bytes)"
            )

    @property
    def blocks_per_head(self) -> int:
        return self.head_dim // 32

    @property
    def raw_page_granules(self) -> int:
        return self.n_kv_heads * 2 * self.blocks_per_head * 4

    @property
    def raw_page_bytes(self) -> int:
        """One page of one layer at raw size (all KV heads, K and V)."""
        return self.raw_page_granules * codec.GRANULE

    @property
    def n_page_ids(self) -> int:
        return self.max_seqs * math.ceil(self.max_tokens_per_seq / codec.PAGE_TOKENS)

    @property
    def meta_words(self) -> int:
        return codec.meta_words(self.head_dim)

    def geometry(self) -> PoolGeometry:
        return PoolGeometry.for_budget(
            self.budget_bytes,
            self.n_layers,
            self.raw_page_granules,
            pages_per_chunk=self.pages_per_chunk,
            private_chunks=self.private_chunks,
            compress_reserve_chunks=self.compress_reserve_chunks,
        )


@dataclass
class _Seq:
    length: int = 0  # tokens committed to the pool
    pages: list[int] = field(default_factory=list)  # page ids; the last one is raw if length % 16


def _tables(head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column (inside a raw page's (head, K/V) section) of token t, dim d: [2, 16, D]."""
    pos = np.stack([codec.positions("k", head_dim), codec.positions("v", head_dim)])
    return (pos // ROW_VALUES).astype(np.int32), (pos % ROW_VALUES).astype(np.int32)


class ZipStore:
    """Pages of every layer and sequence in one pool, with the memory manager's page table."""

    def __init__(self, cfg: ZipConfig, use_kernel: bool | None = None):
        self.cfg = cfg
        self.use_kernel = kernels.kernels_available() if use_kernel is None else use_kernel
        self.geometry = cfg.geometry()
        self.mem = ZipMemory(self.geometry)
        self.n_ids = cfg.n_page_ids
        self.pool = mx.zeros((self.geometry.total_granules, ROW_VALUES), mx.uint16)
        self.meta = mx.zeros(
            (cfg.n_layers * self.n_ids, cfg.n_kv_heads * 2 * cfg.meta_words), mx.uint32
        )
        mx.eval(self.pool, self.meta)
        self._free_ids = list(range(self.n_ids - 1, -1, -1))
        self.page_off = np.zeros((cfg.n_layers, self.n_ids), np.int64)  # granule offset per layer
        self.seqs: dict[int, _Seq] = {}
        self._next_seq = 0
        rows, cols = _tables(cfg.head_dim)
        self._pos_row = mx.array(rows)
        self._pos_col = mx.array(cols)
        nb = cfg.blocks_per_head
        # Row offset of each (head, K/V) section inside a raw page.
        self._section_rows = mx.array(
            (np.arange(cfg.n_kv_heads * 2) * nb * 4).reshape(cfg.n_kv_heads, 2).astype(np.int32)
        )
        self.active: list[int] = []
        self.staged: list[tuple[mx.array, mx.array] | None] = [None] * cfg.n_layers
        self.page_table: mx.array | None = None
        self.seq_len: mx.array | None = None
        self.auto_sid: int | None = None  # set by single_sequence(): begin/commit happen implicitly
        self.stats = {"pages_compressed": 0, "blocks": 0, "blocks_compressed": 0, "pages_moved": 0}

    # -- sequences ---------------------------------------------------------------------------
    def add_sequence(self) -> int:
        sid = self._next_seq
        self._next_seq += 1
        self.seqs[sid] = _Seq()
        return sid

    def free_sequence(self, sid: int) -> None:
        s = self.seqs.pop(sid)
        for pid in s.pages:
            for layer in range(self.cfg.n_layers):
                self.mem.free_page(layer, pid)
            self._free_ids.append(pid)

    def single_sequence(self) -> int:
        """Serve one sequence through mlx-lm's own generate loop: each forward pass commits the
        previous one (layer 0 calls `auto_step`)."""
        self.auto_sid = self.add_sequence()
        return self.auto_sid

    def auto_step(self) -> None:
        if self.staged[0] is not None:
            self.commit()
        self.begin([self.auto_sid])

    def flush(self) -> None:
        """Commit a step that is still staged (the last one of a single-sequence generation)."""
        if self.staged[0] is not None:
            self.commit()

    def length(self, sid: int) -> int:
        return self.seqs[sid].length

    def pages_allocated(self, sid: int) -> int:
        return len(self.seqs[sid].pages)

    # -- a step ------------------------------------------------------------------------------
    def begin(self, seq_ids: list[int]) -> None:
        """Start a forward pass over `seq_ids` (in batch order)."""
        if any(s is not None for s in self.staged):
            raise RuntimeError("begin() before the previous step was committed")
        self.active = list(seq_ids)
        seqs = [self.seqs[s] for s in self.active]
        maxp = max(1, max(len(s.pages) for s in seqs))
        table = np.zeros((len(seqs), maxp), np.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.pages)] = s.pages
        self.page_table = mx.array(table)
        self.seq_len = mx.array([s.length for s in seqs], dtype=mx.int32)

    @property
    def lengths(self) -> list[int]:
        if self.auto_sid is not None:
            return [self.seqs[self.auto_sid].length]
        return [self.seqs[s].length for s in self.active]

    def stage(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """keys, values: [B, Hkv, n, D] for the active sequences; written at commit."""
        if self.staged[layer] is not None:
            raise RuntimeError(f"layer {layer} staged twice in one step")
        if keys.shape[0] != len(self.active):
            raise ValueError(f"staged batch {keys.shape[0]} != {len(self.active)} active sequences")
        want = (self.cfg.n_kv_heads, self.cfg.head_dim)
        if keys.ndim != 4 or (keys.shape[1], keys.shape[3]) != want or values.shape != keys.shape:
            raise ValueError(
                f"layer {layer}: K/V of shape {keys.shape}/{values.shape}, the store holds "
                f"[B, {want[0]}, n, {want[1]}]"
            )
        self.staged[layer] = (keys.astype(mx.bfloat16), values.astype(mx.bfloat16))

    def dense_kv(self, layer: int) -> tuple[mx.array, mx.array]:
        """The one active sequence's committed K/V plus its staged tokens: [1, Hkv, T, D]."""
        if len(self.active) != 1:
            raise ValueError("dense K/V (prefill) is built for one sequence at a time")
        keys, values = self.staged[layer]
        s = self.seqs[self.active[0]]
        if s.length == 0:
            return keys, values
        k, v = kernels.gather_pages_reference(
            self.pool,
            self.meta,
            self.page_table,
            layer,
            self.n_ids,
            self.cfg.n_kv_heads,
            self.cfg.head_dim,
        )
        k = k[:, :, : s.length]
        v = v[:, :, : s.length]
        return mx.concatenate([k, keys], axis=2), mx.concatenate([v, values], axis=2)

    def attend(self, layer: int, queries: mx.array, scale: float) -> mx.array:
        """Decode attention for the active sequences: queries [B, Hq, 1, D] -> [B, Hq, 1, D]."""
        keys, values = self.staged[layer]
        if keys.shape[2] != 1 or queries.shape[2] != 1:
            raise ValueError("paged decode attention takes one token per sequence")
        out = kernels.paged_decode_attention(
            queries[:, :, 0].astype(mx.bfloat16),
            self.pool,
            self.meta,
            self.page_table,
            self.seq_len,
            keys[:, :, 0],
            values[:, :, 0],
            layer=layer,
            n_ids=self.n_ids,
            scale=scale,
            use_kernel=self.use_kernel,
        )
        return out[:, :, None].astype(queries.dtype)

    # -- commit ------------------------------------------------------------------------------
    def _new_page(self, raw: bool) -> int:
        if not self._free_ids:
            raise OutOfPages(
                f"all {self.n_ids} page ids are in use (max_seqs x max_tokens_per_seq)"
            )
        pid = self._free_ids.pop()
        if not raw:
            return pid  # full when written: stored compressed, memory taken once sizes are known
        for layer in range(self.cfg.n_layers):
            try:
                self.page_off[layer, pid] = self.mem.alloc_raw(layer, pid)
            except OutOfPages:
                for done in range(layer):
                    self.mem.free_page(done, pid)
                self._free_ids.append(pid)
                raise
        return pid

    def _raw_meta_rows(self, pids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Meta rows for raw pages (every block 0xFF) at their raw slots."""
        cfg = self.cfg
        nb, mw = cfg.blocks_per_head, cfg.meta_words
        sec = np.arange(cfg.n_kv_heads * 2, dtype=np.int64) * nb * 4
        idx, rows = [], []
        for layer in range(cfg.n_layers):
            for pid in pids:
                words = np.full((cfg.n_kv_heads * 2, mw), 0xFFFFFFFF, np.uint32)
                words[:, 0] = (self.page_off[layer, pid] + sec).astype(np.uint32)
                idx.append(layer * self.n_ids + pid)
                rows.append(words.reshape(-1))
        return np.asarray(idx, np.int32), np.asarray(rows, np.uint32).reshape(len(idx), -1)

    def commit(self) -> None:
        """Write the staged tokens of every layer, compress the pages that became full."""
        cfg = self.cfg
        if any(s is None for s in self.staged):
            missing = [i for i, s in enumerate(self.staged) if s is None]
            raise RuntimeError(f"commit() with layers {missing[:4]}... not staged")
        mx.eval([a for st in self.staged for a in st])
        mx.synchronize()  # kernels of the step are done and hold no reference to the pool
        self.mem.end_read_epoch()
        n_new = self.staged[0][0].shape[2]
        tok_b, tok_k, tok_t, tok_pid = [], [], [], []  # token writes into raw pages
        from_pool: list[int] = []  # raw pages that became full: compress from the pool
        dense: list[tuple[int, int, int]] = []  # (batch index, first staged token, page id)
        new_raw: list[int] = []
        try:
            for bi, sid in enumerate(self.active):
                s = self.seqs[sid]
                k = 0
                while k < n_new:
                    pos = s.length + k
                    t0 = pos % codec.PAGE_TOKENS
                    take = min(n_new - k, codec.PAGE_TOKENS - t0)
                    if t0 == 0 and take == codec.PAGE_TOKENS:
                        pid = self._new_page(raw=False)  # full already: compressed directly
                        s.pages.append(pid)
                        dense.append((bi, k, pid))
                    else:
                        if t0 == 0:
                            pid = self._new_page(raw=True)  # new pages are raw: they take writes
                            s.pages.append(pid)
                            new_raw.append(pid)
                        pid = s.pages[-1]
                        tok_b += [bi] * take
                        tok_k += list(range(k, k + take))
                        tok_t += list(range(t0, t0 + take))
                        tok_pid += [pid] * take
                        if t0 + take == codec.PAGE_TOKENS:
                            from_pool.append(pid)
                    k += take
                s.length += n_new
        except OutOfPages:
            self.staged = [None] * cfg.n_layers
            raise
        ks = mx.stack([st[0] for st in self.staged])  # [L, B, Hkv, n, D]
        vs = mx.stack([st[1] for st in self.staged])
        self.staged = [None] * cfg.n_layers

        if new_raw:
            idx, rows = self._raw_meta_rows(new_raw)
            self.meta[mx.array(idx)] = mx.array(rows)
        if tok_b:
            self._write_tokens(ks, vs, tok_b, tok_k, tok_t, tok_pid)
        if not cfg.compress:
            from_pool = []  # the uncompressed baseline leaves full pages in their raw slots
        if from_pool or dense:
            self._compress_pages(ks, vs, from_pool, dense)
        mx.eval(self.pool, self.meta)

    def _write_tokens(self, ks, vs, tok_b, tok_k, tok_t, tok_pid) -> None:
        b = mx.array(np.asarray(tok_b, np.int32))
        k = mx.array(np.asarray(tok_k, np.int32))
        t = mx.array(np.asarray(tok_t, np.int32))
        off = mx.array(self.page_off[:, np.asarray(tok_pid)].astype(np.int32))  # [L, E]
        # [L, B, Hkv, n, D] -> [B, n, L, Hkv, D] so one gather picks (sequence, token) pairs.
        kt = ks.transpose(1, 3, 0, 2, 4)[b, k]  # [E, L, Hkv, D]
        vt = vs.transpose(1, 3, 0, 2, 4)[b, k]
        vals = mx.moveaxis(mx.stack([kt, vt], axis=3), 0, 1).view(mx.uint16)  # [L, E, Hkv, 2, D]
        pr = mx.moveaxis(self._pos_row[:, t], 0, 1)  # [E, 2, D]
        pc = mx.moveaxis(self._pos_col[:, t], 0, 1)
        rows = (
            off[:, :, None, None, None]
            + self._section_rows[None, None, :, :, None]
            + pr[None, :, None]
        )
        cols = mx.broadcast_to(pc[None, :, None], rows.shape)
        self.pool[rows.reshape(-1), cols.reshape(-1)] = vals.reshape(-1)

    def _compress_pages(
        self, ks, vs, from_pool: list[int], dense: list[tuple[int, int, int]]
    ) -> None:
        cfg = self.cfg
        L, nb = cfg.n_layers, cfg.blocks_per_head
        parts = []
        if from_pool:
            base = self.page_off[:, np.asarray(from_pool)]  # [L, P]
            rows = base[..., None] + np.arange(cfg.raw_page_granules)
            parts.append(
                self.pool[mx.array(rows.reshape(-1).astype(np.int32))].reshape(
                    -1, codec.BLOCK_VALUES
                )
            )
        if dense:
            bi = mx.array(np.asarray([d[0] for d in dense], np.int32))
            k0 = np.asarray([d[1] for d in dense], np.int32)
            tk = mx.array(k0[:, None] + np.arange(codec.PAGE_TOKENS, dtype=np.int32))  # [P, 16]
            kp = ks.transpose(1, 3, 0, 2, 4)[bi[:, None], tk]  # [P, 16, L, Hkv, D]
            vp = vs.transpose(1, 3, 0, 2, 4)[bi[:, None], tk]
            kp = codec.to_fragment_order(kp.transpose(2, 0, 3, 1, 4), "k")  # [L, P, Hkv, nb, 512]
            vp = codec.to_fragment_order(vp.transpose(2, 0, 3, 1, 4), "v")
            parts.append(mx.stack([kp, vp], axis=3).reshape(-1, codec.BLOCK_VALUES))
        blocks = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        if cfg.compress:
            flags, payload = kernels.compress_blocks(blocks, use_kernel=self.use_kernel)
        else:
            flags = mx.full((blocks.shape[0],), codec.RAW_FLAG, mx.uint8)
            payload = blocks
        mx.eval(flags, payload, self.pool)
        mx.synchronize()  # the gather above read the pool: release it before writing in place

        # Order of blocks: from_pool pages [L, P1, Hkv, 2, nb], then dense pages [L, P2, Hkv, 2, nb].
        fl = np.array(flags)
        sizes = codec.block_granules(fl)
        p1, p2 = len(from_pool), len(dense)
        per_page = cfg.n_kv_heads * 2 * nb
        fl1 = fl[: L * p1 * per_page].reshape(L, p1, per_page)
        fl2 = fl[L * p1 * per_page :].reshape(L, p2, per_page)
        sz1 = sizes[: L * p1 * per_page].reshape(L, p1, per_page)
        sz2 = sizes[L * p1 * per_page :].reshape(L, p2, per_page)
        pids = list(from_pool) + [d[2] for d in dense]
        fl_all = np.concatenate([fl1, fl2], axis=1)  # [L, P, per_page]
        sz_all = np.concatenate([sz1, sz2], axis=1)
        src_block = np.concatenate(
            [
                np.arange(L * p1 * per_page).reshape(L, p1, per_page),
                L * p1 * per_page + np.arange(L * p2 * per_page).reshape(L, p2, per_page),
            ],
            axis=1,
        )
        starts = np.cumsum(sz_all, axis=-1) - sz_all  # granule start of each block inside the page
        totals = sz_all.sum(-1)  # [L, P]
        dst_base = np.empty((L, len(pids)), np.int64)
        for layer in range(L):
            for i, pid in enumerate(pids):
                if i < p1:
                    off = self.mem.place_compressed(layer, pid, int(totals[layer, i]))
                else:
                    off = self.mem.alloc_compressed(layer, pid, int(totals[layer, i]))
                dst_base[layer, i] = self.page_off[layer, pid] = off
        # Row copies: block b's first `size` rows of the payload -> its place in the pool.
        blk_dst = dst_base[..., None] + starts  # [L, P, per_page]
        n_rows = sz_all.reshape(-1)
        rep_src = np.repeat(src_block.reshape(-1) * 4, n_rows)
        rep_dst = np.repeat(blk_dst.reshape(-1), n_rows)
        within = np.arange(n_rows.sum()) - np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
        src_rows = (rep_src + within).astype(np.int32)
        dst_rows = (rep_dst + within).astype(np.int32)
        payload_rows = payload.reshape(-1, ROW_VALUES)
        self.pool[mx.array(dst_rows)] = payload_rows[mx.array(src_rows)]
        # Meta rows: offset of each (head, K/V) section's first block, then its block flags.
        mw = cfg.meta_words
        sec_start = (blk_dst.reshape(L, len(pids), cfg.n_kv_heads * 2, nb))[..., 0]
        flag_bytes = np.full((L, len(pids), cfg.n_kv_heads * 2, 4 * (mw - 1)), 0xFF, np.uint8)
        flag_bytes[..., :nb] = fl_all.reshape(L, len(pids), cfg.n_kv_heads * 2, nb)
        words = np.empty((L, len(pids), cfg.n_kv_heads * 2, mw), np.uint32)
        words[..., 0] = sec_start.astype(np.uint32)
        words[..., 1:] = flag_bytes.view(np.uint32).reshape(
            L, len(pids), cfg.n_kv_heads * 2, mw - 1
        )
        idx = (
            (np.arange(L)[:, None] * self.n_ids + np.asarray(pids)[None])
            .reshape(-1)
            .astype(np.int32)
        )
        self.meta[mx.array(idx)] = mx.array(words.reshape(len(idx), -1))
        self.stats["pages_compressed"] += L * len(pids)
        self.stats["blocks"] += int(fl.size)
        self.stats["blocks_compressed"] += int((fl != codec.RAW_FLAG).sum())

    # -- maintenance -------------------------------------------------------------------------
    def compact(self, max_live_fraction: float = 0.5) -> int:
        """Move compressed pages out of sparse chunks so whole chunks return to the pool."""
        mx.synchronize()
        self.mem.end_read_epoch()
        src, dst, metas = [], [], []
        for layer in range(self.cfg.n_layers):
            for pid, s0, d0, n in self.mem.compact(layer, max_live_fraction):
                src.append(np.arange(s0, s0 + n))
                dst.append(np.arange(d0, d0 + n))
                metas.append((layer, pid, d0 - s0))
                self.page_off[layer, pid] = d0
        if not src:
            return 0
        vals = self.pool[mx.array(np.concatenate(src).astype(np.int32))]
        mx.eval(vals)
        mx.synchronize()
        self.pool[mx.array(np.concatenate(dst).astype(np.int32))] = vals
        # Shift the offsets of every (head, K/V) section of the moved pages.
        idx = mx.array(np.asarray([m[0] * self.n_ids + m[1] for m in metas], np.int32))
        rows = self.meta[idx].reshape(len(metas), -1, self.cfg.meta_words)
        delta = mx.array(np.asarray([m[2] for m in metas], np.int64).astype(np.uint32))
        first = rows[..., :1] + delta[:, None, None]  # uint32 wrap-around subtracts
        rows = mx.concatenate([first, rows[..., 1:]], axis=-1).reshape(len(metas), -1)
        mx.eval(rows)
        mx.synchronize()
        self.meta[idx] = rows
        mx.eval(self.pool, self.meta)
        self.stats["pages_moved"] += len(metas)
        return len(metas)

    # -- accounting --------------------------------------------------------------------------
    def pages_fit_every_layer(self) -> int:
        return min(self.mem.pages_fit_every_layer(), len(self._free_ids))

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: the pool (the KV budget) plus the page metadata."""
        return self.pool.nbytes + self.meta.nbytes

    def used_bytes(self, layer: int | None = None) -> int:
        return self.mem.used_granules(layer) * codec.GRANULE

    def seq_kv_bytes(self, sid: int) -> int:
        s = self.seqs[sid]
        return (
            sum(
                self.mem.location(layer, pid)[1]
                for pid in s.pages
                for layer in range(self.cfg.n_layers)
            )
            * codec.GRANULE
        )
