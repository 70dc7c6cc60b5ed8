"""hybrid.py's speculation and tensor-parallel parts (tinymlx alone: mlx-lm runs neither on a hybrid model;
its MTP is an open pull request and its speculative decoding needs a separate draft model).

Speculation (`hybrid.py --only speculation`, results/hybrid_speculation.{json,png}): the Qwen3.5-0.8B-shaped
checkpoint with a random MTP head (one gated full-attention layer and its MLP, fc and norms, in Hugging
Face's layout; written once beside the checkpoint, whose files it links), greedy, prompts cut from real
text. Random weights keep almost no drafts, so the drafts' *contents* are forced: each step the proposer
runs as it would (the head's pass and chained forwards are paid for), then a draft is replaced by the
token plain decoding gives there with probability `rate`, and by another token otherwise, draft by draft.
At 70% and k = 3 a step keeps 1 + 0.7 + 0.49 + 0.34 = 2.53 tokens on average. The outputs must equal the
plain run's. Rows: plain, n-gram and MTP at concurrency 1 and 8, decode tok/s per stream and generated
tok/s, against plain; and the recurrent state's snapshot traffic per verified token (each drafting sequence
writes k states a recurrent layer, kv/state_slots.py). The bar: >= 1.3x plain at concurrency 1.

Tensor parallelism (`--only tp`, results/hybrid_tp.{json,png}): the same checkpoint over 2 ranks and over 1,
a single stream and an 8-request burst, greedy; the tokens must be identical. On one 2-core machine the two
ranks share its cores: no speed-up is expected (it pays off across machines); the row says what it costs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import common
import mlx.core as mx
import numpy as np
from matplotlib import pyplot as plt

from tinymlx import Engine, EngineConfig
from tinymlx.models import load_mtp_head
from tinymlx.text.tokenizer import Tokenizer

SPECULATION, TP = "speculation", "tp"
PROPOSERS = {"n-gram": "ngram:max_draft={k},min_n=1,adaptive=0", "MTP": "mtp:{k},adaptive=0"}
WORKLOADS = {
    "full": {"prompt_len": 128, "output_len": 64, "concurrency": (1, 8), "rate": 0.7, "k": 3,
             "tp_requests": 8, "tp_output_len": 32},
    "quick": {"prompt_len": 32, "output_len": 8, "concurrency": (1, 2), "rate": 0.7, "k": 3,
              "tp_requests": 2, "tp_output_len": 4},
}


# -- the MTP head beside the checkpoint ------------------------------------------------------------
def ensure_mtp_checkpoint(checkpoint: Path, full_attention_tensors: dict, init) -> Path:
    """`checkpoint`'s files linked into a sibling directory with a random MTP head added (mtp.safetensors):
    mlx-lm keeps reading the checkpoint itself, untouched. `full_attention_tensors`: HF name -> (shape, init)
    of one gated full-attention decoder layer, named from `layers.N.`."""
    path = checkpoint.with_name(checkpoint.name + "-mtp")
    if (path / "mtp.safetensors").is_file():
        return path
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        if not (path / file.name).exists():
            os.symlink(file, path / file.name)
    rng = np.random.default_rng(1)
    hidden = next(shape for name, (shape, _) in full_attention_tensors.items() if name.endswith("input_layernorm.weight"))[0]
    layer = {"mtp.layers.0." + name.split(".", 2)[2]: value for name, value in full_attention_tensors.items()}
    tensors = {**layer, "mtp.fc.weight": ((hidden, 2 * hidden), "normal"), "mtp.norm.weight": ((hidden,), "zeros"),
               "mtp.pre_fc_norm_embedding.weight": ((hidden,), "zeros"),
               "mtp.pre_fc_norm_hidden.weight": ((hidden,), "zeros")}
    partial = path / "mtp.safetensors.partial"
    save_file({name: init(shape, kind, rng) for name, (shape, kind) in tensors.items()}, str(partial),
              metadata={"format": "pt"})
    os.replace(partial, path / "mtp.safetensors")
    return path


# -- speculation at a forced acceptance rate ---------------------------------------------------------
def force_drafts(proposer, reference: dict[tuple[int, ...], list[int]], rate: float, vocab: int,
                 rng: np.random.Generator) -> None:
    """Run `proposer` as it is, then make each of its drafts the reference's token with probability `rate`."""
    propose = proposer.propose
    proposer.available = lambda seq, limit: limit

    def forced(chunks, seqs):
        propose(chunks, seqs)  # its cost is paid; its tokens are replaced
        drafts = {}
        for chunk in chunks:
            seq = seqs[chunk.seq_id]
            output = reference[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            done = seq.num_tokens - seq.num_prompt_tokens
            right = output[done:done + chunk.num_draft_tokens]
            drafts[chunk.seq_id] = [t if rng.random() < rate else (t + 1) % vocab for t in right]
        return drafts

    proposer.propose = forced


def run_speculation(job: dict) -> dict:
    """In one process: plain, then each proposer forced, at each concurrency, on fresh engines."""
    loaded = common.load_tinymlx(job["model_dir"], job["dtype"])
    common.warm_up(loaded)
    rows = []
    for concurrency in job["concurrency"]:
        prompts = job["prompts"][:concurrency]
        params = [common.fixed_length(job["output_len"])] * concurrency
        mx.clear_cache()
        plain = common.run_tinymlx(common.new_engine(loaded, max_num_seqs=concurrency), prompts, params,
                                   desc=f"plain x{concurrency}")
        reference = {tuple(p): out.token_ids for p, out in zip(prompts, plain.outputs)}
        rows.append({"concurrency": concurrency, "proposer": "none", **common.summarize(plain)})
        for name, spec in PROPOSERS.items():
            engine = _speculative_engine(loaded, job["model_dir"], spec.format(k=job["k"]), concurrency)
            proposer_name = spec.split(":")[0]
            force_drafts(engine.speculation.proposers[proposer_name], reference, job["rate"],
                         loaded.model.args.vocab_size, np.random.default_rng(concurrency))
            run = common.run_tinymlx(engine, prompts, params, desc=f"{name} x{concurrency}")
            assert [o.token_ids for o in run.outputs] == [o.token_ids for o in plain.outputs], "speculation changed tokens"
            stats = engine.stats()
            slot_bytes = stats.state_slots.slot_nbytes
            per_step = stats.num_accepted_tokens / max(stats.num_verified_chunks, 1) + 1  # kept tokens per verify
            rows.append({"concurrency": concurrency, "proposer": name, **common.summarize(run),
                         "acceptance_rate": stats.acceptance_rate, "tokens_per_verified_chunk": per_step,
                         "snapshot_mb_per_verified_chunk": job["k"] * slot_bytes / 1e6,
                         "snapshot_mb_per_kept_token": job["k"] * slot_bytes / 1e6 / per_step,
                         "num_steps": engine.num_steps})
            engine.close()
    return {"rows": rows}


def _speculative_engine(loaded: common.LoadedModel, model_dir: str, speculative: str, max_num_seqs: int) -> Engine:
    """An engine on the loaded target whose MTP head (if asked for) is the checkpoint's."""
    head = load_mtp_head(Path(model_dir), loaded.model) if speculative.startswith("mtp") else None
    return Engine(loaded.model, loaded.tokenizer, EngineConfig(speculative=speculative, max_num_seqs=max_num_seqs),
                  model_name="hybrid", draft_model=head)


def speculation_table(result: dict) -> dict:
    plain = {r["concurrency"]: r for r in result["rows"] if r["proposer"] == "none"}
    rows = [[r["concurrency"], r["proposer"], r["decode_tok_s_per_stream"],
             r["decode_tok_s_per_stream"] / plain[r["concurrency"]]["decode_tok_s_per_stream"], r["gen_tok_s"],
             r.get("acceptance_rate"), r.get("tokens_per_verified_chunk"), r.get("snapshot_mb_per_kept_token")]
            for r in result["rows"]]
    headers = ["concurrency", "proposer", "decode tok/s per stream", "x plain", "generated tok/s",
               "acceptance", "tokens per verify", "snapshot MB per kept token"]
    return common.print_table("Speculation on the hybrid at a forced acceptance rate (k drafts, greedy)", headers, rows)


def speculation_bar(result: dict, rate: float, k: int) -> dict:
    rows = {(r["concurrency"], r["proposer"]): r for r in result["rows"]}
    best = max(rows[1, name]["decode_tok_s_per_stream"] for name in PROPOSERS) / rows[1, "none"]["decode_tok_s_per_stream"]
    return {"name": f"speculation at {rate:.0%} forced acceptance, k={k}, concurrency 1: decode / plain",
            "measured": best, "bar": ">= 1.3"}


def plot_speculation(ax, result: dict) -> None:
    plain = {r["concurrency"]: r["decode_tok_s_per_stream"] for r in result["rows"] if r["proposer"] == "none"}
    names = ["none", *PROPOSERS]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rows = [r for r in result["rows"] if r["proposer"] == name]
        xs = np.arange(len(rows)) + i * width
        ax.bar(xs, [r["decode_tok_s_per_stream"] / plain[r["concurrency"]] for r in rows], width, label=name)
    ax.set_xticks(np.arange(len(plain)) + width, [f"concurrency {c}" for c in plain])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("decode per stream / plain")
    ax.legend(fontsize=8)
    ax.set_title("Speculation at a forced acceptance rate", fontsize=9)


# -- tensor parallelism ----------------------------------------------------------------------------
def run_tp(job: dict) -> dict:
    """TP=1 then TP=2 in this process (the worker rank is a process of its own), same prompts, greedy."""
    model_dir = Path(job["model_dir"])
    tokenizer = Tokenizer.from_dir(model_dir)
    out = {}
    for size in (1, 2):
        t0 = time.perf_counter()
        engine = Engine.load(model_dir, tokenizer, EngineConfig(tensor_parallel_size=size, dtype=job["dtype"]),
                             progress=False)
        load_s = time.perf_counter() - t0
        common.run_tinymlx(engine, job["prompts"][:1], [common.fixed_length(2)], desc="warm-up")
        single = common.run_tinymlx(engine, job["prompts"][:1], [common.fixed_length(job["output_len"])],
                                    desc=f"TP={size} single")
        burst = common.run_tinymlx(engine, job["prompts"], [common.fixed_length(job["output_len"])] * len(job["prompts"]),
                                   desc=f"TP={size} burst")
        out[size] = {"load_s": load_s, "single": common.summarize(single), "burst": common.summarize(burst),
                     "tokens": [o.token_ids for o in single.outputs + burst.outputs]}
        engine.close()
    out["identical_tokens"] = out[1]["tokens"] == out[2]["tokens"]
    return {str(k): v for k, v in out.items()}


def tp_table(result: dict) -> dict:
    rows = [[f"TP={size}", result[size]["load_s"], result[size]["single"]["decode_tok_s_per_stream"],
             result[size]["burst"]["gen_tok_s"], result[size]["burst"]["mean_ttft_s"]] for size in ("1", "2")]
    rows.append(["TP=2 / TP=1", None, rows[1][2] / rows[0][2], rows[1][3] / rows[0][3], rows[1][4] / rows[0][4]])
    headers = ["ranks", "load s", "single decode tok/s", "burst generated tok/s", "burst mean TTFT s"]
    table = common.print_table(f"Tensor parallelism on the hybrid (identical tokens: {result['identical_tokens']})",
                               headers, rows)
    return table


def plot_tp(ax, result: dict) -> None:
    labels = ["single decode tok/s", "burst generated tok/s"]
    for i, size in enumerate(("1", "2")):
        values = [result[size]["single"]["decode_tok_s_per_stream"], result[size]["burst"]["gen_tok_s"]]
        ax.bar(np.arange(2) + i * 0.4, values, 0.4, label=f"TP={size}")
    ax.set_xticks(np.arange(2) + 0.2, labels)
    ax.legend(fontsize=8)
    ax.set_title(f"TP=2 vs TP=1 (identical tokens: {result['identical_tokens']})", fontsize=9)


def figure(draw, result: dict) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(7, 3.4))
    draw(ax, result)
    return fig
