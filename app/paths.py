"""Where the app keeps its data (platformdirs), overridable with ROTARYQUANT_HOME for tests."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "RotaryQuant"


def data_dir() -> Path:
    root = os.environ.get("ROTARYQUANT_HOME")
    p = Path(root) / "data" if root else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    p.mkdir(parents=True, exist_ok=True)
    return p


def models_dir() -> Path:
    p = data_dir() / "models"
    p.mkdir(parents=True, exist_ok=True)
    return p


def cache_dir() -> Path:
    root = os.environ.get("ROTARYQUANT_HOME")
    p = Path(root) / "cache" if root else Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))
    p.mkdir(parents=True, exist_ok=True)
    return p


def log_dir() -> Path:
    root = os.environ.get("ROTARYQUANT_HOME")
    p = Path(root) / "logs" if root else Path(platformdirs.user_log_dir(APP_NAME, appauthor=False))
    p.mkdir(parents=True, exist_ok=True)
    return p
