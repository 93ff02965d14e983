"""Shared fixtures. Every test session gets its own app home (no user data touched) and the
Qt platform is offscreen unless a display is given explicitly."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_HOME = tempfile.mkdtemp(prefix="rq-test-home-")
os.environ["ROTARYQUANT_HOME"] = _HOME
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network; hub tests use a local server
os.environ.pop("HF_ENDPOINT", None)

_TINY_ROOT = Path(_HOME) / "tiny-models"


@pytest.fixture(scope="session")
def tiny_model_path():
    """Factory: tiny_model_path(arch, seed=0) -> folder of a random tiny model (built once)."""
    from app.engine.testing.random_models import make_random_model

    def get(arch: str, seed: int = 0) -> Path:
        folder = _TINY_ROOT / f"{arch}-{seed}"
        if not (folder / "model.safetensors").exists():
            make_random_model(arch, folder, seed=seed)
        return folder

    return get


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real embedded model, SmolLM2-135M-Instruct, converted from its GGUF."""
    from app.engine.embedded import ensure_default_model

    return ensure_default_model()


@pytest.fixture
def app_home() -> Path:
    return Path(_HOME)
