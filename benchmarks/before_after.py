"""Benchmark suites before and after a change, in one run: each suite's script runs from a git worktree of
the `--before` revision and from one of this checkout's HEAD, in turn, on the same machine and load.

Every suite measures mlx-lm beside tinymlx in each run, and mlx-lm's code is the same on both sides, so
how far its numbers moved between the before run and the after run is the machine's noise over the run;
the table states it beside tinymlx's changes. Numbers compared: each result's throughput (gen_tok_s,
prefill_tok_s, decode_tok_s_per_stream) and latency (mean_ttft_s, ttft_s) where both runs have it.

    python benchmarks/before_after.py --before 66046c6 [--suites vs_mlx_lm families hybrid] [--quick]

With TINYMLX_PORTABLE=1 every suite runs the portable path, and the results go to before_after_portable.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common
from matplotlib import pyplot as plt

from tinymlx.ops.kernels import PORTABLE_ENV

SUITES = ("vs_mlx_lm", "families", "hybrid")
HIGHER_IS_BETTER = ("gen_tok_s", "prefill_tok_s", "decode_tok_s_per_stream")
LOWER_IS_BETTER = ("mean_ttft_s", "ttft_s")
REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the revision before the change")
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    args = parser.parse_args()
    common.check_blas()
    rows, noise = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {side: _worktree(rev, Path(tmp) / side) for side, rev in (("before", args.before), ("after", "HEAD"))}
        try:
            for suite in args.suites:
                runs = {side: _run(suite, tree, args.quick) for side, tree in trees.items()}
                suite_rows = _compare(suite, runs["before"], runs["after"])
                moved = [abs(row[4] - 1) for row in suite_rows if "mlx-lm" in row[1]]
                noise[suite] = {"median": statistics.median(moved), "max": max(moved)} if moved else None
                rows += suite_rows
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    table = common.print_table(f"before ({args.before}) and after (HEAD), one run", ["suite", "result", "before",
                               "after", "after / before"], rows)
    for suite, moved in noise.items():
        print(f"{suite}: mlx-lm's results moved by {moved['median']:.1%} (median), up to {moved['max']:.1%}, between "
              "the runs: the machine's noise" if moved else f"{suite}: no mlx-lm result to gauge the noise")
    # TINYMLX_PORTABLE=1 reaches every suite's process: those results are the portable path's (what a Mac runs).
    portable = os.environ.get(PORTABLE_ENV, "0") not in ("", "0")
    common.save_results("before_after_portable" if portable else "before_after", args.quick,
                        common.machine_info(args.dtype),
                        {"before": args.before, "table": table, "noise": noise}, _plot(rows))


def _worktree(rev: str, path: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def _run(suite: str, tree: Path, quick: bool) -> dict:
    """The suite's script from `tree`, with `tree`'s tinymlx first on the path; its results JSON."""
    print(f"\n== {suite} from {tree.name}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(tree / "benchmarks" / f"{suite}.py"), *(["--quick"] if quick else [])]
    subprocess.run(command, cwd=tree, env=env, check=True)
    return json.loads((tree / "benchmarks" / "results" / f"{suite}{'_quick' if quick else ''}.json").read_text())


def _numbers(results: object, path: str = "") -> dict[str, float]:
    """Every compared number in a results tree, by its path (e.g. `8/tinymlx/gen_tok_s`)."""
    if isinstance(results, dict):
        found = {}
        for key, value in results.items():
            found |= _numbers(value, f"{path}/{key}" if path else str(key))
        return found
    key = path.rsplit("/", 1)[-1]
    if isinstance(results, (int, float)) and key in HIGHER_IS_BETTER + LOWER_IS_BETTER:
        return {path: float(results)}
    return {}


def _compare(suite: str, before: dict, after: dict) -> list[list]:
    old, new = _numbers(before["results"]), _numbers(after["results"])
    return [[suite, path, old[path], new[path], new[path] / old[path]]
            for path in old if path in new and old[path] > 0]


def _plot(rows: list[list]):
    ours = [row for row in rows if "mlx-lm" not in row[1]]
    fig, ax = plt.subplots(figsize=(8, max(3, 0.22 * len(ours))))
    gains = [row[4] if row[1].rsplit("/", 1)[-1] in HIGHER_IS_BETTER else 1 / row[4] for row in ours]
    ax.barh([f"{row[0]}: {row[1]}" for row in ours], gains, color=["#55a868" if g >= 1 else "#c44e52" for g in gains])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("after / before (higher is better; latencies inverted)")
    ax.tick_params(axis="y", labelsize=6)
    if gains:
        ax.set_title(f"tinymlx after the change, median {statistics.median(gains):.2f}x before", fontsize=9)
    return fig


if __name__ == "__main__":
    main()
