"""The one way mm reads and writes sizes, rates, durations, and what a commit id looks like.

Sizes: decimal (SI) everywhere mm prints one, as disks are sold and as `--volume-size` reads them: 1 kB = 1,000 B,
1 MB = 10^6 B, 1 GB = 10^9 B, 1 TB = 10^12 B; rates in the same units per second; binary units only when spelled
with an 'i' (4GiB). Every size, rate and duration on a terminal goes through human_bytes / human_rate /
human_duration; --json stays in bytes and seconds.
"""
from __future__ import annotations

import re
import time

from .errors import BadValue

# --- sizes in --------------------------------------------------------------------------------------------------

MAX_SIZE = 10**18  # bytes: the largest size a --volume-size or --chunk-size may name (mm's own bound)
_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
               "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}  # 20Gi as Kubernetes writes it: 20GiB


def parse_size(text: str | int) -> int:
    """'4G' -> 4e9, '1.8T' -> 1.8e12, '750M', '4GiB' -> 2**32. Decimal unless spelled with 'i'."""
    if isinstance(text, int):
        text = str(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text or "")
    unit = m.group(2).upper() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise BadValue(f"volume size {text[:40]!r} is not a size (examples: 750M, 4G, 500G, 1.8T, 4GiB, 4Gi)")
    from fractions import Fraction  # here: the CLI imports this module at start-up

    number = m.group(1)
    # exact arithmetic (no float rounding, no overflow); a number of more than 40 digits is out of range anyway
    size = int(Fraction(number) * _SIZE_UNITS[unit]) if len(number) <= 40 else MAX_SIZE + 1
    if not 1 <= size <= MAX_SIZE:
        raise BadValue(f"volume size {text[:40]!r} is out of range (1 byte to {MAX_SIZE // 10**15} PB)")
    return size


# --- sizes, rates and durations out ----------------------------------------------------------------------------

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units: see the module docstring)."""
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 999.95 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")  # pragma: no cover


def human_rate(bytes_per_second: float) -> str:
    return f"{human_bytes(bytes_per_second)}/s"


def human_duration(seconds: float) -> str:
    """12.34 -> '12.3 s', 192 -> '3 min 12 s', 7380 -> '2 h 03 min'."""
    if seconds < 59.95:
        return f"{max(seconds, 0):.1f} s"
    whole = int(round(seconds))
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def iso_time(t: float) -> str:
    """Epoch seconds as UTC ISO 8601, to the second: '2026-01-01T10:00:00Z'."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# --- commit ids ------------------------------------------------------------------------------------------------

COMMIT = re.compile(r"[0-9a-f]{40}")  # a full git commit id, as huggingface_hub's REGEX_COMMIT_HASH (fullmatch it)


def is_commit(text: object) -> bool:
    """TEXT is a full 40-hex commit id (lower case, nothing around it)."""
    return isinstance(text, str) and COMMIT.fullmatch(text) is not None
