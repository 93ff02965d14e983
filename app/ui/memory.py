"""The live memory panel: the worker's stats as curves, at a throttled rate.

`MemoryHistory` (plain Python + numpy) keeps a ring of samples derived from `M.Stats`; the
panel's curves are created once and fed with `setData` from a QTimer (REDRAW_MS) only when a
new sample came in, never per token.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from ..engine import messages as M
from ..units import size

WINDOW_S = 120  # the plots show the last two minutes
REDRAW_MS = 250  # plots redraw at most 4 times a second; stats arrive at ~2 Hz
CAPACITY = 1200  # samples kept: 10 min at 2 Hz
GB = float(1 << 30)
MB = float(1 << 20)
NAN = float("nan")


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "—"
    return size(n, 2)


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the history started
    rss: float  # engine process resident bytes
    mlx_active: float
    weights: float  # always-resident weights
    experts: float  # routed experts resident (NaN: no pager)
    kv: float
    tps: float  # decode tok/s (NaN while not generating)
    hit_rate: float  # expert-cache hits over the last interval, 0..1 (NaN: no lookups)
    ssd_mbs: float  # expert bytes read per second over the last interval, MB/s
    kv_saved: float  # bytes the KV mode saves against fp16 (0 in fp16)
    # the pager's ms per token over the last interval by part (NaN: no tokens in it)
    ms_reads: float = NAN
    ms_readbacks: float = NAN
    ms_pager: float = NAN
    ms_rest: float = NAN


def _pager_totals(extra: dict) -> dict | None:
    """The pager's totals from Stats.extra["pager"] (flat, or under "total")."""
    p = extra.get("pager")
    if not isinstance(p, dict):
        return None
    t = p.get("total") if isinstance(p.get("total"), dict) else p
    return {
        "hits": float(t.get("hits", 0) or 0),
        "misses": float(t.get("misses", 0) or 0),
        "bytes_read": float(t.get("bytes_read", 0) or 0),
        "resident_bytes": float(t.get("resident_bytes", t.get("resident", 0)) or 0),
        **{k: float(t.get(k, 0) or 0) for k in _TIMES},
    }


_TIMES = ("read_s", "readback_s", "host_s", "tokens", "token_s")


def _ms_parts(now: dict, prev: dict) -> dict:
    """ms per token by part between two pager totals (NaN without a token in between)."""
    d = {k: now[k] - prev[k] for k in _TIMES}
    if d["tokens"] <= 0:
        return {}
    ms = {"ms_reads": d["read_s"], "ms_readbacks": d["readback_s"], "ms_pager": d["host_s"]}
    ms = {k: 1000 * v / d["tokens"] for k, v in ms.items()}
    ms["ms_rest"] = max(0.0, 1000 * d["token_s"] / d["tokens"] - sum(ms.values()))
    return ms


def paging_text(x: Sample) -> str:
    """ms per token by part, e.g. "reads 12 · read-backs 3 · pager 1 · rest 40"."""
    if math.isnan(x.ms_reads):
        return "—"
    return (
        f"reads {x.ms_reads:.1f} · read-backs {x.ms_readbacks:.1f} · "
        f"pager {x.ms_pager:.1f} · rest {x.ms_rest:.1f}"
    )


class MemoryHistory:
    FIELDS = tuple(f for f in Sample.__dataclass_fields__ if f != "t")

    def __init__(self, capacity: int = CAPACITY, clock: Callable[[], float] = time.monotonic):
        self.samples: deque[Sample] = deque(maxlen=capacity)
        self.clock = clock
        self.t0 = clock()
        self.version = 0
        self.last_pager: tuple[float, dict] | None = None
        self.kv_mode = "fp16"
        self.context_tokens = 0  # tokens in the worker's last cache (prompt + generated)
        # fp16 KV bytes at a number of tokens, for the loaded model (from the planner's sizes)
        self.kv_fp16: Callable[[int], int] | None = None

    def add(self, s: M.Stats) -> Sample:
        now = self.clock() - self.t0
        pager = _pager_totals(s.extra)
        hit_rate = ssd = NAN
        experts = NAN
        parts: dict = {}
        if pager is not None:
            experts = pager["resident_bytes"]
            if self.last_pager is not None:
                t_prev, prev = self.last_pager
                dh = pager["hits"] - prev["hits"]
                dm = pager["misses"] - prev["misses"]
                dt = now - t_prev
                if dh + dm > 0:
                    hit_rate = dh / (dh + dm)
                if dt > 0:
                    ssd = max(0.0, pager["bytes_read"] - prev["bytes_read"]) / dt / 1e6
                parts = _ms_parts(pager, prev)
            self.last_pager = (now, pager)
        sample = Sample(
            t=now,
            rss=float(s.rss),
            mlx_active=float(s.mlx_active),
            weights=float(s.weight_bytes),
            experts=experts,
            kv=float(s.kv_bytes),
            tps=float(s.decode_tps) if s.generating else NAN,
            hit_rate=hit_rate,
            ssd_mbs=ssd,
            kv_saved=self.kv_saved(s),
            **parts,
        )
        self.samples.append(sample)
        self.version += 1
        return sample

    def kv_saved(self, s: M.Stats) -> float:
        kv = s.extra.get("kv") if isinstance(s.extra.get("kv"), dict) else None
        if kv and "float_bytes" in kv:  # the worker's count: a float cache at the real dtype
            return max(0.0, float(kv["float_bytes"]) - float(s.kv_bytes))
        if self.kv_mode == "fp16" or not s.kv_bytes:
            return 0.0
        if self.kv_fp16 is None or not self.context_tokens:
            return NAN
        return max(0.0, float(self.kv_fp16(self.context_tokens)) - float(s.kv_bytes))

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"t": np.fromiter((x.t for x in self.samples), float, len(self.samples))}
        for f in self.FIELDS:
            out[f] = np.fromiter((getattr(x, f) for x in self.samples), float, len(self.samples))
        return out

    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None


# (field, label, color, scale) of each curve, by plot
MEMORY_CURVES = (
    ("rss", "process", "#0a84ff", GB),
    ("mlx_active", "MLX active", "#5e5ce6", GB),
    ("weights", "weights", "#30d158", GB),
    ("experts", "experts", "#ff9f0a", GB),
    ("kv", "KV", "#ff375f", GB),
)


class MemoryPanel(QWidget):
    def __init__(self, history: MemoryHistory | None = None, parent=None):
        super().__init__(parent)
        self.history = history or MemoryHistory()
        self.drawn = -1
        self.expected_peak: int | None = None
        self.dark = False
        self._build()
        self.timer = QTimer(self)
        self.timer.setInterval(REDRAW_MS)
        self.timer.timeout.connect(self.redraw)
        self.timer.start()

    def _build(self) -> None:
        pg.setConfigOptions(antialias=True)
        self.metrics: dict[str, QLabel] = {}
        grid = QGridLayout()
        grid.setHorizontalSpacing(12)
        names = [
            ("rss", "Engine process"),
            ("weights", "Dense weights"),
            ("experts", "Experts resident"),
            ("kv", "KV cache"),
            ("tps", "Decode"),
            ("hit_rate", "Expert hit rate"),
            ("ssd_mbs", "SSD reads"),
            ("kv_saved", "KV saved"),
            ("peak", "Plan's expected peak"),
            ("paging_ms", "Paging ms per token"),
        ]
        for i, (key, label) in enumerate(names):
            title = QLabel(label)
            title.setObjectName("muted")
            value = QLabel("—")
            value.setObjectName("metric")
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.metrics[key] = value
            grid.addWidget(title, (i // 3) * 2, i % 3)
            grid.addWidget(value, (i // 3) * 2 + 1, i % 3)

        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setMinimumHeight(300)
        g = self.graphics
        self.mem_plot = g.addPlot(row=0, col=0, colspan=2, title="Memory (GiB)")
        self.curves: dict[str, pg.PlotDataItem] = {}
        for key, _label, color, _scale in MEMORY_CURVES:
            self.curves[key] = self.mem_plot.plot(
                [], [], pen=pg.mkPen(color, width=2), connect="finite"
            )
        self.legend = QLabel(
            "&nbsp;&nbsp;".join(
                f'<span style="color:{color};">■</span>&nbsp;{label}'
                for _k, label, color, _s in MEMORY_CURVES
            )
        )
        self.legend.setWordWrap(True)
        self.legend.setObjectName("legend")
        self.peak_line = pg.InfiniteLine(
            angle=0,
            movable=False,
            pen=pg.mkPen("#8e8e93", width=1, style=Qt.PenStyle.DashLine),
            label="expected peak",
            labelOpts={"position": 0.15, "color": "#8e8e93"},
        )
        self.peak_line.hide()
        self.mem_plot.addItem(self.peak_line)
        self.tps_plot = g.addPlot(row=1, col=0, colspan=2, title="Decode tok/s")
        self.curves["tps"] = self.tps_plot.plot(
            [], [], pen=pg.mkPen("#0a84ff", width=2), connect="finite"
        )
        self.hit_plot = g.addPlot(row=2, col=0, title="Expert hit rate (%)")
        self.curves["hit_rate"] = self.hit_plot.plot(
            [], [], pen=pg.mkPen("#30d158", width=2), connect="finite"
        )
        self.hit_plot.setYRange(0, 100)
        self.no_pager = [
            pg.TextItem("no expert paging", color="#8e8e93", anchor=(0.5, 0.5)) for _ in range(2)
        ]
        self.ssd_plot = g.addPlot(row=2, col=1, title="SSD MB/s")
        self.curves["ssd_mbs"] = self.ssd_plot.plot(
            [], [], pen=pg.mkPen("#ff9f0a", width=2), connect="finite"
        )
        self.kv_plot = g.addPlot(row=3, col=0, colspan=2, title="KV saved vs fp16 (MiB)")
        self.curves["kv_saved"] = self.kv_plot.plot(
            [], [], pen=pg.mkPen("#ff375f", width=2), connect="finite"
        )
        self.plots = (self.mem_plot, self.tps_plot, self.hit_plot, self.ssd_plot, self.kv_plot)
        for p in self.plots:
            p.showGrid(x=True, y=True, alpha=0.15)
            p.setMenuEnabled(False)
            p.setMouseEnabled(x=False, y=False)
            p.hideButtons()
            p.getAxis("bottom").setStyle(tickTextOffset=2)
            p.enableAutoRange(axis="y", enable=True)
            p.setXRange(-WINDOW_S, 0, padding=0.02)
            p.enableAutoRange(axis="x", enable=False)
        for p, text in zip((self.hit_plot, self.ssd_plot), self.no_pager, strict=True):
            p.addItem(text)
            text.setPos(-WINDOW_S / 2, 50 if p is self.hit_plot else 0.5)
        self.hit_plot.enableAutoRange(axis="y", enable=False)
        self.note = QLabel("")
        self.note.setObjectName("muted")
        self.note.setWordWrap(True)

        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        heading = QLabel("Live memory")
        heading.setObjectName("heading")
        lay.addWidget(heading)
        lay.addLayout(grid)
        lay.addWidget(self.legend)
        lay.addWidget(self.graphics, 1)
        lay.addWidget(self.note)

    # -- inputs ------------------------------------------------------------------------------
    def add_stats(self, s: M.Stats) -> None:
        self.history.add(s)

    def set_expected_peak(self, nbytes: int | None) -> None:
        self.expected_peak = nbytes
        if nbytes:
            self.peak_line.setValue(nbytes / GB)
            self.peak_line.show()
            self.metrics["peak"].setText(fmt_bytes(nbytes))
        else:
            self.peak_line.hide()
            self.metrics["peak"].setText("—")

    def engine_stopped(self) -> None:
        """The engine's figures are gone with it: blank until a new engine reports."""
        for key, label in self.metrics.items():
            if key != "peak":
                label.setText("—")
        self.drawn = self.history.version  # the next report redraws, the last one does not

    def set_note(self, text: str) -> None:
        self.note.setText(text)

    def apply_theme(self, dark: bool) -> None:
        self.dark = dark
        bg = "#1b1c1f" if dark else "#ffffff"
        fg = "#c8c8cc" if dark else "#3a3a3c"
        self.graphics.setBackground(bg)
        self.graphics.resetCachedContent()  # the cached background would keep the old color
        self.graphics.viewport().update()
        for p in self.plots:
            for name in ("left", "bottom"):
                ax = p.getAxis(name)
                ax.setPen(pg.mkPen(fg))
                ax.setTextPen(pg.mkPen(fg))
            p.setTitle(p.titleLabel.text, color=fg, size="9pt")

    # -- drawing -----------------------------------------------------------------------------
    def redraw(self) -> None:
        h = self.history
        if h.version == self.drawn:
            return
        self.drawn = h.version
        a = h.arrays()
        t = a["t"] - h.clock() + h.t0 if len(a["t"]) else a["t"]  # seconds ago (0 = now)
        for key, _label, _color, scale in MEMORY_CURVES:
            self.curves[key].setData(t, a[key] / scale)
        self.curves["tps"].setData(t, a["tps"])
        self.curves["hit_rate"].setData(t, a["hit_rate"] * 100.0)
        self.curves["ssd_mbs"].setData(t, a["ssd_mbs"])
        self.curves["kv_saved"].setData(t, a["kv_saved"] / MB)
        last = h.last()
        if last is None:
            return
        paged = not math.isnan(last.experts)
        for text in self.no_pager:
            text.setVisible(not paged)
        m = self.metrics
        m["rss"].setText(fmt_bytes(last.rss))
        m["weights"].setText(fmt_bytes(last.weights))
        m["experts"].setText("not paged" if math.isnan(last.experts) else fmt_bytes(last.experts))
        m["kv"].setText(fmt_bytes(last.kv))
        tps = a["tps"][~np.isnan(a["tps"])]
        m["tps"].setText(
            f"{last.tps:.1f} tok/s"
            if not math.isnan(last.tps)
            else (f"{tps[-1]:.1f} tok/s (last)" if len(tps) else "—")
        )
        m["hit_rate"].setText("—" if math.isnan(last.hit_rate) else f"{last.hit_rate:.0%}")
        m["ssd_mbs"].setText("—" if math.isnan(last.ssd_mbs) else f"{last.ssd_mbs:.1f} MB/s")
        m["kv_saved"].setText(fmt_bytes(last.kv_saved))
        m["paging_ms"].setText(paging_text(last))
