"""Folders written atomically: a model folder either appears whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a hidden temporary folder beside `dest`; when the block ends normally it replaces
    `dest`, on any error (or interrupt) it is removed and `dest` is left as it was."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
