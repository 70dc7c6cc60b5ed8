"""HistoryStore: every session's settings and turns in SQLite, so conversations survive restarts."""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from tinymlx_ui.session import NEW_TITLE, ChatSession, SessionSettings

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL,
    temperature REAL NOT NULL,
    max_tokens INTEGER NOT NULL,
    json_output INTEGER NOT NULL DEFAULT 0,
    is_open INTEGER NOT NULL DEFAULT 1,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL
);
"""


def data_dir() -> Path:
    """TINYMLX_DATA overrides the platform's user data directory (tests point it at a temp dir)."""
    return Path(os.environ.get("TINYMLX_DATA") or platformdirs.user_data_dir("tinymlx"))


@dataclass(frozen=True)
class SessionSummary:
    session_id: int
    title: str
    num_turns: int
    updated: float
    is_open: bool


class HistoryStore:
    def __init__(self, path: Path | None = None):
        path = path or data_dir() / "history.sqlite3"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path)
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
        if "json_output" not in columns:  # a history written before the JSON-output setting existed
            with self._db:
                self._db.execute("ALTER TABLE sessions ADD COLUMN json_output INTEGER NOT NULL DEFAULT 0")

    def close(self) -> None:
        self._db.close()

    def create_session(self, settings: SessionSettings) -> ChatSession:
        with self._db:
            cursor = self._db.execute(
                "INSERT INTO sessions (title, system_prompt, temperature, max_tokens, json_output, updated) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (NEW_TITLE, settings.system_prompt, settings.temperature, settings.max_tokens,
                 int(settings.json_output), time.time()),
            )
        return ChatSession(cursor.lastrowid, settings=settings)

    def load(self, session_id: int) -> ChatSession:
        row = self._db.execute(
            "SELECT title, system_prompt, temperature, max_tokens, json_output FROM sessions WHERE id = ?",
            (session_id,)).fetchone()
        if row is None:
            raise KeyError(f"no session {session_id}")
        title, system_prompt, temperature, max_tokens, json_output = row
        turns = [{"role": role, "content": content} for role, content in self._db.execute(
            "SELECT role, content FROM turns WHERE session_id = ? ORDER BY id", (session_id,))]
        return ChatSession(session_id, title, SessionSettings(system_prompt, temperature, max_tokens, bool(json_output)),
                           turns)

    def open_session_ids(self) -> list[int]:
        return [row[0] for row in self._db.execute("SELECT id FROM sessions WHERE is_open = 1 ORDER BY id")]

    def summaries(self) -> list[SessionSummary]:
        """Every session, most recently used first."""
        rows = self._db.execute(
            "SELECT s.id, s.title, COUNT(t.id), s.updated, s.is_open FROM sessions s "
            "LEFT JOIN turns t ON t.session_id = s.id GROUP BY s.id ORDER BY s.updated DESC, s.id DESC"
        )
        return [SessionSummary(sid, title, n, updated, bool(is_open)) for sid, title, n, updated, is_open in rows]

    def set_open(self, session_id: int, is_open: bool) -> None:
        with self._db:
            self._db.execute("UPDATE sessions SET is_open = ? WHERE id = ?", (int(is_open), session_id))

    def save_session(self, session: ChatSession) -> None:
        """Title and settings; turns are appended with add_turns."""
        s = session.settings
        with self._db:
            self._db.execute(
                "UPDATE sessions SET title = ?, system_prompt = ?, temperature = ?, max_tokens = ?, json_output = ?, "
                "updated = ? WHERE id = ?",
                (session.title, s.system_prompt, s.temperature, s.max_tokens, int(s.json_output), time.time(),
                 session.session_id),
            )

    def add_turns(self, session_id: int, turns: list[dict[str, str]]) -> None:
        with self._db:
            self._db.executemany(
                "INSERT INTO turns (session_id, role, content) VALUES (?, ?, ?)",
                [(session_id, t["role"], t["content"]) for t in turns],
            )
            self._db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session_id))
