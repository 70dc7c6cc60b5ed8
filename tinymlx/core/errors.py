"""Errors every layer may raise: the bottom of the import graph, importing nothing of tinymlx."""


class ModelLoadError(Exception):
    """A model that cannot be found or read; the message says what was wrong and what to do."""
