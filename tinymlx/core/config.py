"""EngineConfig: what the user asked for, frozen. Sizes that depend on the model are derived once
by `resolve()`, which returns a new config instead of patching this one."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import mlx.core as mx

from tinymlx.core import refusals
from tinymlx.core.device_memory import working_set_bytes
from tinymlx.core.dtypes import ram_bytes
from tinymlx.core.kv_layout import KV_CACHE_DTYPES, KVLayout
from tinymlx.core.layer_specs import (
    FullAttention,
    LayerSpec,
    block_costs,
    held_places,
    kv_groups,
    kv_piece_shape,
    peak_blocks,
    pool_block_layers,
    state_bytes_per_slot,
)
from tinymlx.core.options import flag_of, gib_to_bytes, option, positive_gib
from tinymlx.core.speculative_config import SpeculativeConfig
from tinymlx.core.step_memory import StepShape, activation_bytes

DTYPES = ("auto", "float32", "bfloat16", "float16", "q8", "q4", "native")
POLICIES = ("fcfs", "priority", "fair")
IMAGE_POLICIES = ("note", "refuse")
DEFAULT_IMAGE_CACHE_BYTES = 256 << 20  # about 40 screenshots of a 3B Qwen2.5-VL's features in float32
DEFAULT_DISK_CACHE_GB = 4.0  # the disk tier's bound when only its directory is given
CHAT_DISK_CACHE_GB = 2.0  # `tinymlx chat`'s default disk tier: a modest share of the user's disk
# The default KV pool holds two whole contexts (one with max_num_seqs=1): one conversation can grow to the
# model's full context while another session streams, and chats of usual length share it many at once.
# A bigger pool only pays under heavy concurrent load (`--kv-cache-gb`, `--num-pages`). It is a budget:
# the pool's arrays grow to it as pages are held (kv_cache.py), and it is capped at 2 GiB and 15% of RAM.
_DEFAULT_POOL_CONTEXTS = 2
_MAX_DEFAULT_KV_CACHE_BYTES = 2 << 30
_MAX_RAM_FRACTION = 0.15
# On a Mac's GPU the weights, every pool and the activations' allowance fit under Metal's working set
# (core/device_memory.py), with this share of it left to the framework (MLX's buffer cache, the OS's share).
_WORKING_SET_HEADROOM = 0.1
# The activations' allowance (core/step_memory.py): a full step (max_num_batched_tokens) attending this many
# tokens of context, at most this share of a memory budget, and never less than the smallest step (a block of
# tokens attending the longest context). Past the context, the scheduler shrinks prefill chunks to stay within it.
_ACTIVATION_CONTEXT = 4096
_MAX_ACTIVATION_SHARE = 0.25


class ModelShape(Protocol):
    """What sizing the pool and the activations reads of a model's config (models.base.BaseModelArgs has it)."""

    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    head_dim: int
    num_hidden_layers: int
    num_key_value_heads: int
    max_position_embeddings: int


@dataclass(frozen=True)
class EngineConfig:
    """Each user field is an `option` (options.py): its default, its command-line flag and help, declared
    here once. `LLM(**options)` takes these fields and no others (`from_options`), and cli.py builds the
    engine flags of `chat`, `serve` and `generate` from them. Fields without a flag are derived by resolve()."""

    model: str | None = option(None, "--model", help="directory, .gguf file, offline model name or Hub repo id "
                               "(default: the embedded Qwen2.5-Coder-0.5B-Instruct)")
    dtype: str = option("auto", "--dtype", choices=DTYPES, help="native: a GGUF's own quantization (or an "
                        "MLX-quantized checkpoint's) on MLX's quantized layers, no float copy; auto: native on a GPU, "
                        "float32 on the CPU unless its float32 weights exceed half the RAM (default: auto)")
    block_size: int = option(16, "--block-size")
    # None: as many as `kv_cache_bytes` holds. A page is `block_size` tokens of K/V; a hybrid's layer kinds
    # share the pool, each block of one kind taking a page per run of as many layers as the kinds have in
    # common (kv/block_pool.py).
    num_pages: int | None = option(None, "--num-pages", exclusive="pool",
                                   help="KV pool size in pages of --block-size tokens, shared by every kind of "
                                   "layer (default: see --kv-cache-gb)")
    # None: two whole contexts, capped at min(2 GiB, 15% of RAM). It holds every pool the engine allocates: the
    # KV pages, recurrent state slots, and a draft model's or MTP head's pool beside the target's.
    kv_cache_bytes: int | None = option(None, "--kv-cache-gb", exclusive="pool", parse=gib_to_bytes, metavar="GiB",
                                        help="memory for the KV cache in GiB: the pool's pages, recurrent state slots, "
                                        "and a draft model's or MTP head's pool (default: two whole contexts of the "
                                        "model, at most 2 GiB and 15%% of RAM)")
    # None: the KV cache's default (see kv_cache_bytes) plus the activations' allowance. One number for
    # everything the engine allocates beyond the weights: the pools get what the activations leave.
    memory_budget_bytes: int | None = option(None, "--memory-gb", exclusive="pool", parse=gib_to_bytes,
                                             metavar="GiB", help="memory beyond the weights in GiB: every pool of "
                                             "the KV cache and the largest step's activations, which the scheduler "
                                             "keeps within their share by sizing prefill chunks (default: see "
                                             "--kv-cache-gb, plus the activations)")
    # "auto": the model's activation dtype; "int8": see kv_layout.py
    kv_cache_dtype: str = option("auto", "--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                                 help="what the KV pool stores: the model's activation dtype (auto), or int8 codes "
                                 "with a scale and bias per token and head (about 2x the tokens of bfloat16, 3.5x of "
                                 "float32)")
    max_num_seqs: int = option(32, "--max-num-seqs")
    max_num_batched_tokens: int = option(512, "--max-num-batched-tokens")
    # Ranks splitting every layer; >1 starts worker processes. The command line's default comes from --hostfile.
    tensor_parallel_size: int = option(1, "--tp", "--tensor-parallel-size", cli_default=None,
                                       help="split every layer over this many ranks (worker processes; default 1, "
                                       "or the hostfile's number of hosts)")
    # Stages of contiguous layers, each on its own ranks; >1 starts worker processes (parallel/pipeline_group.py).
    pipeline_parallel_size: int = option(1, "--pp", "--pipeline-parallel-size",
                                         help="split the layers into this many stages, one after another, each on "
                                         "its own rank (worker processes; default 1); a hostfile lists tp x pp hosts")
    # An mlx.launch-style JSON hostfile; None: every rank on this machine
    hostfile: str | None = option(None, "--hostfile", help="mlx.launch-style JSON hostfile: run the ranks on these "
                                  "machines, this one first (see the README's two-Mac set-up)")
    # "ngram" | "draft:<model>" | "ngram+draft:<model>" (options: see SpeculativeConfig.parse)
    speculative: str | None = option(None, "--speculative", help="speculative decoding: 'ngram' (prompt lookup), "
                                     "'draft:<model>' (a smaller model with the same vocabulary), "
                                     "'ngram+draft:<model>' (each sequence the one that suits it) or 'mtp[:k]' "
                                     "(a Qwen3.5/3.6/Next checkpoint's own MTP head); same output, faster decode")
    scheduling_policy: str = option("fcfs", "--policy", choices=POLICIES,
                                    help="which waiting request runs next: arrival order, `priority` (lower first), "
                                    "or fair shares across tenants (the API's `user`)")
    # The prefix cache's disk tier (kv/disk/): a directory of block files, kept under disk_cache_gb GiB.
    disk_cache_dir: str | None = option(
        None, "--disk-cache", exclusive="disk", metavar="DIR",
        help="keep the prefix cache's blocks in DIR too, so a later run reuses long prompts (chat: on by default, "
        "under the user cache directory's prefix-cache/)",
        off=("--no-disk-cache", "no disk tier for the prefix cache (chat's default one included)"))
    disk_cache_gb: float | None = option(None, "--disk-cache-gb", parse=positive_gib, metavar="GiB",
                                         help=f"the disk tier's bound; the least recently used blocks go first "
                                         f"(default {DEFAULT_DISK_CACHE_GB:g}, chat's {CHAT_DISK_CACHE_GB:g})")
    max_model_len: int | None = option(None, "--max-model-len", help="the longest context a request may fill, "
                                       "prompt and reply, in tokens (default: the model's)")
    enable_prefix_caching: bool = option(True, "--enable-prefix-caching", help="reuse the KV blocks of prompts' "
                                         "shared prefixes across requests (default: on)")
    # Hybrid models: the most recurrent-state checkpoints kept for prefix hits, in pages of the KV pool
    # (None: as many as its pages hold).
    num_state_checkpoints: int | None = option(None, "--num-state-checkpoints",
                                               help="models with recurrent layers: the most recurrent-state "
                                               "checkpoints kept for prefix-cache hits, in pages of the KV pool "
                                               "beside the blocks (default: as many as it holds)")
    # Images (vision-language models: models/qwen2_5_vl.py). What a text-only model does with one: a note.
    images: str = option("note", "--images", choices=IMAGE_POLICIES,
                         help="what a model that reads text only does with an image: replace it with a one-line "
                         "note that it was omitted (note, the default), or refuse the request (refuse: a 400)")
    max_image_pixels: int = option(1_003_520, "--max-image-pixels", metavar="PIXELS",
                                   help="resize larger images to at most this many pixels before the vision tower "
                                   "(default 1003520: Qwen's 1280 image tokens)")
    max_images_per_request: int = option(16, "--max-images-per-request")
    max_image_bytes: int = option(20 << 20, "--max-image-bytes", metavar="BYTES",
                                  help="the most encoded image bytes one request may send (default 20 MiB)")
    image_cache_bytes: int = option(DEFAULT_IMAGE_CACHE_BYTES, "--image-cache-gb", parse=gib_to_bytes,
                                    metavar="GiB", help="the vision encoder's cache of image features, by image "
                                    "content (default 0.25)")
    # The bytes each page also takes in pools that the target's page tables address (a draft model's, an MTP
    # head's: as many pages as the target's). Set by the engine from the draft before resolve(), so that the
    # budget holds them too, and sent to tensor-parallel ranks with the rest, so that every rank agrees.
    companion_page_bytes: int = 0
    # Set by resolve(): the model's dims a step's activations are estimated from, and the bytes the largest
    # step may take (core/step_memory.py); the scheduler sizes chunks to stay within them.
    step_shape: StepShape | None = None
    activation_bytes: int = 0
    state_slot_pages: int = 0  # set by resolve(): the pages one recurrent-state checkpoint takes (kv/state_slots.py)
    resolved: bool = False  # set by resolve(): the sizes above fit a model

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """The config of these user options (LLM's kwargs); a TypeError names any other and lists them all."""
        unknown = [name for name in options if name not in OPTIONS]
        if unknown:
            raise TypeError(f"unknown engine option{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; "
                            f"the options are: {', '.join(OPTIONS)}")
        return cls(**options)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size", "max_image_pixels", "max_images_per_request", "max_image_bytes",
                     "image_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_state_checkpoints is not None and self.num_state_checkpoints < 0:
            raise ValueError(f"num_state_checkpoints must be >= 0 or None, got {self.num_state_checkpoints}")
        for name in ("num_pages", "kv_cache_bytes", "memory_budget_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.images not in IMAGE_POLICIES:
            raise ValueError(f"images must be one of {IMAGE_POLICIES}, got {self.images!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        if self.speculative is not None:
            SpeculativeConfig.parse(self.speculative)  # a bad spec fails here, before anything loads
        if self.hostfile is not None and self.num_ranks == 1:
            raise ValueError("a hostfile places parallel ranks: set tensor_parallel_size (or pipeline_parallel_size) so "
                             "that tensor_parallel_size x pipeline_parallel_size is its number of hosts")
        self._check_disk_cache()
        refusals.check(self)  # the pairings of features the engine does not do yet

    def _check_disk_cache(self) -> None:
        if self.disk_cache_gb is not None and not 0 < self.disk_cache_gb < float("inf"):
            raise ValueError(f"disk_cache_gb must be a positive number of GiB, got {self.disk_cache_gb}")
        if self.disk_cache_dir is None:
            if self.disk_cache_gb is not None:
                raise ValueError("disk_cache_gb bounds the prefix cache's disk tier: set disk_cache_dir too")
            return
        if not self.enable_prefix_caching:
            raise ValueError("disk_cache_dir is the prefix cache's disk tier: it needs enable_prefix_caching=True")

    @property
    def num_ranks(self) -> int:
        """The processes the model runs on: a stage's tensor-parallel ranks, for each stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def disk_cache_bytes(self) -> int:
        """The disk tier's bound in bytes."""
        return int((self.disk_cache_gb or DEFAULT_DISK_CACHE_GB) * (1 << 30))

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative) if self.speculative else None

    @property
    def num_state_snapshots(self) -> int:
        """Recurrent state slots for speculative decoding's rollback: one per draft a running sequence may
        verify at once (kv/state_slots.py)."""
        speculative = self.speculative_config
        return self.max_num_seqs * speculative.max_draft_tokens if speculative is not None else 0

    @property
    def num_state_slots(self) -> int:
        """Recurrent state slots outside the KV pool: the zero state, one live per running sequence, the
        snapshots (the checkpoints are pages of the pool: `state_slot_pages`)."""
        return 1 + self.max_num_seqs + self.num_state_snapshots

    @property
    def num_initial_checkpoints(self) -> int:
        """Checkpoint slots the pool's region holds from the start, as many as sequences may run (in at most
        half the pages): a hybrid's first requests keep theirs without growing the state arrays (by copying
        them) in their first steps."""
        if not self.state_slot_pages:
            return 0
        return min(self.max_num_seqs, self.num_state_checkpoints or 0, self.num_pages // 2 // self.state_slot_pages)

    @property
    def num_kv_pages_at_start(self) -> int:
        """The pool's pages below the checkpoints' first slots (the region at its top, kv/block_pool.py): those the
        K/V arrays hold from the start."""
        return self.num_pages - self.num_initial_checkpoints * self.state_slot_pages

    @property
    def is_resolved(self) -> bool:
        return self.resolved

    def kv_layout(self, args: ModelShape, activation_dtype: mx.Dtype, specs: tuple[LayerSpec, ...] = ()) -> KVLayout:
        """How the pool stores K/V for a model computing in `activation_dtype`: a piece's head_dim
        (core/layer_specs.py `kv_piece_shape`: the model's, unless its layers' widths differ)."""
        return KVLayout(kv_piece_shape_of(args, specs)[1], activation_dtype, self.kv_cache_dtype)

    def page_bytes(self, args: ModelShape, kv_dtype: mx.Dtype, specs: tuple[LayerSpec, ...] = ()) -> int:
        """One page of the pool for a model of `args` whose layers keep `specs`, computing in `kv_dtype`:
        `block_size` tokens of K/V in `pool_block_layers` layers, of this rank's KV heads."""
        specs = specs or (FullAttention(),) * args.num_hidden_layers
        kv_heads = kv_piece_shape_of(args, specs)[0] // self.tensor_parallel_size
        try:
            bytes_per_token_head = self.kv_layout(args, kv_dtype, specs).bytes_per_token_head
        except ValueError as error:
            raise ValueError(f"this model cannot use it: {error}") from None
        return pool_block_layers(kv_groups(specs), (args.num_key_value_heads, args.head_dim)) * kv_heads * \
            self.block_size * bytes_per_token_head

    def resolve(self, args: ModelShape, kv_dtype: mx.Dtype, specs: tuple[LayerSpec, ...] = (),
                weights_bytes: int = 0, held: range | None = None) -> EngineConfig:
        """Fill in the pool's size and max_model_len for this model, computing in `kv_dtype` (the pool
        stores K/V in it, or as int8 with scales in it), whose layers keep `specs` (() : every
        layer full attention), beside `weights_bytes` of weights (every model's: a device's working set
        must hold them and the pools together).

        Every KV group draws from one pool of `num_pages` pages (kv/block_pool.py), each
        `block_size` tokens of K/V in `pool_block_layers` layers. By default it holds two whole contexts:
        all blocks of the full-attention groups, what a window reaches of the sliding ones. Recurrent
        layers' state slots (`num_state_slots`, float32) come out of the same budget first, and
        their checkpoints are pages of the pool, `state_slot_pages` each; each page costs
        `companion_page_bytes` more where a draft's pool shares the page tables. Under tensor
        parallelism `kv_cache_bytes` is what each rank spends on its own KV heads.

        A memory budget (`memory_budget_bytes`, or the default) also holds the largest step's activations
        (`activation_bytes`, see `_activation_allowance`) and the pools get what they leave; an explicit
        `kv_cache_bytes` or `num_pages` sizes the pools alone, and the allowance sits beside them.

        `held`: a pipeline stage's layers, whose share of each page and whose recurrent states are all its
        machine keeps (and its budget and working set hold); the pages' count and layout stay the whole model's."""
        specs = specs or (FullAttention(),) * args.num_hidden_layers
        groups = kv_groups(specs)
        model_shape = (args.num_key_value_heads, args.head_dim)
        whole_page_bytes = self.page_bytes(args, kv_dtype, specs) + self.companion_page_bytes
        bytes_per_page, slot_bytes = whole_page_bytes, state_bytes_per_slot(specs)  # 0 where no layer keeps a state
        if held is not None:
            share = held_places(specs, model_shape, held), pool_block_layers(groups, model_shape)
            bytes_per_page = max(1, whole_page_bytes * share[0] // share[1])
            slot_bytes = state_bytes_per_slot(tuple(spec for layer, spec in enumerate(specs) if layer in held))
        max_model_len = min(self.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        state_bytes = self.num_state_slots * slot_bytes
        costs = block_costs(groups, model_shape)
        _check_working_set(state_bytes, weights_bytes)  # weights that leave no room are named as such
        step_shape = StepShape.of(args, specs, self.block_size, kv_dtype.size)
        smallest, full = self._activation_allowance(step_shape, max_model_len)
        activations = max(smallest, full)
        num_pages = self.num_pages
        if num_pages is None:
            context = sum(cost * peak_blocks(spec, max_model_len, self.max_num_batched_tokens, self.block_size)
                          for cost, (spec, _) in zip(costs, groups))
            # Room for as many checkpoints as sequences, beside the contexts (they share the pages).
            wanted = (min(_DEFAULT_POOL_CONTEXTS, self.max_num_seqs) * context * bytes_per_page + state_bytes
                      + self.max_num_seqs * slot_bytes)
            budget, pools = self.kv_cache_bytes, self.kv_cache_bytes
            if budget is None:  # a memory budget: the activations' allowance first, the pools get the rest
                budget = self.memory_budget_bytes or default_kv_cache_bytes(wanted + activations, weights_bytes)
                # No sequence reaches past what the whole budget's pages could hold: no step attends more.
                reachable = min(max_model_len, budget // bytes_per_page * self.block_size)
                smallest, full = self._activation_allowance(step_shape, reachable)
                # A full step's, unless the budget is tight: then at most its share, and the chunks shrink sooner.
                share = max(int(_MAX_ACTIVATION_SHARE * budget), budget - wanted)
                activations = max(smallest, min(full, share))
                pools = budget - activations
            num_pages = (pools - state_bytes) // bytes_per_page
            if num_pages < sum(costs) and pools != budget:
                raise ValueError(f"the memory budget of {budget} bytes cannot hold the activations of the smallest "
                                 f"step ({smallest} bytes: {self.block_size} tokens attending {reachable} tokens, "
                                 "the longest context it could hold), the recurrent state slots ({state_bytes} bytes) and "
                                 f"{sum(costs)} KV pages of {bytes_per_page} bytes (a block of each kind of layer); "
                                 "raise memory_budget_bytes (--memory-gb) or lower max_model_len")
            if num_pages < sum(costs):
                draft = " with the draft's pool beside them" if self.companion_page_bytes else ""
                needed = f"{sum(costs)} KV pages of {bytes_per_page} bytes (a block of each kind of layer{draft})"
                if state_bytes:
                    needed = (f"the recurrent state slots ({state_bytes} bytes for {self.num_state_slots} slots) and "
                              f"{needed}; raise kv_cache_bytes or lower max_num_seqs"
                              f"{' or max_draft' if self.num_state_snapshots else ''}")
                else:
                    needed += "; raise kv_cache_bytes"
                raise ValueError(f"the KV cache budget of {budget} bytes cannot hold {needed}")
        _check_working_set(num_pages * bytes_per_page + state_bytes + activations, weights_bytes)
        slot_pages = -(-state_bytes_per_slot(specs) // whole_page_bytes)  # the whole model's: every stage alike
        most_checkpoints = num_pages // slot_pages if slot_pages else 0
        checkpoints = most_checkpoints if self.num_state_checkpoints is None else self.num_state_checkpoints
        return dataclasses.replace(self, num_pages=num_pages, max_model_len=max_model_len,
                                   num_state_checkpoints=min(checkpoints, most_checkpoints), step_shape=step_shape,
                                   activation_bytes=activations, state_slot_pages=slot_pages, resolved=True)

    def _activation_allowance(self, shape: StepShape, longest: int) -> tuple[int, int]:
        """(the smallest step's activations: a block of tokens attending the `longest` context, which every
        allowance must hold for any request to finish; a full step's attending _ACTIVATION_CONTEXT tokens)."""
        smallest = activation_bytes(shape, [(self.block_size, longest)])
        chunk = self.max_num_batched_tokens
        full = activation_bytes(shape, [(chunk, min(longest, max(chunk, _ACTIVATION_CONTEXT)))])
        return smallest, full


def kv_piece_shape_of(args: ModelShape, specs: tuple[LayerSpec, ...]) -> tuple[int, int]:
    """(kv_heads, head_dim) of one piece of the pool's pages for a model of `args` whose layers keep `specs`."""
    return kv_piece_shape(kv_groups(specs), (args.num_key_value_heads, args.head_dim))


# The user options: every LLM kwarg and engine flag, in declaration order (the flags' order in --help).
OPTION_FIELDS = tuple(field for field in dataclasses.fields(EngineConfig) if flag_of(field) is not None)
OPTIONS = tuple(field.name for field in OPTION_FIELDS)

F = TypeVar("F", bound=Callable)


def takes_options(function: F) -> F:
    """For `function(model=None, *, ..., **options)`, which passes `options` to EngineConfig.from_options:
    give it a signature that lists the options with their defaults (help(), inspect.signature)."""
    signature = inspect.signature(function)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in own}
    at = next((i for i, p in enumerate(own) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(own))
    listed = [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                                annotation=field.type) for field in OPTION_FIELDS if field.name not in taken]
    function.__signature__ = signature.replace(parameters=[*own[:at], *listed, *own[at:]])
    return function


def default_kv_cache_bytes(wanted: int | None = None, weights_bytes: int = 0) -> int:
    """The default pool: `wanted` bytes (two whole contexts, see `resolve`), capped at min(2 GiB, 15% of RAM)
    and, on a Mac's GPU, at what the working set leaves beside `weights_bytes`. Without `wanted`, the cap
    alone: the budget tensor-parallel ranks agree on before the model is read."""
    cap = _MAX_DEFAULT_KV_CACHE_BYTES
    ram = ram_bytes()
    if ram is not None:
        cap = min(cap, int(_MAX_RAM_FRACTION * ram))
    room = _working_set_room(weights_bytes)
    if room is not None:
        cap = min(cap, max(room, 0))
    return cap if wanted is None else min(wanted, cap)


def _working_set_room(weights_bytes: int) -> int | None:
    """The bytes the device's working set leaves for the pools beside the weights and the headroom; None
    where no working set is known (the CPU)."""
    size = working_set_bytes()
    return None if size is None else int(size * (1 - _WORKING_SET_HEADROOM)) - weights_bytes


def _check_working_set(pools_bytes: int, weights_bytes: int) -> None:
    """Never plan past the device's working set: on a Mac that is where GPU memory stops being resident."""
    room = _working_set_room(weights_bytes)
    if room is not None and pools_bytes > room:
        size = working_set_bytes()
        raise ValueError(f"the weights ({weights_bytes / 2**30:.2f} GiB) and the KV cache's pools "
                         f"({pools_bytes / 2**30:.2f} GiB) do not fit this GPU's working set of {size / 2**30:.2f} GiB "
                         f"(Metal's max_recommended_working_set_size) less {_WORKING_SET_HEADROOM:.0%} for "
                         "the framework: lower --kv-cache-gb (kv_cache_bytes) or --num-pages, or use a smaller dtype")

