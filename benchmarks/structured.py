"""Structured output: a constrained batch against the same batch unconstrained, and the feature's cost to others.

Workload: requests asking for JSON records (a schema per request; greedy), single stream (one after
another) and concurrency 16 (all at once). Each constrained run is matched by an unconstrained run of
the same prompts generating exactly as many tokens per request (ignore_eos), so the two differ only
by the masks: the ratio of their tok/s is the cost of constraining. Mask time per token is what the
engine spent building bitmasks (llguidance) per constrained row, measured inside the run.

"Before vs with": the unconstrained concurrency-16 batch on this checkout against the commit before
structured output existed (a git worktree), each in fresh processes, alternated, medians compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import common
import jsonschema
import numpy as np
from matplotlib import pyplot as plt

from tinymlx import SamplingParams

STRING = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "language": {"type": "object", "properties": {
        "name": STRING, "first_released": {"type": "integer", "minimum": 1950, "maximum": 2030},
        "paradigms": {"type": "array", "items": {"enum": ["functional", "imperative", "object-oriented",
                                                           "declarative", "logic", "concurrent"]},
                      "minItems": 1, "maxItems": 4},
        "typing": {"enum": ["static", "dynamic", "gradual"]}, "garbage_collected": {"type": "boolean"}},
        "required": ["name", "first_released", "paradigms", "typing", "garbage_collected"],
        "additionalProperties": False},
    "city": {"type": "object", "properties": {
        "name": STRING, "country": STRING, "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
        "landmarks": {"type": "array", "items": STRING, "minItems": 2, "maxItems": 3}},
        "required": ["name", "country", "population_millions", "landmarks"], "additionalProperties": False},
    "function": {"type": "object", "properties": {
        "name": STRING, "arguments": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "properties": {"name": STRING, "type": STRING}, "required": ["name", "type"],
            "additionalProperties": False}},
        "returns": STRING, "pure": {"type": "boolean"}},
        "required": ["name", "arguments", "returns", "pure"], "additionalProperties": False},
}
SUBJECTS = {
    "language": ["Python", "Rust", "Haskell", "Go", "JavaScript", "Prolog"],
    "city": ["Paris", "Tokyo", "Nairobi", "Lima", "Toronto"],
    "function": ["binary search over a sorted list", "merging two dictionaries", "parsing an ISO date",
                 "computing a SHA-256 digest", "retrying an HTTP request"],
}
WORKLOADS = {
    "full": {"single": 4, "concurrent": 16, "max_tokens": 200, "repeats": 2},
    "quick": {"single": 1, "concurrent": 3, "max_tokens": 48, "repeats": 1},
}


def requests(n: int) -> list[tuple[str, dict]]:
    """(question, schema) pairs, cycling through the kinds so a batch mixes schemas."""
    items = [(kind, subject) for i in range(max(map(len, SUBJECTS.values())))
             for kind, subjects in SUBJECTS.items() if i < len(subjects) for subject in [subjects[i]]]
    out = []
    for kind, subject in (items * (n // len(items) + 1))[:n]:
        question = f"Describe {subject} as a JSON object with the fields {list(SCHEMAS[kind]['properties'])}."
        out.append((question, SCHEMAS[kind]))
    return out


def run_job(job: dict) -> dict:
    """In a fresh process (this checkout or the baseline's, whichever `tinymlx` imports): the
    unconstrained batch, `repeats` times; generated tok/s of each."""
    import tinymlx

    loaded = common.load_tinymlx(job["model"], job["dtype"])
    common.warm_up(loaded)
    params = [common.fixed_length(n) for n in job["lengths"]]
    rates = [common.summarize(common.run_tinymlx(common.new_engine(loaded), job["prompts"], params,
                                                 desc=f"{job['label']} unconstrained"))["gen_tok_s"]
             for _ in range(job["repeats"])]
    return {"gen_tok_s": rates, "tinymlx": str(Path(tinymlx.__file__).parent)}


def main() -> None:
    setup = common.start_process_per_run(__doc__, WORKLOADS, run_job)
    if setup is None:
        return
    args, info, workload = setup.args, setup.info, setup.workload
    loaded = common.load_tinymlx(args.model, args.dtype)
    common.warm_up(loaded)
    results = {}
    for mode in ("single", "concurrent"):
        asked = requests(workload[mode])
        prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in asked]
        wave = 1 if mode == "single" else None
        engine = common.new_engine(loaded)
        mask_s, rows = _time_masks(engine)
        constrained = [SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], json_schema=schema)
                       for _, schema in asked]
        on = common.run_tinymlx(engine, prompts, constrained, wave_size=wave, desc=f"{mode} constrained")
        valid = sum(_is_valid(out.text, schema) for out, (_, schema) in zip(on.outputs, asked))
        lengths = [len(out.token_ids) for out in on.outputs]
        off = common.run_tinymlx(common.new_engine(loaded), prompts, [common.fixed_length(n) for n in lengths],
                                 wave_size=wave, desc=f"{mode} unconstrained")
        on_summary, off_summary = common.summarize(on), common.summarize(off)
        results[mode] = {
            "num_requests": len(prompts), "constrained": on_summary, "unconstrained": off_summary,
            "ratio": on_summary["gen_tok_s"] / off_summary["gen_tok_s"], "num_valid": valid,
            "mask_us_per_token": 1e6 * sum(mask_s) / max(1, sum(rows)), "mask_us_p99": _p99_us_per_row(mask_s, rows),
            "stop_reasons": [out.finish_reason for out in on.outputs], "sample_output": on.outputs[0].text,
        }
        if mode == "concurrent":
            concurrent_prompts, concurrent_lengths = prompts, lengths
    results["before vs with"] = _before_vs_with(args, concurrent_prompts, concurrent_lengths, workload["repeats"])
    table = _table(results)
    payload = {"workload": workload, "schemas": SCHEMAS, "results": results, "table": table}
    common.save_results("structured", args.quick, info, payload, _plot(results))


def _time_masks(engine) -> tuple[list[float], list[int]]:
    """Record the seconds and rows of every mask the engine builds (the wrapper adds ~1 us a call)."""
    structured = engine.structured_output  # the tokenizer wrap (once per engine) is outside the timing
    seconds, rows = [], []
    build = structured.masks

    def timed(*a, **k):
        t0 = time.perf_counter()
        masks = build(*a, **k)
        seconds.append(time.perf_counter() - t0)
        rows.append(len(masks.rows))
        return masks

    structured.masks = timed
    return seconds, rows


def _p99_us_per_row(seconds: list[float], rows: list[int]) -> float:
    return float(np.percentile([1e6 * s / r for s, r in zip(seconds, rows)], 99)) if rows else 0.0


def _is_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def _before_vs_with(args, prompts: list[list[int]], lengths: list[int], repeats: int) -> dict:
    """Unconstrained concurrency-16 tok/s: this checkout vs the commit before structured output."""
    repo = Path(__file__).resolve().parent.parent
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "tinymlx/sample/structured.py"],
                           cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    baseline = subprocess.run(["git", "rev-parse", f"{added[-1]}^" if added else "HEAD"], cwd=repo,
                              capture_output=True, text=True, check=True).stdout.strip()
    rates = {"with": [], "before": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), baseline], cwd=repo, check=True,
                       capture_output=True)
        try:
            for rep in range(repeats):  # alternate, so drift in the machine's speed hits both alike
                for label, root in (("with", repo), ("before", tree)):
                    job = {"model": args.model, "dtype": args.dtype, "prompts": prompts, "lengths": lengths,
                           "repeats": 1, "label": label}
                    # The run imports `tinymlx` from `root`: this checkout's, or the baseline's.
                    out = common.run_in_fresh_process(__file__, job, Path(tmp) / f"{label}{rep}.json",
                                                      env={**os.environ, "PYTHONPATH": str(root)})
                    if Path(out["tinymlx"]).parent != root:
                        raise RuntimeError(f"the {label} run imported tinymlx from {out['tinymlx']}")
                    rates[label] += out["gen_tok_s"]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, check=False)
    return {"baseline_commit": baseline, "gen_tok_s": rates,
            "ratio": statistics.median(rates["with"]) / statistics.median(rates["before"])}


def _table(results: dict) -> dict:
    headers = ["mode", "requests", "valid", "tok/s unconstrained", "tok/s constrained", "x", "bar",
               "mask us/token", "mask p99 us"]
    rows = []
    for mode in ("single", "concurrent"):
        r = results[mode]
        bar = "met (0.9x)" if r["ratio"] >= 0.9 else "MISSED (0.9x)"
        rows.append([mode, r["num_requests"], f"{r['num_valid']}/{r['num_requests']}", r["unconstrained"]["gen_tok_s"],
                     r["constrained"]["gen_tok_s"], r["ratio"], bar if mode == "concurrent" else "-",
                     r["mask_us_per_token"], r["mask_us_p99"]])
    b = results["before vs with"]
    rows.append(["unconstrained, before vs with", len(b["gen_tok_s"]["with"]), "-",
                 statistics.median(b["gen_tok_s"]["before"]), statistics.median(b["gen_tok_s"]["with"]), b["ratio"],
                 "met (0.98x)" if b["ratio"] >= 0.98 else "MISSED (0.98x)", "-", "-"])
    return common.print_table("structured output: constrained vs unconstrained (same tokens per request), "
                              "and unconstrained before vs with the feature", headers, rows)


def _plot(results: dict) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = ["single", "concurrent 16", "unconstrained\nbefore vs with"]
    ratios = [results["single"]["ratio"], results["concurrent"]["ratio"], results["before vs with"]["ratio"]]
    bars_at = [None, 0.9, 0.98]
    bars = left.bar(labels, ratios, color=["#2e75b6" if b is None or r >= b else "#c0504d"
                                           for r, b in zip(ratios, bars_at)])
    left.bar_label(bars, fmt="%.3fx")
    left.scatter([1, 2], [0.9, 0.98], marker="_", s=900, color="black", label="bar")
    left.set_ylim(0, max(1.1, max(ratios) * 1.1))
    left.set_title("tok/s ratio (constrained / unconstrained; with / before)")
    left.legend(loc="lower right")
    modes = ["single", "concurrent"]
    means = [results[m]["mask_us_per_token"] for m in modes]
    p99 = [results[m]["mask_us_p99"] for m in modes]
    x = np.arange(len(modes))
    right.bar(x - 0.2, means, 0.4, label="mean", color="#c8a040")
    right.bar(x + 0.2, p99, 0.4, label="p99", color="#7f7f7f")
    right.set_xticks(x, ["single", "concurrent 16"])
    right.set_ylabel("us per constrained token")
    right.set_title("mask time per token (llguidance, 151,936-token vocabulary)")
    right.legend()
    return fig


if __name__ == "__main__":
    main()
