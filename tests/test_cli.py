"""The headless command line, as a user runs it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())


def test_generate_paris(smollm2_path):
    r = _run("generate", "What is the capital of France?", "--max-tokens", "32", "-v")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr


def test_generate_through_worker(tiny_model_path):
    r = _run("generate", "Hello", "--model", str(tiny_model_path("gpt_oss")), "--max-tokens", "4", "--worker")
    assert r.returncode == 0, r.stderr


def test_bad_model_is_a_clear_error(tmp_path):
    r = _run("generate", "hi", "--model", str(tmp_path))
    assert r.returncode == 2
    assert "config.json is missing" in r.stderr and "Traceback" not in r.stderr
