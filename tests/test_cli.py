"""The headless command line, as a user runs it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )


def test_generate_paris(smollm2_path):
    r = _run("generate", "What is the capital of France?", "--max-tokens", "32", "-v")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr


def test_generate_through_worker(tiny_model_path):
    r = _run(
        "generate",
        "Hello",
        "--model",
        str(tiny_model_path("gpt_oss")),
        "--max-tokens",
        "4",
        "--worker",
    )
    assert r.returncode == 0, r.stderr


def test_bad_model_is_a_clear_error(tmp_path):
    r = _run("generate", "hi", "--model", str(tmp_path))
    assert r.returncode == 2
    assert "config.json is missing" in r.stderr and "Traceback" not in r.stderr


def test_version():
    r = _run("--version", timeout=60)
    assert (
        r.returncode == 0
        and r.stdout.startswith("rotaryquant ")
        and r.stdout.split()[1][0].isdigit()
    )


def test_models_verify_and_inspect_see_the_builtin_model(smollm2_path):
    """The app lists the built-in model; so do `models`, `verify` and `inspect`, by name."""
    r = _run("models", timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("SmolLM2-135M-Instruct"))
    assert "ready" in line and "built in" in line and "MiB" in line
    r = _run("verify", "SmolLM2-135M-Instruct", timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    r = _run("remove", "SmolLM2-135M-Instruct", timeout=120)
    assert r.returncode != 0 and "built into the app" in r.stderr and "Traceback" not in r.stderr
    r = _run("inspect", "SmolLM2-135M-Instruct", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    dense = json.loads(r.stdout)["roles"]["dense"]
    assert 100e6 < dense["params"] < 200e6  # SmolLM2-135M: 134.5M parameters with its embedding
