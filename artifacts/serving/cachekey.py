"""The kernel-cache key, schema mm-cache-key/1: which host a compiled kernel cache is good for.

`mm warmup` writes it as CACHE_DIR/mm-cache-key.json once the caches are compiled; `mm bundle` reads it
(or builds one from `--cache-key KEY=VALUE`) and carries it in the bundle index beside the cache.
Document: {"schema": "mm-cache-key/1", "gpu", "compute_capability", "driver", "image", "recipe", "gpu_count"};
a key given on the command line holds only the fields named there.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import BadInput, BadValue
from ..edges.fsutil import atomic_write_json, read_json_file

SCHEMA = "mm-cache-key/1"
FILE_NAME = "mm-cache-key.json"
MAX_KEY_BYTES = 1024 * 1024
MAX_FIELD = 1024


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
    atomic_write_json(Path(cache_dir) / FILE_NAME, key.document(), root=Path(cache_dir))


def read_cache_key(cache_dir: Path) -> dict | None:
    """The key stored in CACHE_DIR, or None when there is none; BadInput when the file is not a key."""
    path = Path(cache_dir) / FILE_NAME
    if not path.is_file():
        return None
    key = read_json_file(path, what="cache key", max_bytes=MAX_KEY_BYTES)
    if not isinstance(key, dict) or key.get("schema") != SCHEMA:
        raise BadInput(f"{path}: not a cache key (expected schema {SCHEMA!r})")
    try:
        return check_cache_key(key, str(path))
    except ValueError as e:
        raise BadInput(str(e)) from None


def parse_cache_key(pairs: tuple[str, ...] | list[str]) -> dict | None:
    """`--cache-key gpu=B300 --cache-key driver=590.44` -> a key document; None when no pair is given."""
    if not pairs:
        return None
    key: dict[str, str] = {"schema": SCHEMA}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise BadValue(f"--cache-key {pair[:80]!r} is not KEY=VALUE (e.g. gpu=B300)")
        if len(k) > MAX_FIELD or len(v) > MAX_FIELD:
            raise BadValue(f"--cache-key {pair[:80]!r}: a key or value longer than {MAX_FIELD} characters")
        key[k] = v
    return key


def check_cache_key(key: object, where: str) -> dict | None:
    """A key read from a (hostile) bundle index: null, or an object of this schema with string keys."""
    if key is None:
        return None
    if not isinstance(key, dict) or key.get("schema") != SCHEMA or not all(isinstance(k, str) for k in key):
        raise ValueError(f"{where}: cache key is not a {SCHEMA} object")
    for k, v in key.items():
        # flat: strings and counts (it is compared, printed and written into scripts, never interpreted)
        if len(k) > MAX_FIELD or not (isinstance(v, str) and len(v) <= MAX_FIELD
                                      or isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31):
            raise ValueError(f"{where}: cache key field {k[:60]!r} is not a string of at most {MAX_FIELD} characters "
                             f"or a count")
    return key
