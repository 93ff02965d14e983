"""The live memory panel: samples derived from the worker's Stats (pager deltas, KV saved),
curves created once and fed only when a new sample came in, the plan's peak as a line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.engine import messages as M
from app.ui.memory import GB, MemoryHistory, MemoryPanel, paging_text

MiB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def stats(rss=500 * MiB, kv=8 * MiB, tps=20.0, generating=True, pager=None, extra=None) -> M.Stats:
    e = dict(extra or {})
    if pager is not None:
        e["pager"] = pager
    return M.Stats(0, 0.0, rss, 300 * MiB, 400 * MiB, 10 * MiB, 200 * MiB, kv, tps, generating, e)


def test_pager_hit_rate_and_ssd_rate_come_from_deltas():
    clock = Clock()
    h = MemoryHistory(clock=clock)
    s0 = h.add(stats(pager={"hits": 90, "misses": 10, "bytes_read": 0, "resident_bytes": 3 * GB}))
    assert math.isnan(s0.hit_rate) and math.isnan(s0.ssd_mbs) and s0.experts == 3 * GB
    clock.t += 2.0
    s1 = h.add(
        stats(
            pager={
                "total": {"hits": 120, "misses": 30, "bytes_read": 50e6, "resident_bytes": 3 * GB}
            }
        )
    )
    assert s1.hit_rate == pytest.approx(30 / 50) and s1.ssd_mbs == pytest.approx(25.0)
    assert s1.t == pytest.approx(2.0)
    clock.t += 1.0
    s2 = h.add(stats(pager=None, generating=False))  # a model without a pager
    assert math.isnan(s2.experts) and math.isnan(s2.tps)


def test_paging_ms_per_token_by_part_from_deltas():
    clock = Clock()
    h = MemoryHistory(clock=clock)
    base = {"hits": 0, "misses": 0, "bytes_read": 0, "resident_bytes": GB}
    s0 = h.add(
        stats(
            pager={
                **base,
                "read_s": 1.0,
                "readback_s": 0.5,
                "host_s": 0.1,
                "tokens": 10,
                "token_s": 3.0,
            }
        )
    )
    assert math.isnan(s0.ms_reads) and paging_text(s0) == "—"
    clock.t += 1.0
    # 4 tokens in 1.0 s: 0.2 s of reads, 0.04 s of read-backs, 0.02 s in the pager
    s1 = h.add(
        stats(
            pager={
                **base,
                "read_s": 1.2,
                "readback_s": 0.54,
                "host_s": 0.12,
                "tokens": 14,
                "token_s": 4.0,
            }
        )
    )
    assert (s1.ms_reads, s1.ms_readbacks, s1.ms_pager, s1.ms_rest) == pytest.approx(
        (50.0, 10.0, 5.0, 185.0)
    )
    assert paging_text(s1) == "reads 50.0 · read-backs 10.0 · pager 5.0 · rest 185.0"
    clock.t += 1.0
    s2 = h.add(
        stats(
            pager={
                **base,
                "read_s": 1.2,
                "readback_s": 0.54,
                "host_s": 0.12,
                "tokens": 14,
                "token_s": 4.0,
            }
        )
    )  # no token since: no figure
    assert math.isnan(s2.ms_reads)


def test_kv_saved_from_the_worker_or_from_the_sizes():
    h = MemoryHistory(clock=Clock())
    assert h.add(stats(kv=8 * MiB)).kv_saved == 0.0  # fp16: nothing saved
    h.kv_mode = "isoquant3"
    assert math.isnan(h.add(stats(kv=8 * MiB)).kv_saved)  # unknown until sizes are known
    h.kv_fp16 = lambda tokens: tokens * 100_000
    h.context_tokens = 400
    assert h.add(stats(kv=8 * MiB)).kv_saved == 400 * 100_000 - 8 * MiB
    s = h.add(stats(kv=8 * MiB, extra={"kv": {"float_bytes": 50 * MiB}}))  # the worker's count wins
    assert s.kv_saved == 42 * MiB


def test_history_is_a_bounded_ring():
    clock = Clock()
    h = MemoryHistory(capacity=5, clock=clock)
    for i in range(8):
        clock.t += 1
        h.add(stats(rss=i))
    a = h.arrays()
    assert list(a["rss"]) == [3, 4, 5, 6, 7] and len(a["t"]) == 5 and h.version == 8


def test_panel_feeds_the_same_curves_only_when_data_changed(qtbot, monkeypatch):
    clock = Clock()
    panel = MemoryPanel(MemoryHistory(clock=clock))
    qtbot.addWidget(panel)
    panel.timer.stop()  # drive redraws by hand
    curves = dict(panel.curves)
    items = {p: len(p.items) for p in panel.plots}
    calls = []
    for name, c in curves.items():
        orig = c.setData
        monkeypatch.setattr(
            c, "setData", lambda *a, _o=orig, _n=name, **k: (calls.append(_n), _o(*a, **k))
        )
    for i in range(3):
        clock.t += 0.5
        panel.add_stats(
            stats(
                rss=(i + 1) * GB // 4,
                pager={"hits": 10 * i, "misses": i, "bytes_read": i * 1e6, "resident_bytes": GB},
            )
        )
    panel.redraw()
    n = len(calls)
    assert n == len(curves)  # each curve fed once for three samples
    panel.redraw()
    assert len(calls) == n  # nothing new: nothing redrawn
    assert panel.curves == curves and {p: len(p.items) for p in panel.plots} == items
    x, y = panel.curves["rss"].getData()
    assert np.allclose(y, [0.25, 0.5, 0.75]) and x[-1] == pytest.approx(0.0)  # seconds ago
    _, hit = panel.curves["hit_rate"].getData()
    assert np.isnan(hit[0]) and hit[-1] == pytest.approx(100 * 10 / 11)
    assert (
        panel.metrics["rss"].text() == "0.75 GiB" and panel.metrics["experts"].text() == "1.00 GiB"
    )
    assert not panel.no_pager[0].isVisible()
    panel.set_expected_peak(3 * GB)
    assert panel.peak_line.isVisible() and panel.peak_line.value() == pytest.approx(3.0)
    assert panel.metrics["peak"].text() == "3.00 GiB"


def test_panel_says_when_there_is_no_pager(qtbot):
    panel = MemoryPanel(MemoryHistory(clock=Clock()))
    qtbot.addWidget(panel)
    panel.add_stats(stats(generating=False, kv=3 * MiB))
    panel.redraw()
    assert panel.metrics["experts"].text() == "not paged" and panel.metrics["tps"].text() == "—"
    assert panel.metrics["kv"].text() == "3.0 MiB"
    assert all(t.isVisible() for t in panel.no_pager)
