"""Capture exactly what an agent CLI (Claude Code, Codex CLI, opencode, aider...) sends to a model server.

A stdlib-only HTTP server on 127.0.0.1 that records every request (method, path, query, headers with
secrets redacted, JSON body) as one JSON file per request, and answers just plausibly enough that the
CLI goes on to its next request:

    POST .../v1/messages                 Anthropic Messages: SSE (message_start ... message_stop) or JSON
    POST .../v1/messages/count_tokens    {"input_tokens": N}
    POST .../v1/responses                OpenAI Responses: SSE (response.created ... completed) or JSON
    POST .../v1/chat/completions         OpenAI chat: chunks ending with data: [DONE], or JSON
    POST .../v1/completions              OpenAI legacy completions (JSON or SSE)
    GET  .../v1/models[/ID]              a model list that reads as both OpenAI's and Anthropic's shape
    anything else                        404 with an error body (still recorded)

Every answer is the text of --reply (default "hi"), so the run ends after one turn.  With
--tool-call NAME='{"arg": ...}' the first request that offers a tool called NAME is answered with a call
to it instead (tool_use / function_call / tool_calls), so the next request shows how the CLI sends the
tool's result back.  The server stops after --max-requests requests or --max-seconds seconds, whichever
comes first.

    python scripts/capture_agent_requests.py --out /tmp/capture/claude --port 0 --port-file /tmp/port
    ANTHROPIC_BASE_URL=http://127.0.0.1:$(cat /tmp/port) ... claude -p "say hi"

Files are named NN-<path>.json (e.g. 01-v1_messages.json) with
{"seq", "method", "path", "query", "headers", "body"}; a body that is not JSON is kept as "body_text",
or as "body_base64" when it is not UTF-8 either.  A compressed body (gzip, deflate, zstd via the
`zstd` command) is decoded first and its encoding noted in "body_content_encoding".
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization",
                  "x-goog-api-key", "openai-api-key", "anthropic-api-key"}
# Vary from run to run and carry nothing a server must handle.
DROPPED_HEADERS = {"host", "content-length"}
MODEL_ID = "qwen2.5-coder-0.5b-instruct"
SSE_TYPE = "text/event-stream; charset=utf-8"


def redact_headers(headers) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in headers.items():
        k = key.lower()
        if k in DROPPED_HEADERS:
            continue
        if k in SECRET_HEADERS:
            has_scheme = k in {"authorization", "proxy-authorization"} and " " in value
            value = f"{value.split(' ', 1)[0] if has_scheme else ''} <redacted>".strip()
        out[k] = value if k not in out else out[k] + ", " + value
    return out


def decode_body(raw: bytes, encoding: str) -> tuple[bytes, str | None]:
    enc = (encoding or "").strip().lower()
    if not raw or enc in {"", "identity"}:
        return raw, None
    try:
        if enc in {"gzip", "x-gzip"}:
            return gzip.decompress(raw), enc
        if enc == "deflate":
            try:
                return zlib.decompress(raw), enc
            except zlib.error:
                return zlib.decompress(raw, -zlib.MAX_WBITS), enc
        if enc == "zstd" and shutil.which("zstd"):
            proc = subprocess.run(["zstd", "-d", "-c"], input=raw, capture_output=True, timeout=30,
                                  check=True)
            return proc.stdout, enc
    except Exception as exc:  # keep the raw bytes; say why
        return raw, f"{enc} (undecoded: {exc})"
    return raw, f"{enc} (undecoded)"


def estimate_tokens(body) -> int:
    return max(1, len(json.dumps(body)) // 4) if body is not None else 1


def sse(event: str | None, data) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


# ---------------------------------------------------------------- Anthropic Messages

def anthropic_message(body: dict, text: str) -> dict:
    return {
        "id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
        "model": body.get("model", MODEL_ID),
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": estimate_tokens(body), "output_tokens": 1,
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }


def anthropic_stream(body: dict, text: str) -> bytes:
    msg = anthropic_message(body, text)
    start = dict(msg, content=[], stop_reason=None, usage=dict(msg["usage"], output_tokens=0))
    parts = [
        sse("message_start", {"type": "message_start", "message": start}),
        sse("content_block_start", {"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "text", "text": ""}}),
        sse("ping", {"type": "ping"}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "text_delta", "text": text}}),
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse("message_delta", {"type": "message_delta",
                              "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                              "usage": {"output_tokens": 1}}),
        sse("message_stop", {"type": "message_stop"}),
    ]
    return b"".join(parts)


def anthropic_tool_message(body: dict, name: str, args: dict) -> dict:
    msg = anthropic_message(body, "")
    msg["content"] = [{"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": name,
                       "input": args}]
    msg["stop_reason"] = "tool_use"
    return msg


def anthropic_tool_stream(body: dict, name: str, args: dict) -> bytes:
    msg = anthropic_tool_message(body, name, args)
    block = msg["content"][0]
    start = dict(msg, content=[], stop_reason=None, usage=dict(msg["usage"], output_tokens=0))
    return b"".join([
        sse("message_start", {"type": "message_start", "message": start}),
        sse("content_block_start", {"type": "content_block_start", "index": 0,
                                    "content_block": dict(block, input={})}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(args)}}),
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse("message_delta", {"type": "message_delta",
                              "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                              "usage": {"output_tokens": 1}}),
        sse("message_stop", {"type": "message_stop"}),
    ])


# ---------------------------------------------------------------- OpenAI Responses

def responses_object(body: dict, text: str, status: str, with_output: bool) -> tuple[dict, dict]:
    item = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}
    n_in = estimate_tokens(body)
    resp = {
        "id": "resp_" + uuid.uuid4().hex[:24], "object": "response", "created_at": int(time.time()),
        "status": status, "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "model": body.get("model", MODEL_ID),
        "output": [item] if with_output else [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"), "tools": [], "store": body.get("store", False),
        "text": {"format": {"type": "text"}}, "reasoning": {"effort": None, "summary": None},
        "usage": ({"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": n_in + 1} if with_output else None),
        "metadata": {},
    }
    return resp, item


def responses_stream(body: dict, text: str) -> bytes:
    done, item = responses_object(body, text, "completed", True)
    started = dict(done, status="in_progress", output=[], usage=None)
    pending = dict(item, status="in_progress", content=[])
    part = {"type": "output_text", "text": "", "annotations": []}
    ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    events = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
        ("response.output_item.added", {"output_index": 0, "item": pending}),
        ("response.content_part.added", dict(ids, part=part)),
        ("response.output_text.delta", dict(ids, delta=text)),
        ("response.output_text.done", dict(ids, text=text)),
        ("response.content_part.done", dict(ids, part=dict(part, text=text))),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": done}),
    ]
    return b"".join(sse(name, dict({"type": name, "sequence_number": i}, **data))
                    for i, (name, data) in enumerate(events))


def responses_tool_stream(body: dict, name: str, args: dict) -> bytes:
    done, _ = responses_object(body, "", "completed", True)
    arguments = json.dumps(args)
    item = {"id": "fc_" + uuid.uuid4().hex[:24], "type": "function_call", "status": "completed",
            "call_id": "call_" + uuid.uuid4().hex[:24], "name": name, "arguments": arguments}
    done["output"] = [item]
    started = dict(done, status="in_progress", output=[], usage=None)
    ids = {"item_id": item["id"], "output_index": 0}
    events = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
        ("response.output_item.added",
         {"output_index": 0, "item": dict(item, status="in_progress", arguments="")}),
        ("response.function_call_arguments.delta", dict(ids, delta=arguments)),
        ("response.function_call_arguments.done", dict(ids, arguments=arguments)),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": done}),
    ]
    return b"".join(sse(ev, dict({"type": ev, "sequence_number": i}, **data))
                    for i, (ev, data) in enumerate(events))


# ---------------------------------------------------------------- OpenAI chat / completions

def chat_completion(body: dict, text: str) -> dict:
    n_in = estimate_tokens(body)
    return {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model", MODEL_ID),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": n_in, "completion_tokens": 1, "total_tokens": n_in + 1}}


def chat_stream(body: dict, text: str) -> bytes:
    return _chat_chunks(body, [{"role": "assistant", "content": ""}, {"content": text}], "stop")


def chat_tool_stream(body: dict, name: str, args: dict) -> bytes:
    call = {"index": 0, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": ""}}
    deltas = [{"role": "assistant", "content": None, "tool_calls": [call]},
              {"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(args)}}]}]
    return _chat_chunks(body, deltas, "tool_calls")


def _chat_chunks(body: dict, deltas: list[dict], finish_reason: str) -> bytes:
    """A streamed chat completion: one chunk per delta, the finish chunk, usage if asked, [DONE]."""
    full = chat_completion(body, "")
    base = {k: full[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta, finish=None):
        return dict(base, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])

    out = [sse(None, chunk(delta)) for delta in deltas] + [sse(None, chunk({}, finish_reason))]
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append(sse(None, dict(base, choices=[], usage=full["usage"])))
    out.append(sse(None, "[DONE]"))
    return b"".join(out)


def chat_tool_completion(body: dict, name: str, args: dict) -> dict:
    full = chat_completion(body, "")
    full["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
         "function": {"name": name, "arguments": json.dumps(args)}}]}
    full["choices"][0]["finish_reason"] = "tool_calls"
    return full


def offered_tools(body: dict) -> set[str]:
    names = set()
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            if fn.get("name"):
                names.add(fn["name"])
    return names


def text_completion(body: dict, text: str, stream: bool) -> bytes | dict:
    full = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
            "model": body.get("model", MODEL_ID),
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": estimate_tokens(body), "completion_tokens": 1,
                      "total_tokens": estimate_tokens(body) + 1}}
    if not stream:
        return full
    return sse(None, full) + sse(None, "[DONE]")


def model_entry(model_id: str) -> dict:
    # Both OpenAI's ({id, object, created, owned_by}) and Anthropic's ({id, type, display_name, created_at}).
    return {"id": model_id, "object": "model", "created": 1700000000, "owned_by": "tinymlx",
            "type": "model", "display_name": model_id, "created_at": "2024-01-01T00:00:00Z"}


# ---------------------------------------------------------------- server

class Capture:
    def __init__(self, out: Path, reply: str, max_requests: int, tool_call: tuple[str, dict] | None = None):
        self.out, self.reply, self.max_requests = out, reply, max_requests
        self.tool_call = tool_call  # answered once, to the first request that offers the tool
        self.count = 0
        self.lock = threading.Lock()
        self.done = threading.Event()

    def record(self, rec: dict) -> int:
        with self.lock:
            self.count += 1
            seq = self.count
            if seq >= self.max_requests:
                self.done.set()
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", rec["path"].strip("/")) or "root"
        rec = {"seq": seq, **rec}
        path = self.out / f"{seq:02d}-{slug[:80]}.json"
        path.write_text(json.dumps(rec, indent=2, ensure_ascii=False) + "\n")
        print(f"[capture] {seq:02d} {rec['method']} {rec['path']} -> {path.name} ({path.stat().st_size} B)",
              file=sys.stderr, flush=True)
        return seq

    def take_tool_call(self, body: dict) -> tuple[str, dict] | None:
        with self.lock:
            if self.tool_call and self.tool_call[0] in offered_tools(body):
                call, self.tool_call = self.tool_call, None
                return call
        return None


def make_handler(cap: Capture):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "capture-agent-requests/1"

        def log_message(self, fmt, *args):  # the record above is the log
            pass

        def _read_body(self) -> bytes:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                raw = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return raw
                    raw += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _send(self, status: int, payload, content_type: str = "application/json"):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("request-id", "req_" + uuid.uuid4().hex[:24])
            self.send_header("x-request-id", uuid.uuid4().hex)
            if content_type.startswith("text/event-stream"):
                self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
                self.wfile.flush()

        def _handle(self):
            split = urlsplit(self.path)
            raw, enc = decode_body(self._read_body(), self.headers.get("Content-Encoding", ""))
            rec: dict = {"method": self.command, "path": split.path,
                         "query": {k: v if len(v) > 1 else v[0] for k, v in parse_qs(split.query).items()},
                         "headers": redact_headers(self.headers)}
            if enc:
                rec["body_content_encoding"] = enc
            body = None
            if raw:
                try:
                    body = json.loads(raw)
                    rec["body"] = body
                except ValueError:
                    try:
                        rec["body_text"] = raw.decode()
                    except UnicodeDecodeError:
                        rec["body_base64"] = base64.b64encode(raw).decode()
            cap.record(rec)
            self._respond(split.path.rstrip("/"), body if isinstance(body, dict) else {})

        def _respond(self, path: str, body: dict):
            text, stream = cap.reply, bool(body.get("stream"))
            post = self.command == "POST"
            if post and path.endswith("/messages/count_tokens"):
                return self._send(200, {"input_tokens": estimate_tokens(body)})
            call = cap.take_tool_call(body) if post and not path.endswith("/count_tokens") else None
            if post and path.endswith("/messages"):
                if call:
                    return (self._send(200, anthropic_tool_stream(body, *call), SSE_TYPE)
                            if stream else self._send(200, anthropic_tool_message(body, *call)))
                if stream:
                    return self._send(200, anthropic_stream(body, text), SSE_TYPE)
                return self._send(200, anthropic_message(body, text))
            if post and path.endswith("/responses"):
                if call and stream:
                    return self._send(200, responses_tool_stream(body, *call), SSE_TYPE)
                if stream:
                    return self._send(200, responses_stream(body, text), SSE_TYPE)
                return self._send(200, responses_object(body, text, "completed", True)[0])
            if post and path.endswith("/chat/completions"):
                if call:
                    return (self._send(200, chat_tool_stream(body, *call), SSE_TYPE)
                            if stream else self._send(200, chat_tool_completion(body, *call)))
                if stream:
                    return self._send(200, chat_stream(body, text), SSE_TYPE)
                return self._send(200, chat_completion(body, text))
            if post and path.endswith("/completions"):
                out = text_completion(body, text, stream)
                return self._send(200, out, SSE_TYPE if stream else "application/json")
            if self.command in ("GET", "HEAD") and path.endswith("/models"):
                entry = model_entry(MODEL_ID)
                return self._send(200, {"object": "list", "data": [entry], "has_more": False,
                                        "first_id": MODEL_ID, "last_id": MODEL_ID})
            if self.command in ("GET", "HEAD") and "/models/" in path:
                return self._send(200, model_entry(path.rsplit("/models/", 1)[1]))
            msg = f"capture server: no route for {self.command} {path}"
            return self._send(404, {"type": "error", "error": {"type": "not_found_error", "message": msg,
                                                               "code": "not_found"}})

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for NN-<path>.json records")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free one)")
    ap.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    ap.add_argument("--reply", default="hi", help="the assistant text every answer carries")
    ap.add_argument("--tool-call", metavar="NAME=JSON",
                    help="answer the first request offering tool NAME with a call to it, arguments JSON")
    ap.add_argument("--max-requests", type=int, default=50, help="stop after this many requests")
    ap.add_argument("--max-seconds", type=float, default=300, help="stop after this long")
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    tool_call = None
    if args.tool_call:
        name, _, raw_args = args.tool_call.partition("=")
        tool_call = (name, json.loads(raw_args or "{}"))
    cap = Capture(args.out, args.reply, args.max_requests, tool_call)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(cap))
    server.daemon_threads = True
    port = server.server_address[1]
    if args.port_file:
        args.port_file.write_text(f"{port}\n")
    print(f"[capture] listening on http://127.0.0.1:{port} -> {args.out}", file=sys.stderr, flush=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cap.done.wait(args.max_seconds)
        if cap.done.is_set():
            time.sleep(1.0)  # let the last answer go out
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    print(f"[capture] stopped after {cap.count} request(s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
