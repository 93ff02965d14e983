"""ZipFusion's memory manager: plain-Python bookkeeping, tested without MLX in microseconds."""

from __future__ import annotations

import math
import random

import pytest

from app.engine.kvcache.zipfusion.memory import OutOfPages, PoolGeometry, ZipMemory


def _geo(**kw) -> PoolGeometry:
    base = dict(
        n_layers=2,
        n_chunks=10,
        chunk_granules=40,
        raw_page_granules=4,
        private_chunks=1,
        compress_reserve_chunks=0,
    )
    base.update(kw)
    return PoolGeometry(**base)


def test_geometry_checks_itself():
    with pytest.raises(ValueError, match="hold at least one raw page"):
        _geo(chunk_granules=3)
    with pytest.raises(ValueError, match="private chunks"):
        _geo(n_chunks=1)
    g = PoolGeometry.for_budget(10 * 16 * 4 * 256, n_layers=2, raw_page_granules=4)
    assert g.n_chunks == 10 and g.slots_per_chunk == 16


def test_raw_then_compressed_moves_and_frees_the_raw_slot():
    m = ZipMemory(_geo())
    off = m.alloc_raw(0, 7)
    assert m.location(0, 7) == (off, 4, True)
    new = m.place_compressed(0, 7, 3)
    assert new != off and m.location(0, 7) == (new, 3, False)
    assert m.used_granules(0) == 3
    with pytest.raises(ValueError, match="not a raw page"):
        m.place_compressed(0, 7, 3)
    with pytest.raises(ValueError, match="already allocated"):
        m.alloc_raw(0, 7)
    m.check()


def test_free_chunk_returns_to_pool_only_after_read_epoch():
    m = ZipMemory(_geo(n_chunks=4, private_chunks=1))
    # fill layer 0's private chunk and one shared chunk with raw pages
    pids = list(range(12))
    for p in pids:
        m.alloc_raw(0, p)
    assert len(m.shared) == 1  # 4 chunks - 2 private - 1 taken
    for p in pids[10:]:
        m.free_page(0, p)  # second chunk (slots 10, 11) wholly free: draining, not reusable yet
    assert len(m.shared) == 1 and m._draining and not m.arenas[0].private_free
    m.end_read_epoch()
    assert len(m.arenas[0].private_free) == 1  # the arena keeps one free chunk (its private part)
    for p in pids[:10]:
        m.free_page(0, p)
    m.end_read_epoch()
    assert len(m.shared) == 2  # the arena already keeps one: this one returns to the shared pool
    m.check()


def test_paper_shared_pool_example():
    """The paper's picture: layer 0 compresses well, layer 1 hardly; with private arenas only the
    tighter layer decides, with a shared pool layer 0's free chunks become layer 1's new pages."""

    def build(private):
        # raw page = 4 units, chunk = 12 units (3 raw pages), 16 chunks = 96 units per layer
        g = PoolGeometry(
            n_layers=2,
            n_chunks=16,
            chunk_granules=12,
            raw_page_granules=4,
            private_chunks=private,
            compress_reserve_chunks=0,
        )
        m = ZipMemory(g)
        for p in range(20):  # 20 old pages: 1 unit each in layer 0, 3 units each in layer 1
            m.alloc_raw(0, p), m.alloc_raw(1, p)
            m.place_compressed(0, p, 1)
            m.place_compressed(1, p, 3)
            m.end_read_epoch()
        return m

    m = build(private=8)  # each layer keeps its 8 chunks: layer 0 has 6 free, layer 1 only 3
    assert m.pages_fit_every_layer() == 9  # min(6, 3) chunks x 3 pages
    m2 = build(private=0)  # free chunks go back to the shared pool: 9 free chunks for both
    assert m2.pages_fit_every_layer() == 12  # 4 + 4 chunks of 3 pages <= 9 < 5 + 5
    for p in range(100, 112):  # and they really fit
        m2.alloc_raw(0, p), m2.alloc_raw(1, p)
    assert len(m2.shared) == 1
    m2.alloc_raw(0, 200)  # takes the last shared chunk
    with pytest.raises(OutOfPages, match="full"):
        m2.alloc_raw(1, 200)
    m2.check()


def test_pages_fit_keeps_the_compression_reserve():
    g = _geo(n_chunks=10, private_chunks=1, compress_reserve_chunks=2)
    m = ZipMemory(g)
    # local 10 slots per layer; shared pool 8 chunks - 2 layers x 2 reserve = 4 chunks
    assert m.pages_fit_every_layer() == 10 + (4 // 2) * 10


def test_compaction_frees_sparse_chunks_and_keeps_ids():
    m = ZipMemory(_geo(n_chunks=12, chunk_granules=12, raw_page_granules=4, private_chunks=0))
    for p in range(12):
        m.alloc_compressed(0, p, 3)  # 4 pages per 12-granule chunk
    for p in range(12):
        if p % 4:
            m.free_page(0, p)  # leave one live page per zip chunk
    m.end_read_epoch()
    held, shared = m.chunks_held(0), len(m.shared)
    moves = m.compact(0, max_live_fraction=0.5)
    assert {mv[0] for mv in moves} <= {0, 4, 8} and moves
    for pid, src, dst, n in moves:
        assert m.location(0, pid) == (dst, n, False) and src != dst
    m.end_read_epoch()
    assert m.chunks_held(0) < held and len(m.shared) > shared
    m.check()


def test_admission_by_pages_fit_never_runs_out_mid_sequence():
    """Simulate the scheduler: admit by pages_fit >= growth reserve + need (raw size), grow one
    token per step, compress full pages to a random size, retire finished sequences."""
    rnd = random.Random(0)
    layers, raw = 3, 8
    g = PoolGeometry(
        n_layers=layers,
        n_chunks=60,
        chunk_granules=raw * 4,
        raw_page_granules=raw,
        private_chunks=1,
        compress_reserve_chunks=1,
    )
    m = ZipMemory(g)
    next_pid = 0
    running = []  # dicts: need (pages), tokens, remaining, pages
    admitted = 0
    for step in range(3000):
        m.end_read_epoch()
        reserve = sum(s["need"] - len(s["pages"]) for s in running)
        while True:
            total = rnd.randint(20, 200)
            need = math.ceil(total / 16)
            if m.pages_fit_every_layer() < reserve + need:
                break
            running.append({"need": need, "tokens": 0, "remaining": total, "pages": []})
            reserve += need
            admitted += 1
        for s in running:
            if s["tokens"] % 16 == 0:
                pid = next_pid
                next_pid += 1
                for layer in range(layers):
                    m.alloc_raw(layer, pid)  # must not raise: admission reserved it
                s["pages"].append(pid)
            s["tokens"] += 1
            s["remaining"] -= 1
            if s["tokens"] % 16 == 0:
                for layer in range(layers):
                    m.place_compressed(layer, s["pages"][-1], rnd.choice([6, 7, 8]))
        for s in [s for s in running if s["remaining"] == 0]:
            for pid in s["pages"]:
                for layer in range(layers):
                    m.free_page(layer, pid)
            running.remove(s)
        if step % 200 == 0:
            for layer in range(layers):
                m.compact(layer)
            m.check()
    assert admitted > 20 and max(len(running), 1) > 0
    m.check()
