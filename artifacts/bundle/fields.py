"""Reading fields of a hostile JSON record (a volume's index): the value with its type checked, else ValueError.

The index parser turns ValueError/KeyError/TypeError into one BadInput naming the volume.
"""
from __future__ import annotations

import re

from ..edges.fsutil import check_relpath


def record(raw: object, what: str) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is not an object")
    return raw


MAX_INT = 2**63 - 1  # sizes and offsets: what a file system can hold (and os.pwrite/lseek accept)
MAX_NAME = 4096  # a path, a member name, a label
MAX_TEXT = 1024  # a bundle id, a name, a reference


def integer(raw: dict, key: str, low: int = 0, high: int = MAX_INT) -> int:
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} {_shown(value)} is not an integer")
    if not low <= value <= high:
        raise ValueError(f"{key} {value} is outside [{low}, {high}]")
    return value


def string(raw: dict, key: str, max_len: int = MAX_NAME, empty: bool = True) -> str:
    value = raw[key]
    if not isinstance(value, str):
        raise ValueError(f"{key} {_shown(value)} is not a string")
    if len(value) > max_len:
        raise ValueError(f"{key} is a string of {len(value)} characters, more than the {max_len} allowed")
    if not value and not empty:
        raise ValueError(f"{key} is empty")
    return value


def _shown(value: object) -> str:
    """VALUE for a message: short, whatever it is (a hostile index may hold a megabyte there)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


HEX64 = re.compile(r"^[0-9a-f]{64}$")


def digest(raw: dict, key: str, optional: bool = False) -> str | None:
    """A 64-digit lowercase hex digest (blake3, sha256); None too when OPTIONAL."""
    value = raw.get(key) if optional else raw[key]
    if value is None and optional:
        return None
    if not isinstance(value, str) or not HEX64.match(value):
        raise ValueError(f"{key} {_shown(value)} is not a 64-digit hex digest")
    return value


def plain_name(raw: dict, key: str, where: str, what: str) -> str:
    """A name that becomes one path component at the destination (no '/', nothing that escapes)."""
    name = string(raw, key, max_len=255, empty=False)
    if "/" in check_relpath(name, where):
        raise ValueError(f"{what} {_shown(name)} is not a plain name")
    return name
