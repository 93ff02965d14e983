"""ZipFusion's memory manager: plain-Python bookkeeping over one pool of 256-byte granules.

The pool is cut in equal chunks. Each layer has a private arena (chunks it keeps even when free)
and borrows the rest from the shared pool. New pages are allocated at raw size in *raw chunks*
(fixed slots: a page must accept writes until it is full); a full page is compressed into a
*zip chunk* (bump-allocated extents of variable size) and its raw slot freed, so compressed pages
move, and the owner keeps a page id -> location table. A chunk that becomes wholly free goes back
to the shared pool once no step in flight can still read it (`end_read_epoch`).

`pages_fit_every_layer()` is the number the scheduler admits by: how many new raw pages every
layer can still take at once (the most constrained layer decides, the shared pool evens them out).
Like nano-vllm's BlockManager this is unit-tested without MLX.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """The pool has no room for a page; admission should have prevented this."""


@dataclass(frozen=True)
class PoolGeometry:
    n_layers: int
    n_chunks: int  # chunks in the whole pool (private arenas come out of it)
    chunk_granules: int  # 256-byte rows per chunk
    raw_page_granules: int  # one page of one layer at raw size (all KV heads, K and V)
    private_chunks: int = 1  # chunks each layer keeps when free (its private arena)
    # per layer: room to place compressed pages before their raw slots free
    compress_reserve_chunks: int = 1

    def __post_init__(self):
        if min(self.n_layers, self.n_chunks, self.chunk_granules, self.raw_page_granules) <= 0:
            raise ValueError(f"pool geometry needs positive sizes: {self}")
        if self.chunk_granules < self.raw_page_granules:
            raise ValueError(
                f"a chunk ({self.chunk_granules} granules) must hold at least one raw page "
                f"({self.raw_page_granules} granules)"
            )
        if self.private_chunks < 0 or self.compress_reserve_chunks < 0:
            raise ValueError(f"reserves must be >= 0: {self}")
        if self.n_chunks < self.n_layers * self.private_chunks:
            raise ValueError(
                f"{self.n_chunks} chunks cannot give {self.n_layers} layers "
                f"{self.private_chunks} private chunks each"
            )

    @property
    def slots_per_chunk(self) -> int:
        return self.chunk_granules // self.raw_page_granules

    @property
    def total_granules(self) -> int:
        return self.n_chunks * self.chunk_granules

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        n_layers: int,
        raw_page_granules: int,
        pages_per_chunk: int = 16,
        **kw,
    ) -> PoolGeometry:
        """The geometry whose pool fits in `budget_bytes`."""
        chunk = raw_page_granules * pages_per_chunk
        n = budget_bytes // (chunk * 256)
        return cls(n_layers, int(n), chunk, raw_page_granules, **kw)


@dataclass
class _Extent:
    offset: int  # granule offset in the pool
    size: int  # granules
    raw: bool  # in a raw slot (still being written) or a compressed extent


@dataclass
class _Arena:
    private_free: list[int] = field(default_factory=list)  # wholly free chunks kept by this layer
    raw_free: dict[int, set[int]] = field(default_factory=dict)  # raw chunk -> free slot indices
    zip_live: dict[int, int] = field(default_factory=dict)  # zip chunk -> live granules
    zip_pages: dict[int, set[int]] = field(default_factory=dict)  # zip chunk -> page ids in it
    bump: tuple[int, int] | None = None  # (zip chunk, next free granule inside it)
    pages: dict[int, _Extent] = field(default_factory=dict)


class ZipMemory:
    """Arenas + shared pool + page table for every layer. All sizes in granules."""

    def __init__(self, geometry: PoolGeometry):
        self.g = geometry
        self.shared: deque[int] = deque(
            range(geometry.n_layers * geometry.private_chunks, geometry.n_chunks)
        )
        self.arenas = [_Arena() for _ in range(geometry.n_layers)]
        for layer, a in enumerate(self.arenas):
            p = geometry.private_chunks
            a.private_free = list(range(layer * p, (layer + 1) * p))
        self._draining: list[tuple[int, int]] = []  # (layer, chunk) freed while a step may read it

    # -- chunks ---------------------------------------------------------------------------
    def _take_chunk(self, layer: int) -> int:
        a = self.arenas[layer]
        if a.private_free:
            return a.private_free.pop()
        if self.shared:
            return self.shared.popleft()
        raise OutOfPages(f"layer {layer}: the KV pool ({self.g.n_chunks} chunks) is full")

    def _chunk_freed(self, layer: int, chunk: int) -> None:
        # Not reusable yet: kernels of the step in flight may still read it.
        self._draining.append((layer, chunk))

    def end_read_epoch(self) -> None:
        """No step in flight reads the pool any more: freed chunks become reusable."""
        for layer, chunk in self._draining:
            a = self.arenas[layer]
            if len(a.private_free) < self.g.private_chunks:
                a.private_free.append(chunk)
            else:
                self.shared.append(chunk)
        self._draining.clear()

    # -- pages ----------------------------------------------------------------------------
    def alloc_raw(self, layer: int, page_id: int) -> int:
        """A new page at raw size (it must accept writes). Returns its granule offset."""
        a = self.arenas[layer]
        if page_id in a.pages:
            raise ValueError(f"layer {layer}: page {page_id} is already allocated")
        chunk = next((c for c, free in a.raw_free.items() if free), None)
        if chunk is None:
            chunk = self._take_chunk(layer)
            a.raw_free[chunk] = set(range(self.g.slots_per_chunk))
        slot = min(a.raw_free[chunk])
        a.raw_free[chunk].discard(slot)
        off = chunk * self.g.chunk_granules + slot * self.g.raw_page_granules
        a.pages[page_id] = _Extent(off, self.g.raw_page_granules, True)
        return off

    def _alloc_zip(self, layer: int, size: int) -> tuple[int, int]:
        a = self.arenas[layer]
        if size > self.g.chunk_granules:
            raise ValueError(f"a compressed page of {size} granules exceeds a chunk")
        if a.bump is None or a.bump[1] + size > self.g.chunk_granules:
            chunk = self._take_chunk(layer)
            a.zip_live[chunk] = 0
            a.zip_pages[chunk] = set()
            a.bump = (chunk, 0)
        chunk, nxt = a.bump
        a.bump = (chunk, nxt + size)
        a.zip_live[chunk] += size
        return chunk, chunk * self.g.chunk_granules + nxt

    def place_compressed(self, layer: int, page_id: int, size: int) -> int:
        """Move a full page from its raw slot to a compressed extent of `size` granules."""
        a = self.arenas[layer]
        ext = a.pages.get(page_id)
        if ext is None or not ext.raw:
            raise ValueError(f"layer {layer}: page {page_id} is not a raw page")
        if not 0 < size <= self.g.raw_page_granules:
            raise ValueError(f"compressed size {size} outside (0, {self.g.raw_page_granules}]")
        chunk, off = self._alloc_zip(layer, size)
        a.zip_pages[chunk].add(page_id)
        self._free_extent(layer, ext)
        a.pages[page_id] = _Extent(off, size, False)
        return off

    def alloc_compressed(self, layer: int, page_id: int, size: int) -> int:
        """A page that is already full when written (prefill) is compressed before it is
        stored: it never needs a raw slot. Returns its granule offset."""
        a = self.arenas[layer]
        if page_id in a.pages:
            raise ValueError(f"layer {layer}: page {page_id} is already allocated")
        if not 0 < size <= self.g.raw_page_granules:
            raise ValueError(f"compressed size {size} outside (0, {self.g.raw_page_granules}]")
        chunk, off = self._alloc_zip(layer, size)
        a.zip_pages[chunk].add(page_id)
        a.pages[page_id] = _Extent(off, size, False)
        return off

    def _free_extent(self, layer: int, ext: _Extent) -> None:
        a = self.arenas[layer]
        chunk = ext.offset // self.g.chunk_granules
        if ext.raw:
            slot = (ext.offset - chunk * self.g.chunk_granules) // self.g.raw_page_granules
            a.raw_free[chunk].add(slot)
            if len(a.raw_free[chunk]) == self.g.slots_per_chunk:
                del a.raw_free[chunk]
                self._chunk_freed(layer, chunk)
        else:
            a.zip_live[chunk] -= ext.size
            if a.zip_live[chunk] == 0 and (a.bump is None or a.bump[0] != chunk):
                del a.zip_live[chunk]
                del a.zip_pages[chunk]
                self._chunk_freed(layer, chunk)

    def free_page(self, layer: int, page_id: int) -> None:
        a = self.arenas[layer]
        ext = a.pages.pop(page_id, None)
        if ext is None:
            raise ValueError(f"layer {layer}: page {page_id} is not allocated")
        if not ext.raw:
            a.zip_pages[ext.offset // self.g.chunk_granules].discard(page_id)
        self._free_extent(layer, ext)

    def location(self, layer: int, page_id: int) -> tuple[int, int, bool]:
        """(granule offset, granules, raw?) of a page: the page table."""
        e = self.arenas[layer].pages[page_id]
        return e.offset, e.size, e.raw

    def compact(
        self, layer: int, max_live_fraction: float = 0.5
    ) -> list[tuple[int, int, int, int]]:
        """Move the pages out of zip chunks that are at most `max_live_fraction` full, so those
        chunks free up. Returns moves (page_id, src offset, dst offset, granules) for the owner to
        copy on the device (pages may move; ids stay)."""
        a = self.arenas[layer]
        cur = a.bump[0] if a.bump else None
        sparse = [
            c
            for c, live in a.zip_live.items()
            if c != cur and live <= max_live_fraction * self.g.chunk_granules
        ]
        moves = []
        for c in sparse:
            for pid in sorted(a.zip_pages[c]):
                ext = a.pages[pid]
                dchunk, dst = self._alloc_zip(layer, ext.size)
                a.zip_pages[dchunk].add(pid)
                a.zip_pages[c].discard(pid)
                self._free_extent(layer, ext)
                a.pages[pid] = _Extent(dst, ext.size, False)
                moves.append((pid, ext.offset, dst, ext.size))
        return moves

    # -- admission ------------------------------------------------------------------------
    def _local_raw_capacity(self, layer: int) -> int:
        a = self.arenas[layer]
        return (
            sum(len(s) for s in a.raw_free.values()) + len(a.private_free) * self.g.slots_per_chunk
        )

    def pages_fit_every_layer(self) -> int:
        """How many new raw pages every layer can take at once, keeping each layer's
        compression reserve in the shared pool."""
        spc = self.g.slots_per_chunk
        local = [self._local_raw_capacity(i) for i in range(self.g.n_layers)]
        pool = len(self.shared) - self.g.n_layers * self.g.compress_reserve_chunks
        pool = max(0, pool)  # a missing reserve leaves only what the arenas hold

        def fits(n: int) -> bool:
            need = sum(-(-max(0, n - loc) // spc) for loc in local)
            return need <= pool

        lo, hi = 0, min(local) + pool * spc + 1
        while lo + 1 < hi:  # invariant: fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    # -- accounting -----------------------------------------------------------------------
    def used_granules(self, layer: int | None = None) -> int:
        layers = range(self.g.n_layers) if layer is None else [layer]
        return sum(e.size for i in layers for e in self.arenas[i].pages.values())

    def chunks_held(self, layer: int) -> int:
        a = self.arenas[layer]
        return len(a.raw_free) + len(a.zip_live) + len(a.private_free)

    def check(self) -> None:
        """Invariants: every chunk is in exactly one place; extents don't overlap."""
        seen: dict[int, str] = {}

        def own(c, where):
            assert c not in seen, f"chunk {c} in {where} and {seen[c]}"
            seen[c] = where

        for c in self.shared:
            own(c, "shared")
        for layer, c in self._draining:
            own(c, f"draining[{layer}]")
        for i, a in enumerate(self.arenas):
            for c in a.private_free:
                own(c, f"private[{i}]")
            for c in a.raw_free:
                own(c, f"raw[{i}]")
            for c in a.zip_live:
                own(c, f"zip[{i}]")
            spans = sorted((e.offset, e.offset + e.size) for e in a.pages.values())
            for (s0, e0), (s1, _) in zip(spans, spans[1:], strict=False):
                assert e0 <= s1, f"layer {i}: overlapping extents at {s0}..{e0} and {s1}"
            for c, live in a.zip_live.items():
                real = sum(a.pages[p].size for p in a.zip_pages[c])
                assert live == real, f"layer {i} chunk {c}: live {live} != {real}"
        assert len(seen) == self.g.n_chunks, f"{self.g.n_chunks - len(seen)} chunks lost"
