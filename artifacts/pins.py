"""Curated pins in manifests/: data only, every value with its source (see manifests/*.json)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import BadInput
from .edges.untrusted import At
from .edges.fsutil import read_json_file

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
    draft_subfolder: str | None  # the draft model's subfolder, e.g. "dspark/"; None: the model has no draft
    size_bytes_approx: int | None
    sources: dict[str, str]
    cuda_runtime: str | None = None  # the pinned image's CUDA runtime (the host driver must support it)
    recipes: str | None = None  # the recipes file beside the pin (manifests/<name>), read by launch.recipes_path()
    container_name: str = ""  # default container name for launch and warm-up (default: the pin's name)
    troubleshooting: str | None = None  # the guide's troubleshooting table beside the pin, read by diagnose.table_path()

    @property
    def draft_dir(self) -> str | None:
        """The draft subfolder without its trailing slash ("dspark"), for paths."""
        return self.draft_subfolder.strip("/") if self.draft_subfolder else None


def sourced_value(entry: object, where: str):
    """The value of a `{"value": ..., "source": ...}` record (pins and recipes): every value names its source."""
    if not isinstance(entry, dict) or "value" not in entry or "source" not in entry:
        raise BadInput(f"{where}: must be {{'value': ..., 'source': ...}}")
    return entry["value"]


def _value(doc: dict, key: str, where: Path):
    entry = doc.get(key)
    return None if entry is None else sourced_value(entry, f"{where}: pin field {key!r}")


def _beside(doc: dict, key: str, path: Path) -> str | None:
    """A pin field naming a data file beside the pin (recipes, troubleshooting)."""
    name = _value(doc, key, path)
    if name is not None and (not isinstance(name, str) or "/" in name or not name.endswith(".json")):
        raise BadInput(f"{path}: pin field {key!r} must name a .json file beside the pin")
    return name


def load_pin_file(path: Path) -> Pin:
    doc = read_json_file(path, what="pin file")
    if not isinstance(doc, dict) or doc.get("schema") != PIN_SCHEMA:
        raise BadInput(f"{path}: not a pin file (expected schema {PIN_SCHEMA!r})")
    at = At(str(path))
    draft = _value(doc, "draft", path) or {}
    if not isinstance(draft, dict):
        raise BadInput(f"{path}: pin field 'draft' must hold an object with a subfolder")
    recipes, troubleshooting = _beside(doc, "recipes", path), _beside(doc, "troubleshooting", path)
    return Pin(
        name=at.get_str(doc, "name", max_len=256),
        repo_id=at.key("repo_id").str(_value(doc, "repo_id", path), max_len=256),
        revision=at.key("revision").str(_value(doc, "revision", path), max_len=256),
        modelscope_id=_opt_str(_value(doc, "modelscope_id", path), at.key("modelscope_id")),
        image=_opt_str(_value(doc, "image", path), at.key("image")),
        draft_subfolder=_opt_str(at.key("draft").obj(draft).get("subfolder"), at.key("draft").key("subfolder")),
        size_bytes_approx=None if (size := _value(doc, "size_bytes_approx", path)) is None
        else at.key("size_bytes_approx").int(size),
        sources={k: v["source"] for k, v in doc.items() if isinstance(v, dict) and "source" in v},
        cuda_runtime=_value(doc, "cuda_runtime", path),
        recipes=recipes,
        container_name=_container_name(_value(doc, "container_name", path), at.key("container_name"))
        or re.sub(r"[^A-Za-z0-9_.-]", "-", str(doc["name"])),
        troubleshooting=troubleshooting,
    )


def _container_name(value: object, at: At) -> str | None:
    """Docker's rule for a container name (it goes into launch scripts): [A-Za-z0-9][A-Za-z0-9_.-]*."""
    name = _opt_str(value, at)
    if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", name):
        raise at.fail(f"{name[:60]!r} is not a container name (letters, digits, '_', '.', '-')")
    return name


def _opt_str(value: object, at: At) -> str | None:
    return None if value is None else at.str(value, max_len=1024)


def all_pins() -> list[Pin]:
    return [load_pin_file(p) for p in sorted(manifests_dir().glob("*.json")) if _is_pin(p)]


def _pin_doc(path: Path) -> dict | None:
    """The document at PATH when it is a pin file (manifests/ also holds recipes), else None."""
    try:
        doc = read_json_file(path, what="pin file")
    except BadInput:
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == PIN_SCHEMA else None


def _is_pin(path: Path) -> bool:
    return _pin_doc(path) is not None


def default_pin() -> Pin:
    for path in sorted(manifests_dir().glob("*.json")):
        if (doc := _pin_doc(path)) is not None and doc.get("default") is True:
            return load_pin_file(path)
    raise BadInput(f"{manifests_dir()}: no default pin")


def pin_for_repo(repo_id: str) -> Pin | None:
    return next((p for p in all_pins() if p.repo_id == repo_id), None)


@dataclass(frozen=True)
class Target:
    repo_id: str
    revision: str | None  # None: no revision given and no pin for the repo
    pin: Pin | None


def pinned_target(repo: str | None, revision: str | None) -> Target:
    """The one place the pin fills in what the user left out: REPO (the default pin's when omitted) and
    REVISION (the repo's pin's when omitted)."""
    pin = default_pin() if repo is None else pin_for_repo(repo)
    repo_id = repo or pin.repo_id
    return Target(repo_id, revision or (pin.revision if pin else None), pin)
