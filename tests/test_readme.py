"""The README's Python examples run as written, on the real default model, and print what they say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tinymlx

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def _block(marker: str) -> str:
    (block,) = [b for b in BLOCKS if marker in b]
    return block


@pytest.fixture(scope="module")
def shared_llm(default_model_dir):
    """One engine for every block: each `LLM()` in them is this one (loading it again would only cost time)."""
    with tinymlx.LLM(str(default_model_dir)) as llm:
        yield llm


@pytest.mark.real_model
@pytest.mark.parametrize("marker", ["outs = llm.chat", "json_schema=schema"], ids=["python-api", "structured-output"])
def test_readme_python_block_runs_as_written(marker, shared_llm, monkeypatch, capsys):
    monkeypatch.setattr(tinymlx, "LLM", lambda *args, **kwargs: shared_llm)
    block = _block(marker)
    namespace: dict = {}
    exec(compile(block, f"README.md ({marker})", "exec"), namespace)  # a NameError here is the README's bug
    if marker == "json_schema=schema":  # the comment shows what the model answers
        claimed = re.search(r"json\.loads\(out\[0\]\.text\)\s+# (.*)", block)[1]
        assert json.loads(namespace["out"][0].text) == json.loads(claimed)
    else:
        assert capsys.readouterr().out  # the streamed deltas were printed
