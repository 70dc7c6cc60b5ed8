"""Serving under open-loop load: `tinymlx serve` vs `mlx_lm.server`, at several Poisson arrival rates.

Requests arrive at exponential gaps (a Poisson process at each rate), whatever the server is doing,
as users would: real text prompts of U[32, 128] tokens, streamed completions of up to 32 tokens at
temperature 0 (neither server is told to ignore EOS). Each (rate, server) gets a fresh server
process on loopback and the same prompts and arrival times. Reported per rate: completed requests and
errors, generated tok/s (tokens over the span from the first arrival to the last token), TTFT and
inter-token latency percentiles.
"""

from __future__ import annotations

import asyncio
import time

import common
import httpx
import numpy as np
from http_load import RequestResult, ServerProcess, percentiles, stream_completion
from matplotlib import pyplot as plt

from tinymlx.text.tokenizer import Tokenizer

WORKLOADS = {
    "full": {"rates": [0.1, 0.2, 0.4], "num_requests": 12, "prompt_len": (32, 128), "max_tokens": 32},
    "quick": {"rates": [0.5], "num_requests": 4, "prompt_len": (16, 32), "max_tokens": 8},
}
SERVERS = ("tinymlx", "mlx-lm")


def main() -> None:
    setup = common.setup(__doc__, WORKLOADS)
    args, info, workload, model_dir, text_ids = (setup.args, setup.info, setup.workload, setup.model_dir,
                                                 setup.text_ids)
    tokenizer = Tokenizer.from_dir(model_dir)

    results: dict[float, dict[str, dict]] = {}
    for rate in workload["rates"]:
        rng = np.random.default_rng([args.seed, int(rate * 1000)])
        prompts = [tokenizer.decode(p) for p in common.sample_prompts(
            text_ids, workload["num_requests"], workload["prompt_len"], rng)]
        arrivals = np.cumsum(rng.exponential(1 / rate, size=len(prompts))).tolist()
        results[rate] = {}
        for name in SERVERS:
            server = (ServerProcess.tinymlx(model_dir, "--dtype", args.dtype) if name == "tinymlx"
                      else ServerProcess.mlx_lm(model_dir))
            print(f"\n== {rate} req/s: {name}", flush=True)
            with server:
                runs = asyncio.run(_open_loop(server, prompts, arrivals, workload["max_tokens"]))
            results[rate][name] = _summary(runs)

    table = _table(results)
    payload = {"workload": {**workload, "seed": args.seed}, "results": results, "table": table}
    common.save_results("serve", args.quick, info, payload, _plot(results))


async def _open_loop(server: ServerProcess, prompts: list[str], arrivals: list[float], max_tokens: int
                     ) -> list[RequestResult]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0)) as http:
        await stream_completion(http, server, {"prompt": "warm up", "max_tokens": 2}, time.perf_counter())
        start = time.perf_counter()

        async def arrive(prompt: str, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            return await stream_completion(http, server, body, start)

        return await asyncio.gather(*(arrive(p, at) for p, at in zip(prompts, arrivals)))


def _summary(runs: list[RequestResult]) -> dict:
    done = [r for r in runs if r.ok]
    span = max(r.sent_s + r.e2e_s for r in runs) - min(r.sent_s for r in runs)
    itl = [gap for r in done for gap in r.itl_s]
    return {
        "completed": len(done), "errors": len(runs) - len(done),
        "generated_tokens": sum(r.num_tokens for r in done),
        "gen_tok_s": sum(r.num_tokens for r in done) / span,
        "ttft_s": percentiles([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.e2e_s for r in done]),
        "requests": [r.__dict__ for r in runs],
    }


def _table(results: dict) -> dict:
    headers = ["req/s", "server", "done", "errors", "gen tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
               "ITL p99 ms", "x gen tok/s", "x TTFT p50"]
    rows = []
    for rate, by_server in results.items():
        peer = by_server["mlx-lm"]
        for name, s in by_server.items():
            ratio = name == "tinymlx"
            rows.append([rate, name, s["completed"], s["errors"], s["gen_tok_s"], s["ttft_s"]["p50"],
                         s["ttft_s"]["p99"], 1000 * (s["itl_s"]["p50"] or 0), 1000 * (s["itl_s"]["p99"] or 0),
                         s["gen_tok_s"] / peer["gen_tok_s"] if ratio else "-",
                         s["ttft_s"]["p50"] / peer["ttft_s"]["p50"] if ratio and peer["ttft_s"]["p50"] else "-"])
    return common.print_table("open-loop Poisson load (x = tinymlx / mlx-lm)", headers, rows)


def _plot(results: dict) -> plt.Figure:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    rates = list(results)
    for name, marker in zip(SERVERS, "os"):
        series = [results[r][name] for r in rates]
        axes[0].plot(rates, [s["gen_tok_s"] for s in series], marker=marker, label=name)
        axes[1].plot(rates, [s["ttft_s"]["p50"] for s in series], marker=marker, label=f"{name} p50")
        axes[1].plot(rates, [s["ttft_s"]["p99"] for s in series], marker=marker, linestyle="--", label=f"{name} p99")
        axes[2].plot(rates, [1000 * (s["itl_s"]["p50"] or 0) for s in series], marker=marker, label=f"{name} p50")
        axes[2].plot(rates, [1000 * (s["itl_s"]["p99"] or 0) for s in series], marker=marker, linestyle="--",
                     label=f"{name} p99")
    for ax, title, unit in zip(axes, ("throughput", "time to first token", "inter-token latency"),
                               ("generated tok/s", "seconds", "ms")):
        ax.set_title(title)
        ax.set_xlabel("arrival rate, requests/s")
        ax.set_ylabel(unit)
        ax.legend()
    return fig


if __name__ == "__main__":
    main()
