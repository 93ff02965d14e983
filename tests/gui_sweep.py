"""Drives every view of the real window (a real engine worker, downloads from the local hub
at $HF_ENDPOINT) and prints which MLX modules the window process holds, as JSON.

Run by tests/test_ui_no_mlx.py in a fresh interpreter, so that no other test's imports count.
usage: gui_sweep.py REPO HF_FOLDER
"""

from __future__ import annotations

import json
import sys
import time

MLX_MODULES = ("mlx", "mlx.core", "mlx_lm")


def main() -> int:
    from PySide6.QtCore import QCoreApplication, QSettings
    from PySide6.QtWidgets import QApplication

    from app import paths
    from app.downloads import catalog
    from app.ui.main import MainWindow

    repo, hf_folder = sys.argv[1], sys.argv[2]
    qapp = QApplication.instance() or QApplication([])  # noqa: F841 (kept alive for the window)
    settings = QSettings(str(paths.data_dir() / "sweep.ini"), QSettings.Format.IniFormat)
    win = MainWindow(settings=settings, start=False)
    win.library.transfer_options = {"reserve": 0, "progress_interval": 0.0}
    win.show()
    seen: list[str] = []

    def wait(cond, what: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            QCoreApplication.processEvents()
            time.sleep(0.01)
        seen.append(what)

    plans, refusals, stats = [], [], []
    win.planner.plan_ready.connect(plans.append)
    win.planner.refused.connect(refusals.append)
    win.session.stats.connect(stats.append)
    win.start()
    wait(lambda: win.session.state == "ready", "the engine with the built-in model")
    wait(lambda: plans, "the loaded model's plan")
    # chat
    finished = []
    win.chat.stream_finished.connect(finished.append)
    win.chat.set_settings({"max_tokens": 4})
    assert win.chat.send("Hi")
    wait(lambda: finished, "an answer")
    wait(lambda: stats, "the memory panel's figures")
    win.memory.redraw()
    # library: a download that is converted, a folder opened, a verify, the catalog's verdicts
    win.show_tab(1)
    wait(lambda: win.library.verdicts, "the catalog's verdicts")
    assert win.library.download(repo)
    wait(
        lambda: any(e.repo == repo and e.state == "ready" for e in win.library.entries),
        "a download converted",
    )
    win.library.open_folder(hf_folder)
    wait(
        lambda: len([e for e in win.library.entries if e.state == "ready"]) == 2, "a folder opened"
    )
    win.library.verify(win.library.entries[0].name)
    wait(lambda: not win.library.runner.busy(), "a verify")
    # plan: the model, with an override, and a catalog model before download
    win.show_tab(2)
    n = len(plans) + len(refusals)
    win.planner.compute(win.planner.overrides.__class__(context=1024))
    wait(lambda: len(plans) + len(refusals) > n, "a plan with an override")
    e = catalog.load_catalog()[0]
    win.planner.set_target(e.config, e.name)
    wait(lambda: any(r.target == e.config for r in plans + refusals), "a catalog model's plan")
    loaded = [m for m in MLX_MODULES if m in sys.modules]
    win.close()
    print(json.dumps({"seen": seen, "mlx_modules": loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
