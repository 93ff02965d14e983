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


class Busy(OSError):
    """Another process holds the lock."""


@contextmanager
def exclusive(dest: str | os.PathLike) -> Iterator[None]:
    """Hold `.NAME.rq-lock` beside `dest` (non-blocking flock): one writer of `dest` at a time,
    released when the process ends, however it ends. The lock file is removed on exit."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    path = dest.parent / f".{dest.name}.rq-lock"
    try:
        import fcntl
    except ImportError:  # Windows: no flock; a single writer is the user's to ensure
        yield
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(f"{dest}: another process is writing it") from None
        try:  # the holder before us may have removed the file we opened: lock the current one
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)
