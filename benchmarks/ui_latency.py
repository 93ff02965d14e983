"""How long the window's event loop waits while tokens stream at full speed.

A 10 ms timer ticks in the window process while the real worker process generates with a tiny
random llama (hundreds of tok/s here, faster than any real model on a laptop); the gaps between
ticks are the latency a user feels when typing or scrolling during an answer. Timing depends on
the machine's load, so it is measured here, not asserted in the test suite.

    QT_QPA_PLATFORM=offscreen python benchmarks/ui_latency.py [--tokens 1500] [--trials 3]

Writes benchmarks/results/ui_latency.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("ROTARYQUANT_HOME", tempfile.mkdtemp(prefix="rq-bench-ui-"))

from PySide6.QtCore import QElapsedTimer, QSettings, Qt, QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402
from record import write_result  # noqa: E402

from app.downloads.library import Library  # noqa: E402
from app.ui.library_model import LibraryController  # noqa: E402
from app.ui.main import MainWindow  # noqa: E402


def wait_for(app: QApplication, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        app.processEvents()
        time.sleep(0.002)


def one_run(app: QApplication, win: MainWindow, tokens: int) -> dict:
    chat = win.chat
    chat.new_conversation()
    chat.set_settings({"max_tokens": tokens})
    gaps: list[float] = []
    clock = QElapsedTimer()
    clock.start()
    last = [0]

    def tick():
        now = clock.nsecsElapsed()
        gaps.append((now - last[0]) / 1e6)
        last[0] = now

    timer = QTimer()
    timer.setInterval(10)
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.timeout.connect(tick)
    pieces: list[str] = []
    done: list[str] = []
    chat.token_received.connect(pieces.append)
    chat.stream_finished.connect(done.append)
    try:
        assert chat.send("Go")
        wait_for(app, lambda: pieces or done, 60)
        last[0] = clock.nsecsElapsed()
        timer.start()
        t0 = time.perf_counter()
        wait_for(app, lambda: done, 300)
        seconds = time.perf_counter() - t0
    finally:
        timer.stop()
        chat.token_received.disconnect(pieces.append)
        chat.stream_finished.disconnect(done.append)
    gaps.sort()
    return {
        "pieces": len(pieces),
        "tok_per_s": len(pieces) / seconds,
        "max_gap_ms": gaps[-1],
        "p99_gap_ms": gaps[int(len(gaps) * 0.99)],
        "median_gap_ms": statistics.median(gaps),
    }


def main() -> None:
    from app.engine.testing.random_models import make_random_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    home = Path(os.environ["ROTARYQUANT_HOME"])
    model = home / "tiny-llama"
    if not (model / "model.safetensors").exists():
        make_random_model("llama", model, seed=0)
    app = QApplication.instance() or QApplication([])
    settings = QSettings(str(home / "settings.ini"), QSettings.Format.IniFormat)
    lib = LibraryController(Library(home / "models", home / "library.sqlite3"))
    win = MainWindow(str(model), settings=settings, library=lib, start=False)
    win.show()
    win.session.start()
    wait_for(app, lambda: win.session.state in ("ready", "crashed"), 120)
    assert win.session.state == "ready", win.session.message
    runs = [one_run(app, win, args.tokens) for _ in range(args.trials)]
    win.close()
    print(
        f"event-loop gaps while streaming {args.tokens} tokens (10 ms timer; tiny llama, real worker)"
    )
    print(f"{'run':>4} {'tok/s':>7} {'median ms':>10} {'p99 ms':>8} {'max ms':>8}")
    for i, r in enumerate(runs):
        print(
            f"{i:>4} {r['tok_per_s']:>7.0f} {r['median_gap_ms']:>10.1f} {r['p99_gap_ms']:>8.1f} "
            f"{r['max_gap_ms']:>8.1f}"
        )
    write_result(
        "ui_latency",
        {
            "tokens": args.tokens,
            "timer_ms": 10,
            "runs": runs,
            "best_max_gap_ms": min(r["max_gap_ms"] for r in runs),
        },
    )


if __name__ == "__main__":
    main()
