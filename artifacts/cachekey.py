"""The kernel-cache key, schema mm-cache-key/1: which host a compiled kernel cache is good for.

`mm warmup` writes it as CACHE_DIR/mm-cache-key.json once the caches are compiled; `mm bundle` reads it
(or builds one from `--cache-key KEY=VALUE`) and carries it in the bundle index beside the cache.
Document: {"schema": "mm-cache-key/1", "gpu", "compute_capability", "driver", "image", "recipe", "gpu_count"};
a key given on the command line holds only the fields named there.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import BadInput
from .fsutil import atomic_write_json

SCHEMA = "mm-cache-key/1"
FILE_NAME = "mm-cache-key.json"


@dataclass(frozen=True)
class CacheKey:
    gpu: str
    compute_capability: str
    driver: str
    image: str
    recipe: str
    gpu_count: int
    schema: str = SCHEMA

    def document(self) -> dict:
        doc = asdict(self)
        return {"schema": doc.pop("schema"), **doc}


def write_cache_key(cache_dir: Path, key: CacheKey) -> None:
    atomic_write_json(Path(cache_dir) / FILE_NAME, key.document())


def read_cache_key(cache_dir: Path) -> dict | None:
    """The key stored in CACHE_DIR, or None when there is none; BadInput when the file is not a key."""
    path = Path(cache_dir) / FILE_NAME
    if not path.is_file():
        return None
    try:
        key = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: unreadable cache key ({e})") from None
    if not isinstance(key, dict) or key.get("schema") != SCHEMA:
        raise BadInput(f"{path}: not a cache key (expected schema {SCHEMA!r})")
    return key


def parse_cache_key(pairs: tuple[str, ...] | list[str]) -> dict | None:
    """`--cache-key gpu=B300 --cache-key driver=590.44` -> a key document; None when no pair is given."""
    if not pairs:
        return None
    key: dict[str, str] = {"schema": SCHEMA}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise BadInput(f"--cache-key {pair!r} is not KEY=VALUE (e.g. gpu=B300)")
        key[k] = v
    return key


def check_cache_key(key: object, where: str) -> dict | None:
    """A key read from a (hostile) bundle index: null, or an object of this schema with string keys."""
    if key is None:
        return None
    if not isinstance(key, dict) or key.get("schema") != SCHEMA or not all(isinstance(k, str) for k in key):
        raise ValueError(f"{where}: cache key is not a {SCHEMA} object")
    return key
