"""The engine and the downloads never import Qt: they run headless in the worker and the CLI."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_engine_imports_no_qt():
    code = (
        "import sys, pkgutil, importlib, app.engine, app.downloads\n"
        "for pkg in (app.engine, app.downloads):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'pyqtgraph', 'PyQt5', 'PyQt6')]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_qt_import_statements_in_engine():
    pat = re.compile(r"^\s*(from|import)\s+(PySide6|pyqtgraph|PyQt\d)", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for d in ("app/engine", "app/downloads")
        for p in (ROOT / d).rglob("*.py")
        if pat.search(p.read_text())
    ]
    assert offenders == []
