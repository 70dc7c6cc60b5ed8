"""Continuous batching vs gang-scheduled (static) batching, on the same tinymlx engine.

A burst of requests arrives at once, with prompts of U[32, 256] tokens and a high-variance mix of
output lengths (log-uniform in [16, 256], EOS ignored). Continuous: all are queued at once and the
scheduler refills free seats every step. Gang: the requests are fed `gang_size` at a time and the
next group starts only when the whole group has finished, which is what static batching does.
TTFT and completion times count from the burst's arrival, so a request's wait for its group counts.
"""

from __future__ import annotations

import common
import numpy as np
from matplotlib import pyplot as plt

WORKLOADS = {
    "full": {"num_requests": 32, "prompt_len": (32, 256), "output_len": (16, 256), "gang_size": 8},
    "quick": {"num_requests": 8, "prompt_len": (32, 64), "output_len": (8, 32), "gang_size": 4},
}


def main() -> None:
    args, info, workload, loaded = common.start(__doc__, WORKLOADS)
    rng = np.random.default_rng(args.seed)
    n = workload["num_requests"]
    prompts = common.sample_prompts(common.text_token_ids(loaded.tokenizer), n, workload["prompt_len"], rng)
    params = [common.fixed_length(m) for m in common.log_uniform_lengths(n, *workload["output_len"], rng)]
    common.warm_up(loaded)

    modes = {"continuous": None, f"gang (batch={workload['gang_size']})": workload["gang_size"]}
    runs, summaries = {}, {}
    for mode, wave_size in modes.items():
        # A fresh engine per mode: the prompts repeat, and the second mode must not find them cached.
        engine = common.new_engine(loaded)
        runs[mode] = common.run_tinymlx(engine, prompts, params, wave_size=wave_size, desc=mode)
        summaries[mode] = common.summarize(runs[mode])
        del engine

    headers = ["mode", "mean TTFT s", "p99 TTFT s", "gen tok/s", "p99 completion s", "makespan s"]
    rows = [[mode, s["mean_ttft_s"], s["p99_ttft_s"], s["gen_tok_s"], s["p99_e2e_s"], s["makespan_s"]]
            for mode, s in summaries.items()]
    table = common.print_table(f"{n} requests at once, outputs {workload['output_len']} tokens "
                               f"({sum(p.max_tokens for p in params)} in all), dtype {info['dtype']}",
                               headers, rows)
    cont, gang = summaries.values()
    ratios = {
        "mean_ttft_gang_over_continuous": gang["mean_ttft_s"] / cont["mean_ttft_s"],
        "throughput_continuous_over_gang": cont["gen_tok_s"] / gang["gen_tok_s"],
        "p99_completion_gang_over_continuous": gang["p99_e2e_s"] / cont["p99_e2e_s"],
    }
    print("\n" + "\n".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))

    payload = {
        "workload": {**workload, "seed": args.seed, "prompt_lengths": [len(p) for p in prompts],
                     "output_lengths": [p.max_tokens for p in params]},
        "results": summaries, "ratios": ratios, "table": table,
        "requests": {mode: [r.__dict__ for r in run.requests] for mode, run in runs.items()},
    }
    common.save_results("bench", args.quick, info, payload, _plot(runs))


def _plot(runs: dict[str, common.Run]) -> plt.Figure:
    """One row per request: waiting + prefill (light) until its first token, then decoding (dark)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(12, 5), sharex=True, sharey=True)
    for ax, (mode, run) in zip(axes, runs.items()):
        for i, r in enumerate(run.requests):
            ax.barh(i, r.ttft_s, color="#f4b183", height=0.8)
            ax.barh(i, r.e2e_s - r.ttft_s, left=r.ttft_s, color="#2e75b6", height=0.8)
        s = common.summarize(run)
        ax.set_title(f"{mode}\nmean TTFT {s['mean_ttft_s']:.1f} s, {s['gen_tok_s']:.1f} tok/s")
        ax.set_xlabel("seconds since the burst arrived")
    axes[0].set_ylabel("request")
    axes[0].invert_yaxis()
    axes[0].legend(["waiting + prefill", "decoding"], loc="upper right")
    return fig


if __name__ == "__main__":
    main()
