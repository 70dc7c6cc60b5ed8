"""Claude Code and Codex CLI doing a small real task against `tinymlx serve`, end to end.

Each CLI (pinned, installed by scripts/agent_clis.py, set up as the README says) gets a scratch git
repository holding mathutils.py (one function) and test_mathutils.py (its test), and the task: add a
function clamp(value, low, high) and a test for it, then run the tests. Then, in the same session
(`--continue`, `exec resume --last`), a follow-up: run the tests and report. It runs non-interactively
(Claude Code `-p` with its file and shell tools allowed; Codex `exec` with its sandbox off, in the scratch
repository) against a fresh server, so its first turn finds nothing cached; the follow-up guarantees a
later turn even where the model answers the task in one.

Per turn (each request to the CLI's endpoint): TTFT and the prompt tokens the prefix cache served, from
the server's own log line for the request. Done: afterwards test_mathutils.py tests clamp and
`python -m pytest` passes in the repository.

mlx_lm.server is probed for each CLI's API (Claude Code: /v1/messages, Codex: /v1/responses, the only
wire API Codex has): where it answers 404, it cannot serve that CLI, and the table says so.

The bar: both CLIs finish with no API error; every turn after the first takes at least 90% of its prompt
from the cache; the median TTFT of turns 2 on is at most 0.1x turn 1's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import httpx
from http_load import ServerProcess, free_port
from matplotlib import pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import agent_clis  # noqa: E402

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
CACHED_BAR, TTFT_BAR = 0.9, 0.1
TASK = ("Add a function clamp(value, low, high) to mathutils.py that returns value limited to the range "
        "[low, high], and a test for it in test_mathutils.py. Then run the tests with `python -m pytest -q`.")
FOLLOW_UP = "Run the tests with `python -m pytest -q` and tell me whether they pass."
MATHUTILS = 'def add(a, b):\n    """The sum of a and b."""\n    return a + b\n'
TESTS = "from mathutils import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
ENDPOINTS = {"claude": "/v1/messages", "codex": "/v1/responses"}
# Past the defaults on a 2-core CPU: a first turn's prefill of ~10k tokens on the 1.5B takes minutes.
SLOW_FIRST_TURN_MS = str(60 * 60 * 1000)
FLAGS = {"claude": ("--allowedTools", "Read,Edit,Write,Bash,Glob,Grep"),
         "codex": ("-c", f"model_providers.tinymlx.stream_idle_timeout_ms={SLOW_FIRST_TURN_MS}",
                   "--dangerously-bypass-approvals-and-sandbox")}
ENV = {"claude": {"API_TIMEOUT_MS": SLOW_FIRST_TURN_MS}, "codex": {}}


def scratch_repository(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    (repo / "mathutils.py").write_text(MATHUTILS)
    (repo / "test_mathutils.py").write_text(TESTS)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "start"]):
        subprocess.run([*git, *command], cwd=repo, check=True)
    return repo


def task_done(repo: Path) -> dict:
    tests = (repo / "test_mathutils.py").read_text()
    source = (repo / "mathutils.py").read_text()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=repo,
                         capture_output=True, text=True, timeout=120, check=False)
    has_function = "def clamp(" in source
    has_test = "clamp(" in tests and tests.count("def test_") >= 2
    return {"done": has_function and has_test and run.returncode == 0, "clamp_defined": has_function,
            "clamp_tested": has_test, "pytest_returncode": run.returncode, "pytest_tail": run.stdout[-400:]}


def turns_from_log(log_path: Path, endpoint: str) -> list[dict]:
    """The server's log line of each request to `endpoint`, in order."""
    name = endpoint.rsplit("/", 1)[-1]
    turns = []
    for line in log_path.read_text().splitlines():
        start = line.find('{"request_id"')
        if start >= 0:
            record = json.loads(line[start:])
            if record["endpoint"] == name:
                turns.append(record)
    return turns


def run_cli(name: str, model_dir: Path, model: str, timeout_s: float, scratch: Path) -> dict:
    repo = scratch_repository(scratch / name)
    log_path = scratch / f"{name}-server.log"
    port = free_port()
    command = [sys.executable, "-m", "tinymlx.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--served-model-name", model]
    with ServerProcess(command, port, "tinymlx", model, log_path) as server:
        runner = agent_clis.AgentCLIs(server.base_url, model, scratch / name / "home")
        print(f"{name}: running the task (a first turn of ~10k tokens takes minutes on a CPU) ...", file=sys.stderr)
        sessions = [_session(runner, name, prompt, repo, timeout_s, resume)
                    for prompt, resume in ((TASK, False), (FOLLOW_UP, True))]
    turns = turns_from_log(log_path, ENDPOINTS[name])
    return {"returncodes": [s["returncode"] for s in sessions], "seconds": sum(s["seconds"] for s in sessions),
            "api_error": any(s["api_error"] for s in sessions), "statuses": [t["status"] for t in turns],
            "turns": turns, "output_tails": [s["output_tail"] for s in sessions], **task_done(repo)}


def _session(runner: agent_clis.AgentCLIs, name: str, prompt: str, repo: Path, timeout_s: float, resume: bool
             ) -> dict:
    try:
        finished = runner.run(name, prompt, repo, resume=resume, timeout_s=timeout_s, flags=FLAGS[name],
                              env=ENV[name])
        returncode, output, seconds = finished.returncode, finished.stdout + finished.stderr, finished.seconds
    except subprocess.TimeoutExpired as timeout:
        returncode, seconds = None, timeout_s
        output = (timeout.stdout or b"").decode(errors="replace") + (timeout.stderr or b"").decode(errors="replace")
    return {"returncode": returncode, "seconds": seconds, "api_error": "API Error" in output or "APIError" in output,
            "output_tail": output[-3000:]}


def mlx_lm_endpoints(model_dir: Path) -> dict[str, int]:
    """The status mlx_lm.server answers each CLI's endpoint with (404: it does not serve that API)."""
    statuses = {}
    with ServerProcess.mlx_lm(model_dir) as server:
        for name, endpoint in ENDPOINTS.items():
            body = {"model": server.model, "max_tokens": 1, "input": "hi", "messages": [{"role": "user", "content": "hi"}]}
            statuses[name] = httpx.post(server.base_url + endpoint, json=body, timeout=120).status_code
    return statuses


def summary(name: str, run: dict) -> dict:
    turns = run["turns"]
    later = turns[1:]
    first_ttft = turns[0]["ttft_s"] if turns else None
    later_ttft = [t["ttft_s"] for t in later if t["ttft_s"] is not None]
    median_later = statistics.median(later_ttft) if later_ttft else None
    min_cached = min((_cached(t) for t in later), default=None)
    ratio = median_later / first_ttft if median_later is not None and first_ttft else None
    bar = (all(code == 0 for code in run["returncodes"]) and not run["api_error"] and all(s == 200 for s in run["statuses"])
           and min_cached is not None and min_cached >= CACHED_BAR and ratio is not None and ratio <= TTFT_BAR)
    return {"cli": name, "turns": len(turns), "first_ttft_s": first_ttft, "median_later_ttft_s": median_later,
            "ttft_ratio": ratio, "min_later_cached": min_cached, "done": run["done"], "bar": bar}


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--clis", default="claude,codex", help="which CLIs (claude, codex)")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds a CLI may take for the task")
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip probing mlx_lm.server")
    args = parser.parse_args()
    common.check_blas()
    model = args.model or DEFAULT_MODEL
    model_dir = common.resolve_model_dir(model)
    names = tuple(args.clis.split(","))
    agent_clis.install(names, log=lambda line: print(line, file=sys.stderr))
    info = common.machine_info(args.dtype)
    info["clis"] = {name: f"{agent_clis.PINS[name].package}=={agent_clis.PINS[name].version}" for name in names}
    runs = {}
    scratch = Path(tempfile.mkdtemp(prefix="tinymlx-agent-clis-"))  # kept: the servers' logs, the repositories
    print(f"scratch repositories and server logs: {scratch}", file=sys.stderr)
    for name in names:
        started = time.monotonic()
        runs[name] = run_cli(name, model_dir, model, args.timeout, scratch)
        print(f"{name}: {len(runs[name]['turns'])} turns in {time.monotonic() - started:.0f} s", file=sys.stderr)
    peer = {} if args.no_mlx_lm else mlx_lm_endpoints(model_dir)

    rows = []
    for name in names:
        for k, turn in enumerate(runs[name]["turns"]):
            rows.append([name, k + 1, turn["status"], turn["prompt_tokens"], turn["cached_tokens"],
                         _cached(turn), turn["ttft_s"], turn["output_tokens"]])
    turn_table = common.print_table(f"Per turn, {model} ({info['cpu']}, {info['cores']} cores)",
                                    ["cli", "turn", "status", "prompt", "cached", "cached %", "TTFT s", "out"], rows)
    summaries = [summary(name, runs[name]) for name in names]
    summary_table = common.print_table(
        f"Per CLI (bar: every later turn >= {CACHED_BAR:.0%} cached, median later TTFT <= {TTFT_BAR}x turn 1)",
        ["cli", "turns", "turn 1 TTFT s", "later TTFT s (median)", "ratio", "min later cached", "task done",
         "bar", "mlx_lm.server"],
        [[s["cli"], s["turns"], s["first_ttft_s"], s["median_later_ttft_s"], s["ttft_ratio"], s["min_later_cached"],
          s["done"], s["bar"], _peer_text(peer.get(s["cli"]))] for s in summaries])

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        turns = runs[name]["turns"]
        x = range(1, len(turns) + 1)
        axes[0].plot(x, [t["ttft_s"] for t in turns], marker="o", label=name)
        axes[1].plot(x, [100 * _cached(t) for t in turns], marker="o", label=name)
    axes[0].set(yscale="log", xlabel="turn", ylabel="TTFT (s, log)", title="Time to first token per turn")
    axes[1].axhline(100 * CACHED_BAR, color="gray", linestyle="--", linewidth=1)
    axes[1].set(xlabel="turn", ylabel="prompt served from cache (%)", ylim=(0, 105), title="Prefix cache per turn")
    for axis in axes:
        axis.legend()
    fig.suptitle(f"Agent CLIs on tinymlx serve: {model}, {info['cpu']}")
    common.save_results("agent_clis", args.quick, info, {
        "model": model, "task": TASK, "runs": runs, "mlx_lm_server": peer, "summaries": summaries,
        "tables": [turn_table, summary_table]}, fig)


def _cached(turn: dict) -> float:
    """The share of a turn's prompt the cache served; 0 for a request refused before its prompt was read."""
    return turn["cached_tokens"] / turn["prompt_tokens"] if turn["prompt_tokens"] else 0.0


def _peer_text(status: int | None) -> str:
    if status is None:
        return "not probed"
    return "cannot (404)" if status == 404 else f"answers {status}"


if __name__ == "__main__":
    main()
