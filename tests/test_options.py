"""EngineConfig's user fields are declared once (core/config.py): LLM's kwargs, `tinymlx chat`'s options
and the engine flags of `chat`, `serve` and `generate` derive from them and cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

import tinymlx_ui
from tinymlx import LLM
from tinymlx.cli import _engine_kwargs, build_parser
from tinymlx.core.config import OPTIONS, EngineConfig
from tinymlx.core.options import flag_default, flag_of

COMMANDS = ("serve", "chat", "generate")
FIELDS = {field.name: field for field in dataclasses.fields(EngineConfig)}


def command_parser(command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def parse(command: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *(["hi"] if command == "generate" else []), *flags])


def test_the_options_are_every_field_but_the_derived_ones():
    # resolve() sets `resolved`, `step_shape`, `activation_bytes` and `state_slot_pages`; the engine sets
    # `companion_page_bytes` from a draft model before it
    assert set(FIELDS) - set(OPTIONS) == {"resolved", "companion_page_bytes", "step_shape", "activation_bytes",
                                          "state_slot_pages"}
    assert OPTIONS[0] == "model"  # LLM's one positional argument


def test_llm_takes_exactly_the_options_with_their_defaults():
    parameters = dict(inspect.signature(LLM).parameters)
    assert parameters.pop("progress").default is True  # the one kwarg of LLM's own
    assert list(parameters) == list(OPTIONS)
    assert {name: p.default for name, p in parameters.items()} == {name: FIELDS[name].default for name in OPTIONS}
    assert list(inspect.signature(tinymlx_ui.run_chat).parameters) == list(OPTIONS)


@pytest.mark.parametrize("kwargs", [{"blok_size": 4}, {"resolved": True}])
def test_an_unknown_option_is_a_type_error_naming_it_and_listing_the_options(kwargs):
    (name,) = kwargs
    with pytest.raises(TypeError, match=rf"unknown engine option '{name}'; the options are: model, dtype, ") as info:
        LLM(**kwargs)  # refused before anything loads
    assert all(option in str(info.value) for option in OPTIONS)
    with pytest.raises(TypeError, match=name):
        tinymlx_ui.run_chat(**kwargs)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_a_flag_of_every_engine_command(command):
    flags = {action.dest: action for action in command_parser(command)._actions}
    for name in OPTIONS:
        assert name in flags, f"{command} has no flag for {name}"
        assert flags[name].option_strings[:len(flag_of(FIELDS[name]).names)] == list(flag_of(FIELDS[name]).names)
        assert flags[name].default == flag_default(FIELDS[name])
        assert flags[name].help == flag_of(FIELDS[name]).help


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flags_give_the_default_config(command):
    kwargs = _engine_kwargs(parse(command, "--no-disk-cache"))  # chat's own default: a disk tier
    assert list(kwargs) == list(OPTIONS)
    assert EngineConfig.from_options(**kwargs) == EngineConfig()


def test_each_flag_sets_its_field():
    config = EngineConfig.from_options(**_engine_kwargs(parse(
        "serve", "--model", "m", "--dtype", "q8", "--block-size", "8", "--kv-cache-gb", "0.5",
        "--kv-cache-dtype", "int8", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--tp", "2",
        "--speculative", "ngram", "--policy", "fair", "--max-model-len", "100", "--no-enable-prefix-caching",
        "--num-state-checkpoints", "3")))
    assert config == EngineConfig(model="m", dtype="q8", block_size=8, kv_cache_bytes=1 << 29, kv_cache_dtype="int8",
                                  max_num_seqs=4, max_num_batched_tokens=64, tensor_parallel_size=2,
                                  speculative="ngram", scheduling_policy="fair", max_model_len=100,
                                  enable_prefix_caching=False, num_state_checkpoints=3)
    served = _engine_kwargs(parse("serve", "--num-pages", "64", "--disk-cache", "d", "--disk-cache-gb", "1.5"))
    assert (served["num_pages"], served["disk_cache_dir"], served["disk_cache_gb"]) == (64, "d", 1.5)


def test_chat_keeps_no_default_disk_tier_without_the_prefix_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_CACHE", str(tmp_path))
    assert _engine_kwargs(parse("chat"))["disk_cache_dir"] == str(tmp_path / "prefix-cache")
    kwargs = _engine_kwargs(parse("chat", "--no-enable-prefix-caching"))
    assert kwargs["disk_cache_dir"] is None
    EngineConfig.from_options(**kwargs)  # a disk tier would need the prefix cache


@pytest.mark.parametrize("value", ["0", "inf", "lots"])
def test_a_bad_size_in_gib_names_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--disk-cache", "d", "--disk-cache-gb", value)
    assert f"argument --disk-cache-gb: must be a positive number of GiB, got {value}" in capsys.readouterr().err
