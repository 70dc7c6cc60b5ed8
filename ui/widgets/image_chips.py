"""Images as chips: the ones attached to the message being written (AttachmentTray, each removable), and the
ones a sent message carried (SentImages). A chip names the file, its pixel size and its prompt tokens; chips
stack one a line, so a narrow pane never cuts one off."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Static

from tinymlx_ui.attachments import Attachment, chip_text


class ImageChip(Static):
    def __init__(self, attachment: Attachment, sees_images: bool, **kwargs) -> None:
        super().__init__(chip_text(attachment, sees_images), markup=False, **kwargs)
        self.attachment = attachment


class AttachmentChip(ImageChip, can_focus=True):
    """A chip of the message being written: Delete, Backspace or a click takes the image off it."""

    # Shift+Tab from the prompt reaches the chips (they come before it).
    BINDINGS = [Binding("delete,backspace", "remove", "Remove", tooltip="On an image chip (Shift+Tab): remove it")]

    class Removed(Message):
        def __init__(self, attachment: Attachment) -> None:
            super().__init__()
            self.attachment = attachment

    def __init__(self, attachment: Attachment, sees_images: bool, **kwargs) -> None:
        super().__init__(attachment, sees_images, **kwargs)
        self.tooltip = "Delete or click: remove this image from the message"

    def on_click(self) -> None:
        self.action_remove()

    def action_remove(self) -> None:
        self.post_message(self.Removed(self.attachment))


class AttachmentTray(Vertical):
    """The images attached to the message being written; hidden while there are none."""

    attachments: reactive[tuple[Attachment, ...]] = reactive((), recompose=True)

    def __init__(self, sees_images: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sees_images = sees_images

    def compose(self) -> ComposeResult:
        for attachment in self.attachments:
            yield AttachmentChip(attachment, self.sees_images, classes="image-chip")

    def watch_attachments(self, attachments: tuple[Attachment, ...]) -> None:
        self.display = bool(attachments)

    def on_attachment_chip_removed(self, message: AttachmentChip.Removed) -> None:
        # By identity: the same file attached twice is two attachments, and a click removes one.
        self.attachments = tuple(a for a in self.attachments if a is not message.attachment)


class SentImages(Vertical):
    """The images of a sent message, under its text."""

    def __init__(self, attachments: tuple[Attachment, ...], sees_images: bool, **kwargs) -> None:
        super().__init__(*(ImageChip(a, sees_images, classes="image-chip") for a in attachments), **kwargs)
