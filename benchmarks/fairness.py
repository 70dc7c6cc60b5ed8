"""Scheduling policies head to head: a flooding batch tenant against an interactive one.

`tinymlx serve --max-num-seqs 4` (so requests queue), one fresh server per policy. At t = 0 the
"batch" tenant sends 12 requests (96-token prompts, 32 output tokens); from t = 2 s the "interactive"
tenant sends 6 short ones (24-token prompts, 8 output tokens), one every 2 s. Both name their tenant
in `user`; under `priority` the interactive requests carry priority -1. Reported per policy and
class: TTFT and completion-time percentiles, and the makespan: what each policy trades.
"""

from __future__ import annotations

import asyncio
import time

import common
import httpx
import numpy as np
from http_load import RequestResult, ServerProcess, percentiles, stream_completion
from matplotlib import pyplot as plt

WORKLOADS = {
    "full": {"batch": (12, 96, 32), "interactive": (6, 24, 8), "interactive_every_s": 2.0, "max_num_seqs": 4},
    "quick": {"batch": (4, 32, 8), "interactive": (2, 16, 4), "interactive_every_s": 1.0, "max_num_seqs": 2},
}
POLICIES = ("fcfs", "priority", "fair")
CLASSES = ("batch", "interactive")


def main() -> None:
    setup = common.setup(__doc__, WORKLOADS)
    args, info, workload, model_dir, text_ids = (setup.args, setup.info, setup.workload, setup.model_dir,
                                                 setup.text_ids)
    rng = np.random.default_rng(args.seed)
    prompts = {}
    for name in CLASSES:
        count, length, _ = workload[name]
        starts = rng.integers(0, len(text_ids) - length, size=count)
        prompts[name] = [text_ids[s:s + length] for s in starts]

    results: dict[str, dict[str, dict]] = {}
    for policy in POLICIES:
        print(f"\n== policy: {policy}", flush=True)
        flags = ["--dtype", args.dtype, "--policy", policy, "--max-num-seqs", str(workload["max_num_seqs"])]
        with ServerProcess.tinymlx(model_dir, *flags) as server:
            runs = asyncio.run(_scenario(server, policy, prompts, workload))
        results[policy] = {name: _summary(r) for name, r in runs.items()}
        results[policy]["makespan_s"] = max(r.sent_s + r.e2e_s for rs in runs.values() for r in rs)

    table = _table(results)
    payload = {"workload": {**workload, "seed": args.seed}, "results": results, "table": table}
    common.save_results("fairness", args.quick, info, payload, _plot(results))


async def _scenario(server: ServerProcess, policy: str, prompts: dict, workload: dict) -> dict[str, list]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0), limits=httpx.Limits(max_connections=None)) as http:
        await stream_completion(http, server, {"prompt": "warm up", "max_tokens": 2}, time.perf_counter())
        start = time.perf_counter()

        async def send(name: str, prompt: list[int], at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            max_tokens = workload[name][2]
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "user": name, "priority": -1 if name == "interactive" and policy == "priority" else 0}
            return await stream_completion(http, server, body, start)

        every = workload["interactive_every_s"]
        batch = [send("batch", p, 0.0) for p in prompts["batch"]]
        interactive = [send("interactive", p, every * (i + 1)) for i, p in enumerate(prompts["interactive"])]
        done = await asyncio.gather(*batch, *interactive)
        return {"batch": done[:len(batch)], "interactive": done[len(batch):]}


def _summary(runs: list[RequestResult]) -> dict:
    assert all(r.ok for r in runs), [r.code for r in runs if not r.ok]
    return {"ttft_s": percentiles([r.ttft_s for r in runs]), "e2e_s": percentiles([r.e2e_s for r in runs]),
            "ttft_mean_s": float(np.mean([r.ttft_s for r in runs]))}


def _table(results: dict) -> dict:
    headers = ["policy", "class", "mean TTFT s", "TTFT p50 s", "TTFT p99 s", "completion p50 s",
               "completion p99 s", "makespan s"]
    rows = [[policy, name, r[name]["ttft_mean_s"], r[name]["ttft_s"]["p50"], r[name]["ttft_s"]["p99"],
             r[name]["e2e_s"]["p50"], r[name]["e2e_s"]["p99"], r["makespan_s"]]
            for policy, r in results.items() for name in CLASSES]
    return common.print_table("a flooding batch tenant vs an interactive one", headers, rows)


def _plot(results: dict) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = np.arange(len(POLICIES))
    width = 0.38
    for k, name in enumerate(CLASSES):
        for ax, metric in ((left, "ttft_s"), (right, "e2e_s")):
            p50 = [results[p][name][metric]["p50"] for p in POLICIES]
            p99 = [results[p][name][metric]["p99"] for p in POLICIES]
            bars = ax.bar(x + (k - 0.5) * width, p50, width, label=f"{name} p50")
            ax.scatter(x + (k - 0.5) * width, p99, color=bars.patches[0].get_facecolor(), marker="_", s=400,
                       label=f"{name} p99")
    for ax, title in ((left, "time to first token"), (right, "completion time")):
        ax.set_xticks(x, POLICIES)
        ax.set_title(title)
        ax.set_ylabel("seconds")
        ax.set_ylim(top=ax.get_ylim()[1] * 1.4)  # headroom for the legend
        ax.legend(loc="upper right", ncol=2, fontsize="small")
    return fig


if __name__ == "__main__":
    main()
