"""The library's work that imports MLX (conversion, checking a folder, the planner's verdicts),
as functions that app/engine/jobs.py runs in a process of their own for the window.

Each opens the same library (folders and SQLite store) in the child; progress and state events
come back through `emit`. A conversion that crashes leaves its entry owned by a dead process,
which `Library.recover` puts back to "downloaded".
"""

from __future__ import annotations

from pathlib import Path

from .library import Library


def finish(root: str, db: str, name: str, emit=None):
    """After a download: convert it (an MoE) or register it as it is."""
    return Library(root, db).finish(name, on_event=emit)


def convert(root: str, db: str, name: str, emit=None):
    return Library(root, db).convert(name, on_event=emit)


def verify(root: str, db: str, name: str, deep: bool = True, emit=None):
    return Library(root, db).verify(name, deep=deep)


def open_folder(root: str, db: str, folder: str, emit=None):
    """Add a model folder the user already has (see Library.open_folder)."""
    return Library(root, db).open_folder(Path(folder), on_event=emit)


def catalog_plans(root: str, db: str, emit=None) -> dict[str, dict]:
    """Each catalog model's plan summary on this machine (the library's verdict column)."""
    from . import catalog

    lib = Library(root, db)
    return {e.name: lib.catalog_plan(e) for e in catalog.load_catalog()}
