"""HistoryStore: every session's settings and turns in SQLite, so conversations survive restarts."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from tinymlx_ui.attachments import Attachment
from tinymlx_ui.session import NEW_TITLE, ChatSession, SessionSettings

# One column per SessionSettings field, declared with that field's default: a history written by an older version
# lacks the newer columns, and HistoryStore adds each with its default, so every older database still opens.
_SETTINGS_COLUMNS = {
    "system_prompt": "TEXT", "temperature": "REAL", "max_tokens": "INTEGER", "json_output": "INTEGER",
    "top_p": "REAL", "top_k": "INTEGER", "min_p": "REAL", "repetition_penalty": "REAL",
    "presence_penalty": "REAL", "frequency_penalty": "REAL",
    "seed": "TEXT",  # NULL = none; text because a seed reaches 2**64 - 1, past SQLite's signed 64-bit INTEGER
    "stop": "TEXT",  # a JSON list of strings
}


def _settings_row(settings: SessionSettings) -> tuple:
    """SessionSettings -> SQL values, in _SETTINGS_COLUMNS order."""
    values = {name: getattr(settings, name) for name in _SETTINGS_COLUMNS}
    values["json_output"] = int(settings.json_output)
    values["seed"] = None if settings.seed is None else str(settings.seed)
    values["stop"] = json.dumps(list(settings.stop))
    return tuple(values.values())


def _settings_of(row: tuple) -> SessionSettings:
    values = dict(zip(_SETTINGS_COLUMNS, row))
    values["json_output"] = bool(values["json_output"])
    values["seed"] = None if values["seed"] is None else int(values["seed"])
    values["stop"] = tuple(json.loads(values["stop"]))
    return SessionSettings(**values)


def _sql_literal(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


_DEFAULTS = dict(zip(_SETTINGS_COLUMNS, _settings_row(SessionSettings())))
_DEFINITIONS = {name: f"{kind}{'' if _DEFAULTS[name] is None else ' NOT NULL'} DEFAULT {_sql_literal(_DEFAULTS[name])}"
                for name, kind in _SETTINGS_COLUMNS.items()}


_SETTINGS_SQL = ",\n    ".join(f"{name} {definition}" for name, definition in _DEFINITIONS.items())
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    {_SETTINGS_SQL},
    is_open INTEGER NOT NULL DEFAULT 1,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    note TEXT,  -- why a reply ended early: "(cut off: cancelled)", ...
    stats TEXT  -- the line under a reply: tokens, TTFT, tok/s, prompt tokens from the prefix cache
);
-- Added with image input; IF NOT EXISTS adds it to a history written before. A turn's images in order.
CREATE TABLE IF NOT EXISTS turn_images (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id INTEGER NOT NULL REFERENCES turns(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    data BLOB NOT NULL  -- the file's bytes as attached: resent every turn, so the prefix cache sees the same image
);
CREATE INDEX IF NOT EXISTS turn_images_of_turn ON turn_images(turn_id);
"""
_TURN_EXTRAS = ("note", "stats", "reasoning")  # optional keys of a turn dict, NULL when absent
_COLUMNS = ", ".join(_SETTINGS_COLUMNS)


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
        turn_columns = {row[1] for row in self._db.execute("PRAGMA table_info(turns)")}
        with self._db:
            for name, definition in _DEFINITIONS.items():
                if name not in columns:  # a history written before this setting existed
                    self._db.execute(f"ALTER TABLE sessions ADD COLUMN {name} {definition}")
            for name in _TURN_EXTRAS:
                if name not in turn_columns:
                    self._db.execute(f"ALTER TABLE turns ADD COLUMN {name} TEXT")

    def close(self) -> None:
        self._db.close()

    def create_session(self, settings: SessionSettings) -> ChatSession:
        with self._db:
            cursor = self._db.execute(
                f"INSERT INTO sessions (title, {_COLUMNS}, updated) VALUES (?, {', '.join('?' * len(_SETTINGS_COLUMNS))}, ?)",
                (NEW_TITLE, *_settings_row(settings), time.time()),
            )
        return ChatSession(cursor.lastrowid, settings=settings)

    def load(self, session_id: int) -> ChatSession:
        row = self._db.execute(f"SELECT title, {_COLUMNS} FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise KeyError(f"no session {session_id}")
        images = self._images_of(session_id)
        turns = []
        for turn_id, role, content, *extras in self._db.execute(
                f"SELECT id, role, content, {', '.join(_TURN_EXTRAS)} FROM turns WHERE session_id = ? ORDER BY id",
                (session_id,)):
            turns.append({"role": role, "content": content,
                          **{k: v for k, v in zip(_TURN_EXTRAS, extras) if v is not None}})
            if turn_id in images:
                turns[-1]["images"] = tuple(images[turn_id])
        return ChatSession(session_id, row[0], _settings_of(row[1:]), turns)

    def _images_of(self, session_id: int) -> dict[int, list[Attachment]]:
        """turn id -> its images, in order; their token counts are the loaded model's to say (None here)."""
        images: dict[int, list[Attachment]] = {}
        for turn_id, name, width, height, data in self._db.execute(
                "SELECT i.turn_id, i.name, i.width, i.height, i.data FROM turn_images i "
                "JOIN turns t ON t.id = i.turn_id WHERE t.session_id = ? ORDER BY i.id", (session_id,)):
            images.setdefault(turn_id, []).append(Attachment(name, bytes(data), width, height))
        return images

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
        assignments = ", ".join(f"{name} = ?" for name in _SETTINGS_COLUMNS)
        with self._db:
            self._db.execute(
                f"UPDATE sessions SET title = ?, {assignments}, updated = ? WHERE id = ?",
                (session.title, *_settings_row(session.settings), time.time(), session.session_id),
            )

    def add_turns(self, session_id: int, turns: list[dict]) -> None:
        with self._db:
            for t in turns:
                cursor = self._db.execute(
                    f"INSERT INTO turns (session_id, role, content, {', '.join(_TURN_EXTRAS)}) "
                    f"VALUES (?, ?, ?, {', '.join('?' * len(_TURN_EXTRAS))})",
                    (session_id, t["role"], t["content"], *(t.get(k) for k in _TURN_EXTRAS)))
                self._db.executemany(
                    "INSERT INTO turn_images (turn_id, name, width, height, data) VALUES (?, ?, ?, ?, ?)",
                    [(cursor.lastrowid, a.name, a.width, a.height, a.data) for a in t.get("images", ())])
            self._db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session_id))

    def delete_last_turns(self, session_id: int, num_turns: int) -> None:
        """Drop a session's newest turns (regenerate, edit and resend), and their images (ON DELETE CASCADE)."""
        with self._db:
            self._db.execute(
                "DELETE FROM turns WHERE id IN (SELECT id FROM turns WHERE session_id = ? ORDER BY id DESC LIMIT ?)",
                (session_id, num_turns))
