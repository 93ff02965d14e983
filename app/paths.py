"""Where the app keeps its data (platformdirs), overridable with ROTARYQUANT_HOME for tests."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "RotaryQuant"


def location_file() -> Path:
    """Where a data folder chosen in the settings is remembered (outside the data folder)."""
    root = os.environ.get("ROTARYQUANT_HOME")
    base = Path(root) if root else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))
    return base / "data-location"


def default_data_dir() -> Path:
    root = os.environ.get("ROTARYQUANT_HOME")
    return Path(root) / "data" if root else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def data_dir() -> Path:
    try:
        chosen = location_file().read_text().strip()
    except OSError:
        chosen = ""
    p = Path(chosen) if chosen else default_data_dir()
    p.mkdir(parents=True, exist_ok=True)
    return p


def set_data_dir(folder: str | os.PathLike | None) -> None:
    """Use `folder` for models, library and conversations from the next start (None: the
    default). The old folder is left as it is."""
    f = location_file()
    if folder is None:
        f.unlink(missing_ok=True)
        return
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(str(Path(folder).expanduser().resolve()))


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
