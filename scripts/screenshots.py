"""Screenshots of every view of the real app, with the embedded model loaded in the real
worker, for docs/. Run under Xvfb (no window manager, so input goes to widgets directly and
falls back to clicks):

    xvfb-run -a -s "-screen 0 1280x800x24" .venv/bin/python scripts/screenshots.py docs

It uses a fresh app home (nothing of yours is read or written) holding the embedded model, a
tiny random MoE added to the library, and a local test hub (tests/hubserver.py) serving
another one slowly, so that the library shows a download in progress. Saves chat.png,
chat-dark.png, library.png, plan.png, plan-catalog.png and memory.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
)


def prepare_home(home: Path) -> tuple[Path, Path]:
    """A tiny MoE for the library (added as a local folder) and one for the hub to serve."""
    from app.engine.quant.hf_layout import to_hf_layout
    from app.engine.testing.random_models import make_random_model

    local = make_random_model("qwen3_moe", home / "work" / "tiny-qwen3-moe", seed=1)
    hf = to_hf_layout(
        make_random_model("qwen3_moe", home / "work" / "mlx", seed=3), home / "work" / "hf"
    )
    return local, hf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "docs"))
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=800)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="rq-screens-"))
    os.environ["ROTARYQUANT_HOME"] = str(home)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["HF_HOME"] = str(home / "hf-home")
    os.environ.pop("HF_HUB_OFFLINE", None)

    sys.path.insert(0, str(ROOT / "tests"))
    import hubserver  # the tests' local hub: serves files on 127.0.0.1 only
    from PySide6.QtCore import Qt, QTimer
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication

    from app.downloads.library import Library
    from app.ui.library_model import LibraryController
    from app.ui.main import MainWindow, app_icon, app_settings
    from app.ui.plan_model import Overrides
    from app.ui.theme import Theme

    local, hf = prepare_home(home)
    server = hubserver.HubServer().start()
    server.hub.add_folder("org/tiny-moe", hf)
    server.hub.delay = 0.25  # slow enough to show a download in progress
    os.environ["HF_ENDPOINT"] = server.endpoint
    lib = Library()
    lib.add_folder(local, "tiny-qwen3-moe")

    app = QApplication(sys.argv)
    app.setApplicationName("RotaryQuant")
    app.setWindowIcon(app_icon())
    theme = Theme(app, "light")
    library = LibraryController(lib)
    win = MainWindow(settings=app_settings(), library=library, theme=theme)
    win.resize(args.width, args.height)
    win.show()
    saved: list[str] = []
    state = {"asked": 0, "failed": ""}
    t0 = time.monotonic()

    def shot(name: str, widget=None) -> None:
        app.processEvents()
        (widget or win).grab().save(str(out / name))
        saved.append(name)
        print(f"{time.monotonic() - t0:6.1f} s  {out / name}", flush=True)

    def after(ms: int, fn) -> None:
        QTimer.singleShot(ms, fn)

    def ask() -> None:
        q = QUESTIONS[state["asked"]]
        state["asked"] += 1
        win.show_tab(0)
        win.activateWindow()
        box = win.chat_view.input
        box.setFocus()
        QTest.keyClicks(box, q)
        QTest.keyClick(box, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
        if not win.chat.busy:  # no window manager: the shortcut may not have reached us
            QTest.mouseClick(win.chat_view.send_btn, Qt.MouseButton.LeftButton)

    def on_loaded(_info) -> None:
        if state["asked"] == 0:
            after(1500, ask)

    def on_finished(_reason) -> None:
        if state["asked"] < len(QUESTIONS):
            after(300, ask)
        else:
            after(2500, chat_done)

    def on_failed(why: str) -> None:
        state["failed"] = why
        print("generation failed:", why, flush=True)
        app.quit()

    def chat_done() -> None:
        shot("chat.png")
        shot("memory.png", win.memory)
        win.show_tab(1)
        library.download("org/tiny-moe")
        wait_progress()

    def wait_progress() -> None:
        p = library.progress.get("org/tiny-moe")
        if p is None or p["fraction"] < 0.25:
            after(200, wait_progress)
            return
        win.library_view.select("tiny-qwen3-moe")
        after(400, library_done)

    def library_done() -> None:
        shot("library.png")
        library.manager.pause("org/tiny-moe")
        win.show_tab(2)
        v = win.plan_view
        v.context_auto.setChecked(False)
        v.context_spin.setValue(100_000)
        win.planner.refused.connect(plan_refused)
        v.replan()

    def plan_refused(_r) -> None:
        win.planner.refused.disconnect(plan_refused)
        after(300, plan_shot)

    def plan_shot() -> None:
        shot("plan.png")
        win.plan_view.reset()
        win.planner.plan_ready.connect(catalog_planned)
        entry = next(e for e in library.catalog if "120B" in e.name and "Nemotron" in e.name)
        win.planner.set_target(entry.config, f"{entry.name} (catalog, before download)")
        win.planner.compute(Overrides())

    def catalog_planned(r) -> None:
        if r.target == win.session.model_ref:
            return
        win.planner.plan_ready.disconnect(catalog_planned)
        after(300, catalog_shot)

    def catalog_shot() -> None:
        shot("plan-catalog.png")
        theme.set_mode("dark")
        win.show_tab(0)
        after(600, dark_shot)

    def dark_shot() -> None:
        shot("chat-dark.png")
        theme.set_mode("light")
        win.close()
        app.quit()

    win.session.model_loaded.connect(on_loaded)
    win.chat.stream_finished.connect(on_finished)
    win.chat.stream_failed.connect(on_failed)
    after(600_000, app.quit)  # give up after 10 minutes
    app.exec()
    server.stop()
    print(f"saved {len(saved)} screenshots to {out}: {', '.join(saved)}")
    return 0 if len(saved) == 6 and not state["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
