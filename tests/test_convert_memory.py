"""Streaming: peak RSS of a conversion stays under the converter's stated bound, and a
conversion killed midway leaves no output folder (benchmarks/convert_memory.py runs the
multi-GB version)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "convert_memory.py"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path / "home"))


@pytest.mark.slow
def test_peak_rss_under_bound(tmp_path):
    out = tmp_path / "mem.json"
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--small",
            "--layers",
            "4",
            "--trials",
            "1",
            "--chunk-mib",
            "4",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    bound = res["bound"]["above_baseline"]
    assert bound < res["checkpoint"]["bytes"] / 2  # the bound is far below the model size
    for t in res["trials"]:
        assert 0 < t["above_baseline"] <= bound, t


_CHILD = """
import sys, time
from app.engine.quant.convert import convert
def slow(p):
    if p.stage == "experts":
        print("EXPERTS", flush=True)
        time.sleep(0.05)
convert(sys.argv[1], sys.argv[2], progress=slow)
"""


@pytest.mark.slow
def test_killed_conversion_leaves_no_output_and_reruns(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from convert_memory import SMALL_SHAPE, make_synthetic_checkpoint
    finally:
        sys.path.pop(0)
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_synthetic_checkpoint(
        src, {**SMALL_SHAPE, "num_hidden_layers": 1, "vocab_size": 4096, "num_experts": 8}
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(src), str(dst)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "EXPERTS"  # dense part written, experts under way
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    p.stdout.close()
    assert not dst.exists()
    partial = list(tmp_path.glob(".dst.rq-partial-*"))
    assert len(partial) == 1 and any(partial[0].iterdir())
    from app.engine.loader import load
    from app.engine.quant.convert import convert

    convert(src, dst)  # a new run clears the dead run's leftovers
    assert not any(tmp_path.glob(".dst.rq-partial-*")) and dst.exists()
    assert load(dst, verify=True).model is not None
