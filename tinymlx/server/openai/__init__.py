"""OpenAI's chat completions and completions: request bodies and the replies built for them."""
