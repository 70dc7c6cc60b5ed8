"""Messages between the background work (model loading, reply streams, stats polling) and widgets."""

from __future__ import annotations

from textual.message import Message

from tinymlx.engine.engine import Engine
from tinymlx.loader.progress import LoadProgress
from tinymlx_ui.attachments import Attachment
from tinymlx_ui.monitor import PanelData


class EngineReady(Message):
    """The model loaded (posted from the loading thread)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine


class LoadProgressed(Message):
    """How far loading got (posted from the loading thread, up to once a chunk). Within a stage only the
    newest matters; a stage's first report is kept, so the screen sees every stage the loader went through."""

    def __init__(self, progress: LoadProgress) -> None:
        super().__init__()
        self.progress = progress

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgressed) and message.progress.stage == self.progress.stage


class EngineFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class SendRequested(Message):
    """The user submitted a turn in a session, with the images attached to it."""

    def __init__(self, session_id: int, text: str, reasoning: str = "", images: tuple[Attachment, ...] = ()) -> None:
        super().__init__()
        self.session_id, self.text, self.reasoning, self.images = session_id, text, reasoning, images


class ImagesRead(Message):
    """Image files read and measured for a session's next message (posted from a worker thread): the
    attachments, and for each file refused, why."""

    def __init__(self, session_id: int, attachments: list[Attachment], errors: list[str]) -> None:
        super().__init__()
        self.session_id, self.attachments, self.errors = session_id, attachments, errors


class ReplyUpdated(Message, bubble=False):
    """The reply so far. It carries the whole text, so a newer one may replace an unread one."""

    def __init__(self, session_id: int, text: str, reasoning: str = "") -> None:
        super().__init__()
        self.session_id, self.text, self.reasoning = session_id, text, reasoning

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ReplyUpdated) and message.session_id == self.session_id


class ReplyFinished(Message, bubble=False):
    """The reply ended; `turn` is the assistant turn as saved. When the engine refused the request,
    `error` says why and `refused_text` and `refused_images` are the user's message, which goes back into
    the prompt."""

    def __init__(self, session_id: int, text: str, turn: dict | None, error: str | None = None,
                 refused_text: str | None = None, refused_images: tuple[Attachment, ...] = ()) -> None:
        super().__init__()
        self.session_id, self.text, self.turn, self.error = session_id, text, turn, error
        self.refused_text, self.refused_images = refused_text, refused_images


class EngineSnapshot(Message):
    """Fresh panel data; only the newest matters."""

    def __init__(self, data: PanelData) -> None:
        super().__init__()
        self.data = data

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, EngineSnapshot)
