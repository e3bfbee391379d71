"""Curated pins in manifests/: data only, every value with its source (see manifests/*.json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import BadInput

PIN_SCHEMA = "mm-pin/1"


def manifests_dir() -> Path:
    """manifests/ beside the package (source checkout or installed data files)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "manifests", here / "manifests"):
        if candidate.is_dir():
            return candidate
    raise BadInput(f"{here.parent / 'manifests'}: curated pins directory not found")


@dataclass(frozen=True)
class Pin:
    name: str
    repo_id: str
    revision: str
    modelscope_id: str | None
    image: str | None
    draft_subfolder: str | None
    size_bytes_approx: int | None
    sources: dict[str, str]
    cuda_runtime: str | None = None  # the pinned image's CUDA runtime (the host driver must support it)


def _value(doc: dict, key: str, where: Path):
    entry = doc.get(key)
    if entry is None:
        return None
    if not isinstance(entry, dict) or "value" not in entry or "source" not in entry:
        raise BadInput(f"{where}: pin field {key!r} must be {{'value': ..., 'source': ...}}")
    return entry["value"]


def load_pin_file(path: Path) -> Pin:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: cannot read pin: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != PIN_SCHEMA:
        raise BadInput(f"{path}: not a pin file (expected schema {PIN_SCHEMA!r})")
    draft = _value(doc, "draft", path) or {}
    return Pin(
        name=str(doc["name"]),
        repo_id=_value(doc, "repo_id", path),
        revision=_value(doc, "revision", path),
        modelscope_id=_value(doc, "modelscope_id", path),
        image=_value(doc, "image", path),
        draft_subfolder=draft.get("subfolder"),
        size_bytes_approx=_value(doc, "size_bytes_approx", path),
        sources={k: v["source"] for k, v in doc.items() if isinstance(v, dict) and "source" in v},
        cuda_runtime=_value(doc, "cuda_runtime", path),
    )


def all_pins() -> list[Pin]:
    return [load_pin_file(p) for p in sorted(manifests_dir().glob("*.json")) if _is_pin(p)]


def _is_pin(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("schema") == PIN_SCHEMA
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def default_pin() -> Pin:
    for path in sorted(manifests_dir().glob("*.json")):
        if _is_pin(path) and json.loads(path.read_text(encoding="utf-8")).get("default"):
            return load_pin_file(path)
    raise BadInput(f"{manifests_dir()}: no default pin")


def pin_for_repo(repo_id: str) -> Pin | None:
    return next((p for p in all_pins() if p.repo_id == repo_id), None)
