"""Conversations on disk: one SQLite file in the app's data dir (no Qt, no engine).

Each message is written when it is created and, while an answer streams, its partial text is
rewritten every few hundred milliseconds, so a crash of the app or the worker loses at most
that much. WAL mode with synchronous=NORMAL: a commit survives the app dying (not a power cut)
and costs no fsync, so writing from the GUI thread stays well under a frame.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths

DB_NAME = "conversations.sqlite3"
FORMAT_VERSION = 1
ROLES = ("system", "user", "assistant")
# complete: finished normally; stopped: the user stopped it; streaming: being written (or the
# app died while it was); interrupted: the worker died; error: the engine reported an error.
STATES = ("complete", "stopped", "streaming", "interrupted", "error")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


class HistoryError(RuntimeError):
    pass


class _Damaged(Exception):
    """The file opened but SQLite's integrity check failed."""


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    state: str = "complete"
    created: float = field(default_factory=time.time)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"bad message role {self.role!r}; roles are {ROLES}")
        if self.state not in STATES:
            raise ValueError(f"bad message state {self.state!r}; states are {STATES}")


@dataclass
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    model: str = ""
    system_prompt: str = ""
    settings: dict = field(default_factory=dict)  # sampling settings (GenerationSettings keys)


class ConversationStore:
    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else paths.data_dir() / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.set_aside: Path | None = None  # a damaged history moved here; the user is told
        try:
            self._open()
        except (sqlite3.DatabaseError, _Damaged) as e:
            # garbage, a bad header, a truncated file, a folder in its place: keep it for the
            # user, start an empty history (as the library does with its database)
            self.set_aside = self._move_aside(e)
            self._open()

    def _open(self) -> None:
        paths.private_file(self.path)
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=10)
        try:
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > FORMAT_VERSION:
                raise HistoryError(
                    f"{self.path}: history format {version} is newer than this app reads "
                    f"({FORMAT_VERSION}); update RotaryQuant"
                )
            check = self.db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise _Damaged(check)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.executescript(_SCHEMA)
            self.db.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
        except BaseException:
            self.db.close()
            raise

    def _move_aside(self, why: Exception) -> Path:
        aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
        try:
            os.replace(self.path, aside)
            for ext in ("-wal", "-shm"):  # its journal belongs to it, not to the new file
                side = self.path.with_name(self.path.name + ext)
                if side.exists():
                    os.replace(side, aside.with_name(aside.name + ext))
        except OSError as e:
            raise HistoryError(
                f"{self.path}: the conversation history is damaged ({why}) and "
                f"cannot be moved aside: {e}"
            ) from e
        return aside

    def close(self) -> None:
        self.db.close()

    # -- conversations ----------------------------------------------------------------------
    @staticmethod
    def _conv(row) -> Conversation:
        return Conversation(
            row[0], row[1], row[2], row[3], row[4], row[5], json.loads(row[6] or "{}")
        )

    def create(
        self,
        title: str = "New chat",
        model: str = "",
        system_prompt: str = "",
        settings: dict | None = None,
    ) -> Conversation:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, created, updated, model, system_prompt, settings) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (title, now, now, model, system_prompt, json.dumps(settings or {})),
        )
        return self.get(cur.lastrowid)

    def get(self, cid: int) -> Conversation:
        row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (cid,)).fetchone()
        if row is None:
            raise HistoryError(f"no conversation {cid}")
        return self._conv(row)

    def conversations(self) -> list[Conversation]:
        rows = self.db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC")
        return [self._conv(r) for r in rows.fetchall()]

    def update(self, cid: int, **changes) -> Conversation:
        allowed = {"title", "model", "system_prompt", "settings"}
        if set(changes) - allowed:
            raise ValueError(f"cannot change {sorted(set(changes) - allowed)}")
        if "settings" in changes:
            changes["settings"] = json.dumps(changes["settings"])
        sets = ", ".join(f"{k} = ?" for k in changes)
        self.db.execute(
            f"UPDATE conversations SET {sets}, updated = ? WHERE id = ?",
            (*changes.values(), time.time(), cid),
        )
        return self.get(cid)

    def delete(self, cid: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (cid,))

    # -- messages ---------------------------------------------------------------------------
    @staticmethod
    def _msg(row) -> Message:
        return Message(row[0], row[1], row[2], row[3], row[4], row[5], json.loads(row[6] or "{}"))

    def messages(self, cid: int) -> list[Message]:
        rows = self.db.execute(
            "SELECT id, conversation_id, role, content, state, created, meta FROM messages "
            "WHERE conversation_id = ? ORDER BY id",
            (cid,),
        )
        return [self._msg(r) for r in rows.fetchall()]

    def add_message(
        self, cid: int, role: str, content: str, state: str = "complete", meta: dict | None = None
    ) -> Message:
        m = Message(0, cid, role, content, state, time.time(), dict(meta or {}))  # validates
        cur = self.db.execute(
            "INSERT INTO messages (conversation_id, role, content, state, created, meta) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (cid, role, content, state, m.created, json.dumps(m.meta)),
        )
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (m.created, cid))
        m.id = cur.lastrowid
        return m

    def update_message(
        self,
        mid: int,
        content: str | None = None,
        state: str | None = None,
        meta: dict | None = None,
    ) -> None:
        if state is not None and state not in STATES:
            raise ValueError(f"bad message state {state!r}")
        sets, args = [], []
        for col, val in (
            ("content", content),
            ("state", state),
            ("meta", None if meta is None else json.dumps(meta)),
        ):
            if val is not None:
                sets.append(f"{col} = ?")
                args.append(val)
        if sets:
            self.db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, mid))

    def delete_message(self, mid: int) -> None:
        self.db.execute("DELETE FROM messages WHERE id = ?", (mid,))

    def recover(self) -> int:
        """Answers left 'streaming' by an app that died become 'interrupted'; returns how many."""
        cur = self.db.execute("UPDATE messages SET state = 'interrupted' WHERE state = 'streaming'")
        return cur.rowcount
