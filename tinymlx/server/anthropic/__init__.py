"""Anthropic's Messages API: content blocks in, content blocks out."""
