"""Regenerate docs/screenshot.svg (and .png, where rsvg-convert exists): `tinymlx chat` on the default
model, one finished turn and two sessions streaming at once, at 120x40, with an empty history.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python scripts/screenshot.py
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
QUESTIONS = ("Write a Python function that checks whether a string is a palindrome.",
             "Explain in three sentences what a KV cache is.")


async def capture() -> Path:
    from tinymlx.core.config import EngineConfig
    from tinymlx.engine.engine import Engine
    from tinymlx.loader import DEFAULT_MODEL
    from tinymlx_ui import ChatApp
    from tinymlx_ui.screens.chat import ChatScreen
    from tinymlx_ui.session import SessionSettings
    from tinymlx_ui.widgets.prompt_input import PromptInput

    app = ChatApp(lambda: Engine.from_config(EngineConfig(), progress=False), model_label=DEFAULT_MODEL,
                  defaults=SessionSettings(temperature=0.0, max_tokens=160))

    async def wait(condition, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("the chat did not get there in time")
            await pilot.pause(0.2)

    def submit(text: str) -> None:
        prompt = app.screen.active_view.query_one(PromptInput)
        prompt.insert(text)
        prompt.action_submit()

    async with app.run_test(size=(120, 40)) as pilot:
        await wait(lambda: isinstance(app.screen, ChatScreen) and app.screen.active_view is not None)
        screen = app.screen
        first = screen.active_view
        submit("Hi! Who are you, in one line?")
        await wait(lambda: len(first.session.turns) == 2)
        submit(QUESTIONS[0])
        await screen.action_new_session()
        submit(QUESTIONS[1])
        # Both mid-reply, a few lines in: the panel shows them sharing the batch and the blocks they hold.
        await wait(lambda: sum(r.num_output_tokens >= 50 for r in app.async_engine.stats().requests
                               if r.status == "running") == 2)
        await pilot.pause(2.5)  # the panel draws every 2 s (PANEL_REDRAW_S)
        for prompt in screen.query(PromptInput):
            prompt.cursor_blink = False
        return Path(app.save_screenshot(filename="screenshot.svg", path=str(DOCS)))


def main() -> None:
    with tempfile.TemporaryDirectory() as data:
        os.environ["TINYMLX_DATA"] = data  # an empty history, not the user's
        svg = asyncio.run(capture())
    print(f"wrote {svg}")
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "-z", "0.8", str(svg), "-o", str(svg.with_suffix(".png"))], check=True)
        print(f"wrote {svg.with_suffix('.png')}")


if __name__ == "__main__":
    main()
