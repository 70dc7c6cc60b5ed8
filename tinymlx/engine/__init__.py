"""The step (schedule -> run -> sample -> commit -> emit), the LLM API and the asyncio engine."""
