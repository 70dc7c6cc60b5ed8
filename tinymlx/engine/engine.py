"""Engine: requests in, Engine.step() (schedule -> run -> sample -> commit -> emit), outputs out. The only place that knows the order."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tinymlx.core import refusals
from tinymlx.core.batch import ScheduledBatch, StepRecord
from tinymlx.core.config import EngineConfig, default_kv_cache_bytes
from tinymlx.core.device_memory import hold_working_set, release_working_set
from tinymlx.core.images import ProcessedImage, PromptImages
from tinymlx.core.outputs import EngineStats, RequestOutput
from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.core.sequence import Sequence
from tinymlx.engine.image_intake import ImageIntake
from tinymlx.engine.requests import KeptTokens, Requests
from tinymlx.engine.run_ahead import Launched, RunAhead
from tinymlx.engine.stages import Stages
from tinymlx.engine.stats_reader import StatsReader
from tinymlx.engine.step_counters import StepCounters
from tinymlx.kv.coordinator import KVCoordinator, managers_of
from tinymlx.kv.disk.tier import DiskTier, DiskTierStage
from tinymlx.loader import DEFAULT_MODEL, resolve_model_dir
from tinymlx.loader.progress import LoadProgress, ProgressCallback
from tinymlx.loader.progress import ignore as ignore_progress
from tinymlx.models import (
    CausalLM,
    MTPModel,
    activation_dtype,
    check_tensor_parallel,
    load_model,
    load_mtp_head,
    read_model_args,
    stage_costs,
)
from tinymlx.models.registry import family_for
from tinymlx.ops import kernels
from tinymlx.parallel.parallel_runner import ParallelRunner
from tinymlx.parallel.pipeline_group import PipelineGroup, plan_stages
from tinymlx.parallel.pipeline_runner import PipelineRunner
from tinymlx.parallel.rank_group import RankGroup
from tinymlx.runner.model_runner import ModelRunner, PoolShrink
from tinymlx.sample.sampler import DeviceSample, Sampler, SampleRequest, SamplerOutput
from tinymlx.sample.structured import StructuredOutput
from tinymlx.sched.scheduler import RequestTooLargeError, Scheduler
from tinymlx.speculative.speculation import Speculation, make_speculation
from tinymlx.text.tokenizer import Tokenizer
from tinymlx.vision.processors import image_processor_for

Prompt = str | list[int] | list[dict]


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig, model_name: str = "model",
                 ranks: RankGroup | None = None, draft_model: CausalLM | None = None, image_processor=None,
                 pipeline: PipelineGroup | None = None):
        """`ranks`: with tensor parallelism, the worker ranks holding the other shards of `model`
        (`Engine.load` starts them and loads a shard on each). `draft_model`: the proposer of
        draft-model speculation (`config.speculative = "draft:<model>"`), or the checkpoint's MTP head
        (`"mtp"`: models.load_mtp_head); `Engine.load` loads either. `image_processor`: a vision-language
        checkpoint's (vision/processors.py; `Engine.load` reads it). `pipeline`: with pipeline parallelism, the
        workers running the stages before `model`'s, the last (`Engine.load` starts them and loads a stage on each)."""
        size = config.tensor_parallel_size
        if size != model.tensor_parallel_size or size != (ranks.size if ranks else pipeline.tensor_parallel_size
                                                         if pipeline else 1):
            raise ValueError(f"tensor_parallel_size={size} needs the model sharded over that many ranks: "
                             "build the engine with Engine.from_config or LLM, which start them")
        stages = config.pipeline_parallel_size
        if stages != model.stage.num_stages or stages != (pipeline.num_stages if pipeline else 1):
            raise ValueError(f"pipeline_parallel_size={stages} needs the model's last stage here and its other stages "
                             "on workers: build the engine with Engine.from_config or LLM, which start them")
        refusals.check(config, model.layer_specs(), _draft_facts(config, model, draft_model), model.args.model_type)
        self.model_name, self.tokenizer = model_name, tokenizer
        config = with_draft_pool(config, draft_model)  # the budget holds the draft's pool too
        self.weights_bytes = _weights_bytes(model)
        self.draft_weights_bytes = _weights_bytes(draft_model, besides=model) if draft_model is not None else 0
        resolve = functools.partial(config.resolve, model.args, activation_dtype(model), model.layer_specs(),
                                    self.weights_bytes + self.draft_weights_bytes)
        # Every stage's pool has the pages the fullest stage's share of a page fits in its budget.
        self.config = (min((resolve(held=stage.layers) for stage in pipeline.stages), key=lambda c: c.num_pages)
                       if pipeline is not None else resolve())
        self.ranks, self.pipeline = ranks, pipeline
        drafts_with_mtp = config.speculative_config is not None and "mtp" in config.speculative_config.proposers
        self.runner = (ParallelRunner(model, self.config, ranks) if ranks
                       else PipelineRunner(model, self.config, pipeline) if pipeline
                       else ModelRunner(model, self.config, keeps_hidden=drafts_with_mtp))
        self.images = ImageIntake(model.sees_images, image_processor, self.config)
        self.stages = Stages()  # the features at the step's stages (engine/stages.py), added below: one line each
        self.requests = Requests(tokenizer, self.config.max_model_len, self.stages, self._draft_counts)
        self._aborted: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self.disk_tier = (DiskTier.open(self.config, model, self.runner.kv_cache, self.runner.state_pools)
                          if self.config.disk_cache_dir else None)
        self.kv_coordinator = KVCoordinator(self.config.num_pages, self.config.block_size,
                                          self.config.enable_prefix_caching, self.runner.kv_group_windows,
                                          managers_of(model.layer_specs(), self.config, self.disk_tier),
                                          lower_tier=self.disk_tier, costs=self.runner.kv_group_costs)
        self.speculation = self._speculation(draft_model)
        self.scheduler = Scheduler(self.config, self.kv_coordinator,
                                   self.speculation.plan_drafts if self.speculation is not None else None)
        self.sampler = Sampler()
        self.counters = StepCounters(self.requests.seq_of)
        self._structured: StructuredOutput | None = None  # built by the first constrained request
        self._structured_lock = threading.Lock()  # validate() runs on callers' threads
        self.stages.add(self.counters)
        if self.speculation is not None:
            self.stages.add(self.speculation)
        if self.disk_tier is not None:
            self.stages.add(DiskTierStage(self.disk_tier, self.kv_coordinator, self.requests.seq_of,
                                          self.runner.stage_writes))
        is_alone = ranks is None and pipeline is None
        if is_alone:  # the workers' pools change only with a step's inputs: they grow, never shrink
            self.stages.add(PoolShrink(self.runner, self.kv_coordinator))
        # Overlapped steps (engine/run_ahead.py); `run_ahead.is_enabled = False` gives the synchronous step.
        self.run_ahead = RunAhead(self.scheduler, self.config.max_model_len, self.requests.live_seq,
                                  is_alone and self.kv_coordinator.allows_run_ahead and self.stages.can_run_ahead)
        self._stats = StatsReader(self.config, self.runner, self.kv_coordinator, self.scheduler, self.counters,
                                  self.speculation, self.disk_tier, self.weights_bytes, self.draft_weights_bytes,
                                  lambda: self.images.num_omitted_images)
        self._wired_before = hold_working_set()  # a Mac's GPU keeps the weights and pools resident

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
        draft, processor = None, _image_processor(model_dir)
        if config.speculative_config is not None and "draft" in config.speculative_config.proposers:
            name = config.speculative_config.draft_model
            draft_dir = resolve_model_dir(name, progress=progress, dtype=config.dtype)
            same = Tokenizer.from_dir(draft_dir).has_same_vocabulary(tokenizer)
            refusals.check(config, draft=refusals.DraftFacts(same_tokenizer=same))  # before its weights load
            draft = load_model(draft_dir, config.dtype)
        if config.pipeline_parallel_size > 1:
            return cls._load_pipeline(model_dir, tokenizer, config, model_name, draft, on_progress)
        size = config.tensor_parallel_size
        if size == 1:
            model = load_model(model_dir, config.dtype)
            if config.speculative_config is not None and "mtp" in config.speculative_config.proposers:
                draft = load_mtp_head(model_dir, model)
            on_progress(LoadProgress("pool", 0, 0))
            return cls(model, tokenizer, config, model_name, draft_model=draft, image_processor=processor)

        check_tensor_parallel(model_dir, config.dtype, size)  # before any process starts
        ranks = RankGroup.acquire(size, config.hostfile)
        # Every rank sizes its pool from the same budget, whatever memory its machine has, and the draft's
        # pool (on this rank) takes its share of every rank's pages.
        config = with_draft_pool(dataclasses.replace(
            config, kv_cache_bytes=config.kv_cache_bytes or default_kv_cache_bytes()), draft)

        def build() -> Engine:
            model = load_model(model_dir, config.dtype, shard=ranks.collectives)
            return cls(model, tokenizer, config, model_name, ranks=ranks, draft_model=draft,
                       image_processor=processor)

        return ranks.load(model_dir, config, build, lambda engine: engine.runner)

    @classmethod
    def _load_pipeline(cls, model_dir: Path, tokenizer: Tokenizer, config: EngineConfig, model_name: str,
                       draft: CausalLM | None, on_progress: ProgressCallback) -> Engine:
        """Start a worker for each stage but the last, load the last here and then the others on them, each with
        the pool this rank sized: the scheduler's page tables address every stage's pool alike. A draft model
        runs here, whole."""
        args, _ = read_model_args(model_dir)
        family = family_for(args.model_type).model
        refusals.check(config, family.layer_specs_of(args), model_type=args.model_type,  # before any worker starts
                       splits_into_stages=not family.sees_images)
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(model_dir, config.dtype, config.tensor_parallel_size)
        costs = stage_costs(model_dir, 2 * (config.max_model_len or args.max_position_embeddings))
        stages = plan_stages(costs, config.pipeline_parallel_size)
        pipeline = PipelineGroup(stages, config.hostfile, config.tensor_parallel_size)
        try:
            model = load_model(model_dir, config.dtype, shard=pipeline.collectives, stage=stages[-1])
            engine = cls(model, tokenizer, config, model_name, draft_model=draft, pipeline=pipeline)
            on_progress(LoadProgress("pool", 0, 0))
            pipeline.load(model_dir, engine.config, engine.runner.fingerprint())
        except BaseException:
            pipeline.close()
            raise
        return engine

    def _speculation(self, draft_model: CausalLM | None) -> Speculation | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        row_cost = kernels.chosen().step_cost
        full_group = self.runner.windows.index(None)  # a full-attention page group: there is one (core/refusals.py)
        if "mtp" in spec.proposers:
            head = sum(p.size for name, p in tree_flatten(draft_model.model.parameters()) if "embed_tokens" not in name)
            share = (head + self.runner.model.args.vocab_size * self.runner.model.args.hidden_size) \
                / _num_parameters(self.runner.model)  # the head's layers, and the lm_head it shares
            return make_speculation(spec, row_cost, self.requests.seq_of, self._draft_runner(draft_model), share,
                                    full_group, self.runner)
        if "draft" not in spec.proposers:
            return make_speculation(spec, row_cost, self.requests.seq_of)
        # A draft step costs about its share of the weights the target reads: every rank's shard, every stage's.
        cost = (_num_parameters(draft_model) / _num_parameters(self.runner.model) * self.config.tensor_parallel_size
                / self.config.pipeline_parallel_size)
        return make_speculation(spec, row_cost, self.requests.seq_of, self._draft_runner(draft_model), cost,
                                full_group)

    def _draft_runner(self, draft_model: CausalLM) -> ModelRunner:
        """The draft's own pool, as many pages as the target's: one page table addresses both."""
        config = dataclasses.replace(self.config, tensor_parallel_size=1, pipeline_parallel_size=1, hostfile=None,
                                     speculative=None, companion_page_bytes=0, resolved=False)
        specs = draft_model.layer_specs()
        return ModelRunner(draft_model, config.resolve(draft_model.args, activation_dtype(draft_model), specs),
                           page_limit=lambda: self.kv_coordinator.pool.boundary)

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
        self.run_ahead.in_flight = None
        if self.ranks is not None:
            self.ranks.release()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.disk_tier is not None:
            self.disk_tier.close()
        for runner in (self.runner, *(self.speculation.runners if self.speculation is not None else ())):
            runner.release()
        gc.collect()  # the model's modules may sit in reference cycles, which hold their arrays
        mx.clear_cache()  # MLX keeps freed buffers for reuse: hand them back to the system
        release_working_set(self._wired_before)

    def set_disk_cache(self, enabled: bool) -> None:
        """Turn the prefix cache's disk tier off (nothing read or written) or back on; no-op without one."""
        if self.disk_tier is not None:
            self.disk_tier.is_enabled = enabled

    def check_alive(self) -> None:
        """Raise a ParallelError if a tensor-parallel rank or a pipeline stage has failed (cheap: for idle loops)."""
        if self.ranks is not None:
            self.ranks.check_alive()
        if self.pipeline is not None:
            self.pipeline.check_alive()

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

    def validate(self, token_ids: list[int], params: SamplingParams, images: PromptImages | None = None) -> ValidRequest:
        """The one check of a request (SamplingParams checked its own fields when it was made): raises
        RequestTooLargeError when the prompt and max_tokens can never fit the context or the KV pool, and
        ValueError when the constraint does not compile. Each request passes here once: add_request calls
        it, unless a face that must answer before queueing called it (or `prepare`) itself and hands
        add_request the ValidRequest it returned as `checked`. `images`: the prompt's (`place_images`)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        if images is not None and images.whole_spans and images.longest_span > self.config.max_num_batched_tokens:
            raise RequestTooLargeError(
                f"an image of {images.longest_span} tokens must be computed in one step (its tokens attend to each "
                f"other), but a step computes at most {self.config.max_num_batched_tokens}: raise "
                "max_num_batched_tokens (--max-num-batched-tokens) or lower max_image_pixels")
        self.check_constraint(params)
        return ValidRequest(token_ids, params, images)

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None,
                checked: ValidRequest | None = None) -> ValidRequest:
        """The request encoded and validated; or `checked`, when `validate` returned it for these very token
        ids and params (a face checked them before queueing): it is not checked again."""
        if checked is not None and checked.token_ids is prompt and checked.params is params:
            return checked
        images: list[ProcessedImage] = []
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            prompt, images = self.images.split(prompt)
        token_ids, placed = self.place_images(self.encode_prompt(prompt), images)
        return self.validate(token_ids, params or SamplingParams(), placed)

    def place_images(self, token_ids: list[int], images: list[ProcessedImage]) -> tuple[list[int], PromptImages | None]:
        """The prompt with each image's placeholder token expanded to the image's tokens, and where they sit
        (None for a prompt without images)."""
        if not images:
            return token_ids, None
        return self.runner.model.place_images(token_ids, images,
                                              lambda text: self.tokenizer.encode(text, add_special_tokens=False))

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt this long could ever generate: what the context and the KV pool leave."""
        return self.scheduler.max_new_tokens(num_prompt_tokens)

    def kv_blocks_for(self, num_tokens: int) -> int:
        """The KV pool pages a sequence of `num_tokens` holds at most (in every kind of layer)."""
        return self.kv_coordinator.peak_blocks(num_tokens, self.config.max_num_batched_tokens)

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
                self.stages.add(self._structured)  # masks at sample, advances at commit
            return self._structured

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, tenant: str = "default", checked: ValidRequest | None = None) -> str:
        """Queue a request; raises ValueError (and queues nothing) when it can never be served. `checked`:
        what `validate` returned for this prompt's token ids and these params, if a face checked them first."""
        if self.is_closed:
            raise RuntimeError("this engine is closed (close() gave its model and KV pool back): load a new one")
        checked = self.prepare(prompt, params, checked)
        seq_id = next(self._seq_ids)
        request = dataclasses.replace(checked, request_id=request_id or f"req-{seq_id}", priority=priority,
                                      tenant=tenant)
        seq = Sequence(seq_id, request)
        self.requests.add(seq)  # ValueError for an id in use, before anything else holds the request
        if request.params.constraint is not None:
            self.structured_output.add(seq_id, request.params.constraint)
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now: its blocks are freed at once, its final output comes with the next step."""
        request = self.requests.get(request_id)
        if request is None:
            return
        self.scheduler.finish(request.seq, "abort")
        self._aborted.append(self.requests.output(request, ""))
        self.requests.forget(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> sample -> commit -> emit; features attach at the stages (engine/stages.py).

        Overlapped (engine/run_ahead.py), a step of decodes is committed ahead and left computing, and the
        next is scheduled and launched on its tokens before they are read: one step's commit and emit run
        while the device computes the next. Outputs come a step later, the same."""
        outputs, self._aborted = self._aborted, []
        if self.run_ahead.in_flight is not None and not self.run_ahead.can_schedule_ahead():
            outputs += self._finish(self.run_ahead.take())  # this schedule depends on its tokens
        launched = self._launch(self.stages.plan(self.scheduler.schedule()))
        outputs += self._finish(self.run_ahead.take())  # while `launched` computes
        if not self.run_ahead.hold(launched):
            outputs += self._finish(launched)
        return outputs

    def _launch(self, batch: ScheduledBatch) -> Launched:
        """run -> sample, on the device (a step scheduled ahead takes its pending tokens there)."""
        started = time.perf_counter()
        if batch.is_empty:
            return Launched(batch, None, started)
        run = functools.partial(self.runner.start, pending=self.run_ahead.pending) if self.run_ahead.is_on \
            else self.runner.run
        sample = self._sample(batch, self.stages.forward(batch, run))
        if sample is not None:
            mx.async_eval(sample.arrays)
        return Launched(batch, sample, started)

    def _finish(self, launched: Launched | None) -> list[RequestOutput]:
        """commit -> emit: the step's draws read off the device (its one host sync). A chunk whose request
        ended after it was scheduled ahead is dropped, its token computed for nothing."""
        if launched is None:
            return []
        batch, rows = self._live(launched.batch)
        if launched.batch.chunks and not batch.chunks:  # nothing left to read
            return []
        sampled = None
        if launched.sample is not None:
            drawn = launched.sample.resolve()
            sampled = SamplerOutput([drawn.token_ids[i] for i in rows], [drawn.logprobs[i] for i in rows])
        kept = self.requests.keep(batch, sampled) if sampled is not None else KeptTokens({}, {}, {})
        if not batch.is_empty:
            self.scheduler.commit(batch, kept.tokens, kept.finish_reasons)
        self.stages.observe(StepRecord(batch, 0.0 if batch.is_empty else time.perf_counter() - launched.started,
                                       kept.tokens))
        return self.requests.emit(kept.deltas)

    def _live(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[int]]:
        """The chunks of requests still here, and the rows of the step's draws that are theirs."""
        chunks, rows, row = [], [], 0
        for chunk in batch.chunks:
            if chunk.seq_id in self.requests:
                chunks.append(chunk)
                rows += range(row, row + chunk.num_logits)
            row += chunk.num_logits
        if len(chunks) < len(batch.chunks):
            batch = batch._replace(chunks=chunks, num_batched_tokens=sum(c.num_tokens for c in chunks))
        return batch, rows

    def _sample(self, batch: ScheduledBatch, logits: mx.array) -> DeviceSample | None:
        """One row per position that samples: a verified chunk's row i sees the drafts before it."""
        chunks = batch.sampled_chunks
        if not chunks:  # only mid-prompt chunks ran: nothing to sample yet
            return None
        rows = []
        for chunk in chunks:
            seq, drafts = self.requests.seq_of(chunk.seq_id), chunk.draft_token_ids
            rows += [SampleRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids + drafts[:i],
                                   seq.num_pending_tokens)
                     for i in range(chunk.num_logits)]
        return self.sampler.sample(logits, rows, self.stages.masks(chunks))

    def _draft_counts(self, seq_id: int) -> tuple[int, int]:
        return self.speculation.request_counts(seq_id) if self.speculation is not None else (0, 0)

    # -- observability ------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the KV coordinator's and scheduler's invariants (the state slots' among them), and the
        proposers' pools': as many pages as the target's, whose tables address them, and none allocated past."""
        self.scheduler.check()
        for runner in self.speculation.runners if self.speculation is not None else ():
            cache = runner.kv_cache
            assert cache.num_pages == self.config.num_pages, "a draft pool's pages differ from the target's"
            assert cache.num_allocated_pages <= cache.num_pages, "a draft pool grew past its pages"

    def stats(self) -> EngineStats:
        return self._stats.read(self.requests.seqs(), self.requests.metrics)

    @property
    def num_steps(self) -> int:
        return self.counters.num_steps

    @property
    def num_generated_tokens(self) -> int:
        return self.counters.num_generated_tokens

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self.counters.num_computed_prompt_tokens


def _image_processor(model_dir: Path):
    """A vision-language checkpoint's image processor (vision/processors.py); None for a text model."""
    args, config = read_model_args(model_dir)
    return image_processor_for(model_dir, config) if family_for(args.model_type).model.sees_images else None


def _draft_facts(config: EngineConfig, model: CausalLM, draft_model: CausalLM | None) -> refusals.DraftFacts | None:
    """What the refusals table needs of the proposer's model (None: the setting needs none)."""
    spec = config.speculative_config
    if spec is None or not {"draft", "mtp"} & set(spec.proposers):
        return None
    if draft_model is None or isinstance(draft_model, MTPModel) != ("mtp" in spec.proposers):
        return refusals.DraftFacts(is_loaded=False)
    return refusals.DraftFacts(draft_model.layer_specs(), vocab_size=draft_model.args.vocab_size,
                               target_vocab_size=model.args.vocab_size)


def with_draft_pool(config: EngineConfig, draft_model: CausalLM | None) -> EngineConfig:
    """`config` whose budget holds a draft model's or MTP head's pool beside the target's: as many pages as
    the target's (one page table addresses both), each of the draft's K/V for a block of tokens."""
    if draft_model is None:
        return config
    unsharded = dataclasses.replace(config, tensor_parallel_size=1)  # the draft runs whole, on rank 0
    page = unsharded.page_bytes(draft_model.args, activation_dtype(draft_model), draft_model.layer_specs())
    return dataclasses.replace(config, companion_page_bytes=page)


def _weights_bytes(model: CausalLM, besides: CausalLM | None = None) -> int:
    """The bytes of `model`'s parameters, less the arrays it shares with `besides` (an MTP head shares the
    target's embedding)."""
    shared = {id(array) for _, array in tree_flatten(besides.parameters())} if besides is not None else set()
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()) if id(array) not in shared)


def _num_parameters(model: CausalLM) -> int:
    return sum(array.size for _, array in tree_flatten(model.parameters()))
