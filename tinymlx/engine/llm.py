"""LLM: the synchronous facade over Engine (generate, chat, stream, stats)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from tinymlx.core.config import EngineConfig, takes_options
from tinymlx.core.outputs import EngineStats, RequestOutput
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.engine.engine import Engine, Prompt

Params = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    @takes_options
    def __init__(self, model: str | None = None, *, progress: bool = True, **options):
        """`options`: EngineConfig's fields (core/config.py declares each, with its help), and no others.
        `tensor_parallel_size` > 1 splits every layer over that many ranks: worker processes on this
        machine, or on the machines a `hostfile` lists (this one first). `close()` gives them back.
        `speculative`: "ngram" (prompt lookup), "draft:<model>" or both, "ngram+draft:<model>", or "mtp[:k]"
        (a Qwen3.5/3.6/Next checkpoint's own head), proposes tokens that one forward verifies; the output is
        the same as without. `kv_cache_dtype="int8"` stores
        K/V as int8 codes (see kv_layout.py): about twice the tokens of a bfloat16 pool in the same bytes.
        `disk_cache_dir`: the prefix cache's disk tier, kept under `disk_cache_gb` GiB (default 4): blocks
        evicted from memory and prompts' blocks are saved there, and a later process with the same model
        reuses them."""
        self.engine = Engine.from_config(EngineConfig.from_options(model=model, **options), progress=progress)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Free the weights and KV pool (a draft model's too) and give back the tensor-parallel ranks (see
        Engine.close): the next LLM loads into that memory. This one serves nothing more."""
        self.engine.close()

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: Params = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order.

        A single prompt may be a string or a list of token ids. Every request is validated before
        any is queued, so one impossible request raises without leaving the others half-done.
        """
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        return self._run_all(list(prompts), params, use_tqdm)

    def chat(self, conversations: list[dict] | Sequence[list[dict]], params: Params = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Like generate, for conversations (lists of {"role", "content"} messages)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run_all(list(conversations), params, use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield deltas for one prompt as they are produced; closing the iterator aborts it."""
        request_id = self.engine.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _run_all(self, prompts: list[Prompt], params: Params, use_tqdm: bool) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        # Every request is checked before any is queued: one that can never be served leaves nothing half-done.
        requests = [self.engine.prepare(prompt, p) for prompt, p in zip(prompts, params)]
        ids = [self.engine.add_request(r.token_ids, r.params, checked=r) for r in requests]
        index = {request_id: i for i, request_id in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req") as bar:
            while any(r is None for r in results):
                for output in self.engine.step():
                    if output.finished and output.request_id in index:
                        results[index[output.request_id]] = output
                        bar.update()
        return results
