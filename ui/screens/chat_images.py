"""ImageAttaching: ChatScreen's images. A path typed (Ctrl+F) or pasted (a file dragged into the terminal)
is read and measured off the UI thread, then attached to that session's next message as a chip, or refused
with a notification that says why, leaving the message and its other images as they were."""

from __future__ import annotations

from pathlib import Path

from textual import work

from tinymlx.engine.async_engine import AsyncEngine
from tinymlx_ui.attachments import over_limit, paths_in, read_images, remeasured
from tinymlx_ui.messages import ImagesRead
from tinymlx_ui.screens.attach import AttachScreen
from tinymlx_ui.session import ChatSession
from tinymlx_ui.widgets.prompt_input import PromptInput
from tinymlx_ui.widgets.session_view import SessionView
from tinymlx_ui.widgets.status_bar import EngineInfo


class ImageAttaching:
    """Mixed into ChatScreen, whose engine, engine info and open views it reads."""

    _engine: AsyncEngine
    _info: EngineInfo
    _views: dict[int, SessionView]

    @property
    def _sees_images(self) -> bool:
        # Without a chat template the prompt is plain text: images go as notes, as to a text model.
        return self._engine.engine.images.sees_images and self._info.has_chat_template

    def _measure_stored_images(self, session: ChatSession) -> None:
        """A reopened session's images: their token counts are the loaded model's to say."""
        for turn in session.turns:
            if turn.get("images"):
                turn["images"] = tuple(remeasured(image, self._engine.engine.images) for image in turn["images"])

    def action_attach_image(self) -> None:
        view = self.active_view
        if view is not None:
            def attach(text: str | None) -> None:
                if text:
                    self._read_images(view.session.session_id, paths_in(text))

            self.app.push_screen(AttachScreen(), attach)

    def on_prompt_input_images_pasted(self, message: PromptInput.ImagesPasted) -> None:
        view = message.prompt_input.query_ancestor(SessionView)
        self._read_images(view.session.session_id, message.paths)

    @work(thread=True, group="images")
    def _read_images(self, session_id: int, paths: list[Path]) -> None:
        """In a thread: decoding a large photo takes a while."""
        self.post_message(ImagesRead(session_id, *read_images(paths, self._engine.engine.images)))

    def on_images_read(self, message: ImagesRead) -> None:
        view = self._views.get(message.session_id)
        if view is None:
            return  # closed meanwhile
        conversation = [image for turn in view.session.turns for image in turn.get("images", ())]
        attached, errors = list(view.attachments), list(message.errors)
        for attachment in message.attachments:
            problem = over_limit(conversation + attached, attachment, self._engine.engine.images)
            if problem:
                errors.append(problem)
            else:
                attached.append(attachment)
        view.set_attachments(tuple(attached))
        for error in errors:
            self.notify(error, title="Image not attached", severity="error", timeout=8)
