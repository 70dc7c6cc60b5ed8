"""Turns, chat templates, tool-call and reasoning parsers: shared by the server and the chat UI."""
