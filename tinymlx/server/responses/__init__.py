"""OpenAI's Responses API: input items, tools, reasoning items, the reply, its stream and store."""
