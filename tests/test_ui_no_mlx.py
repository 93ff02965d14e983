"""The window process never imports MLX: every view is driven in a fresh interpreter (the
real engine worker, a download converted from the local hub, a folder opened, plans of a
loaded and a catalog model, the memory panel) and MLX must not be among its modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hubserver
import pytest

pytestmark = pytest.mark.slow
hub_env = hubserver.hub_env
ROOT = Path(__file__).resolve().parents[1]
REPO = "org/tiny-moe"


def test_window_process_never_imports_mlx(hub_env, tmp_path, smollm2_path):
    from app.engine.quant.hf_layout import to_hf_layout
    from app.engine.testing.random_models import make_random_model

    hf = to_hf_layout(make_random_model("qwen3_moe", tmp_path / "mlx", seed=5), tmp_path / "hf")
    hub_env.add_folder(REPO, hf)
    home = Path(os.environ["ROTARYQUANT_HOME"])
    (home / "models").mkdir(parents=True, exist_ok=True)
    # the built-in model, converted once for the test session, shared rather than rebuilt
    os.symlink(smollm2_path, home / "models" / smollm2_path.name)
    mine = tmp_path / "mine"
    to_hf_layout(make_random_model("qwen3_moe", tmp_path / "mlx2", seed=6), mine)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gui_sweep.py"), REPO, str(mine)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["seen"]) == 10, report
    assert report["mlx_modules"] == [], report
