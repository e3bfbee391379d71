"""Structure checks for safetensors shards and their index files, reading headers only.

A safetensors file is: 8-byte little-endian header length N, N bytes of JSON, then the data area.
Engines mmap the data area, so a header whose offsets leave the file, overlap or leave gaps loads
garbage or fails minutes into a start; these checks find that in milliseconds per shard.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

from ..errors import BadInput
from ..edges.fsutil import read_local_file
from ..edges.untrusted import MAX_DOCUMENT, Malformed, load_json

# Element width in bits, as safetensors' Rust Dtype::bitsize spells the header names.
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
# safetensors refuses headers above 100 MB; a larger length is corruption, not a big model.
MAX_HEADER = 100_000_000
# How many tensor names to quote in one line before summarising the rest as a count.
QUOTE = 3


class StructureError(Exception):
    """One line saying what is wrong with a shard's layout."""


@dataclass(frozen=True)
class Header:
    tensors: frozenset[str]
    data_bytes: int


def read_header(path: Path, reference: bool = True) -> Header:
    """Parse and check PATH's header against its own size; raise StructureError with the first fault.

    mm's bounded JSON loader runs first; then, unless REFERENCE is False, the safetensors reference parser (the
    header reader `safe_open` runs) has the last word on what mm's checks let through (a repeated field, a shape
    whose element count overflows). Where it finds fault, mm's own checks of each tensor name the tensor and the
    bytes at fault when they can; where it finds none, they would find none either, and only the data area's size
    is left to check.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise StructureError(f"file is {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER or 8 + n > size:
            raise StructureError(f"header length {n} does not fit in a file of {size} bytes")
        raw = f.read(n)
    try:
        doc = load_json(raw, "header", max_bytes=MAX_HEADER)
    except Malformed as e:
        raise StructureError(f"header ({n} bytes): {e.detail}") from None
    if not isinstance(doc, dict):
        raise StructureError("header is not a JSON object")
    data_bytes = size - 8 - n
    why = reference_rejects(struct.pack("<Q", n) + raw) if reference else None
    if reference and why is None and (names := _sound_layout(doc, data_bytes)) is not None:
        return Header(tensors=frozenset(names), data_bytes=data_bytes)
    header = Header(tensors=frozenset(_check_layout(doc, data_bytes)), data_bytes=data_bytes)
    if why:
        raise StructureError(f"the safetensors reference parser rejects it: {why}")
    return header


# The reference parser's last word on a header handed to it without its data area: everything about the header
# was checked and found sound (the data area's size against the file is mm's own check, made before).
_HEADER_SOUND = "incomplete metadata, file not fully covered"


def reference_rejects(header: bytes) -> str | None:
    """Why the safetensors reference parser refuses HEADER (the 8-byte length and the JSON), or None.

    This is the Rust crate's own header reader, the one `safe_open` runs (the differential test holds the two to
    the same verdicts), called through `deserialize` on the header alone: `safe_open` would load numpy (~45 ms of
    every quick verify) and map the file."""
    from safetensors import SafetensorError, deserialize

    try:
        deserialize(header)
    except SafetensorError as e:
        why = str(e).removeprefix("Error while deserializing: ")
        return None if why == _HEADER_SOUND else why[:300]
    return None  # no tensor bytes at all: the header is the whole file


def _sound_layout(doc: dict, data_bytes: int) -> list[str] | None:
    """The tensor names of a header the reference parser accepted, or None to check it tensor by tensor.

    The reference's acceptance already covers what _check_layout checks per tensor (known dtypes, sizes, offsets
    from 0 with no gap and no overlap; the differential test holds mm's own checks to never reject what it
    accepts): left is the data area's size, which the reference, given the header alone, cannot see. In C-speed
    passes: _check_layout's Python loop costs ~17 k instructions a tensor (12 M of a quick verify's 300 M)."""
    names = [name for name in doc if name != "__metadata__"]
    try:
        end = max((doc[name]["data_offsets"][1] for name in names), default=0)
    except (KeyError, TypeError, IndexError):
        return None
    _check_end(end, data_bytes)
    return names


def _check_end(cursor: int, data_bytes: int) -> None:
    if cursor != data_bytes:
        raise StructureError(f"tensors end at data offset {cursor} but the data area is {data_bytes} bytes "
                             f"(header plus data {'exceeds' if cursor > data_bytes else 'is short of'} the file size)")


def _check_layout(doc: dict, data_bytes: int) -> list[str]:
    spans = []
    for name, info in doc.items():
        if name == "__metadata__":
            if info is not None and (not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values())):
                raise StructureError("__metadata__ is not a map of strings")
            continue
        begin, end = _tensor_span(name, info)
        spans.append((begin, end, name))
    spans.sort()
    cursor, previous = 0, None
    for begin, end, name in spans:
        if begin < cursor:
            raise StructureError(f"tensor {name!r} at [{begin}, {end}) overlaps {previous!r} ending at {cursor}")
        if begin > cursor:
            raise StructureError(f"gap of {begin - cursor} bytes before tensor {name!r} at offset {begin}")
        cursor, previous = end, name
    _check_end(cursor, data_bytes)
    return [name for _, _, name in spans]


def _tensor_span(name: str, info: object) -> tuple[int, int]:
    if not isinstance(info, dict):
        raise StructureError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:  # a list or an object is no key of the table
        raise StructureError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_u64(d) for d in shape):
        raise StructureError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_u64(o) for o in offsets) or offsets[0] > offsets[1]):
        raise StructureError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with begin <= end")
    elements = prod(shape)
    if elements >= 2**64:
        raise StructureError(f"tensor {name!r}: shape {shape} holds more than 2**64 elements")
    bits = elements * DTYPE_BITS[dtype]
    begin, end = offsets
    if bits % 8 or bits // 8 != end - begin:
        raise StructureError(f"tensor {name!r}: {dtype} {shape} needs {bits / 8:g} bytes but data_offsets span {end - begin}")
    return begin, end


def _u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


@dataclass(frozen=True)
class IndexFault:
    shard: str  # path relative to the model dir
    detail: str


def read_weight_map(path: Path) -> dict[str, str]:
    """tensor name -> shard file name from a *.safetensors.index.json; StructureError if malformed."""
    try:
        doc = load_json(read_local_file(path, what="index", max_bytes=MAX_DOCUMENT), "index")
    except Malformed as e:
        raise StructureError(f"index: {e.detail}") from None
    except BadInput as e:  # not a regular file, or larger than an index can be
        raise StructureError(f"index: {e.message.split(': ', 1)[-1]}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise StructureError("index has no weight_map of tensor name -> shard file")
    return weight_map


def index_faults(weight_map: dict[str, str], shard_tensors: dict[str, frozenset[str] | None]) -> list[IndexFault]:
    """Compare an index's weight_map with the shards' headers.

    shard_tensors: for each shard the index names, its header's tensor names, or None when the shard
    is missing (one fault; its tensors are not listed again). Shards left out (an unreadable or
    malformed header, already reported) are not compared.
    """
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(tensor)
    faults = []
    for shard, mapped in sorted(by_shard.items()):
        if shard not in shard_tensors:
            continue
        held = shard_tensors[shard]
        if held is None:
            faults.append(IndexFault(shard, f"names shard {shard} ({len(mapped)} tensors), which is missing"))
            continue
        if absent := mapped - held:
            faults.append(IndexFault(shard, f"maps {_names(absent)} to {shard}, whose header does not hold them"))
        if unlisted := held - mapped:
            faults.append(IndexFault(shard, f"does not list {_names(unlisted)}, which {shard} holds"))
    return faults


def _names(names: set[str]) -> str:
    shown = sorted(names)[:QUOTE]
    more = len(names) - len(shown)
    text = ", ".join(shown)
    return f"{len(names)} tensors ({text}, and {more} more)" if more else f"tensor{'s' if len(names) > 1 else ''} {text}"
