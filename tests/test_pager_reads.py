"""The pager's read paths on expert records alone (no model): parallel reads into slots or
through staging land the exact record bytes, a record is CRC-checked on its first read, and
the per-token breakdown adds up."""

import os
import threading

import mlx.core as mx
import numpy as np
import pytest

from app.engine.offload.pager import ExpertPager, PagerOptions
from app.engine.offload.records import ExpertRecordError, ExpertStore
from app.engine.offload.trace import model_traces
from app.engine.testing.synth import write_random_experts

PROJS = {"fc1": (64, 128), "fc2": (128, 64)}
LAYERS, EXPERTS, K = 3, 32, 4


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("records")
    section = write_random_experts(folder, LAYERS, EXPERTS, PROJS, seed=2)
    return folder, section


def _store(records):
    folder, section = records
    return ExpertStore(folder, section)


def _raw(a):
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a


def _run(pager, steps, traces):
    """Route every layer's trace rows; returns each call's gathered slot tensors (host)."""
    out = []
    for t in range(steps):
        for layer in pager.store.layers:
            idx = mx.array(traces[layer][t][None].astype(np.uint32))
            r = pager.route(layer, idx)
            arrays = pager.arrays(layer)
            got = {k: np.array(_raw(a[r.slot_idx])) for k, a in arrays.items()}
            pager.track(mx.zeros(1))
            out.append(got)
    return out


def _check_table(pager):
    """The pager's expert -> slot tables say exactly what its LRUs hold."""
    for layer, table in pager._table.items():
        lru = pager.pool_of[layer].lru
        lru.check()
        want = np.full(len(table), -1)
        for (x, e), slot in lru.slot_of.items():
            if x == layer:
                want[e] = slot
        assert np.array_equal(table, want), layer


@pytest.mark.parametrize(
    "threads,zero_copy,inline",
    [(1, True, True), (4, True, True), (4, True, False), (1, False, True), (4, False, False)],
)
def test_paged_slots_hold_exactly_the_resident_bytes(
    records, threads, zero_copy, inline, monkeypatch
):
    """inline: a call's few small reads on the calling thread; else on the reader threads."""
    import app.engine.offload.pager as pager_mod

    monkeypatch.setattr(pager_mod, "INLINE_BYTES", 1 << 20 if inline else 0)
    store = _store(records)
    traces = model_traces(store.layers, EXPERTS, K, 30, seed=1)
    full = ExpertPager(store, store.expert_bytes())
    ref = _run(full, 30, traces)
    paged = ExpertPager(
        store, store.expert_bytes() // 5, PagerOptions(read_threads=threads, zero_copy=zero_copy)
    )
    got = _run(paged, 30, traces)
    s = paged.stats()
    assert s["misses"] > 0 and s["evictions"] > 0  # the pool really turned over
    for a, b in zip(ref, got, strict=True):
        for k in a:
            assert np.array_equal(a[k], b[k]), k
    _check_table(paged)


def test_a_failed_read_on_the_reader_threads_frees_every_slot_of_the_call(tmp_path, monkeypatch):
    """One corrupt record among a call's parallel reads: the call fails after every read
    ended, and none of its experts stays resident (tables and LRU agree)."""
    import app.engine.offload.pager as pager_mod

    monkeypatch.setattr(pager_mod, "INLINE_BYTES", 0)
    section = write_random_experts(tmp_path, 2, 16, PROJS, seed=5)
    store = ExpertStore(tmp_path, section)
    _corrupt(store, 1, 6)
    pager = ExpertPager(store, store.expert_bytes() // 2, PagerOptions(read_threads=4))
    pager.route(0, mx.array([[0, 1, 2, 3]], dtype=mx.uint32))
    with pytest.raises(ExpertRecordError, match="layer 1, expert 6"):
        pager.route(1, mx.array([[2, 4, 6, 8, 10]], dtype=mx.uint32))
    assert not [k for k in pager.pool_of[1].lru.slot_of if k[0] == 1]
    assert sorted(e for x, e in pager.pool_of[0].lru.slot_of if x == 0) == [0, 1, 2, 3]
    _check_table(pager)
    r = pager.route(1, mx.array([[2, 4]], dtype=mx.uint32))  # the good records read again
    assert pager.layer_stats[1].reads == 2 and r.slots.size == 2
    _check_table(pager)
    pager.close()


def _corrupt(store, layer, expert):
    lay = store.layout(layer)
    path = store.folder / lay.file
    with open(path, "r+b") as f:
        f.seek(lay.record_offset(expert) + 10)
        b = f.read(1)
        f.seek(lay.record_offset(expert) + 10)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("every", [False, True])
def test_a_record_is_checked_on_its_first_read(tmp_path, every):
    section = write_random_experts(tmp_path, 1, 8, PROJS, seed=3)
    store = ExpertStore(tmp_path, section)
    one = store.layout(0).expert_bytes
    pager = ExpertPager(store, one, PagerOptions(verify_every_read=every, read_threads=1))

    def use(e):
        pager.route(0, mx.array([[e]], dtype=mx.uint32))
        pager.track(mx.zeros(1))

    use(3)  # read and checked
    use(4)  # evicts 3
    _corrupt(store, 0, 3)
    if every:
        with pytest.raises(ExpertRecordError, match="expert 3"):
            use(3)
    else:
        use(3)  # verified once already: read again without the CRC
    _corrupt(store, 0, 5)
    with pytest.raises(ExpertRecordError, match="expert 5"):
        use(5)  # a record's first read is always checked
    pager.close()
    os.sync()


def test_per_token_breakdown_adds_up(records):
    store = _store(records)
    traces = model_traces(store.layers, EXPERTS, K, 12, seed=4)
    pager = ExpertPager(store, store.expert_bytes() // 4)
    _run(pager, 12, traces)
    s = pager.stats()
    assert s["tokens"] == 11  # forward passes between the first layer's calls
    ms = s["ms_per_token"]
    parts = ms["reads"] + ms["readbacks"] + ms["pager_host"] + ms["rest"]
    assert parts == pytest.approx(ms["total"])
    assert ms["reads"] > 0 and ms["pager_host"] > 0 and s["read_MBps"] > 0
    pager.reset_stats()
    assert pager.stats()["tokens"] == 0 and pager.stats()["ms_per_token"] is None


def test_bench_reports_paging_figures(tmp_path):
    from app.engine.bench import bench_generate
    from app.engine.generate import Engine
    from app.engine.testing.random_models import TINY_CONFIGS
    from app.engine.testing.synth import write_random_converted

    man = write_random_converted(TINY_CONFIGS["qwen3_moe"], tmp_path / "m", seed=1, dtype="float32")
    eng = Engine()
    eng.load(tmp_path / "m", {"expert_budget": man.roles["routed"]["bytes"] // 3})
    res = bench_generate(eng, prompt_tokens=8, gen_tokens=6, trials=1)
    p = res["pager"]
    assert 0 <= p["hit_rate"] < 1 and p["MB_read_per_token"] > 0
    assert set(p["ms_per_token"]) == {"reads", "readbacks", "pager_host", "rest", "total"}
    assert p["host_ms_per_token"]["readback"] > 0 and p["host_ms_per_token"]["graph"] > 0
    from app.cli import bench_text

    text = bench_text({"model": "m", "machine": {"device": "d", "backend": "cpu"}, **res})
    assert f"{p['hit_rate']:.1%}" in text and "paging ms/token: reads" in text
    assert p["read_path"] == "zero_copy" and "into slots" in text  # the CPU's path, named


def test_memory_panel_reads_every_paging_figure_from_the_pager(records):
    """The worker streams pager.stats(); the panel's interval figures come from its totals."""
    from app.ui.memory import _TIMES, _ms_parts, _pager_totals

    store = _store(records)
    pager = ExpertPager(store, store.expert_bytes() // 4)
    _run(pager, 12, model_traces(store.layers, EXPERTS, K, 12, seed=4))
    s = pager.stats()
    assert all(k in s for k in _TIMES)
    now = _pager_totals({"pager": s})
    parts = _ms_parts(now, dict.fromkeys(now, 0.0))
    ms = s["ms_per_token"]
    assert parts["ms_rest"] == pytest.approx(ms["rest"]) and ms["rest"] > 0
    assert parts["ms_reads"] == pytest.approx(ms["reads"])
    assert parts["ms_pager"] == pytest.approx(ms["pager_host"])
    pager.close()


class _HostCopier:
    """The device copier's interface with memmove: on the CPU an MLX array's memory is host
    memory, so this checks the pager's staging rows and slot addresses. Queued copies run
    only at sync(), as a stream would run them later: staging reused before the pager waits
    for its copies would land the wrong bytes."""

    def __init__(self):
        self.registered, self.copies, self.syncs = 0, 0, 0
        self.queued = []
        self.lock = threading.Lock()

    def register(self, host):
        self.registered += 1

    def bind(self):
        pass

    def unregister(self, host):
        pass

    def copy_async(self, dst, src, nbytes):
        with self.lock:
            self.queued.append((dst, src, nbytes))

    def sync(self):
        import ctypes

        with self.lock:
            for dst, src, nbytes in self.queued:
                ctypes.memmove(dst, src, nbytes)
            self.copies += len(self.queued)
            self.queued.clear()
            self.syncs += 1

    def map_file(self, path, size):
        """A read-only mapping, as the driver pins it (host memory here: nothing to pin)."""
        import mmap

        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.maps.append(mm)
        return np.frombuffer(mm, dtype=np.uint8).ctypes.data, mm

    def unmap_all(self):
        for mm in self.maps:
            mm.close()
        self.maps.clear()

    def close(self):
        self.unmap_all()


def _pinned(store, budget, **kw):
    """A pager on the pinned-file path: the host copier maps the record files."""
    paged = ExpertPager(store, budget, PagerOptions(zero_copy=False, device_copy=False, **kw))
    paged._copier = copier = _HostCopier()
    copier.maps = []
    paged._maps = paged._map_records(force=True)
    assert paged.read_path == "pinned"
    return paged, copier


def test_pinned_record_files_land_the_exact_record_bytes(records):
    """Misses copied from the mapped record files (no staging, no reader threads) give the
    resident bytes at every step, one copy a tensor, one wait a call with misses."""
    store = _store(records)
    traces = model_traces(store.layers, EXPERTS, K, 30, seed=6)
    ref = _run(ExpertPager(store, store.expert_bytes()), 30, traces)
    paged, copier = _pinned(store, store.expert_bytes() // 5)
    got = _run(paged, 30, traces)
    s = paged.stats()
    assert s["read_path"] == "pinned" and s["reads"] > 0
    assert copier.registered == 0 and copier.copies == s["reads"] * 6
    assert not copier.queued and 0 < copier.syncs <= s["reads"]
    for a, b in zip(ref, got, strict=True):
        for k in a:
            assert np.array_equal(a[k], b[k]), k
    _check_table(paged)
    paged.close()
    assert not copier.maps


def test_pinned_record_files_check_a_record_on_its_first_read(tmp_path):
    """The CRC runs over the mapped bytes: a corrupt record fails its call, names itself, and
    frees the call's slots; a cold benchmark's pager (drop_page_cache) reads through staging."""
    section = write_random_experts(tmp_path, 2, 16, PROJS, seed=7)
    store = ExpertStore(tmp_path, section)
    _corrupt(store, 1, 6)
    paged, _ = _pinned(store, store.expert_bytes() // 2)
    paged.route(0, mx.array([[0, 1, 2, 3]], dtype=mx.uint32))
    with pytest.raises(ExpertRecordError, match="layer 1, expert 6"):
        paged.route(1, mx.array([[2, 4, 6, 8]], dtype=mx.uint32))
    assert not [k for k in paged.pool_of[1].lru.slot_of if k[0] == 1]
    _check_table(paged)
    r = paged.route(1, mx.array([[2, 4]], dtype=mx.uint32))
    assert r.slots.size == 2
    from dataclasses import replace

    paged.options = replace(paged.options, drop_page_cache=True)
    assert paged.read_path == "device_copy"
    paged.close()


def test_pinning_needs_the_files_to_fit_in_half_the_free_memory(records, monkeypatch):
    """By default the files are pinned only where they take at most half the available
    memory (page-locked pages cannot be reclaimed); too large, the staging path stays."""
    import psutil

    store = _store(records)
    files = sum(store.layout(x).file_size for x in store.layers)
    paged = ExpertPager(store, store.expert_bytes() // 5, PagerOptions(zero_copy=False))
    paged._copier = copier = _HostCopier()
    copier.maps = []

    class Free:
        def __init__(self, n):
            self.available = n

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Free(2 * files - 1))
    assert paged._map_records() is None and not copier.maps
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Free(2 * files))
    maps = paged._map_records()
    assert sorted(maps) == sorted(store.layers) and len(copier.maps) == len(store.layers)
    paged._maps = maps
    assert paged.read_path == "pinned"
    paged.close()
    assert not copier.maps


def test_pinning_is_off_when_asked(records):
    store = _store(records)
    paged = ExpertPager(
        store, store.expert_bytes() // 5, PagerOptions(zero_copy=False, pin_records=False)
    )
    paged._copier = _HostCopier()
    paged._copier.maps = []
    assert paged._map_records(force=True) is None
    paged.close()


def test_device_copies_land_the_exact_record_bytes(records):
    store = _store(records)
    traces = model_traces(store.layers, EXPERTS, K, 30, seed=5)
    ref = _run(ExpertPager(store, store.expert_bytes()), 30, traces)
    paged = ExpertPager(
        store,
        store.expert_bytes() // 5,
        PagerOptions(zero_copy=False, device_copy=False, read_threads=2),
    )
    paged._copier = copier = _HostCopier()
    got = _run(paged, 30, traces)
    assert copier.registered == 1 and copier.copies == paged.stats()["reads"] * 6
    assert not copier.queued and 0 < copier.syncs <= paged.stats()["reads"]
    for a, b in zip(ref, got, strict=True):
        for k in a:
            assert np.array_equal(a[k], b[k]), k


def test_no_device_copier_without_cuda():
    from app.engine.offload.cuda_copy import DeviceCopier

    if mx.cuda.is_available():
        pytest.skip("this checks the fallback on a machine without CUDA")
    assert DeviceCopier.open() is None


def test_bench_names_the_device_route(tmp_path, monkeypatch):
    """`rotaryquant bench` on a model paged through the device route: the route is named and
    its figures come from the step's counters (the reference backend here; on CUDA the kernel,
    whose copies run inside the step, gets its own line instead of the read timers)."""
    from app.cli import bench_text
    from app.engine.bench import bench_generate
    from app.engine.generate import Engine
    from app.engine.offload.pager import DEVICE_ROUTE_ENV
    from app.engine.testing.random_models import TINY_CONFIGS
    from app.engine.testing.synth import write_random_converted

    monkeypatch.setenv(DEVICE_ROUTE_ENV, "reference")
    man = write_random_converted(TINY_CONFIGS["qwen3_moe"], tmp_path / "m", seed=1, dtype="float32")
    eng = Engine()
    eng.load(tmp_path / "m", {"expert_budget": man.roles["routed"]["bytes"] // 3})
    res = bench_generate(eng, prompt_tokens=8, gen_tokens=6, trials=1)
    p = res["pager"]
    assert p["read_path"] == "device_route_reference" and p["MB_read_per_token"] > 0
    head = {"model": "m", "machine": {"device": "d", "backend": "cpu"}}
    text = bench_text({**head, **res})
    assert "device step" in text and "paging ms/token: reads" in text
    gpu = {**res, "pager": {**p, "read_path": "device_route"}}
    text = bench_text({**head, **gpu})
    assert "by the GPU" in text and "no read-backs" in text and "paging ms/token" not in text
