"""Engine.step(): schedule -> run -> sample -> detokenize -> commit. The only place that knows the order."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tinymlx.core.config import EngineConfig, default_kv_cache_bytes
from tinymlx.core.outputs import (
    CommCounts,
    EngineStats,
    KVGroupStats,
    RequestMetrics,
    RequestOutput,
    RequestStats,
    StateSlotStats,
    TokenLogprobs,
)
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.core.sequence import Sequence
from tinymlx.kv.block_manager import BlockManager
from tinymlx.kv.disk.tier import DiskTier
from tinymlx.kv.group_blocks import NULL_BLOCK
from tinymlx.kv.state_slots import StateSlots
from tinymlx.loader import DEFAULT_MODEL, resolve_model_dir
from tinymlx.loader.progress import LoadProgress, ProgressCallback
from tinymlx.loader.progress import ignore as ignore_progress
from tinymlx.models import CausalLM, SlidingWindow, activation_dtype, check_tensor_parallel, load_model
from tinymlx.parallel.parallel_runner import ParallelRunner
from tinymlx.parallel.rank_group import RankGroup
from tinymlx.runner.model_runner import ModelRunner
from tinymlx.sample.sampler import Sampler, SampleRequest
from tinymlx.sample.structured import StructuredOutput, TokenMasks
from tinymlx.sched.scheduler import Scheduler
from tinymlx.spec.speculative import DraftModelProposer, Speculation, accept, make_speculation
from tinymlx.text.detokenizer import IncrementalDetokenizer
from tinymlx.text.tokenizer import Tokenizer

Prompt = str | list[int] | list[dict]


@dataclass(eq=False)
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    num_reported_tokens: int = 0
    text: str = ""


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig, model_name: str = "model",
                 ranks: RankGroup | None = None, draft_model: CausalLM | None = None):
        """`ranks`: with tensor parallelism, the worker ranks holding the other shards of `model`
        (`Engine.load` starts them and loads a shard on each). `draft_model`: the proposer of
        draft-model speculation (`config.speculative = "draft:<model>"`; `Engine.load` loads it)."""
        size = config.tensor_parallel_size
        if size != model.tensor_parallel_size or size != (ranks.size if ranks else 1):
            raise ValueError(f"tensor_parallel_size={size} needs the model sharded over that many ranks: "
                             "build the engine with Engine.from_config or LLM, which start them")
        self.model_name, self.tokenizer = model_name, tokenizer
        self.config = config.resolve(model.args, activation_dtype(model), model.layer_specs())
        self.ranks = ranks
        self.runner = ParallelRunner(model, self.config, ranks) if ranks else ModelRunner(model, self.config)
        states = None
        if self.runner.recurrent_layers:
            states = StateSlots(self.config.max_num_seqs, self.config.num_state_checkpoints)
        self.disk_tier = DiskTier.open(self.config, model, self.runner.kv_cache) if self.config.disk_cache_dir else None
        self.block_manager = BlockManager(self.config.kv_group_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching, self.runner.windows, states,
                                          lower_tier=self.disk_tier)
        self.weights_bytes = sum(array.nbytes for _, array in tree_flatten(model.parameters()))
        self._block_bytes = [len(layers) * self.runner.kv_cache.block_nbytes
                             for _, layers in self.runner.kv_groups]  # one block of each group, in all its layers
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.sampler = Sampler()
        self.speculation = self._speculation(draft_model)
        if self.speculation is not None:
            self.scheduler.plan_drafts = self.speculation.plan_drafts
        self._structured: StructuredOutput | None = None  # built by the first constrained request
        self._structured_lock = threading.Lock()  # validate() runs on callers' threads
        self._requests: dict[str, _Request] = {}
        self._request_of_seq: dict[int, _Request] = {}
        self._aborted: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self._last_batch = (0, 0)
        self._last_step_comm = CommCounts()
        self.num_steps = self.num_generated_tokens = self.num_computed_prompt_tokens = 0

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True,
                    on_progress: ProgressCallback = ignore_progress) -> Engine:
        """`progress`: tqdm bars on the terminal; `on_progress`: every stage (download, verify, convert,
        load) as plain data, for a UI."""
        model_dir = resolve_model_dir(config.model, progress=progress, on_progress=on_progress, dtype=config.dtype)
        on_progress(LoadProgress("load", 0, 0))  # mx.load and the dtype conversion give no progress of their own
        return cls.load(model_dir, Tokenizer.from_dir(model_dir), config, str(config.model or DEFAULT_MODEL),
                        progress=progress, on_progress=on_progress)

    @classmethod
    def load(cls, model_dir: Path, tokenizer: Tokenizer, config: EngineConfig, model_name: str = "model",
             progress: bool = True, on_progress: ProgressCallback = ignore_progress) -> Engine:
        """Load the model in `model_dir` (and a draft model, if asked for); with tensor parallelism,
        start the ranks and load a shard on each. `on_progress` hears when the KV pool is allocated."""
        draft = None
        if config.speculative_config is not None and "draft" in config.speculative_config.proposers:
            name = config.speculative_config.draft_model
            draft_dir = resolve_model_dir(name, progress=progress, dtype=config.dtype)
            if not Tokenizer.from_dir(draft_dir).has_same_vocabulary(tokenizer):
                raise ValueError(f"the draft model {name!r} has another vocabulary than the target: a draft must "
                                 "tokenize exactly as the target does (same tokenizer), e.g. a smaller model of its family")
            draft = load_model(draft_dir, config.dtype)
        size = config.tensor_parallel_size
        if size == 1:
            model = load_model(model_dir, config.dtype)
            on_progress(LoadProgress("pool", 0, 0))
            return cls(model, tokenizer, config, model_name, draft_model=draft)

        check_tensor_parallel(model_dir, config.dtype, size)  # before any process starts
        ranks = RankGroup.acquire(size, config.hostfile)
        # Every rank sizes its pool from the same budget, whatever memory its machine has.
        config = dataclasses.replace(config, kv_cache_bytes=config.kv_cache_bytes or default_kv_cache_bytes())

        def build() -> Engine:
            model = load_model(model_dir, config.dtype, shard=ranks.collectives)
            return cls(model, tokenizer, config, model_name, ranks=ranks, draft_model=draft)

        return ranks.load(model_dir, config, build, lambda engine: engine.runner)

    def _speculation(self, draft_model: CausalLM | None) -> Speculation | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.runner.recurrent_layers:
            # Verifying k drafts would have to keep the recurrent state after each of them, to roll back to
            # the accepted one: k+1 copies of every sequence's state per step.
            raise ValueError(f"speculative={self.config.speculative!r}: speculative decoding is not supported for "
                             f"hybrid recurrent models ({self.runner.model.args.model_type}); run without it")
        if "draft" in spec.proposers:
            if draft_model is None:
                raise ValueError("draft-model speculation needs the draft model: build with Engine.load or LLM")
            target = self.runner.model.args
            # Same tokenizer is checked where both are loaded (Engine.load); sizes may differ by padding only.
            if draft_model.args.vocab_size > target.vocab_size:
                raise ValueError(f"the draft model {spec.draft_model!r} has a vocabulary of {draft_model.args.vocab_size} "
                                 f"tokens, the target {target.vocab_size}: a draft must share the target's vocabulary")
        device = "cpu" if mx.default_device() == mx.cpu else "gpu"
        if "draft" not in spec.proposers:
            return make_speculation(spec, device)
        # A draft step costs about its share of the weights the target reads.
        cost = _num_parameters(draft_model) / _num_parameters(self.runner.model) * self.config.tensor_parallel_size
        full_groups = [g for g, window in enumerate(self.runner.windows) if window is None]
        if not full_groups or any(isinstance(spec, SlidingWindow) for spec in draft_model.layer_specs()):
            raise ValueError("draft-model speculation needs a target with full-attention layers and a draft with "
                             "only those: the draft's pool shares the target's full-attention block tables")
        return make_speculation(spec, device, self._draft_runner(draft_model), cost, full_groups[0])

    def _draft_runner(self, draft_model: CausalLM) -> ModelRunner:
        """The draft's own pool, with the target's full-attention blocks: one block table addresses both."""
        config = dataclasses.replace(self.config, tensor_parallel_size=1, hostfile=None, speculative=None)
        specs = draft_model.layer_specs()
        return ModelRunner(draft_model, config.resolve(draft_model.args, activation_dtype(draft_model), specs))

    @property
    def is_closed(self) -> bool:
        return self.runner.model is None

    def close(self) -> None:
        """Give the tensor-parallel ranks back: they drop this model (the processes live on, for the
        next engine of this process); let the disk tier finish its queued writes (up to 10 s); and free
        the weights and KV pools, the draft model's too, so the next engine loads into their memory.
        A closed engine takes no more requests."""
        if self.is_closed:
            return
        if self.ranks is not None:
            self.ranks.release()
        if self.disk_tier is not None:
            self.disk_tier.close()
        proposers = self.speculation.proposers.values() if self.speculation is not None else ()
        for runner in (self.runner, *(p.runner for p in proposers if isinstance(p, DraftModelProposer))):
            runner.release()
        gc.collect()  # the model's modules may sit in reference cycles, which hold their arrays
        mx.clear_cache()  # MLX keeps freed buffers for reuse: hand them back to the system

    def set_disk_cache(self, enabled: bool) -> None:
        """Turn the prefix cache's disk tier off (nothing read or written) or back on; no-op without one."""
        if self.disk_tier is not None:
            self.disk_tier.is_enabled = enabled

    def check_alive(self) -> None:
        """Raise TensorParallelError if a tensor-parallel rank has failed (cheap: for idle loops)."""
        if self.ranks is not None:
            self.ranks.check_alive()

    # -- requests -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif prompt and all(isinstance(m, dict) for m in prompt):
            token_ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        else:
            token_ids = list(prompt)
            vocab = self.runner.model.args.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        return token_ids

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        self.check_constraint(params)

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt this long could ever generate: what the context and the KV pool leave."""
        return self.scheduler.max_new_tokens(num_prompt_tokens)

    def check_constraint(self, params: SamplingParams) -> None:
        """ValueError if the request's constraint does not compile against this tokenizer."""
        if params.constraint is not None:
            self.structured_output.grammar(params.constraint)

    @property
    def structured_output(self) -> StructuredOutput:
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutput(self.tokenizer.to_json(), self.tokenizer.eos_token_ids,
                                                    self.runner.model.args.vocab_size)
            return self._structured

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, tenant: str = "default") -> str:
        """Queue a request; raises ValueError (and queues nothing) when it can never be served."""
        if self.is_closed:
            raise RuntimeError("this engine is closed (close() gave its model and KV pool back): load a new one")
        params = params or SamplingParams()
        token_ids = self.encode_prompt(prompt)
        self.validate(token_ids, params)
        seq_id = next(self._seq_ids)
        request_id = request_id or f"req-{seq_id}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(seq_id, request_id, token_ids, params, priority=priority, tenant=tenant)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens, token_ids)
        request = _Request(seq, detokenizer, [] if params.logprobs is not None else None)
        if params.constraint is not None:
            self.structured_output.add(seq_id, params.constraint)
        self.scheduler.add(seq)
        self._requests[request_id] = self._request_of_seq[seq_id] = request
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now: its blocks are freed at once, its final output comes with the next step."""
        request = self._requests.get(request_id)
        if request is None:
            return
        self.scheduler.finish(request.seq, "abort")
        self._aborted.append(self._output(request, ""))
        self._forget(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        if batch.num_draft_slots:
            batch = self.speculation.fill(batch, {c.seq_id: self._request_of_seq[c.seq_id].seq for c in batch.chunks})
        self._last_batch = (batch.num_batched_tokens, len(batch.chunks))
        if batch.is_empty:
            self._shrink_pool_when_idle()
            return outputs
        self.num_steps += 1
        now = time.monotonic()
        for chunk in batch.chunks:
            seq = self._request_of_seq[chunk.seq_id].seq
            seq.first_scheduled_time = seq.first_scheduled_time or now
        self.num_computed_prompt_tokens += sum(
            max(0, min(c.start_position + len(c.token_ids), self._request_of_seq[c.seq_id].seq.num_prompt_tokens)
                - c.start_position)
            for c in batch.chunks
        )
        comm_before = self._comm_total
        if self.disk_tier is not None:  # evicted blocks saved, restored ones filled: before the forward overwrites
            self.disk_tier.before_forward(self.block_manager.cached_block)
        forward_start = time.perf_counter()
        logits = self.runner.run(batch)
        self._last_step_comm = self._comm_total - comm_before
        if self.disk_tier is not None:
            self.disk_tier.after_forward(((self._request_of_seq[c.seq_id].seq, c) for c in batch.chunks),
                                         self.block_manager.cached_block)
        chunks = batch.sampled_chunks
        if not chunks:  # only mid-prompt chunks ran: nothing to sample yet
            self.scheduler.commit(batch, {}, {})
            return outputs
        # One row per position that samples: a verified chunk's row i sees the drafts before it.
        rows = []
        for chunk in chunks:
            seq = self._request_of_seq[chunk.seq_id].seq
            drafts = _drafts(chunk)
            rows += [SampleRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids + drafts[:i])
                     for i in range(chunk.num_logits)]
        sampled = self.sampler(logits, rows, self._token_masks(chunks))
        # The forward and sampling, evaluated, teach the planner's step-cost curve: decode steps only (each
        # chunk one new token, plus its drafts), the steps it plans; a prefill's rows cost otherwise.
        if self.speculation is not None and all(len(c.token_ids) - c.num_draft_tokens == 1 for c in batch.chunks):
            self.speculation.observe_step(batch.num_batched_tokens, time.perf_counter() - forward_start)

        now = time.monotonic()
        tokens, reasons, deltas, row = {}, {}, {}, 0
        for chunk in chunks:
            request = self._request_of_seq[chunk.seq_id]
            seq, drafts = request.seq, _drafts(chunk)
            samples = sampled.token_ids[row:row + chunk.num_logits]
            logprobs = sampled.logprobs[row:row + chunk.num_logits]
            row += chunk.num_logits
            kept = accept(drafts, samples)
            constrained = self._structured is not None and self._structured.is_constrained(seq.seq_id)
            if self.speculation is not None:
                self.speculation.record(seq.seq_id, len(drafts), len(kept) - 1)
                seq.num_draft_tokens += len(drafts)
                seq.num_accepted_tokens += len(kept) - 1
            seq.first_token_time = seq.first_token_time or now
            tokens[seq.seq_id], deltas[seq.seq_id] = [], ""
            for token, token_logprobs in zip(kept, logprobs):
                tokens[seq.seq_id].append(token)
                if request.logprobs is not None:
                    request.logprobs.append(token_logprobs)
                deltas[seq.seq_id] += request.detokenizer.add(token)
                grammar_done = constrained and self._structured.advance(seq.seq_id, token)
                reason = "stop" if grammar_done else self._finish_reason(seq, token, request.detokenizer,
                                                                            len(tokens[seq.seq_id]))
                if reason is not None:  # a stop inside an accepted run: nothing after it is kept
                    reasons[seq.seq_id] = reason
                    seq.finish_time = now
                    if request.detokenizer.stop_matched is None:
                        deltas[seq.seq_id] += request.detokenizer.flush()
                    break
        self.num_generated_tokens += sum(len(t) for t in tokens.values())
        self.scheduler.commit(batch, tokens, reasons)

        for chunk in chunks:
            request = self._request_of_seq[chunk.seq_id]
            outputs.append(self._output(request, deltas[chunk.seq_id]))
            if request.seq.is_finished:
                self._forget(request)
        self._shrink_pool_when_idle()
        return outputs

    def _shrink_pool_when_idle(self) -> None:
        """With no request left, give back the pool's arrays past the last block held or cached. Not under
        tensor parallelism: the workers' pools change only with a step's inputs (they grow, never shrink)."""
        if not self._requests and self.ranks is None:
            self.runner.shrink_pools([group.num_blocks_reached for group in self.block_manager.groups])

    def _token_masks(self, chunks) -> TokenMasks | None:
        """The constrained rows' allowed tokens: one row per sampled position, in sampler row order."""
        if self._structured is None:
            return None
        constrained, row = [], 0
        for chunk in chunks:
            if self._structured.is_constrained(chunk.seq_id):
                constrained.append((chunk.seq_id, row, _drafts(chunk)))
            row += chunk.num_logits
        return self._structured.masks(constrained) if constrained else None

    def _finish_reason(self, seq: Sequence, token: int, detokenizer: IncrementalDetokenizer,
                       num_new: int) -> str | None:
        """Why `seq` ends at `token`, the num_new-th token it gets this step (not yet appended)."""
        params = seq.params
        if detokenizer.stop_matched is not None or token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            return "stop"
        if seq.num_output_tokens + num_new >= params.max_tokens or seq.num_tokens + num_new >= self.config.max_model_len:
            return "length"
        return None

    def _output(self, request: _Request, delta_text: str) -> RequestOutput:
        seq = request.seq
        output_ids = seq.output_token_ids
        delta_ids = output_ids[request.num_reported_tokens:]
        request.num_reported_tokens = len(output_ids)
        request.text += delta_text
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, text=request.text,
            token_ids=output_ids, delta_text=delta_text, delta_token_ids=delta_ids, finished=seq.is_finished,
            finish_reason=seq.finish_reason, logprobs=list(request.logprobs) if request.logprobs is not None else None,
            metrics=self._metrics(seq), stop_sequence=request.detokenizer.stop_matched if seq.is_finished else None,
        )

    @staticmethod
    def _metrics(seq: Sequence) -> RequestMetrics:
        def since_arrival(t: float | None) -> float | None:
            return None if t is None else t - seq.arrival_time

        return RequestMetrics(
            arrival_time=seq.arrival_time, queue_s=since_arrival(seq.first_scheduled_time),
            ttft_s=since_arrival(seq.first_token_time),
            e2e_s=since_arrival(seq.finish_time), num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=seq.num_output_tokens,
            num_preemptions=seq.num_preemptions, num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
        )

    def _forget(self, request: _Request) -> None:
        del self._requests[request.seq.request_id]
        del self._request_of_seq[request.seq.seq_id]
        if self.speculation is not None:
            self.speculation.forget(request.seq.seq_id)
        if self._structured is not None:
            self._structured.forget(request.seq.seq_id)

    # -- observability ------------------------------------------------------------------------
    @property
    def _comm_total(self) -> CommCounts:
        return self.ranks.collectives.counts if self.ranks is not None else CommCounts()

    def check(self) -> None:
        """Assert the block manager's and scheduler's invariants."""
        self.scheduler.check()

    def stats(self) -> EngineStats:
        bm, now, spec = self.block_manager, time.monotonic(), self.speculation
        requests = []
        for request in self._requests.values():
            seq = request.seq
            # A live request's rate so far: its metrics as if it finished now.
            metrics = dataclasses.replace(self._metrics(seq), e2e_s=(seq.finish_time or now) - seq.arrival_time)
            requests.append(RequestStats(
                request_id=seq.request_id, status=seq.status.value, num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                ttft_s=metrics.ttft_s, tokens_per_s=metrics.tokens_per_s,
                block_tables=tuple(tuple(b for b in table if b != NULL_BLOCK) for table in seq.block_tables),
            ))
        cache = self.runner.kv_cache
        groups = tuple(KVGroupStats(
            window=group.window, num_layers=len(layers), num_blocks=group.num_blocks,
            num_blocks_used=group.num_used_blocks, num_blocks_cached=group.num_cached_blocks,
            cached_block_ids=group.prefix_cache.evictable_block_ids,
            nbytes=sum(cache.layer_nbytes(layer) for layer in layers),
        ) for group, (_, layers) in zip(bm.groups, self.runner.kv_groups))
        return EngineStats(
            block_size=bm.block_size, num_blocks_total=bm.num_blocks, num_blocks_used=bm.num_used_blocks,
            num_blocks_cached=bm.num_cached_blocks, num_blocks_free=bm.num_free_blocks - bm.num_cached_blocks,
            kv_groups=groups, kv_cache_bytes=cache.nbytes,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_batched_tokens=self._last_batch[0], num_batched_seqs=self._last_batch[1],
            prefix_hit_rate=bm.prefix_hit_rate, num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps, num_generated_tokens=self.num_generated_tokens,
            num_computed_prompt_tokens=self.num_computed_prompt_tokens, requests=tuple(requests),
            tensor_parallel_size=self.config.tensor_parallel_size, comm_last_step=self._last_step_comm,
            comm_total=self._comm_total, speculative=self.config.speculative,
            num_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            num_verified_chunks=spec.num_verified_chunks if spec else 0,
            proposers=tuple(spec.counts.values()) if spec else (),
            step_cost=tuple(spec.target_cost.points().items()) if spec else (),
            draft_step_cost=tuple(spec.draft_cost.points().items()) if spec and spec.draft_cost else (),
            state_slots=self._state_slot_stats(), weights_bytes=self.weights_bytes,
            kv_cache_bytes_used=sum(n * g.num_used_blocks for n, g in zip(self._block_bytes, bm.groups)),
            kv_cache_bytes_budget=sum(n * g.num_blocks for n, g in zip(self._block_bytes, bm.groups)),
            disk_cache=self.disk_tier.stats(bm.num_lower_hits, bm.num_lower_misses) if self.disk_tier else None,
        )

    def _state_slot_stats(self) -> StateSlotStats | None:
        states = self.block_manager.states
        if states is None:
            return None
        return StateSlotStats(
            num_layers=len(self.runner.recurrent_layers), num_live_slots=states.num_live,
            num_live_used=states.num_live_used, num_checkpoint_slots=states.num_checkpoints,
            num_checkpoints_cached=states.num_cached_checkpoints, num_resumed=states.num_resumed,
            num_resumed_tokens=states.num_resumed_tokens, nbytes=self.runner.state_cache.nbytes,
        )


def _drafts(chunk) -> list[int]:
    return chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens:] if chunk.num_draft_tokens else []


def _num_parameters(model: CausalLM) -> int:
    return sum(array.size for _, array in tree_flatten(model.parameters()))
