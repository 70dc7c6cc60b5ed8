"""Images through every server API, end to end over loopback with the official `openai` and `anthropic` clients:
the tiny random Qwen2.5-VL (tests/vision_checkpoints.py) behind `tinymlx serve`, images sent as data URLs,
base64 blocks and http URLs a tiny local HTTP server answers.

The reference is the server itself: the same image and question give the same prompt and the same greedy reply
whichever API (and whichever way: inline or fetched, streamed or not) sent them. Every bad image is a 4xx naming
its part, and the engine serves on with nothing leaked (`check()`). A text-only model given an image answers
with a note in its place (counted in /metrics), or a 400 under `images="refuse"`.
"""

from __future__ import annotations

import base64
import io
import ipaddress
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import anyio
import httpx
import openai
import pytest
from server_harness import RunningServer, free_port
from tiny_models import tiny_engine
from vision_checkpoints import drawn_image, png_bytes, qwen2_5_vl_checkpoint

from tinymlx.cli import build_parser
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.engine.image_intake import IMAGE_NOTE
from tinymlx.server import ServerConfig
from tinymlx.server.image_fetch import ImageFetcher, is_public
from tinymlx.text.tokenizer import Tokenizer
from tinymlx.turns.api_error import APIError

pytest.importorskip("torch")
pytest.importorskip("transformers")

BLOCK_SIZE = 8
MAX_IMAGE_BYTES = 200_000
QUESTION = "what is this?"
GREEDY = {"temperature": 0, "max_tokens": 6}
CAT = png_bytes(drawn_image(112, 84))  # 12 image tokens
DOG = png_bytes(drawn_image(112, 84, seed=5))  # the same size, other pixels


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def asking(*images: dict, text: str = QUESTION) -> list[dict]:
    """One user message: the images, then the question (chat completions' parts)."""
    return [{"role": "user", "content": [*images, {"type": "text", "text": text}]}]


# -- the servers ------------------------------------------------------------------------------------
class _ImageFiles(BaseHTTPRequestHandler):
    """/cat.png, /dog.png, /moved.png (a redirect to /cat.png), /loop (a redirect to itself), /huge (no length,
    over the byte limit), /slow (1.5 s to answer), else 404."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.server.paths.append(self.path)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        elif self.path == "/huge":
            self.send_response(200)
            self.end_headers()  # HTTP/1.0 without Content-Length: the body ends when the connection does
            try:
                for _ in range(MAX_IMAGE_BYTES // 16384 + 2):
                    self.wfile.write(os.urandom(16384))
            except OSError:
                pass  # the fetcher stopped reading at its limit
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
        elif self.path == "/slow":
            time.sleep(1.5)  # the fetcher has given up by now: nothing to answer
        elif self.path in self.server.files:
            body = self.server.files[self.path]
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    """A tiny HTTP server on 127.0.0.1; `files.paths` lists the paths it was asked for."""
    http = ThreadingHTTPServer(("127.0.0.1", free_port()), _ImageFiles)
    http.daemon_threads = True
    http.files, http.paths = {"/cat.png": CAT, "/dog.png": DOG}, []
    http.base_url = f"http://127.0.0.1:{http.server_address[1]}"
    thread = threading.Thread(target=http.serve_forever, name="test-image-files", daemon=True)
    thread.start()
    yield http
    http.shutdown()
    http.server_close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    qwen2_5_vl_checkpoint(path)
    return path


def vision_server(path, config: ServerConfig) -> RunningServer:
    engine = Engine.load(path, Tokenizer.from_dir(path), EngineConfig(
        block_size=BLOCK_SIZE, num_pages=256, max_num_batched_tokens=64, max_images_per_request=2,
        max_image_bytes=MAX_IMAGE_BYTES), model_name="tiny-qwen2.5-vl")
    return RunningServer(engine, config)


@pytest.fixture(scope="module")
def server(checkpoint):
    """Allowed to fetch from 127.0.0.1, as a user who serves images on their own machine would set it."""
    running = vision_server(checkpoint, ServerConfig(allow_private_image_urls=True, image_fetch_timeout_s=5))
    yield running
    running.close()


@pytest.fixture(scope="module")
def strict_server(checkpoint):
    running = vision_server(checkpoint, ServerConfig())
    yield running
    running.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, server: RunningServer, messages: list[dict]):
    return client.chat.completions.create(model=server.model, messages=messages, **GREEDY)


def still_serving(server: RunningServer) -> None:
    """After a refusal: a normal request succeeds, and the engine holds nothing (its check() holds)."""
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": asking(image_part(data_url(CAT))), **GREEDY})
    assert reply.status_code == 200, reply.text
    server.wait_idle()


# -- chat completions ---------------------------------------------------------------------------------
def test_chat_completions_read_an_image_streamed_and_not(client, server):
    reply = chat(client, server, asking(image_part(data_url(CAT))))
    chunks = list(client.chat.completions.create(model=server.model, messages=asking(image_part(data_url(CAT))),
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    without = chat(client, server, asking())
    # The image's 12 tokens replace its one placeholder, between <|vision_start|> and <|vision_end|>.
    assert reply.usage.prompt_tokens == without.usage.prompt_tokens + 2 + 12
    server.wait_idle()


def test_an_http_image_is_fetched_and_reads_as_the_same_image_inline(client, server, files):
    inline = chat(client, server, asking(image_part(data_url(CAT))))
    for path in ("/cat.png", "/moved.png"):  # a redirect is followed (its target checked as the URL was)
        fetched = chat(client, server, asking(image_part(f"{files.base_url}{path}")))
        assert fetched.choices[0].message.content == inline.choices[0].message.content
        assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    assert files.paths[-2:] == ["/moved.png", "/cat.png"]
    url = f"{files.base_url}/cat.png"
    responses = client.responses.create(model=server.model, temperature=0, max_output_tokens=6, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": QUESTION}]}])
    assert responses.usage.input_tokens == inline.usage.prompt_tokens
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    counted = claude.messages.count_tokens(model=server.model, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": url}}, {"type": "text", "text": QUESTION}]}])
    assert counted.input_tokens == inline.usage.prompt_tokens
    server.wait_idle()


def test_serve_takes_the_image_fetch_flags():
    args = build_parser().parse_args(["serve", "--allow-private-image-urls", "--image-fetch-timeout", "3"])
    assert args.allow_private_image_urls and args.image_fetch_timeout == 3.0
    assert not build_parser().parse_args(["serve"]).allow_private_image_urls


def test_a_private_url_is_not_fetched_without_the_flag(strict_server, files):
    asked = len(files.paths)
    reply = httpx.post(f"{strict_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": strict_server.model, "messages": asking(image_part(f"{files.base_url}/cat.png")), **GREEDY})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages[0].content[0]" and "--allow-private-image-urls" in error["message"]
    assert len(files.paths) == asked  # the server never connected
    still_serving(strict_server)


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.0.0.7", False),
    ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False),
    ("224.0.0.251", False), ("::1", False), ("fe80::1", False), ("::ffff:127.0.0.1", False),
    ("2002:7f00:1::", False),
])
def test_only_public_addresses_are_fetched_by_default(address, public):
    assert is_public(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize("path, words", [("/slow", "no answer within 0.3 s"), ("/loop", "more than 3 redirects"),
                                         ("/cat.png", "more than 1000 bytes")])
def test_a_fetch_is_bounded_in_time_redirects_and_bytes(files, path, words):
    fetcher = ImageFetcher(timeout_s=0.3, allow_private=True)
    with pytest.raises(APIError, match=words) as refused:
        anyio.run(fetcher.fetch, f"{files.base_url}{path}", "messages[0].content[0]", 1000)
    assert refused.value.status == 400 and refused.value.param == "messages[0].content[0]"
    assert anyio.run(fetcher.fetch, f"{files.base_url}/cat.png", "image", len(CAT)) == CAT


def test_the_same_image_in_a_second_turn_is_a_prefix_hit(client, server):
    first_turn = asking(image_part(data_url(CAT)))
    first = chat(client, server, first_turn)
    encoded = server.engine.runner.encoder_cache.num_encoded_images
    second_turn = [*first_turn, {"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "and now?"}]
    second = chat(client, server, second_turn)
    # The first turn's prompt, its image included (tokens 7 .. 18), comes from the cache.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert server.engine.runner.encoder_cache.num_encoded_images == encoded  # not encoded again
    other = chat(client, server, [{"role": "user", "content": [image_part(data_url(DOG)), *second_turn[0]["content"][1:]]},
                                  *second_turn[1:]])
    assert other.usage.prompt_tokens == second.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens < BLOCK_SIZE  # "<user>" and no further
    server.wait_idle()


# -- Responses ----------------------------------------------------------------------------------------
def test_responses_read_an_input_image_streamed_and_not(client, server):
    reference = chat(client, server, asking(image_part(data_url(CAT))))
    image_input = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(CAT), "detail": "auto"},
                                                {"type": "input_text", "text": QUESTION}]}]
    fields = {"model": server.model, "input": image_input, "temperature": 0, "max_output_tokens": 6}
    reply = client.responses.create(**fields)
    assert reply.output_text == reference.choices[0].message.content
    assert reply.usage.input_tokens == reference.usage.prompt_tokens
    with client.responses.stream(**fields) as stream:
        events = list(stream)
    streamed = events[-1].response  # response.completed, or response.incomplete at max_output_tokens
    assert streamed.status == reply.status and streamed.usage.input_tokens == reply.usage.input_tokens
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    server.wait_idle()


# -- Anthropic Messages -------------------------------------------------------------------------------
def base64_block(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": base64.b64encode(data).decode()}}


READ_CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                                "input": {"file_path": "/work/screenshot.png"}}]}
READ_TOOL = [{"name": "Read", "description": "Read a file.", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}]


def claude_code_turn(result_content) -> list[dict]:
    """Claude Code's shape: its Read tool opened a PNG, and the tool_result carries the image."""
    return [{"role": "user", "content": "look at the screenshot"}, READ_CALL,
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content,
                                          "cache_control": {"type": "ephemeral"}}]}]


CLAUDE_GREEDY = {"max_tokens": 6, "extra_body": {"temperature": 0}}  # this client takes no temperature


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def prompt_tokens(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_messages_read_a_base64_image_streamed_and_not(claude, client, server):
    reference = chat(client, server, asking(image_part(data_url(CAT))))
    messages = [{"role": "user", "content": [base64_block(CAT), {"type": "text", "text": QUESTION}]}]
    reply = claude.messages.create(model=server.model, messages=messages, **CLAUDE_GREEDY)
    assert text_of(reply) == reference.choices[0].message.content
    assert prompt_tokens(reply.usage) == reference.usage.prompt_tokens
    with claude.messages.stream(model=server.model, messages=messages, **CLAUDE_GREEDY) as stream:
        streamed = stream.get_final_message()
    assert text_of(streamed) == text_of(reply) and prompt_tokens(streamed.usage) == prompt_tokens(reply.usage)
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_inside_a_tool_result_as_claude_code_sends_it(claude, server, stream):
    shown = claude_code_turn([base64_block(CAT)])
    told = claude_code_turn([{"type": "text", "text": "a PNG"}])
    # tool_choice none: the test checkpoint's byte tokenizer has no call syntax to sample a call under.
    fields = {"model": server.model, "tools": READ_TOOL, "tool_choice": {"type": "none"}, **CLAUDE_GREEDY}
    if stream:
        with claude.messages.stream(messages=shown, **fields) as events:
            reply = events.get_final_message()
    else:
        reply = claude.messages.create(messages=shown, **fields)
    assert reply.stop_reason in ("end_turn", "max_tokens")
    def count(messages: list[dict]) -> int:
        return claude.messages.count_tokens(model=server.model, messages=messages, tools=READ_TOOL,
                                            tool_choice={"type": "none"}).input_tokens

    assert prompt_tokens(reply.usage) == count(shown) > count(told)
    server.wait_idle()


def test_count_tokens_counts_image_tokens(claude, client, server):
    with_image = [{"role": "user", "content": [base64_block(CAT), {"type": "text", "text": QUESTION}]}]
    counted = claude.messages.count_tokens(model=server.model, messages=with_image).input_tokens
    without = claude.messages.count_tokens(model=server.model, messages=[{"role": "user", "content": QUESTION}])
    assert counted == without.input_tokens + 2 + 12
    assert counted == chat(client, server, asking(image_part(data_url(CAT)))).usage.prompt_tokens
    server.wait_idle()


# -- bad input: a 4xx naming the part, and the engine serves on ------------------------------------------
def tiff_bytes() -> bytes:
    buffer = io.BytesIO()
    drawn_image(40, 40).save(buffer, format="TIFF")
    return buffer.getvalue()


BAD_CHAT_IMAGES = {
    "corrupt base64": ([image_part("data:image/png;base64,@@@@")], "does not decode"),
    "truncated png": ([image_part(data_url(CAT[:len(CAT) // 2]))], "truncated"),
    "tiff": ([image_part(data_url(tiff_bytes(), "image/tiff"))], "unsupported image format TIFF"),
    "not an image url": ([image_part("ftp://example.com/cat.png")], "data: URL"),
    "too many": ([image_part(data_url(CAT))] * 3, "at most 2"),
    "a 404": ([image_part("{files}/missing.png")], "404"),
    "too large": ([image_part("{files}/huge")], "more than"),
}


@pytest.mark.parametrize("case", list(BAD_CHAT_IMAGES))
def test_a_bad_image_is_a_400_naming_its_part(server, files, case):
    images, words = BAD_CHAT_IMAGES[case]
    images = [{**part, "image_url": {"url": part["image_url"]["url"].format(files=files.base_url)}}
              for part in images]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "look: "}, *images]}]
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                       json={"model": server.model, "messages": messages, **GREEDY})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert f"messages[1].content[{len(images)}]" in error["message"] and words in error["message"], error
    assert error["code"] == "invalid_image"
    still_serving(server)


def test_bad_images_in_the_other_apis_are_named_in_their_own_terms(server):
    reply = httpx.post(f"{server.base_url}/v1/responses", timeout=60, json={
        "model": server.model, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": data_url(b"\x89PNG broken")}]}]})
    assert reply.status_code == 400 and "input[0].content[1]" in reply.json()["error"]["message"], reply.text
    reply = httpx.post(f"{server.base_url}/v1/responses", timeout=60, json={
        "model": server.model, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input[0].content[0].file_id", reply.text
    truncated = claude_code_turn([{"type": "text", "text": "here:"}, base64_block(CAT[:100])])
    reply = httpx.post(f"{server.base_url}/v1/messages", timeout=60, json={
        "model": server.model, "messages": truncated, "max_tokens": 6})
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.text
    assert "messages[2].content[0].content[1]" in reply.json()["error"]["message"]
    document = [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]
    reply = httpx.post(f"{server.base_url}/v1/messages", timeout=60, json={
        "model": server.model, "messages": document, "max_tokens": 6})
    assert reply.status_code == 400 and "documents" in reply.json()["error"]["message"], reply.text
    still_serving(server)


# -- a model that reads text only ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_servers():
    noting, refusing = RunningServer(tiny_engine()), RunningServer(tiny_engine(images="refuse"))
    yield noting, refusing
    noting.close()
    refusing.close()


def test_a_text_model_reads_a_note_in_each_images_place(text_servers, files, caplog):
    caplog.set_level(logging.INFO, logger="tinymlx.server")
    server, _ = text_servers
    asked = len(files.paths)
    messages = asking(image_part(data_url(CAT)), image_part(f"{files.base_url}/cat.png"))
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                       json={"model": server.model, "messages": messages, **GREEDY})
    assert reply.status_code == 200, reply.text
    noted = [{"role": "user", "content": IMAGE_NOTE + IMAGE_NOTE + QUESTION}]
    assert reply.json()["usage"]["prompt_tokens"] == len(server.engine.tokenizer.apply_chat_template(noted))
    assert len(files.paths) == asked  # what the model cannot read is not fetched
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    screenshot = claude_code_turn([base64_block(CAT)])
    assert claude.messages.create(model=server.model, messages=screenshot, max_tokens=4).content is not None
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert "tinymlx_images_omitted_total 3.0" in metrics
    assert [r.getMessage() for r in caplog.records if "omitted" in r.getMessage()] == [
        "chat: 2 images omitted (a note in their place): this model reads text only",
        "messages: 1 image omitted (a note in its place): this model reads text only"]
    server.wait_idle()


def test_a_text_model_refuses_images_under_images_refuse(text_servers):
    _, server = text_servers
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "system", "content": "hi"}, *asking(image_part(data_url(CAT)))],
        **GREEDY})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages[1].content[0]" and "reads text only" in error["message"]
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": asking(), **GREEDY})
    assert reply.status_code == 200, reply.text
    server.wait_idle()
