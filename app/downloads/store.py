"""The library's store: one SQLite file in the app's data dir, one row per local model.

SQLite gives atomic transactions (a crash never leaves half a record) and safe access from
several threads and processes (the GUI and a `rotaryquant download` at the same time). Each
call opens its own short connection. The format version is SQLite's `user_version`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .errors import LibraryDiskFull, LibraryError

SQLITE_FULL = 13  # sqlite3.SQLITE_FULL (the module has it from Python 3.11)

FORMAT_VERSION = 1
STATES = ("downloading", "paused", "downloaded", "converting", "ready", "broken")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    data TEXT NOT NULL,      -- the entry as JSON (fields below); unknown keys are kept
    state TEXT NOT NULL,
    updated REAL NOT NULL
)
"""


@dataclass
class LibraryEntry:
    name: str
    state: str
    folder: str = ""  # what the engine loads (the converted model, or the download as-is)
    original: str = ""  # the download folder while it exists apart from `folder`
    repo: str = ""  # hub repo id ("" for a folder added by hand)
    revision: str = ""
    commit: str = ""
    architecture: str = ""
    error: str = ""  # why the last step failed, in words
    download_bytes: int = 0
    disk_bytes: int = 0  # bytes of `folder` (+ `original` when kept)
    files: list = field(default_factory=list)  # [{path, size, sha256}] of `folder`, for verify
    original_files: list = field(default_factory=list)  # same for `original`
    plan: dict = field(default_factory=dict)  # plan summary at conversion time
    options: dict = field(default_factory=dict)  # convert, keep_original, widths
    owner_pid: int = 0  # process running the download/conversion (0: none)
    owner_started: float = 0.0  # its start time, so a reused pid is not mistaken for it
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"bad model name {self.name!r}")
        if self.state not in STATES:
            raise ValueError(f"bad state {self.state!r}; states are {STATES}")

    @classmethod
    def from_dict(cls, d: dict) -> LibraryEntry:
        known = {f.name for f in fields(cls)}
        e = cls(**{k: v for k, v in d.items() if k in known})
        e.extra.update({k: v for k, v in d.items() if k not in known})
        return e

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}

    @property
    def busy(self) -> bool:
        return self.state in ("downloading", "converting")


class Store:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect(write=False) as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            has_table = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'models'"
            ).fetchone()
        if version == FORMAT_VERSION and has_table:
            return  # nothing to write: the library opens on a full disk too
        with self._connect() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > FORMAT_VERSION:
                raise LibraryError(
                    f"{self.path}: library format {version} is newer than this app reads "
                    f"({FORMAT_VERSION}); update RotaryQuant"
                )
            db.execute(_SCHEMA)
            if version < FORMAT_VERSION:
                db.execute(f"PRAGMA user_version = {FORMAT_VERSION}")

    @contextmanager
    def _connect(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        try:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        except sqlite3.Error as e:
            raise LibraryError(f"{self.path}: cannot open the library: {e}") from e
        try:
            # one writer at a time, across processes; reads take no write lock (and need no
            # journal, so they work on a full disk)
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            yield db
            db.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            db.execute("ROLLBACK") if db.in_transaction else None
            if getattr(e, "sqlite_errorcode", None) == SQLITE_FULL or "disk is full" in str(e):
                raise LibraryDiskFull(
                    f"disk full: the library ({self.path}) cannot record changes until some "
                    "space is freed"
                ) from e
            raise LibraryError(f"{self.path}: library database error: {e}") from e
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    def _decode(self, row) -> LibraryEntry:
        try:
            return LibraryEntry.from_dict(json.loads(row[0]))
        except (ValueError, TypeError) as e:
            raise LibraryError(f"{self.path}: damaged library record: {e}") from e

    def get(self, name: str) -> LibraryEntry | None:
        with self._connect(write=False) as db:
            row = db.execute("SELECT data FROM models WHERE name = ?", (name,)).fetchone()
        return self._decode(row) if row else None

    def all(self) -> list[LibraryEntry]:
        with self._connect(write=False) as db:
            rows = db.execute("SELECT data FROM models ORDER BY name").fetchall()
        return [self._decode(r) for r in rows]

    def put(self, entry: LibraryEntry) -> LibraryEntry:
        entry.updated = time.time()
        LibraryEntry.from_dict(entry.to_dict())  # re-check: never store what cannot be read back
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO models (name, data, state, updated) VALUES (?, ?, ?, ?)",
                (entry.name, json.dumps(entry.to_dict()), entry.state, entry.updated),
            )
        return entry

    def insert(self, entry: LibraryEntry) -> LibraryEntry:
        """Add a new entry; LibraryError if the name is taken (checked inside the transaction)."""
        entry.updated = time.time()
        with self._connect() as db:
            if db.execute("SELECT 1 FROM models WHERE name = ?", (entry.name,)).fetchone():
                raise LibraryError(f"a model named {entry.name!r} is already in the library")
            db.execute(
                "INSERT INTO models (name, data, state, updated) VALUES (?, ?, ?, ?)",
                (entry.name, json.dumps(entry.to_dict()), entry.state, entry.updated),
            )
        return entry

    def update(self, name: str, **changes) -> LibraryEntry:
        """Read-modify-write of one entry inside one transaction."""
        with self._connect() as db:
            row = db.execute("SELECT data FROM models WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise LibraryError(f"no model named {name!r} in the library")
            d = json.loads(row[0])
            d.update(changes)
            d["updated"] = time.time()
            e = LibraryEntry.from_dict(d)
            db.execute(
                "UPDATE models SET data = ?, state = ?, updated = ? WHERE name = ?",
                (json.dumps(e.to_dict()), e.state, e.updated, name),
            )
        return e

    def delete(self, name: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM models WHERE name = ?", (name,))
