import dataclasses
import math

import numpy as np
import pytest

from tinymlx.core.sampling_params import MAX_LOGPROBS, SamplingParams

INVALID = [
    # (field, value, a fragment the message must show besides the field name)
    ("temperature", -0.1, "[0, inf)"),
    ("temperature", math.nan, "[0, inf)"),
    ("temperature", math.inf, "[0, inf)"),
    ("temperature", "0.7", "number"),
    ("temperature", True, "number"),
    ("temperature", None, "number"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", -0.5, "(0, 1]"),
    ("top_p", 1.01, "(0, 1]"),
    ("top_p", math.nan, "(0, 1]"),
    ("top_k", -2, ">= 1"),
    ("top_k", 1.5, "int"),
    ("top_k", True, "int"),
    ("min_p", -0.01, "[0, 1]"),
    ("min_p", 1.5, "[0, 1]"),
    ("min_p", math.nan, "[0, 1]"),
    ("repetition_penalty", 0.0, "(0, inf)"),
    ("repetition_penalty", -1.0, "(0, inf)"),
    ("repetition_penalty", math.inf, "(0, inf)"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("presence_penalty", -2.01, "[-2, 2]"),
    ("presence_penalty", math.nan, "[-2, 2]"),
    ("frequency_penalty", 3, "[-2, 2]"),
    ("frequency_penalty", -math.inf, "[-2, 2]"),
    ("seed", -1, "2**64"),
    ("seed", 2**64, "2**64"),
    ("seed", 1.0, "int"),
    ("seed", "42", "int"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", -5, ">= 1"),
    ("max_tokens", 10.0, "int"),
    ("max_tokens", None, "int"),
    ("stop", "", "non-empty"),
    ("stop", ["ok", ""], "non-empty"),
    ("stop", ["ok", None], "non-empty"),
    ("stop", [1], "non-empty"),
    ("stop", 5, "str"),
    ("stop_token_ids", [-1], ">= 0"),
    ("stop_token_ids", ["7"], ">= 0"),
    ("stop_token_ids", [1.5], ">= 0"),
    ("stop_token_ids", "12", "sequence of int"),
    ("stop_token_ids", 3, "sequence of int"),
    ("logprobs", -1, f"[0, {MAX_LOGPROBS}]"),
    ("logprobs", MAX_LOGPROBS + 1, f"[0, {MAX_LOGPROBS}]"),
    ("logprobs", 2.0, "int"),
    ("ignore_eos", 1, "bool"),
    ("skip_special_tokens", "yes", "bool"),
]


@pytest.mark.parametrize(("field", "value", "fragment"), INVALID)
def test_invalid_value_raises_with_a_useful_message(field, value, fragment):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message
    assert fragment in message
    assert f"got {value!r}" in message or f"in {value!r}" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0),
        ("temperature", 100.0),
        ("top_p", 1),
        ("top_p", 1e-6),
        ("top_k", -1),
        ("top_k", 0),
        ("top_k", 1),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("repetition_penalty", 1e-3),
        ("presence_penalty", -2),
        ("frequency_penalty", 2.0),
        ("seed", 0),
        ("seed", 2**64 - 1),
        ("max_tokens", 1),
        ("logprobs", 0),
        ("logprobs", MAX_LOGPROBS),
    ],
)
def test_boundary_values_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_numpy_scalars_are_normalised_to_python_types():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(7), stop_token_ids=np.array([3, 4]))
    assert type(p.temperature) is float and p.temperature == 0.5
    assert type(p.top_k) is int and p.top_k == 7
    assert p.stop_token_ids == (3, 4) and all(type(t) is int for t in p.stop_token_ids)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("###", ("###",)),
        (["a", "bc"], ("a", "bc")),
        (("x",), ("x",)),
        ((s for s in ["g1", "g2"]), ("g1", "g2")),
        (None, ()),
        ([], ()),
    ],
)
def test_stop_is_normalised_to_a_tuple(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_equal_params_compare_and_hash_equal_after_normalisation():
    a, b = SamplingParams(stop="x", stop_token_ids=[1]), SamplingParams(stop=["x"], stop_token_ids=(1,))
    assert a == b and hash(a) == hash(b)


def test_is_greedy_and_frozen():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0
