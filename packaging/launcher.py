"""Entry point of the packaged app (PyInstaller's script; also runs from a checkout).

    RotaryQuant                 the desktop app
    RotaryQuant --self-test     headless check: worker, embedded model, a few tokens (no Qt)
    RotaryQuant --cli ARGS...   the `rotaryquant` command line inside the bundle
    RotaryQuant --version
    RotaryQuant --gui-smoke     open the window, wait for the model, close it (for tests)

The engine's worker is a multiprocessing "spawn" child that re-runs this executable, so
`freeze_support()` must come first, before Qt or MLX are imported: in the child it runs the
worker and exits there.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import sys

# System OpenBLAS builds, first match wins: MLX's CPU wheel ships a slow reference BLAS, and
# preloading OpenBLAS makes its fp32 matmul ~36x faster (the worker inherits the variable).
OPENBLAS_CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian, Ubuntu
    "/usr/lib64/libopenblas.so.0",  # Fedora, openSUSE
    "/usr/lib/libopenblas.so.0",  # Arch
)
GUI_SMOKE_TIMEOUT_S = 240.0  # --gui-smoke: give up waiting for the model after this long


def prefer_system_blas(environ=os.environ) -> str | None:
    """On Linux, point LD_PRELOAD at a system OpenBLAS for the worker processes started later
    (the running process is not affected). Returns the library chosen, if any."""
    if not sys.platform.startswith("linux") or environ.get("LD_PRELOAD"):
        return None
    arch = platform.machine()
    for pattern in OPENBLAS_CANDIDATES:
        path = pattern.format(arch=arch)
        if os.path.exists(path):
            environ["LD_PRELOAD"] = path
            return path
    return None


def qt_env(environ=os.environ) -> None:
    """Point Qt at the bundle's plugins (platforms, image formats) before the GUI imports Qt.
    The spec drops PyInstaller's PySide6 runtime hook, which did this by importing QtCore in
    every process; PySide6's own start-up finds the rest of Qt beside itself."""
    base = getattr(sys, "_MEIPASS", None)
    if base and getattr(sys, "frozen", False):
        environ["QT_PLUGIN_PATH"] = os.path.join(base, "PySide6", "Qt", "plugins")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("rotaryquant")
    except Exception:  # metadata not bundled: fall back to the spec's stamp
        return os.environ.get("ROTARYQUANT_VERSION", "unknown")


def _gui_smoke(argv: list[str]) -> int:
    """Open the window, wait for the embedded model to load, close the window the way a user
    does, and report. For tests of the packaged GUI (run with QT_QPA_PLATFORM=offscreen)."""
    import time

    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app.ui.main import main as gui_main

    app = QApplication.instance() or QApplication(argv)
    deadline = time.monotonic() + GUI_SMOKE_TIMEOUT_S
    result = {"state": "no window", "pid": None}

    def poll() -> None:
        wins = [w for w in app.topLevelWidgets() if hasattr(w, "session") and w.isVisible()]
        if not wins:
            return
        win = wins[0]
        session = win.session
        result["pid"] = result["pid"] or session.bridge.client.pid
        if session.state in ("ready", "idle", "crashed") or time.monotonic() > deadline:
            result["state"] = session.state
            timer.stop()
            print(
                f"gui-smoke: state={session.state} worker_pid={result['pid']} "
                f"message={session.message!r}",
                flush=True,
            )
            win.close()

    timer = QTimer()
    timer.setInterval(200)
    timer.timeout.connect(poll)
    timer.start()
    code = gui_main(argv)
    return code if result["state"] == "ready" else 1


def main() -> int:
    multiprocessing.freeze_support()  # the worker child runs and exits in here
    args = sys.argv[1:]
    if "--version" in args:
        print(f"RotaryQuant {_version()}")
        return 0
    prefer_system_blas()
    if "--self-test" in args:
        from app.selftest import main as selftest_main

        return selftest_main(args)
    if args and args[0] == "--cli":
        from app.cli import main as cli_main

        return cli_main(args[1:])
    qt_env()
    # Finder passes -psn_* on old macOS; the GUI takes an optional model folder only.
    gui_argv = [sys.argv[0], *[a for a in args if not a.startswith("-psn")]]
    if "--gui-smoke" in args:
        return _gui_smoke([a for a in gui_argv if a != "--gui-smoke"])
    from app.ui.main import main as gui_main

    return gui_main(gui_argv)


if __name__ == "__main__":
    sys.exit(main())
