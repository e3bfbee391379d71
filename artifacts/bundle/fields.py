"""Reading fields of a hostile JSON record (a volume's index): the value with its type checked, else ValueError.

The index parser turns ValueError/KeyError/TypeError into one BadInput naming the volume.
"""
from __future__ import annotations

import re

from ..fsutil import check_relpath


def record(raw: object, what: str) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is not an object")
    return raw


def integer(raw: dict, key: str, low: int = 0) -> int:
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key} {value!r} is not an integer >= {low}")
    return value


def string(raw: dict, key: str) -> str:
    value = raw[key]
    if not isinstance(value, str):
        raise ValueError(f"{key} {value!r} is not a string")
    return value


HEX64 = re.compile(r"^[0-9a-f]{64}$")


def digest(raw: dict, key: str, optional: bool = False) -> str | None:
    """A 64-digit lowercase hex digest (blake3, sha256); None too when OPTIONAL."""
    value = raw.get(key) if optional else raw[key]
    if value is None and optional:
        return None
    if not isinstance(value, str) or not HEX64.match(value):
        raise ValueError(f"{key} {value!r} is not a 64-digit hex digest")
    return value


def plain_name(raw: dict, key: str, where: str, what: str) -> str:
    """A name that becomes one path component at the destination (no '/', nothing that escapes)."""
    name = string(raw, key)
    if "/" in check_relpath(name, where):
        raise ValueError(f"{what} {name!r} is not a plain name")
    return name
