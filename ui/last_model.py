"""The model the chat ran last, so `tinymlx chat` without --model reopens it after a restart."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from tinymlx.loader import OFFLINE_MODELS
from tinymlx.loader.offline import DEFAULT_MODEL
from tinymlx_ui.store import data_dir


class LastModel(NamedTuple):
    name: str | None  # what --model would take; None: start the default
    note: str  # what the loading screen says about the choice ("" when there was none to make)


def _path() -> Path:
    return data_dir() / "last-model"


def remember(name: str) -> None:
    if Path(name).expanduser().exists():  # a relative path would not hold from another directory
        name = str(Path(name).expanduser().resolve())
    _path().parent.mkdir(parents=True, exist_ok=True)
    _path().write_text(name + "\n")


def forget() -> None:
    _path().unlink(missing_ok=True)


def recall() -> LastModel:
    """The model to reopen, or None with the reason it cannot be (a file since deleted, an offline model
    this version no longer has). A Hub repo id is taken as it is: only loading it can tell."""
    try:
        name = _path().read_text().strip()
    except OSError:
        return LastModel(None, "")
    if not name or name == DEFAULT_MODEL:
        return LastModel(None, "")
    looks_like_path = name.startswith(("/", "~", ".")) or name.endswith(".gguf")
    if looks_like_path and not Path(name).expanduser().exists():
        return LastModel(None, f"The model you used last, {name}, is gone; starting the default.")
    if not looks_like_path and "/" not in name and name not in OFFLINE_MODELS:
        return LastModel(None, f"The model you used last, {name}, is not offered any more; starting the default.")
    return LastModel(name, f"Reopening the model you used last ({name}); --model picks another.")
