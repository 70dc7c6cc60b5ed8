"""The engine's live requests, from a step's draws to what callers read: each request's detokenizer,
logprobs and reported counts; the tokens each keeps of a step (up to the first that ends it, and why);
its outputs and metrics. The scheduler appends the kept tokens (sched/scheduler.py); this module only
reads the sequences."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tinymlx.core.batch import ScheduledBatch
from tinymlx.core.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from tinymlx.core.sequence import Sequence
from tinymlx.engine.stages import Stages
from tinymlx.sample.sampler import SamplerOutput
from tinymlx.text.detokenizer import IncrementalDetokenizer
from tinymlx.text.tokenizer import Tokenizer


@dataclass(eq=False)
class Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    num_reported_tokens: int = 0
    text: str = ""


@dataclass(frozen=True)
class KeptTokens:
    """What a step's draws leave each sampling sequence: its tokens, why it ends (if it does), its text."""

    tokens: dict[int, list[int]]
    finish_reasons: dict[int, str]
    deltas: dict[int, str]


class Requests:
    """The live requests, by request id and by sequence id."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, stages: Stages,
                 draft_counts: Callable[[int], tuple[int, int]]):
        """`stages`: speculation accepts and grammars advance as tokens are kept (engine/stages.py);
        `draft_counts`: a sequence's (drafted, accepted) tokens, for its metrics."""
        self.tokenizer, self.max_model_len, self.stages = tokenizer, max_model_len, stages
        self._draft_counts = draft_counts
        self._by_id: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._by_seq

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def seq_of(self, seq_id: int) -> Sequence:
        return self._by_seq[seq_id].seq

    def live_seq(self, seq_id: int) -> Sequence | None:
        request = self._by_seq.get(seq_id)
        return request.seq if request is not None else None

    def seqs(self) -> list[Sequence]:
        return [request.seq for request in self._by_id.values()]

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        params = seq.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                             seq.prompt_token_ids)
        self._by_id[seq.request_id] = self._by_seq[seq.seq_id] = Request(
            seq, detokenizer, [] if params.logprobs is not None else None)

    def keep(self, batch: ScheduledBatch, sampled: SamplerOutput) -> KeptTokens:
        """Each sampling sequence's accepted tokens, detokenized, up to the first that ends it."""
        tokens, reasons, deltas, row = {}, {}, {}, 0
        for chunk in batch.sampled_chunks:
            request = self._by_seq[chunk.seq_id]
            samples = sampled.token_ids[row:row + chunk.num_logits]
            logprobs = sampled.logprobs[row:row + chunk.num_logits]
            row += chunk.num_logits
            tokens[chunk.seq_id], deltas[chunk.seq_id] = [], ""
            for token, token_logprobs in zip(self.stages.accept(chunk, samples), logprobs):
                tokens[chunk.seq_id].append(token)
                if request.logprobs is not None:
                    request.logprobs.append(token_logprobs)
                is_end = self._is_end_token(request, token)
                if not is_end:  # its text is no part of the reply, as in vLLM
                    deltas[chunk.seq_id] += request.detokenizer.add(token)
                reason = self._finish_reason(request, token, is_end, len(tokens[chunk.seq_id]))
                if reason is not None:  # a stop inside an accepted run: nothing after it is kept
                    reasons[chunk.seq_id] = reason
                    if request.detokenizer.stop_matched is None:
                        deltas[chunk.seq_id] += request.detokenizer.flush()
                    break
        return KeptTokens(tokens, reasons, deltas)

    def _finish_reason(self, request: Request, token: int, is_end: bool, num_new: int) -> str | None:
        """Why the request ends at `token` (`is_end`: an EOS or stop token), the num_new-th token it keeps
        this step (not yet in its token ids)."""
        seq, params = request.seq, request.seq.params
        if self.stages.advance(seq.seq_id, token):  # the grammar is complete
            return "stop"
        if request.detokenizer.stop_matched is not None or is_end:
            return "stop"
        num_tokens = len(seq.token_ids) + num_new
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def _is_end_token(self, request: Request, token: int) -> bool:
        params = request.seq.params
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids)

    def emit(self, deltas: dict[int, str]) -> list[RequestOutput]:
        """The outputs of the sequences that sampled (after the scheduler appended their tokens); finished
        requests are forgotten."""
        outputs = []
        for seq_id, delta in deltas.items():
            request = self._by_seq[seq_id]
            outputs.append(self.output(request, delta))
            if request.seq.is_finished:
                self.forget(request)
        if not self._by_id:
            self.stages.idle()
        return outputs

    def output(self, request: Request, delta_text: str) -> RequestOutput:
        seq = request.seq
        output_ids = seq.output_token_ids
        delta_ids = output_ids[request.num_reported_tokens:]
        request.num_reported_tokens = len(output_ids)
        request.text += delta_text
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, text=request.text,
            token_ids=output_ids, delta_text=delta_text, delta_token_ids=delta_ids, finished=seq.is_finished,
            finish_reason=seq.finish_reason, logprobs=list(request.logprobs) if request.logprobs is not None else None,
            metrics=self.metrics(seq), stop_sequence=request.detokenizer.stop_matched if seq.is_finished else None,
        )

    def metrics(self, seq: Sequence) -> RequestMetrics:
        def since_arrival(t: float | None) -> float | None:
            return None if t is None else t - seq.arrival_time

        drafted, accepted = self._draft_counts(seq.seq_id)
        return RequestMetrics(
            arrival_time=seq.arrival_time, queue_s=since_arrival(seq.first_scheduled_time),
            ttft_s=since_arrival(seq.first_token_time),
            e2e_s=since_arrival(seq.finish_time), num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.output_token_ids),  # the tokens read: not a step in flight's
            num_preemptions=seq.num_preemptions, num_draft_tokens=drafted, num_accepted_tokens=accepted,
        )

    def forget(self, request: Request) -> None:
        del self._by_id[request.seq.request_id]
        del self._by_seq[request.seq.seq_id]
        self.stages.forget(request.seq.seq_id)
