"""What the model cache holds, model by model, and freeing it: `tinymlx models` and `tinymlx models rm`.

    cache_dir()/
      models/<file>.gguf, <file>.gguf.verified     an offline model's verified download
      models/.fetch-*/                              a download cut short (its partial GGUF inside)
      converted/<gguf stem>-<identity>[-bf16|-f16|-native]/ a GGUF as a HF directory: config, tokenizer,
                                                    weights (float; -native: the file's quantization)
      converted/.<that name>-*/                     a conversion cut short

A conversion belongs to the model whose GGUF has its stem: an offline model's file, or a local .gguf
the user passed (listed under that stem; the user's own file is never deleted).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tinymlx.core.errors import ModelLoadError
from tinymlx.loader.gguf import SUFFIXES, _identity
from tinymlx.loader.offline import OFFLINE_MODELS, cache_dir

# <stem>-<12 hex identity>[-bf16|-f16|-native], with a leading "." and a random tail while being built.
_CONVERTED = re.compile(r"(?P<tmp>\.)?(?P<stem>.+)-(?P<id>[0-9a-f]{12})(?P<suffix>-bf16|-f16|-native)?(?(tmp)-\w+)")
_DTYPE_OF_SUFFIX = {suffix: dtype for dtype, suffix in SUFFIXES.items()}
_STATES = ("ready", "stale", "partial")


@dataclass(frozen=True)
class Conversion:
    path: Path
    dtype: str  # what its weights are stored as: a float dtype, or "native" (the GGUF's quantization)
    state: str  # "ready"; "stale" (built from an older file or converter: never read again); "partial"
    num_bytes: int


@dataclass(frozen=True)
class CachedModel:
    name: str  # an offline model's name, or the stem of a local .gguf that was converted
    description: str
    is_offline: bool
    is_downloaded: bool  # its GGUF is in the cache
    download: tuple[Path, ...]  # the GGUF and its marker, and any partial download; () if none
    num_download_bytes: int
    conversions: tuple[Conversion, ...]

    @property
    def num_converted_bytes(self) -> int:
        return sum(c.num_bytes for c in self.conversions)

    @property
    def num_bytes(self) -> int:
        return self.num_download_bytes + self.num_converted_bytes


def list_cached_models() -> list[CachedModel]:
    """Every offline model (downloaded or not), then every local GGUF with a conversion in the cache."""
    root = cache_dir()
    conversions: dict[str, list[Conversion]] = {}
    for path in sorted((root / "converted").glob("*")) if (root / "converted").is_dir() else []:
        match = _CONVERTED.fullmatch(path.name)
        if match and path.is_dir():
            conversions.setdefault(match["stem"], []).append(_conversion(path, match))
    models = []
    for name, entry in OFFLINE_MODELS.items():
        gguf = root / "models" / entry.filename
        download = [p for p in (gguf, gguf.with_name(gguf.name + ".verified")) if p.is_file()]
        download += [p for p in (root / "models").glob(".fetch-*") if (p / entry.filename).exists()]
        own = conversions.pop(gguf.stem, [])
        if gguf.is_file():  # a conversion of an older file or converter version is never read again
            current = _identity(gguf.resolve())
            own = [c if c.state != "ready" or current in c.path.name else _stale(c) for c in own]
        models.append(CachedModel(name, entry.description, True, gguf.is_file(), tuple(download),
                                  sum(_size(p) for p in download), _in_order(own)))
    for stem, own in sorted(conversions.items()):
        models.append(CachedModel(stem, "converted from a local .gguf", False, False, (), 0, _in_order(own)))
    return models


def remove_cached_models(names: list[str], converted_only: bool = False) -> dict[str, int]:
    """Delete what the cache holds for each name (only the conversions with `converted_only`): bytes freed
    by name. Every name is checked before anything is deleted."""
    models = {m.name: m for m in list_cached_models()}
    unknown = [name for name in names if name not in models]
    if unknown:
        raise ModelLoadError(
            f"unknown model {', '.join(map(repr, unknown))}: the models are {', '.join(models)} "
            "(`tinymlx models` lists them)"
        )
    freed = {}
    for name in names:
        model = models[name]
        paths = [c.path for c in model.conversions] + ([] if converted_only else list(model.download))
        freed[name] = sum(_size(path) for path in paths)
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    return freed


def format_bytes(num_bytes: int) -> str:
    """Decimal units, as the model descriptions (491 MB) and `du --si` use."""
    size = float(num_bytes)
    for unit in ("B", "kB", "MB"):
        if size < 999.5:
            return f"{size:.0f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def _conversion(path: Path, match: re.Match) -> Conversion:
    dtype = _DTYPE_OF_SUFFIX[match["suffix"] or ""]
    return Conversion(path, dtype, "partial" if match["tmp"] else "ready", _size(path))


def _in_order(conversions: list[Conversion]) -> tuple[Conversion, ...]:
    return tuple(sorted(conversions, key=lambda c: _STATES.index(c.state)))  # stable: by name within a state


def _stale(conversion: Conversion) -> Conversion:
    return Conversion(conversion.path, conversion.dtype, "stale", conversion.num_bytes)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0
