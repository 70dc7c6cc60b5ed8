"""One colour per session, shared by its tab, its replies, its panel row and its blocks in the block map."""

SESSION_COLORS = ("#4fc3f7", "#ff8a65", "#aed581", "#ba68c8", "#ffd54f", "#4db6ac", "#f06292", "#9575cd")


def session_color(session_id: int) -> str:
    return SESSION_COLORS[session_id % len(SESSION_COLORS)]
