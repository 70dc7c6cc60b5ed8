"""How a conversation is written down: the line under a reply, and a session as Markdown."""

from __future__ import annotations

from tinymlx.core.outputs import RequestMetrics
from tinymlx_ui.session import ChatSession


def reply_stats(metrics: RequestMetrics | None) -> str | None:
    """One line under a reply: what it cost and how much of its prompt the prefix cache served."""
    if metrics is None or not metrics.num_output_tokens:
        return None
    parts = [f"{metrics.num_output_tokens} tokens"]
    if metrics.ttft_s is not None:
        parts.append(f"TTFT {metrics.ttft_s:.2f} s")
    if metrics.tokens_per_s:
        parts.append(f"{metrics.tokens_per_s:.1f} tok/s")
    parts.append(f"{metrics.num_cached_tokens}/{metrics.num_prompt_tokens} prompt tokens from cache")
    return " · ".join(parts)


def session_markdown(session: ChatSession) -> str:
    lines = [f"# {session.title}", ""]
    if session.settings.system_prompt:
        lines += [f"*System:* {session.settings.system_prompt}", ""]
    for turn in session.turns:
        lines += ["## You" if turn["role"] == "user" else "## Assistant", ""]
        if turn.get("reasoning"):
            lines += ["<details><summary>Thought</summary>", "", turn["reasoning"], "", "</details>", ""]
        lines += [turn["content"], ""]
        images = turn.get("images", ())
        lines += [f"*Image: {image.name} ({image.width}×{image.height})*" for image in images] + [""] * bool(images)
        lines += [f"*{extra}*" for extra in (turn.get("note"), turn.get("stats")) if extra]
        if turn.get("note") or turn.get("stats"):
            lines.append("")
    return "\n".join(lines)
