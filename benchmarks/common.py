"""Shared parts of the benchmarks: flags, machine info, workloads, the timed request loop, tables, results."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import difflib
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the benchmarks only write PNGs
import matplotlib.pyplot as plt  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tinymlx import Engine, EngineConfig, SamplingParams  # noqa: E402
from tinymlx.core.outputs import RequestOutput  # noqa: E402
from tinymlx.loader import resolve_model_dir  # noqa: E402
from tinymlx.models import load_model, resolve_dtype  # noqa: E402
from tinymlx.ops import kernels, portable  # noqa: E402
from tinymlx.text.tokenizer import Tokenizer  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


# -- flags and machine ---------------------------------------------------------------------------
def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a small workload that runs in under 2 minutes")
    parser.add_argument("--model", default=None, help="model dir, .gguf or Hub id (default: tinymlx's)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: float32 on the CPU (BLAS), bfloat16 on a GPU")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def blas_libraries() -> list[str]:
    """BLAS libraries mapped into this process (Linux); MLX uses OpenBLAS only when it is preloaded."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return []
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "blas" in line.split()[-1].lower()}
    return sorted(paths)


def has_openblas() -> bool:
    # numpy's bundled libscipy_openblas64_ is mapped too; only a libopenblas* serves MLX's cblas calls.
    return any(Path(p).name.startswith("libopenblas") for p in blas_libraries())


def openblas_core() -> str | None:
    if not has_openblas():
        return None
    library = ctypes.CDLL(OPENBLAS)
    library.openblas_get_corename.restype = ctypes.c_char_p
    return library.openblas_get_corename().decode()


def check_blas() -> None:
    core = openblas_core()
    if sys.platform == "linux" and core is None:
        warnings.warn(
            f"OpenBLAS is not loaded: fp32 matmuls run on MLX's bundled reference BLAS (~30x slower). "
            f"Run with LD_PRELOAD={OPENBLAS}", stacklevel=2,
        )
    elif core in ("Haswell", "Zen") and has_avx512():
        warnings.warn(
            f"OpenBLAS runs its AVX2 kernels ({core}) on a CPU with AVX-512: float32 GEMMs of 85-512 "
            "rows ran up to 1.7-1.9x faster with OPENBLAS_CORETYPE=SKYLAKEX (scripts/setup.sh sets it)", stacklevel=2,
        )


def has_avx512() -> bool:
    """The AVX-512 subsets OpenBLAS's SkylakeX kernels use."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line.split() for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), []) \
        if cpuinfo.is_file() else []
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags)


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    if sys.platform == "darwin":
        return os.popen("sysctl -n machdep.cpu.brand_string").read().strip()
    return platform.processor() or platform.machine()


def tinymlx_commit() -> str | None:
    """The commit the engine was built from (its working tree may differ: the record says which code ran)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def machine_info(dtype: str) -> dict:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    blas = blas_libraries()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "tinymlx_commit": tinymlx_commit(),
        "device": str(mx.default_device()),
        "dtype": resolve_dtype(dtype),
        "blas_libraries": blas,
        "openblas_loaded": has_openblas(),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "openblas_core": openblas_core(),  # the kernels it runs (OPENBLAS_CORETYPE, or what it detected)
        # Other processes share these machines: the load average says how noisy the run was.
        "loadavg_at_start": os.getloadavg(),
    }


# -- one run per fresh process -------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    args: argparse.Namespace
    info: dict
    workload: dict
    model_dir: Path
    text_ids: list[int]


def setup(doc: str, workloads: dict[str, dict], parser: argparse.ArgumentParser | None = None) -> Setup:
    """The shared start of a benchmark that loads no model itself: flags, BLAS check, machine, workload."""
    args = (parser or base_parser(doc.splitlines()[0])).parse_args()
    check_blas()
    model_dir = resolve_model_dir(args.model)
    return Setup(args, machine_info(args.dtype), workloads["quick" if args.quick else "full"], model_dir,
                 text_token_ids(Tokenizer.from_dir(model_dir)))


def start_process_per_run(doc: str, workloads: dict[str, dict], run_job: Callable[[dict], dict]) -> Setup | None:
    """The shared start of a benchmark whose runs each take a fresh process (so memory peaks, caches and
    distributed groups are per run). In such a process (`--worker JOB`) this runs `run_job(job)`, writes
    its result beside the job file and returns None; in the parent it returns the setup."""
    parser = base_parser(doc.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: a job file to run in this process
    args, _ = parser.parse_known_args()
    if run_worker(args, run_job):
        return None
    return setup(doc, workloads, parser)


def run_worker(args: argparse.Namespace, run_job: Callable[[dict], dict]) -> bool:
    """In a worker process (`--worker JOB`, see run_in_fresh_process): run `run_job(job)`, write its result
    beside the job file, and return True; in the parent, False."""
    if not args.worker:
        return False
    path = Path(args.worker)
    out = {"openblas_loaded": has_openblas(), **run_job(json.loads(path.read_text()))}
    path.with_suffix(".out").write_text(json.dumps(out))
    return True


def run_in_fresh_process(script: str, job: dict, path: Path, env: dict[str, str] | None = None) -> dict:
    """Run `job` in a new process of `script` (which called start_process_per_run); return its result.
    `env`: the process's environment (default: this one's)."""
    path.write_text(json.dumps(job))
    subprocess.run([sys.executable, script, "--worker", str(path)], check=True, env=env)
    out = json.loads(path.with_suffix(".out").read_text())
    if not out.pop("openblas_loaded") and sys.platform == "linux":
        raise RuntimeError("a worker ran without OpenBLAS: run with LD_PRELOAD=" + OPENBLAS)
    return out


# -- workloads -----------------------------------------------------------------------------------
def text_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Real text (Python stdlib source, apt for a coder model) as one token stream to cut prompts from."""
    source = "\n".join(inspect.getsource(module) for module in (argparse, difflib, textwrap, dataclasses))
    return tokenizer.encode(source, add_special_tokens=False)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_random_checkpoint(path: Path, what: str, tokenizer_dir: Path, config: dict,
                            shards: list[Callable[[], dict[str, np.ndarray]]]) -> Path:
    """A random checkpoint of `what`, written once: what each of `shards` makes, a safetensors file (with an
    index), the tokenizer of `tokenizer_dir` and `config`, beside `path` and renamed, so a half-written one is
    never read. The shards are made in order, one in memory at a time."""
    if (path / "config.json").is_file():
        return path
    from safetensors.numpy import save_file

    t0 = time.perf_counter()
    print(f"writing the random {what} checkpoint to {path} (once)", file=sys.stderr)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    names = [f"model-{k + 1:05d}.safetensors" for k in range(len(shards))]
    weight_map, total = {}, 0
    for name, make in zip(names, shards):
        shard = make()
        save_file(shard, str(partial / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(x.nbytes for x in shard.values())
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / file, partial / file)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)
    print(f"  {total / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def sample_prompts(text_ids: list[int], n: int, length_range: tuple[int, int],
                   rng: np.random.Generator) -> list[list[int]]:
    """n windows of real text, lengths uniform in length_range, at random offsets: distinct prompts
    that (almost surely) share no prefix block."""
    lengths = uniform_lengths(n, *length_range, rng)
    starts = rng.integers(0, len(text_ids) - max(lengths), size=n)
    return [text_ids[s:s + n] for s, n in zip(starts, lengths)]


def uniform_lengths(n: int, lo: int, hi: int, rng: np.random.Generator) -> list[int]:
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def log_uniform_lengths(n: int, lo: int, hi: int, rng: np.random.Generator) -> list[int]:
    """High-variance lengths: every doubling of the length is equally likely (16-32 as often as 128-256)."""
    return [int(round(x)) for x in np.exp(rng.uniform(np.log(lo), np.log(hi), size=n))]


def fixed_length(max_tokens: int) -> SamplingParams:
    """Greedy (as mlx-lm's default sampler) and run to exactly max_tokens, EOS or not."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# -- tinymlx -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadedModel:
    model: object  # a tinymlx.models.CausalLM
    tokenizer: Tokenizer
    model_dir: Path


def load_tinymlx(model: str | None, dtype: str) -> LoadedModel:
    """Weights loaded once, so every run can start on a fresh engine (empty KV pool and prefix cache)."""
    model_dir = resolve_model_dir(model)
    return LoadedModel(load_model(model_dir, dtype), Tokenizer.from_dir(model_dir), model_dir)


def load_tinymlx_for(model: str | None, dtype: str, portable: bool) -> LoadedModel:
    """The model loaded as TINYMLX_PORTABLE says (a load chooses the kernels and whether linears become the
    CPU's), whatever the environment asked for; the environment comes back as it was. Load the portable
    one first: the last load's kernels stay chosen."""
    found = os.environ.get(kernels.PORTABLE_ENV)
    os.environ[kernels.PORTABLE_ENV] = "1" if portable else "0"
    try:
        return load_tinymlx(model, dtype)
    finally:
        os.environ.pop(kernels.PORTABLE_ENV)
        if found is not None:
            os.environ[kernels.PORTABLE_ENV] = found


@contextlib.contextmanager
def portable_kernels() -> Iterator[None]:
    """The portable kernels chosen while inside, for a model loaded with them (load_tinymlx_for), then the
    kernels chosen before."""
    found = kernels.chosen()
    kernels.use(portable.KERNELS)
    try:
        yield
    finally:
        kernels.use(found)


def start(doc: str, workloads: dict[str, dict], parser: argparse.ArgumentParser | None = None
          ) -> tuple[argparse.Namespace, dict, dict, LoadedModel]:
    """The shared start of a single-engine benchmark: flags, BLAS check, machine info, workload, model."""
    args = (parser or base_parser(doc.splitlines()[0])).parse_args()
    check_blas()
    info = machine_info(args.dtype)
    workload = workloads["quick" if args.quick else "full"]
    return args, info, workload, load_tinymlx(args.model, args.dtype)


def new_engine(loaded: LoadedModel, **config) -> Engine:
    return Engine(loaded.model, loaded.tokenizer, EngineConfig(**config), model_name=loaded.model_dir.name)


def ttft(engine: Engine, prompt: list[int]) -> float:
    """Seconds for `engine` alone (nothing else queued) to give `prompt` its first token: one greedy token."""
    start = time.perf_counter()
    engine.add_request(prompt, fixed_length(1))
    while engine.has_unfinished_requests:
        engine.step()
    return time.perf_counter() - start


def warm_up(loaded: LoadedModel) -> None:
    """One tiny request on a throwaway engine: the first forward of a process pays one-off costs."""
    engine = new_engine(loaded, num_pages=16)
    run_tinymlx(engine, [list(range(100, 108))], [fixed_length(4)], desc="warm-up")


@dataclass(frozen=True)
class RequestTiming:
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float  # burst start -> first token (includes any wait before the engine saw the request)
    e2e_s: float  # burst start -> last token


@dataclass(frozen=True)
class Run:
    requests: list[RequestTiming]
    makespan_s: float
    outputs: list[RequestOutput] | None = None  # tinymlx only: final outputs, in prompt order


def run_tinymlx(engine: Engine, prompts: list, params: list[SamplingParams], wave_size: int | None = None,
                desc: str = "tinymlx") -> Run:
    """All requests arrive at t0. wave_size=None: all are queued at once (continuous batching);
    otherwise they are fed wave_size at a time, the next wave only when the last has fully finished."""
    n = len(prompts)
    waves = [range(i, min(i + (wave_size or n), n)) for i in range(0, n, wave_size or n)]
    first: dict[int, float] = {}
    final: dict[int, tuple[float, RequestOutput]] = {}
    t0 = time.perf_counter()
    with tqdm(total=sum(p.max_tokens for p in params), desc=desc, unit="tok", leave=False) as bar:
        for wave in waves:
            index = {engine.add_request(prompts[i], params[i]): i for i in wave}
            pending = set(index)
            while pending:
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    now = time.perf_counter() - t0
                    if out.delta_token_ids:
                        first.setdefault(i, now)
                        bar.update(len(out.delta_token_ids))
                    if out.finished:
                        final[i] = (now, out)
                        pending.discard(out.request_id)
    makespan = time.perf_counter() - t0
    outputs = [final[i][1] for i in range(n)]
    for out, p in zip(outputs, params):
        if p.ignore_eos and len(out.token_ids) != p.max_tokens:
            raise RuntimeError(f"{out.request_id}: {len(out.token_ids)} tokens, expected {p.max_tokens}")
    timings = [RequestTiming(len(out.prompt_token_ids), len(out.token_ids), first[i], final[i][0])
               for i, out in enumerate(outputs)]
    return Run(timings, makespan, outputs)


# -- metrics, tables, results --------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def summarize(run: Run) -> dict:
    """Aggregate metrics of one burst. Prefill tok/s = prompt tokens / time until every request had its
    first token: the same clock for any engine, whether it interleaves decodes with prefill or not."""
    r = run.requests
    ttft = [x.ttft_s for x in r]
    e2e = [x.e2e_s for x in r]
    decode_rates = [(x.num_output_tokens - 1) / (x.e2e_s - x.ttft_s) for x in r
                    if x.num_output_tokens > 1 and x.e2e_s > x.ttft_s]
    num_prompt, num_output = sum(x.num_prompt_tokens for x in r), sum(x.num_output_tokens for x in r)
    return {
        "num_requests": len(r),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "makespan_s": run.makespan_s,
        "gen_tok_s": num_output / run.makespan_s,
        "prefill_tok_s": num_prompt / max(ttft),
        "decode_tok_s_per_stream": float(np.mean(decode_rates)) if decode_rates else None,
        "mean_ttft_s": float(np.mean(ttft)),
        "p99_ttft_s": percentile(ttft, 99),
        "mean_e2e_s": float(np.mean(e2e)),
        "p99_e2e_s": percentile(e2e, 99),
    }


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def print_table(title: str, headers: list[str], rows: list[list]) -> dict:
    """Print an aligned table; returns it as {"title", "headers", "rows"} for the JSON."""
    cells = [headers] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for k, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    return {"title": title, "headers": headers, "rows": [[fmt(v) for v in row] for row in rows]}


def save_results(name: str, quick: bool, info: dict, payload: dict, fig: plt.Figure) -> Path:
    """benchmarks/results/<name>.json + .png; --quick runs get a _quick suffix and never overwrite them."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / (f"{name}_quick" if quick else name)
    info = {**info, "loadavg_at_end": os.getloadavg()}
    data = {"benchmark": name, "quick": quick, "command": " ".join(sys.argv), "machine": info, **payload}
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return stem
