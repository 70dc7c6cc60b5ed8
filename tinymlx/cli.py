"""Command line: `tinymlx chat`, `tinymlx serve`, `tinymlx generate`, `tinymlx models`, `tinymlx disk-cache`."""

from __future__ import annotations

import argparse
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinymlx.core.config import CHAT_DISK_CACHE_GB, OPTION_FIELDS, OPTIONS, EngineConfig
from tinymlx.core.options import flag_default, flag_of
from tinymlx.core.outputs import EngineStats
from tinymlx.loader import ModelLoadError
from tinymlx.loader.offline import cache_dir
from tinymlx.parallel import ParallelError
from tinymlx.parallel.hostfile import read_hostfile
from tinymlx.turns.tool_calls import SYNTAXES


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig option, as core/config.py declares it: spelling, help and conversion."""
    types = typing.get_type_hints(EngineConfig)
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for field in OPTION_FIELDS:
        flag = flag_of(field)
        target = parser
        if flag.exclusive is not None:
            if flag.exclusive not in groups:
                groups[flag.exclusive] = parser.add_mutually_exclusive_group()
            target = groups[flag.exclusive]
        default = flag_default(field)
        value_type = _value_type(types[field.name])
        if value_type is bool:
            target.add_argument(*flag.names, dest=field.name, default=default, help=flag.help,
                                action=argparse.BooleanOptionalAction)
        else:
            parse = _flag_type(flag.parse) if flag.parse else value_type if value_type in (int, float) else None
            target.add_argument(*flag.names, dest=field.name, default=default, type=parse, choices=flag.choices,
                                metavar=flag.metavar, help=flag.help)
        if flag.off is not None:
            name, help_text = flag.off
            target.add_argument(name, action="store_true", help=help_text)


def _value_type(annotation: Any) -> Any:
    """int for `int | None`: the type a flag's text becomes."""
    return next((t for t in typing.get_args(annotation) if t is not type(None)), annotation)


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` for argparse: its ValueError becomes the usage error's message."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__
    return convert


def chat_disk_cache_dir() -> Path:
    """Where `tinymlx chat` keeps the prefix cache's disk tier by default."""
    return cache_dir() / "prefix-cache"


def _disk_cache(args: argparse.Namespace) -> tuple[str | None, float | None]:
    """(disk_cache_dir, disk_cache_gb): chat's default tier, unless --no-disk-cache; the others' only when asked."""
    if args.no_disk_cache:
        return None, None
    if args.disk_cache_dir is not None:
        return args.disk_cache_dir, args.disk_cache_gb
    if args.command == "chat" and args.enable_prefix_caching:
        return str(chat_disk_cache_dir()), args.disk_cache_gb or CHAT_DISK_CACHE_GB
    if args.disk_cache_gb is not None:
        raise ValueError("--disk-cache-gb bounds the disk tier: give its directory with --disk-cache DIR")
    return None, None


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's options from the flags: --tp defaults to the hostfile's hosts over --pp, chat keeps a disk
    tier."""
    kwargs = {name: getattr(args, name) for name in OPTIONS}
    if kwargs["tensor_parallel_size"] is None:
        hosts = len(read_hostfile(args.hostfile).hosts) if args.hostfile else 1
        kwargs["tensor_parallel_size"] = max(1, hosts // kwargs["pipeline_parallel_size"])
    kwargs["disk_cache_dir"], kwargs["disk_cache_gb"] = _disk_cache(args)
    return kwargs


def _generate(args: argparse.Namespace) -> None:
    from tinymlx import LLM, SamplingParams
    from tinymlx.turns.reply_format import ReplyFormat
    from tinymlx.turns.turn import ReasoningDelta

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    start = time.perf_counter()
    with LLM(**_engine_kwargs(args)) as llm:
        config = llm.engine.config
        ranks = "".join(f" over {size} {kind}" for size, kind in ((config.tensor_parallel_size, "tensor-parallel ranks"),
                        (config.pipeline_parallel_size, "pipeline stages")) if size > 1)
        print(f"[loaded {llm.engine.model_name}{ranks} in {time.perf_counter() - start:.1f}s]", file=sys.stderr)
        if args.raw:
            prompt = args.prompt
        else:
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
        # A harmony reply (gpt-oss) is read as the server reads it: its reasoning to stderr, its answer here.
        reply_format = ReplyFormat.of_template(llm.engine.tokenizer.chat_template_source)
        parser = reply_format.parser() if reply_format.keeps_markup and not args.raw else None
        if parser is not None:
            params = reply_format.reading(params)
        final = None
        for output in llm.stream(prompt, params):
            if parser is None:
                print(output.delta_text, end="", flush=True)
            else:
                for event in parser.feed(output.delta_text) + (parser.finish() if output.finished else []):
                    print(event.text, end="", flush=True, file=sys.stderr if isinstance(event, ReasoningDelta) else None)
            final = output
        print()
        m, stats = final.metrics, llm.stats()
    print(f"[{m.num_prompt_tokens} prompt tokens, {m.num_output_tokens} generated, ttft {m.ttft_s:.2f}s, "
          f"{m.tokens_per_s or 0:.1f} tok/s, finish: {final.finish_reason}]", file=sys.stderr)
    if config.tensor_parallel_size > 1:
        comm = stats.comm_total
        print(f"[{comm.num_all_reduces} all-reduces, {comm.all_reduce_bytes / 1e6:.2f} MB per rank]", file=sys.stderr)
    if stats.speculative:
        per_proposer = "".join(f"; {p.name} {p.num_accepted_tokens}/{p.num_draft_tokens}" for p in stats.proposers
                               if len(stats.proposers) > 1)
        print(f"[speculative {stats.speculative}: {m.num_draft_tokens} drafted, {m.num_accepted_tokens} accepted "
              f"({stats.acceptance_rate:.0%}{per_proposer}), {stats.mean_accepted_length:.2f} tokens per verifying "
              "step]", file=sys.stderr)


def _serve(args: argparse.Namespace) -> None:
    try:
        from tinymlx.server import OpenAIServer, ServerConfig, serve
    except ImportError as missing:
        raise ValueError(f"tinymlx serve needs the server packages ({missing.name} is missing): "
                         "pip install 'tinymlx[serve]'") from None
    from tinymlx.engine.engine import Engine

    config = ServerConfig(served_model_names=tuple(args.served_model_name or ()), api_key=args.api_key,
                          max_queue=args.max_queue,
                          queue_timeout_s=args.queue_timeout, request_timeout_s=args.request_timeout,
                          drain_timeout_s=args.drain_timeout, otel=args.otel, tool_call_parser=args.tool_call_parser,
                          responses_store_size=args.responses_store, image_fetch_timeout_s=args.image_fetch_timeout,
                          allow_private_image_urls=args.allow_private_image_urls)
    engine = Engine.from_config(EngineConfig.from_options(**_engine_kwargs(args)))
    print(_memory_line(engine.stats()), file=sys.stderr)
    serve(OpenAIServer(engine, config), host=args.host, port=args.port)


def _memory_line(stats: EngineStats) -> str:
    """What the engine holds and what fits in it, in one line for the terminal."""
    from tinymlx.loader.cache import format_bytes

    weights = format_bytes(stats.weights_bytes + stats.draft_weights_bytes)
    return (f"[weights {weights}, KV cache pools up to {format_bytes(stats.pools_bytes_budget)}, a step's "
            f"activations up to {format_bytes(stats.activation_bytes_budget)}: a context of {stats.what_fits}]")


def _chat(args: argparse.Namespace) -> None:
    from tinymlx_ui import run_chat

    code = run_chat(**_engine_kwargs(args))
    if code:  # the model failed to load: the error screen said why, and so does stderr
        raise SystemExit(code)


def _models(args: argparse.Namespace) -> None:
    from tinymlx.loader.cache import format_bytes, remove_cached_models
    from tinymlx.loader.offline import DEFAULT_MODEL, fetch_model

    if args.converted and args.action != "rm":
        raise ValueError("--converted goes with `models rm`")
    if args.action == "fetch":
        for name in args.names or [DEFAULT_MODEL]:
            print(fetch_model(name, progress=True))
    elif args.action == "rm":
        if not args.names:
            raise ValueError("models rm: name the models to remove (`tinymlx models` lists them)")
        for name, freed in remove_cached_models(args.names, converted_only=args.converted).items():
            print(f"{name}: freed {format_bytes(freed)}" if freed else f"{name}: nothing cached")
    else:
        _print_models()


def _print_models() -> None:
    from tinymlx.loader.cache import format_bytes, list_cached_models
    from tinymlx.loader.offline import DEFAULT_MODEL, cache_dir

    models = list_cached_models()
    rows = [("MODEL", "DOWNLOADED", "CONVERTED", "ABOUT")]
    for m in models:
        downloaded = format_bytes(m.num_download_bytes) if m.is_downloaded else "no" if m.is_offline else "local"
        if m.download and not m.is_downloaded:
            downloaded += f" (partial {format_bytes(m.num_download_bytes)})"
        kinds = ", ".join(c.dtype if c.state == "ready" else f"{c.dtype} {c.state}" for c in m.conversions)
        converted = f"{format_bytes(m.num_converted_bytes)} {kinds}" if m.conversions else "no"
        rows.append((m.name + (" *" if m.name == DEFAULT_MODEL else ""), downloaded, converted, m.description))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3]).rstrip())
    total = format_bytes(sum(m.num_bytes for m in models))
    print(f"* default. {cache_dir()} holds {total}; free a model's disk with `tinymlx models rm NAME` "
          "(--converted keeps the download)")


def _disk_cache_command(args: argparse.Namespace) -> None:
    from tinymlx.kv.disk.store import DiskStore
    from tinymlx.loader.cache import format_bytes

    directory = Path(args.disk_cache_dir or chat_disk_cache_dir())
    if not directory.is_dir():
        print(f"{directory}: no disk cache there")
        return
    store = DiskStore(directory, capacity_bytes=sys.maxsize)  # look, evict nothing
    if args.action == "clear":
        print(f"{directory}: freed {format_bytes(store.clear())}")
    else:
        print(f"{directory}: {store.num_files} blocks, {format_bytes(store.num_bytes)}; `tinymlx disk-cache clear` "
              "removes them (a running engine only recomputes what it then misses)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinymlx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a reply to one prompt, streamed to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--system", default=None, help="system prompt")
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    _add_engine_args(generate)
    generate.set_defaults(run=_generate)

    server = commands.add_parser("serve", help="an HTTP server: OpenAI chat/completions (tools, reasoning), "
                                 "Anthropic Messages, OpenAI Responses; SSE, metrics")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    server.add_argument("--port", type=int, default=8321)
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(all but /health)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name clients send, then any aliases (as vLLM; default: --model's)")
    server.add_argument("--max-queue", type=int, default=256,
                        help="choices waiting for their first token before new requests get 503")
    server.add_argument("--queue-timeout", type=float, default=None, help="seconds a choice may wait for its first "
                        "token (then 503)")
    server.add_argument("--request-timeout", type=float, default=None, help="seconds a whole request may take "
                        "(then 504)")
    server.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGTERM, seconds in-flight requests "
                        "get to finish")
    server.add_argument("--otel", action="store_true", help="one OpenTelemetry trace per request (console, or "
                        "OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    server.add_argument("--tool-call-parser", choices=SYNTAXES, default=None,
                        help="the model's tool-call syntax (default: read from its chat template)")
    server.add_argument("--responses-store", type=int, default=256,
                        help="/v1/responses replies kept for previous_response_id (oldest dropped)")
    server.add_argument("--image-fetch-timeout", type=float, default=10.0,
                        help="seconds to fetch one http(s) image URL a request names, redirects included (then 400)")
    server.add_argument("--allow-private-image-urls", action="store_true",
                        help="fetch image URLs on private, loopback and link-local addresses too (off: a request "
                        "cannot make the server probe the network it runs in)")
    _add_engine_args(server)
    server.set_defaults(run=_serve)

    chat = commands.add_parser("chat", help="chat in a terminal UI: several sessions, live KV-block and batch graphs")
    _add_engine_args(chat)
    chat.set_defaults(run=_chat)

    models = commands.add_parser("models", help="list the models and the disk each takes in the cache, fetch "
                                 "them, or free it (rm)")
    models.add_argument("action", nargs="?", choices=["list", "fetch", "rm"], default="list",
                        help="list (default): each model, its download and converted copies; fetch: download; "
                        "rm: free the disk")
    models.add_argument("names", nargs="*", help="models to fetch (default: the default model) or remove")
    models.add_argument("--converted", action="store_true", help="with rm: remove only the converted copy and "
                        "keep the download (converting again takes a while on the next start)")
    models.set_defaults(run=_models)

    disk = commands.add_parser("disk-cache", help="where the prefix cache's disk tier is and what it holds, or "
                               "clear it")
    disk.add_argument("action", nargs="?", choices=["info", "clear"], default="info",
                      help="info (default): the directory, its blocks and bytes; clear: delete every block there")
    disk.add_argument("--disk-cache", dest="disk_cache_dir", default=None, metavar="DIR",
                      help="the tier's directory (default: the chat's, under the user cache directory)")
    disk.set_defaults(run=_disk_cache_command)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ModelLoadError, ValueError, ParallelError) as error:
        print(f"tinymlx: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
