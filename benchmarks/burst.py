"""Bursts against `tinymlx serve`: how TTFT grows with the burst, and which requests admission refuses.

Bursts of 1 to 64 requests arrive at once (prompts of exactly 32 distinct tokens, 8 output tokens),
the server idle before each. Two servers, each with one admission limit that binds:
  - queue: `--max-queue 16` over the default KV pool. No request gets its first token before the
    whole burst has arrived (a 32-token prefill takes far longer than admitting 64 requests), so
    exactly max(0, B - 16) of a burst of B must be refused with `queue_full`.
  - kv: `--num-pages 24` (block size 16) and a queue of 1000. Each prompt needs 32 / 16 + 1 = 3
    blocks (two full, one for its tail), so exactly max(0, B - 8) must be refused with `kv_full`.
The script checks every burst against that arithmetic, and that every refusal carries Retry-After.
"""

from __future__ import annotations

import asyncio
import time

import common
import httpx
import numpy as np
from http_load import RequestResult, ServerProcess, percentiles, stream_completion, wait_idle
from matplotlib import pyplot as plt

WORKLOADS = {
    "full": {"bursts": [1, 2, 4, 8, 16, 32, 64], "prompt_len": 32, "max_tokens": 8},
    "quick": {"bursts": [1, 8, 24], "prompt_len": 32, "max_tokens": 2},
}
LIMITS = {  # name: (server flags, reason refused, requests admitted at once)
    "queue": (["--max-queue", "16"], "queue_full", 16),
    "kv": (["--num-pages", "24", "--max-queue", "1000"], "kv_full", 24 // 3),
}


def main() -> None:
    setup = common.setup(__doc__, WORKLOADS)
    args, info, workload, model_dir, text_ids = (setup.args, setup.info, setup.workload, setup.model_dir,
                                                 setup.text_ids)
    rng = np.random.default_rng(args.seed)
    length = workload["prompt_len"]

    results: dict[str, dict[int, dict]] = {}
    for limit, (flags, reason, capacity) in LIMITS.items():
        print(f"\n== limit: {limit} ({' '.join(flags)})", flush=True)
        with ServerProcess.tinymlx(model_dir, "--dtype", args.dtype, "--block-size", "16", *flags) as server:
            results[limit] = {}
            for burst in workload["bursts"]:
                starts = rng.integers(0, len(text_ids) - length, size=burst)
                prompts = [text_ids[s:s + length] for s in starts]  # token ids: exactly `length` tokens
                runs = asyncio.run(_burst(server, prompts, workload["max_tokens"]))
                results[limit][burst] = _summary(runs, reason, expected_refused=max(0, burst - capacity))
                s = results[limit][burst]
                print(f"burst {burst}: {s['accepted']} served, {s['refused']} refused ({s['expected_refused']} "
                      f"expected), mean TTFT {s['ttft_mean_s'] or 0:.2f} s", flush=True)

    table = _table(results)
    mismatches = [(limit, b) for limit, r in results.items() for b, s in r.items() if not s["matches_arithmetic"]]
    print("\nevery burst matches the admission arithmetic" if not mismatches else f"\nMISMATCH: {mismatches}")
    payload = {"workload": {**workload, "seed": args.seed}, "limits": {k: v[0] for k, v in LIMITS.items()},
               "results": results, "table": table, "matches_arithmetic": not mismatches}
    common.save_results("burst", args.quick, info, payload, _plot(results))


async def _burst(server: ServerProcess, prompts: list[list[int]], max_tokens: int) -> list[RequestResult]:
    await wait_idle(server)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0), limits=httpx.Limits(max_connections=None)) as http:
        start = time.perf_counter()
        bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True} for p in prompts]
        return await asyncio.gather(*(stream_completion(http, server, body, start) for body in bodies))


def _summary(runs: list[RequestResult], reason: str, expected_refused: int) -> dict:
    served = [r for r in runs if r.ok]
    refused = [r for r in runs if r.status == 503]
    ttft = [r.ttft_s for r in served if r.ttft_s is not None]
    return {
        "accepted": len(served), "refused": len(refused), "expected_refused": expected_refused,
        "refusal_codes": sorted({r.code for r in refused}),
        "matches_arithmetic": (len(refused) == expected_refused and len(served) + len(refused) == len(runs)
                               and all(r.code == reason and r.retry_after for r in refused)),
        "ttft_mean_s": float(np.mean(ttft)) if ttft else None, "ttft_s": percentiles(ttft),
        "refusal_latency_s": percentiles([r.e2e_s for r in refused]),
    }


def _table(results: dict) -> dict:
    headers = ["limit", "burst", "served", "refused", "expected", "ok", "mean TTFT s", "p99 TTFT s", "refusal p99 ms"]
    rows = [[limit, burst, s["accepted"], s["refused"], s["expected_refused"], "yes" if s["matches_arithmetic"] else "NO",
             s["ttft_mean_s"], s["ttft_s"]["p99"], 1000 * (s["refusal_latency_s"]["p99"] or 0)]
            for limit, by_burst in results.items() for burst, s in by_burst.items()]
    return common.print_table("bursts (refusals checked against the admission arithmetic)", headers, rows)


def _plot(results: dict) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for limit, by_burst in results.items():
        bursts = list(by_burst)
        left.plot(bursts, [s["ttft_mean_s"] for s in by_burst.values()], marker="o", label=f"mean, {limit} limit")
        left.plot(bursts, [s["ttft_s"]["p99"] for s in by_burst.values()], marker="o", linestyle="--",
                  label=f"p99, {limit} limit")
        right.plot(bursts, [s["refused"] for s in by_burst.values()], marker="o", label=f"refused, {limit} limit")
        right.plot(bursts, [s["expected_refused"] for s in by_burst.values()], linestyle=":", color="gray")
    left.set_xscale("log", base=2)
    left.set_title("TTFT of the served requests")
    left.set_xlabel("burst size")
    left.set_ylabel("seconds")
    left.legend()
    right.set_xscale("log", base=2)
    right.set_title("503s per burst (dotted: the arithmetic)")
    right.set_xlabel("burst size")
    right.set_ylabel("requests refused")
    right.legend()
    return fig


if __name__ == "__main__":
    main()
