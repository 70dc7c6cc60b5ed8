"""Structured output on tiny random models: constrained rows always parse, their neighbours never notice.

A random model's unconstrained output is noise, so every valid JSON value, match and choice below
is the mask's doing. Schemas bound their strings, arrays and numbers so a sample at temperature 1
ends within max_tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from tiny_models import run_to_completion, tiny_engine

from tinymlx import SamplingParams
from tinymlx.sample.sampler import Sampler, SampleRequest
from tinymlx.sample.structured import TokenMasks

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
     "required": ["color", "tags", "score"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                  "admin": {"type": "boolean"}},
                 "required": ["id", "admin"], "additionalProperties": False},
        "note": {"anyOf": [NAME, {"type": "null"}]}},
     "required": ["user"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99}, "minItems": 2, "maxItems": 4},
]
REGEXES = [r"\d{3}-\d{4}", r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)", r"(yes|no), because [a-z ]{1,12}\."]
CHOICES = [("alpha", "beta", "gamma"), ("Paris", "Lyon", "Nice", "Lille")]


def constrained_params(i: int) -> tuple[SamplingParams, object]:
    """Request i's params and a checker of its finished text."""
    common = dict(temperature=1.0, seed=1000 + i, max_tokens=400)
    kind = i % 3
    if kind == 0:
        schema = SCHEMAS[i // 3 % len(SCHEMAS)]
        return SamplingParams(json_schema=schema, **common), lambda text: jsonschema.validate(json.loads(text), schema)
    if kind == 1:
        pattern = REGEXES[i // 3 % len(REGEXES)]
        return SamplingParams(regex=pattern, **common), lambda text: _assert(re.fullmatch(pattern, text), text)
    choices = CHOICES[i // 3 % len(CHOICES)]
    return SamplingParams(choice=choices, **common), lambda text: _assert(text in choices, text)


def _assert(condition, text: str) -> None:
    assert condition, f"{text!r} does not match"


def test_200_constrained_requests_all_validate_and_leave_their_neighbours_unchanged():
    rng = np.random.default_rng(0)
    arrivals, checks = {}, {}
    for i in range(200):
        params, checks[f"c{i}"] = constrained_params(i)
        prompt = rng.integers(0, 256, int(rng.integers(3, 30))).tolist()
        arrivals.setdefault(int(rng.integers(0, 40)), []).append((prompt, params, f"c{i}"))
    plain = {}
    for i in range(24):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=int(rng.integers(4, 40)), ignore_eos=True)
        plain[f"u{i}"] = (rng.integers(0, 256, int(rng.integers(3, 30))).tolist(), params, f"u{i}")
        arrivals.setdefault(int(rng.integers(0, 40)), []).append(plain[f"u{i}"])

    engine = tiny_engine(max_num_seqs=48)
    finals = run_outputs(engine, arrivals)
    for request_id, check in checks.items():
        output = finals[request_id]
        assert output.finish_reason == "stop", f"{request_id} ended by {output.finish_reason}: {output.text!r}"
        check(output.text)

    alone = run_to_completion(tiny_engine(max_num_seqs=48), {0: list(plain.values())})
    assert {request_id: finals[request_id].token_ids for request_id in plain} == alone


def run_outputs(engine, arrivals: dict | None = None) -> dict:
    """Like run_to_completion, but keeping each request's final output."""
    arrivals, finals, step_no = dict(arrivals or {}), {}, 0
    while arrivals or engine.has_unfinished_requests:
        for prompt, params, request_id in arrivals.pop(step_no, []):
            engine.add_request(prompt, params, request_id=request_id)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check()
        step_no += 1
    assert engine.kv_coordinator.num_used_pages == 0
    return finals


@pytest.mark.parametrize("speculative", ["ngram:max_draft=4,min_n=1,adaptive=0", None])
def test_preemption_and_aborts_keep_constrained_requests_valid(speculative):
    """A tiny pool preempts (recompute keeps the tokens, so the matcher state stays right); aborted
    constrained requests free everything; with speculation, drafts the grammar refuses are rejected."""
    engine = tiny_engine(num_pages=110, max_num_seqs=12, speculative=speculative)
    checks = {}
    for i in range(12):  # 12 prompts of 36-39 tokens fill 110 blocks of 4 before any output
        params, checks[f"c{i}"] = constrained_params(i if i % 4 else 3 * i)  # JSON (long) every 4th
        engine.add_request([i] + list(range(40, 75 + i % 4)), params, request_id=f"c{i}")  # no shared prefix
    for _ in range(5):
        engine.step()
    engine.abort("c3")
    engine.abort("c7")
    finished = run_outputs(engine)
    assert engine.scheduler.num_preemptions > 0
    assert not engine.structured_output._matchers, "a finished request kept its matcher"
    for request_id, output in finished.items():
        if request_id in ("c3", "c7"):
            assert output.finish_reason == "abort"
        else:
            assert output.finish_reason == "stop"
            checks[request_id](output.text)


def test_speculation_does_not_change_constrained_outputs():
    """Seeded constrained sampling gives the same tokens with and without n-gram drafts."""
    def run(speculative):
        engine = tiny_engine(speculative=speculative)
        arrivals = {0: [(list(b"{'name': 'ab', 'age': 7} " * 3), constrained_params(3 * i)[0], f"c{i}")
                        for i in range(6)]}
        return {request_id: output.token_ids for request_id, output in run_outputs(engine, arrivals).items()}

    assert run("ngram:max_draft=4,min_n=1,adaptive=0") == run(None)


def test_the_grammar_end_stops_and_max_tokens_first_is_length():
    engine = tiny_engine()
    engine.add_request([1, 2, 3], SamplingParams(choice=["abcdef"], max_tokens=20, ignore_eos=True), "whole")
    engine.add_request([1, 2, 3], SamplingParams(choice=["abcdef"], max_tokens=3), "cut")
    engine.add_request([1, 2, 3], SamplingParams(regex="xy", max_tokens=2), "exact")
    outputs = run_outputs(engine)
    assert (outputs["whole"].text, outputs["whole"].finish_reason) == ("abcdef", "stop")
    assert (outputs["cut"].text, outputs["cut"].finish_reason) == ("abc", "length")
    assert (outputs["exact"].text, outputs["exact"].finish_reason) == ("xy", "stop")  # done as it ran out


@pytest.mark.parametrize("params, message", [
    (dict(json_schema={"type": "nonsense"}), "invalid json_schema constraint"),
    (dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/missing"}}}), "invalid json_schema"),
    (dict(regex="(ab"), "invalid regex constraint"),
    (dict(grammar="start: undefined_rule"), "invalid grammar constraint"),
    (dict(grammar="this is not a grammar"), "invalid grammar constraint"),
])
def test_a_bad_constraint_is_refused_when_added_and_the_engine_keeps_serving(params, message):
    engine = tiny_engine()
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "before")
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2], SamplingParams(**params), "bad")
    assert engine.requests.get("bad") is None and len(engine.scheduler.waiting) == 0
    engine.add_request([1, 2], SamplingParams(regex="[ab]{2}", max_tokens=8), "after")
    outputs = run_outputs(engine)
    assert set(outputs) == {"before", "after"} and re.fullmatch("[ab]{2}", outputs["after"].text)


@pytest.mark.parametrize("params, message", [
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema must be a JSON object"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(choice="yes"), "choice must be a sequence of strings"),
    (dict(choice=[]), "choice must be a non-empty"),
    (dict(choice=["a", 3]), "choice must be a non-empty"),
    (dict(json_object=1), "json_object must be a bool"),
    (dict(regex="a", choice=["a"]), "at most one constraint per request, got regex and choice"),
    (dict(json_object=True, grammar="start: 'a'"), "at most one constraint"),
])
def test_malformed_constraints_fail_in_sampling_params(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_constraint_normalises_what_was_given():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert SamplingParams(json_schema=schema) == SamplingParams(json_schema=json.dumps(schema, indent=2))
    assert SamplingParams(json_schema=schema).constraint.kind == "json_schema"
    assert SamplingParams(choice=["x", "y"]).constraint.spec == '["x", "y"]'
    assert SamplingParams(json_object=True).constraint.kind == "json_object"
    assert SamplingParams().constraint is None
    hash(SamplingParams(json_schema=schema, choice=None))  # frozen params stay hashable


def test_masks_touch_only_the_constrained_rows_and_not_the_logprobs():
    V = 70
    logits = mx.array(np.random.default_rng(0).normal(size=(3, V)).astype(np.float32))
    bitmask = np.zeros((1, 3), dtype=np.int32)
    allowed = [5, 33, 64, 69]
    for t in allowed:
        bitmask[0, t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(2**31))
    rows = [SampleRequest(SamplingParams(temperature=0.0, logprobs=0), [1], [])] * 3
    free = Sampler()(logits, rows)
    masked = Sampler()(logits, rows, TokenMasks([1], bitmask))
    best_allowed = max(allowed, key=lambda t: logits[1, t].item())
    assert masked.token_ids == [free.token_ids[0], best_allowed, free.token_ids[2]]
    expected = (logits[1] - mx.logsumexp(logits[1]))[best_allowed].item()
    assert masked.logprobs[1].logprob == pytest.approx(expected, abs=1e-5)  # from the raw logits, as vLLM

    for seed in range(20):  # sampling never leaves the allowed set
        params = SamplingParams(temperature=2.0, seed=seed)
        out = Sampler()(logits, [SampleRequest(params, [1], [])] * 3, TokenMasks([0, 2], np.repeat(bitmask, 2, 0)))
        assert out.token_ids[0] in allowed and out.token_ids[2] in allowed


def test_a_constraint_is_compiled_once_however_often_it_is_checked(monkeypatch):
    """Validation (caller's thread), the matcher's start and n choices share one compiled grammar."""
    engine = tiny_engine()
    structured = engine.structured_output
    compiled = []
    validated = structured._validated
    monkeypatch.setattr(structured, "_validated", lambda c: compiled.append(c) or validated(c))
    params = SamplingParams(json_schema=SCHEMAS[0], max_tokens=4)
    for i in range(3):
        engine.validate([1, 2], params)
        engine.add_request([1, 2], params, request_id=f"r{i}")
    assert compiled == [params.constraint]
    with pytest.raises(ValueError, match="invalid regex"):  # a bad one is not kept: refused every time
        engine.check_constraint(SamplingParams(regex="(ab"))
    with pytest.raises(ValueError, match="invalid regex"):
        engine.check_constraint(SamplingParams(regex="(ab"))
    run_outputs(engine)
