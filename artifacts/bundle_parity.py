"""Parity volumes of a bundle: written after the data volumes, checked alone, used to rebuild lost volumes.

A parity volume is one POSIX tar named `<name>.par<PPP>-of-<MMM>.tar`, self-describing like a data volume:

  MMBUNDLE/index-parPPP.json   its index (schema mm-bundle-parity/1, below)
  MMBUNDLE/manifest.json       the model's manifest, byte for byte
  MMBUNDLE/manifest.json.sig   the manifest's SSH signature, when the model is signed
  MMBUNDLE/RESTORE.txt         the same restore notes as the data volumes
  parity/parityPPP.bin         parity stream PPP over the K data volume files (parity.py: stripes, code)

Index (mm-bundle-parity/1):
  {"schema", "bundle_id", "name", "parity", "parities", "volumes", "code", "stripe", "manifest_blake3",
   "meta": {member: blake3}, "member": "parity/parityPPP.bin",
   "data": [{"number", "file", "size", "blake3"}] (every data volume FILE, whole),
   "streams": [{"number", "size", "blake3"}] (every parity stream)}
so that any one parity volume knows every data volume's exact bytes (a rebuilt volume is byte-identical or
refused) and every other parity stream. Digests are written as 64 zeros first and patched in place once the
stream is written (the JSON keeps its length).

The data volumes are read back once, stripe by stripe, after they are written (the source model is still
read only once; on a staging disk the volumes are still in the page cache).
"""
from __future__ import annotations

import json
import os
import re
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .bundle_format import (
    END_OF_ARCHIVE, MANIFEST_MEMBER, META, PARITY_RE, PLACEHOLDER, b3, padded, render_json, tar_header,
)
from .errors import BadInput, IntegrityError
from .fsutil import check_relpath, fsync_dir
from .hashing import StreamHasher
from .parity import CODEC, STRIPE, FileSource, Layout, NotRecoverable, encode, rebuild
from .progress import NULL_PROGRESS, ProgressSink

PARITY_SCHEMA = "mm-bundle-parity/1"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_INDEX_BYTES = 64 * 1024 * 1024


def parity_filename(name: str, parity: int, parities: int) -> str:
    width = max(3, len(str(parities)))
    return f"{name}.par{parity:0{width}d}-of-{parities:0{width}d}.tar"


def parity_index_member(parity: int) -> str:
    return f"{META}/index-par{parity:03d}.json"


def parity_data_member(parity: int) -> str:
    return f"parity/parity{parity:03d}.bin"


@dataclass(frozen=True)
class Stream:
    number: int  # 1-based data volume or parity number
    size: int
    blake3: str
    file: str | None = None  # data volumes: the volume file name


@dataclass(frozen=True)
class ParityIndex:
    bundle_id: str
    name: str
    parity: int
    parities: int
    volumes: int
    code: str
    stripe: int
    manifest_blake3: str
    meta: dict
    member: str
    data: tuple[Stream, ...]
    streams: tuple[Stream, ...]

    @property
    def layout(self) -> Layout:
        return Layout(self.volumes, self.parities, self.stripe, tuple(d.size for d in self.data))

    def same_set(self, other: "ParityIndex") -> bool:
        """Both describe the same data volumes and parity streams (two parity volumes of one encoding)."""
        return (self.bundle_id, self.volumes, self.parities, self.code, self.stripe, self.data, self.streams) == \
            (other.bundle_id, other.volumes, other.parities, other.code, other.stripe, other.data, other.streams)

    def to_doc(self) -> dict:
        return {"schema": PARITY_SCHEMA, "bundle_id": self.bundle_id, "name": self.name, "parity": self.parity,
                "parities": self.parities, "volumes": self.volumes, "code": self.code, "stripe": self.stripe,
                "manifest_blake3": self.manifest_blake3, "meta": dict(self.meta), "member": self.member,
                "data": [{"number": d.number, "file": d.file, "size": d.size, "blake3": d.blake3} for d in self.data],
                "streams": [{"number": s.number, "size": s.size, "blake3": s.blake3} for s in self.streams]}


def _int(raw: dict, key: str, low: int = 0) -> int:
    v = raw[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{key} {v!r} is not an integer >= {low}")
    return v


def _str(raw: dict, key: str) -> str:
    v = raw[key]
    if not isinstance(v, str):
        raise ValueError(f"{key} {v!r} is not a string")
    return v


def _hex(raw: dict, key: str) -> str:
    v = _str(raw, key)
    if not HEX64.match(v):
        raise ValueError(f"{key} {v!r} is not a 64-digit hex digest")
    return v


def parse_parity_index(doc: object, where: str) -> ParityIndex:
    """Check a parity index (hostile until accepted) and return it typed; BadInput naming WHERE."""
    if not isinstance(doc, dict) or doc.get("schema") != PARITY_SCHEMA:
        raise BadInput(f"{where}: not an mm parity index (expected schema {PARITY_SCHEMA!r})")
    try:
        parity, parities, volumes = _int(doc, "parity", 1), _int(doc, "parities", 1), _int(doc, "volumes", 1)
        stripe = _int(doc, "stripe", 64)
        if parity > parities or volumes + parities > 32 or stripe % 64 or stripe > 64 * 1024 * 1024:
            raise ValueError(f"parity {parity} of {parities} over {volumes} volumes, stripe {stripe}")
        meta = doc["meta"]
        if not isinstance(meta, dict):
            raise ValueError("meta is not an object")
        for name in meta:
            check_relpath(name, where)
            if not name.startswith(META + "/"):
                raise ValueError(f"metadata member {name!r} outside {META}/")
            _hex(meta, name)
        data, streams = doc["data"], doc["streams"]
        if not isinstance(data, list) or len(data) != volumes or not isinstance(streams, list) or len(streams) != parities:
            raise ValueError("data/streams do not list every volume")
        data_recs = []
        for n, d in enumerate(data, 1):
            if not isinstance(d, dict) or _int(d, "number", 1) != n:
                raise ValueError(f"data volume record {n} is out of order")
            file = _str(d, "file")
            if "/" in check_relpath(file, where):
                raise ValueError(f"data volume file {file!r} is not a plain name")
            data_recs.append(Stream(n, _int(d, "size"), _hex(d, "blake3"), file))
        stream_recs = []
        for n, s in enumerate(streams, 1):
            if not isinstance(s, dict) or _int(s, "number", 1) != n:
                raise ValueError(f"parity stream record {n} is out of order")
            stream_recs.append(Stream(n, _int(s, "size"), _hex(s, "blake3")))
        index = ParityIndex(_str(doc, "bundle_id"), _str(doc, "name"), parity, parities, volumes, _str(doc, "code"),
                            stripe, _hex(doc, "manifest_blake3"), dict(meta), _str(doc, "member"),
                            tuple(data_recs), tuple(stream_recs))
        if index.member != parity_data_member(parity):
            raise ValueError(f"member {index.member!r} is not {parity_data_member(parity)!r}")
        if any(s.size != index.layout.parity_length for s in stream_recs):
            raise ValueError("a parity stream's size does not match the data volumes' layout")
    except BadInput as e:
        raise BadInput(f"{where}: parity index names an unsafe path ({e.message})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: malformed parity index ({e})") from None
    if index.code != CODEC:
        raise BadInput(f"{where}: parity made with code {index.code!r}; this mm reads {CODEC!r} only")
    return index


# --- reading --------------------------------------------------------------------------------------

@dataclass
class ParityVolume:
    path: Path
    index: ParityIndex | None = None
    index_bytes: bytes = b""
    manifest_bytes: bytes = b""
    meta: dict[str, tarfile.TarInfo] = field(default_factory=dict)
    data: tarfile.TarInfo | None = None
    refused: list[str] = field(default_factory=list)
    damaged: dict[str, str] = field(default_factory=dict)

    @property
    def bundle_id(self) -> str | None:
        return self.index.bundle_id if self.index else None

    @property
    def number(self) -> int:
        return self.index.parity if self.index else 0

    @property
    def usable(self) -> bool:
        return self.index is not None and not self.refused and not self.damaged and self.data is not None

    def source(self) -> FileSource:
        return FileSource(self.path, self.data.offset_data, self.data.size)


def is_parity_volume(path: Path) -> bool:
    """By name (`*.parNNN-of-MMM.tar`), else by its first member (a parity index)."""
    if PARITY_RE.match(Path(path).name):
        return True
    try:
        with tarfile.open(path, "r:") as tf:
            first = tf.next()
            return first is not None and first.name.startswith(f"{META}/index-par")
    except (tarfile.TarError, OSError, EOFError):
        return False


def open_parity_volume(path: Path) -> ParityVolume:
    """Headers and metadata only; refused on anything hostile (as bundle_format.open_volume), nothing extracted."""
    pv = ParityVolume(Path(path))
    name = pv.path.name
    try:
        file_size = os.stat(pv.path).st_size
        with tarfile.open(pv.path, "r:") as tf:
            first = tf.next()
            if first is None or not first.name.startswith(f"{META}/index-par") or not first.isreg():
                pv.refused.append(f"{name}: first member is not a parity index (not an mm parity volume?)")
                return pv
            if first.size > MAX_INDEX_BYTES:
                pv.refused.append(f"{name}: parity index is {first.size} bytes, more than allowed")
                return pv
            pv.index_bytes = tf.extractfile(first).read()
            try:
                doc = json.loads(pv.index_bytes)
            except ValueError:
                pv.refused.append(f"{name}: parity index {first.name} is not valid JSON")
                return pv
            pv.index = parse_parity_index(doc, f"{name}: {first.name}")
            if first.name != parity_index_member(pv.number):
                pv.refused.append(f"{name}: index member {first.name!r} does not match parity {pv.number}")
            meta = set(pv.index.meta) | {MANIFEST_MEMBER}
            seen = {first.name}
            for info in tf:
                if info is first:
                    continue
                if not info.isreg() or info.sparse is not None:
                    pv.refused.append(f"{name}: member {info.name!r} is not a regular file; refused")
                    continue
                if info.name in seen:
                    pv.refused.append(f"{name}: member {info.name!r} appears twice; refused")
                    continue
                seen.add(info.name)
                if info.name not in meta and info.name != pv.index.member:
                    pv.refused.append(f"{name}: member {info.name!r} is not in the parity index; refused")
                    continue
                if info.offset_data + info.size > file_size:
                    pv.damaged[info.name] = "truncated"
                    continue
                if info.name == MANIFEST_MEMBER:
                    if info.size > MAX_INDEX_BYTES:
                        raise BadInput(f"{info.name} is too large")
                    pv.manifest_bytes = tf.extractfile(info).read()
                elif info.name == pv.index.member:
                    if info.size != pv.index.layout.parity_length:
                        pv.refused.append(f"{name}: member {info.name!r} is {info.size} bytes, the index says "
                                          f"{pv.index.layout.parity_length}; refused")
                        continue
                    pv.data = info
                else:
                    pv.meta[info.name] = info
            for missing in sorted((meta | {pv.index.member}) - seen):
                pv.damaged[missing] = "missing (volume truncated?)"
    except BadInput as e:
        pv.refused.append(e.message if e.message.startswith(name) else f"{name}: {e.message}")
    except (tarfile.TarError, OSError, EOFError) as e:
        if pv.index is None:
            pv.refused.append(f"{name}: not a readable tar volume ({e})")
        else:
            pv.damaged["(tar)"] = f"unreadable after the last good member ({e})"
    if pv.index is not None and pv.manifest_bytes and b3(pv.manifest_bytes) != pv.index.manifest_blake3:
        pv.damaged[MANIFEST_MEMBER] = "blake3 mismatch"
    return pv


def _span_b3(path: Path, offset: int, size: int, progress: ProgressSink) -> str:
    h = StreamHasher(sha256=False, blake3_threads=-1)
    src = FileSource(path, offset, size)
    try:
        pos = 0
        while pos < size:
            data = src.pread(pos, min(8 * 1024 * 1024, size - pos))
            if not data:
                return "truncated"
            h.update(data)
            pos += len(data)
            progress.advance(len(data))
    finally:
        src.close()
    return h.digests().blake3


def check_parity_volume(pv: ParityVolume, progress: ProgressSink = NULL_PROGRESS) -> None:
    """Hash the parity stream and the metadata members against the index; mismatches go to pv.damaged."""
    if pv.index is None or pv.refused:
        return
    if pv.data is not None:
        want = pv.index.streams[pv.number - 1].blake3
        if _span_b3(pv.path, pv.data.offset_data, pv.data.size, progress) != want:
            pv.damaged[pv.index.member] = "blake3 mismatch"
    for name, want in pv.index.meta.items():
        info = pv.meta.get(name)
        if info is not None and _span_b3(pv.path, info.offset_data, info.size, NULL_PROGRESS) != want:
            pv.damaged[name] = "blake3 mismatch"


# --- writing ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParityResult:
    number: int
    path: str
    size: int


def _parity_index(name: str, bundle_id: str, manifest_bytes: bytes, meta: list[tuple[str, bytes]], parity: int,
                  parities: int, layout: Layout, files: list[str], data_b3: list[str], par_b3: list[str]) -> bytes:
    return render_json(ParityIndex(
        bundle_id, name, parity, parities, layout.k, CODEC, layout.stripe, b3(manifest_bytes),
        {member: b3(data) for member, data in meta}, parity_data_member(parity),
        tuple(Stream(i, layout.lengths[i - 1], data_b3[i - 1], files[i - 1]) for i in range(1, layout.k + 1)),
        tuple(Stream(q, layout.parity_length, par_b3[q - 1]) for q in range(1, parities + 1))).to_doc())


def _head(index: bytes, parity: int, manifest_bytes: bytes, meta: list[tuple[str, bytes]], layout: Layout,
          mtime: int) -> tuple[bytes, int]:
    """The parity volume's bytes before the parity stream, and where the index data starts in them."""
    out, patch_at = bytearray(), 0
    for member, data in [(parity_index_member(parity), index), (MANIFEST_MEMBER, manifest_bytes), *meta]:
        out += tar_header(member, len(data), mtime)
        if member == parity_index_member(parity):
            patch_at = len(out)
        out += data
        out += bytes(padded(len(data)) - len(data))
    out += tar_header(parity_data_member(parity), layout.parity_length, mtime)
    return bytes(out), patch_at


def parity_volume_bytes(name: str, bundle_id: str, manifest_bytes: bytes, meta: list[tuple[str, bytes]], mtime: int,
                        files: list[str], sizes: list[int], parities: int, stripe: int = STRIPE) -> int:
    """The size a parity volume will have, before anything is written (bundle planning keeps it on the media)."""
    layout = Layout(len(sizes), parities, stripe, tuple(sizes))
    zeros = [PLACEHOLDER] * max(len(sizes), parities)
    index = _parity_index(name, bundle_id, manifest_bytes, meta, parities, parities, layout, files, zeros, zeros)
    head, _ = _head(index, parities, manifest_bytes, meta, layout, mtime)
    return len(head) + padded(layout.parity_length) + END_OF_ARCHIVE


def write_parity_volumes(out_dir: Path, *, name: str, bundle_id: str, manifest_bytes: bytes, meta: list[tuple[str, bytes]],
                         mtime: int, data_paths: list[Path], parities: int, stripe: int = STRIPE, sync: bool = True,
                         progress: ProgressSink = NULL_PROGRESS, only: set[int] | None = None) -> list[ParityResult]:
    """Read the data volume files DATA_PATHS (in volume order) once and write PARITIES parity volumes to OUT_DIR
    (temporary names, fsync, rename). META: further metadata members (RESTORE.txt, the signature), the same in
    every parity volume. ONLY: write just these parity numbers (repair-volume), the rest is computed and dropped."""
    k = len(data_paths)
    sizes = tuple(os.stat(p).st_size for p in data_paths)
    files = [Path(p).name for p in data_paths]
    layout = Layout(k, parities, stripe, sizes)
    wanted = sorted(only) if only else list(range(1, parities + 1))
    zeros = [PLACEHOLDER] * max(k, parities)
    opened: dict[int, tuple] = {}
    try:
        for p in wanted:
            final = Path(out_dir) / parity_filename(name, p, parities)
            tmp = final.with_name(f".{final.name}.partial")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            w = _Appender(fd)
            opened[p] = (fd, tmp, final, w, 0)
            head, patch_at = _head(_parity_index(name, bundle_id, manifest_bytes, meta, p, parities, layout, files,
                                                 zeros, zeros), p, manifest_bytes, meta, layout, mtime)
            w.write(head)
            opened[p] = (fd, tmp, final, w, patch_at)
        sinks = [opened[p][3].write if p in opened else _discard for p in range(1, parities + 1)]
        sources = [FileSource(path) for path in data_paths]
        try:
            result = encode(layout, sources, sinks, on_bytes=progress.advance)
        finally:
            for src in sources:
                src.close()
        if sizes != tuple(os.stat(p).st_size for p in data_paths):
            raise IntegrityError(f"{out_dir}: a data volume changed size while parity was computed; run again")
        results = []
        for p in wanted:
            fd, tmp, final, w, patch_at = opened.pop(p)
            try:
                w.pad()
                w.write(bytes(END_OF_ARCHIVE))
                os.pwrite(fd, _parity_index(name, bundle_id, manifest_bytes, meta, p, parities, layout, files,
                                            result.data_blake3, result.parity_blake3), patch_at)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            results.append(ParityResult(p, str(final), w.pos))
        if sync:
            fsync_dir(Path(out_dir))
        return results
    finally:
        for fd, tmp, *_ in opened.values():
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)


def _discard(_view) -> None:
    pass


class _Appender:
    def __init__(self, fd: int):
        self.fd, self.pos = fd, 0

    def write(self, data) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
            self.pos += n

    def pad(self) -> None:
        if self.pos % 512:
            self.write(bytes(512 - self.pos % 512))


# --- rebuilding -----------------------------------------------------------------------------------

def parity_set(pvols: list[ParityVolume], bundle_id: str | None) -> tuple[list[ParityVolume], list[str]]:
    """The usable parity volumes of BUNDLE_ID (one per number, all of one encoding), and why others are not."""
    usable, why = [], []
    ref: ParityIndex | None = None
    for pv in sorted(pvols, key=lambda v: v.number):
        if pv.refused:
            why += pv.refused
        elif pv.index is None:
            why.append(f"{pv.path.name}: not a parity volume")
        elif bundle_id and pv.bundle_id != bundle_id:
            why.append(f"{pv.path.name}: parity of bundle {pv.bundle_id} ({pv.index.name}), not {bundle_id}; refused")
        elif pv.damaged:
            why.append(f"{pv.path.name}: damaged ({', '.join(f'{m}: {w}' for m, w in sorted(pv.damaged.items()))}); "
                       f"not used")
        elif ref is not None and not ref.same_set(pv.index):
            why.append(f"{pv.path.name}: parity of another encoding of this bundle; refused")
        elif any(u.number == pv.number for u in usable):
            continue
        else:
            ref = ref or pv.index
            usable.append(pv)
    return usable, why


def rebuild_data_volumes(pvols: list[ParityVolume], data: dict[int, object], want: list[int], out_dir: Path,
                         sync: bool = True, progress: ProgressSink = NULL_PROGRESS,
                         delay: float = 0.0) -> dict[int, Path]:
    """Rebuild data volumes WANT (1-based) from the good DATA sources (1-based number -> Source) and PVOLS,
    each into OUT_DIR under its own file name (temporary name, checked against the whole-volume blake3 the parity
    index records, fsync, rename). Raises NotRecoverable naming what is missing, IntegrityError if an input was
    damaged in a way its own checks did not show."""
    if not pvols:
        raise NotRecoverable("no usable parity volume")
    index = pvols[0].index
    layout = index.layout
    k = layout.k
    inputs = {n - 1: src for n, src in data.items()}
    opened = []
    for pv in pvols:
        src = pv.source()
        opened.append(src)
        inputs[k + pv.number - 1] = src
    want_idx = [n - 1 for n in want]
    out_dir.mkdir(parents=True, exist_ok=True)
    outs: dict[int, tuple[int, Path, Path]] = {}
    try:
        for i in want_idx:
            final = out_dir / index.data[i].file
            tmp = out_dir / f".{index.data[i].file}.partial"
            outs[i] = (os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), tmp, final)

        def sink(i: int):
            fd = outs[i][0]

            def write(view) -> None:
                view = memoryview(view)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if delay:
                    time.sleep(delay)
            return write

        result = rebuild(layout, inputs, want_idx, {i: sink(i) for i in want_idx}, on_bytes=progress.advance)
        bad = [i for i in want_idx if result.output_blake3[i] != index.data[i].blake3]
        if bad:
            checked = rebuild(layout, inputs, want_idx, {i: _discard for i in want_idx}, hash_inputs=True)
            damaged = [(f"volume {i + 1}" if i < k else f"parity {i - k + 1}") for i, d in checked.input_blake3.items()
                       if d != (index.data[i].blake3 if i < k else index.streams[i - k].blake3)]
            raise IntegrityError(f"rebuilt volume(s) {', '.join(str(i + 1) for i in bad)} do not match the bundle "
                                 f"(blake3): damaged input(s): {', '.join(damaged) or 'unknown'}; nothing written")
        done = {}
        for i in want_idx:
            fd, tmp, final = outs.pop(i)
            if sync:
                os.fsync(fd)
            os.close(fd)
            os.replace(tmp, final)
            done[i + 1] = final
        if sync:
            fsync_dir(out_dir)
        return done
    finally:
        for src in opened:
            src.close()
        for fd, tmp, _ in outs.values():
            os.close(fd)
            tmp.unlink(missing_ok=True)


__all__ = ["NotRecoverable", "ParityVolume", "check_parity_volume", "is_parity_volume", "open_parity_volume",
           "parity_filename", "parity_set", "rebuild_data_volumes", "write_parity_volumes"]
