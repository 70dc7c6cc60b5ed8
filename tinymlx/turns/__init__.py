"""The turn protocol: one chat turn as the three wire formats and the chat UI share it, chat templates,
tool-call and reasoning parsers."""
