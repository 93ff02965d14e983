"""Where the app keeps its data (platformdirs), overridable with ROTARYQUANT_HOME for tests.

The folders are private to the user (0700) and so are the files that hold chats and logs
(0600): conversations and prompts are nobody else's to read."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "RotaryQuant"


PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(p: Path) -> Path:
    """`p` created (with its parents) and made 0700."""
    p.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    if os.name == "posix" and p.stat().st_mode & 0o777 != PRIVATE_DIR:
        os.chmod(p, PRIVATE_DIR)
    return p


def private_file(p: Path) -> Path:
    """`p` created empty if missing and made 0600; anything but a plain file is left alone
    (its opener reports it)."""
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE))
    except OSError:
        return p
    if os.name == "posix" and p.is_file() and p.stat().st_mode & 0o777 != PRIVATE_FILE:
        os.chmod(p, PRIVATE_FILE)
    return p


def location_file() -> Path:
    """Where a data folder chosen in the settings is remembered (outside the data folder)."""
    root = os.environ.get("ROTARYQUANT_HOME")
    base = Path(root) if root else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))
    return base / "data-location"


def default_data_dir() -> Path:
    root = os.environ.get("ROTARYQUANT_HOME")
    return (
        Path(root) / "data" if root else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    )


def data_dir() -> Path:
    try:
        chosen = location_file().read_text().strip()
    except OSError:
        chosen = ""
    return private_dir(Path(chosen) if chosen else default_data_dir())


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
    p = (
        Path(root) / "cache"
        if root
        else Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))
    )
    return private_dir(p)


def log_dir() -> Path:
    root = os.environ.get("ROTARYQUANT_HOME")
    p = Path(root) / "logs" if root else Path(platformdirs.user_log_dir(APP_NAME, appauthor=False))
    return private_dir(p)
