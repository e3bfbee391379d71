"""The bundle volume format: names, the per-volume index, tar headers, sizes, and reading a volume safely.

A volume is one POSIX tar (pax format) named `<name>.vol<NNN>-of-<MMM>.tar`. Its first members describe it,
so that a volume alone says what the bundle is even when the rest of it is damaged:

  MMBUNDLE/index-volNNN.json   this volume's index (schema mm-bundle-index/1, below)
  MMBUNDLE/manifest.json       the model's manifest, byte for byte
  MMBUNDLE/SHA256SUMS          `sha256sum -c` lines for the model files (run inside the restored model dir)
  MMBUNDLE/RESTORE.txt         how to restore with tar, cat and sha256sum alone
  MMBUNDLE/payload-volNNN.sha256  sha256 lines of payload files whose last byte is in this volume (if any)
then the data: a whole file as `model/<path>` (or `payload/image/<file>`, `payload/kernel-cache/<label>/<path>`),
a piece of a file split across volumes as `segments/<same>.segNNNN`.

Index (mm-bundle-index/1):
  {"schema", "bundle_id", "name", "volume", "volumes", "volume_size", "repo_id", "revision",
   "manifest_blake3", "meta": {member: blake3},
   "payloads": {"image": {"file", "size", "refs", "image_id"} | null,
                "kernel_caches": [{"label", "key": {...} | null, "files": [[path, size], ...]}]},
   "members": [{"member", "kind": "model"|"image"|"kernel-cache", "path", "offset", "length", "size",
                "segment", "segments", "blake3" (this piece), "file_blake3", "file_sha256"}]}
Digests that are known only after the data is written (a piece's blake3, a payload's whole-file hashes) are
written as 64 zeros first and patched in place when the volume is complete: the JSON keeps its length.

Sizes (`--volume-size`) are DECIMAL, as disks are sold: 4G = 4,000,000,000 bytes. Binary units are spelled
KiB, MiB, GiB, TiB (4GiB = 4,294,967,296 bytes).
"""
from __future__ import annotations

import json
import mmap
import os
import queue
import re
import tarfile
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import blake3

from .errors import BadInput, BadValue
from .fsutil import check_relpath
from .untrusted import At, Malformed, load_json

INDEX_SCHEMA = "mm-bundle-index/1"
META = "MMBUNDLE"
MANIFEST_MEMBER = f"{META}/manifest.json"
SUMS_MEMBER = f"{META}/SHA256SUMS"
RESTORE_MEMBER = f"{META}/RESTORE.txt"
PLACEHOLDER = "0" * 64
BLOCK = 512
CHUNK = 8 * 1024 * 1024
# blake3's own threads over each 8 MiB chunk: the writer thread spends its time in the kernel, so the
# hashing helper thread gets a second core (measured: bundle ~1.4x faster than one hashing thread).
HASH_THREADS = blake3.blake3.AUTO
END_OF_ARCHIVE = 2 * BLOCK
KINDS = {"model": "model", "image": "payload/image", "kernel-cache": "payload/kernel-cache"}
MAX_INDEX_BYTES = 256 * 1024 * 1024
VOLUME_RE = re.compile(r"^(?P<name>.+)\.vol(?P<num>\d{3,})-of-(?P<count>\d{3,})\.tar$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_VOLUMES = 99_999  # volumes in one bundle
MAX_SEGMENTS = 10**7  # pieces of one file
MAX_VOLUME_SIZE = 10**18

_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'4G' -> 4e9, '1.8T' -> 1.8e12, '750M', '4GiB' -> 2**32. Decimal unless spelled with 'i'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text or "")
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise BadValue(f"volume size {text[:40]!r} is not a size (examples: 750M, 4G, 500G, 1.8T, 4GiB)")
    number = m.group(1)
    # exact arithmetic (no float rounding, no overflow); a number of more than 30 digits is out of range anyway
    size = int(Fraction(number) * _UNITS[unit]) if len(number) <= 40 else MAX_VOLUME_SIZE + 1
    if not 1 <= size <= MAX_VOLUME_SIZE:
        raise BadValue(f"volume size {text[:40]!r} is out of range (1 byte to {MAX_VOLUME_SIZE // 10**15} PB)")
    return size


def index_member(volume: int) -> str:
    return f"{META}/index-vol{volume:03d}.json"


def payload_sums_member(volume: int) -> str:
    return f"{META}/payload-vol{volume:03d}.sha256"


def volume_filename(name: str, volume: int, volumes: int) -> str:
    width = max(3, len(str(volumes)))
    return f"{name}.vol{volume:0{width}d}-of-{volumes:0{width}d}.tar"


def data_member(kind: str, path: str, segment: int, segments: int) -> str:
    """Where a file (or one piece of it) sits in the tar; derived, never trusted from the tar itself."""
    if segments == 1:
        return f"{KINDS[kind]}/{path}"
    return f"segments/{KINDS[kind]}/{path}.seg{segment:0{max(4, len(str(segments)))}d}"


def padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def tar_header(name: str, size: int, mtime: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, mtime, 0o644, tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def member_bytes(name: str, size: int, mtime: int = 0) -> int:
    """Bytes a member takes in the tar: header(s) plus data padded to the block size."""
    return len(tar_header(name, size, mtime)) + padded(size)


def render_json(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1) + "\n").encode()


def b3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


# --- reading a volume -------------------------------------------------------------------------

@dataclass
class Volume:
    """What one volume file holds, from its headers and metadata only (no data read yet)."""

    path: Path
    index: dict | None = None
    index_bytes: bytes = b""
    manifest_bytes: bytes = b""
    data: dict[str, tarfile.TarInfo] = field(default_factory=dict)  # data member name -> header
    meta: dict[str, tarfile.TarInfo] = field(default_factory=dict)  # MMBUNDLE/ member name -> header
    refused: list[str] = field(default_factory=list)  # hostile or malformed: nothing is taken from it
    damaged: dict[str, str] = field(default_factory=dict)  # member -> why (missing, truncated, hash)

    @property
    def bundle_id(self) -> str | None:
        return self.index.get("bundle_id") if self.index else None

    @property
    def number(self) -> int:
        return int(self.index["volume"]) if self.index else 0

    def entries(self) -> list[dict]:
        return list(self.index["members"]) if self.index else []


def find_volumes(sources: list[Path]) -> list[Path]:
    """Volume files named on the command line, or found (not recursively) in the directories named."""
    found: list[Path] = []
    for src in sources:
        src = Path(src)
        if src.is_dir():
            found += sorted(p for p in src.iterdir() if VOLUME_RE.match(p.name) and p.is_file())
        elif src.is_file():
            found.append(src)
        else:
            raise BadInput(f"{src}: no such volume file or directory")
    if not found:
        raise BadInput(f"no bundle volumes (*.volNNN-of-MMM.tar) in {', '.join(str(s) for s in sources)}")
    unique = {os.path.realpath(p): p for p in found}
    return list(unique.values())


def _kind_of(info: tarfile.TarInfo) -> str:
    if info.issym():
        return f"a symlink to {info.linkname!r}"
    if info.islnk():
        return f"a hard link to {info.linkname!r}"
    if info.ischr() or info.isblk():
        return "a device node"
    if info.isfifo():
        return "a fifo"
    if info.isdir():
        return "a directory"
    if info.sparse is not None or info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        return f"an unsupported member type {info.type!r}"
    return ""


def _read_member(tf: tarfile.TarFile, info: tarfile.TarInfo, limit: int) -> bytes:
    if info.size > limit:
        raise BadInput(f"{info.name} is {info.size} bytes, more than the {limit} allowed")
    f = tf.extractfile(info)
    data = f.read() if f else b""
    if len(data) != info.size:
        raise BadInput(f"{info.name} is truncated")
    return data


def expected_meta(index: dict) -> set[str]:
    return set(index.get("meta", {})) | {index_member(int(index["volume"])), MANIFEST_MEMBER}


def check_index(doc: object, where: str) -> dict:
    """Validate an index document's shape, every value's type and range, and every path it names; BadInput on
    anything off. Returns the document (its values are then known to have the types read below)."""
    if not isinstance(doc, dict) or doc.get("schema") != INDEX_SCHEMA:
        raise BadInput(f"{where}: not an mm bundle index (expected schema {INDEX_SCHEMA!r})")
    at = At(where)
    try:
        volumes = at.get_int(doc, "volumes", lo=1, hi=MAX_VOLUMES)
        at.get_int(doc, "volume", lo=1, hi=volumes)
        at.get_str(doc, "bundle_id", max_len=128, empty=False)
        at.get_str(doc, "name", max_len=255, empty=False)
        at.get_str(doc, "manifest_blake3", "", max_len=64)
        meta = at.get_obj(doc, "meta", {})
        at.key("meta").str_map(meta, max_len=64)
        for name in meta:
            check_relpath(name, where)
            if not name.startswith(META + "/"):
                raise at.key("meta").fail(f"metadata member {name!r} outside {META}/")
        volume_size = at.get_int(doc, "volume_size", 0)
        capacity = volume_size * volumes if volume_size else None  # no file, piece or payload can exceed it
        members = at.get_list(doc, "members")
        for i, e in enumerate(members):
            e_at = at.key("members").index(i)
            e_at.obj(e)
            kind = e_at.get_str(e, "kind", max_len=32)
            if kind not in KINDS:
                raise e_at.key("kind").fail(f"unknown kind {kind!r}")
            path = check_relpath(e_at.get_str(e, "path", max_len=4096), where)
            size = e_at.get_int(e, "size")
            offset = e_at.get_int(e, "offset", hi=size)
            e_at.get_int(e, "length", hi=size - offset)
            segments = e_at.get_int(e, "segments", lo=1, hi=min(MAX_SEGMENTS, volumes))
            segment = e_at.get_int(e, "segment", lo=1, hi=segments)
            if segments == 1 and (offset, e["length"]) != (0, size):
                raise e_at.fail(f"a whole file of {size} bytes stored as {e['length']} bytes at offset {offset}")
            if volume_size and (e["length"] > volume_size or size > segments * volume_size):
                raise e_at.fail(f"size {size} (length {e['length']}) cannot fit {segments} piece(s) of volumes of "
                                f"{volume_size} bytes")
            if e_at.get_str(e, "member", max_len=8192) != data_member(kind, path, segment, segments):
                raise e_at.key("member").fail(f"member name {e['member']!r} does not match {kind} {path!r}")
            for digest in ("blake3", "file_blake3", "file_sha256"):
                value = e_at.get_str(e, digest, "" if digest != "blake3" else At._REQUIRED, max_len=64)
                if value and not HEX64.match(value):
                    raise e_at.key(digest).fail("not a 64-hex digest")
        payload_bytes = _check_payloads(at.get_obj(doc, "payloads"), where, at.key("payloads"))
        if capacity is not None and payload_bytes > capacity:
            raise at.key("payloads").fail(f"payloads of {payload_bytes} bytes cannot fit {volumes} volume(s) of "
                                          f"{volume_size} bytes")
    except Malformed as e:
        raise BadInput(f"{where}: malformed index ({e.detail})") from None
    except BadInput as e:
        raise BadInput(f"{where}: index names an unsafe path ({e.message})") from None
    return doc


def _check_payloads(payloads: dict, where: str, at: At) -> int:
    """Payload names become paths at the destination: plain names, normalised relative paths, sizes.
    Returns the payloads' total size."""
    total = 0
    image = at.get_obj(payloads, "image", None)
    if image is not None:
        i_at = at.key("image")
        if "/" in check_relpath(i_at.get_str(image, "file", max_len=255), where):
            raise i_at.key("file").fail(f"image file {image['file']!r} is not a plain file name")
        total += i_at.get_int(image, "size")
        for j, ref in enumerate(i_at.get_list(image, "refs", [])):
            i_at.key("refs").index(j).str(ref, max_len=1024)
    for n, c in enumerate(at.get_list(payloads, "kernel_caches", [])):
        c_at = at.key("kernel_caches").index(n)
        c_at.obj(c)
        if "/" in check_relpath(c_at.get_str(c, "label", max_len=255), where):
            raise c_at.key("label").fail(f"kernel cache label {c['label']!r} is not a plain name")
        c_at.get_obj(c, "key", None)
        for j, pair in enumerate(c_at.get_list(c, "files")):
            f_at = c_at.key("files").index(j)
            if len(f_at.list(pair)) != 2:
                raise f_at.fail("expected [path, size]")
            check_relpath(f_at.index(0).str(pair[0], max_len=4096), where)
            total += f_at.index(1).int(pair[1])
    return total


def entry_disagreements(vol: Volume, manifest) -> list[str]:
    """Index entries that disagree with what they stand for: a model file with the manifest (path, size,
    whole-file hashes), a payload with the payload records (name, size). Sizes in an index are never
    trusted alone: what unbundle writes (and the free-space check counts) comes from the records."""
    files = manifest.by_path() if manifest is not None else {}
    payloads = vol.index.get("payloads", {}) if vol.index else {}
    image = payloads.get("image")
    caches = {f"{c['label']}/{rel}": size for c in payloads.get("kernel_caches", []) for rel, size in c["files"]}
    problems = []
    for e in vol.entries():
        kind, path, size = e["kind"], e["path"], e["size"]
        if kind == "model":
            f = files.get(path)
            if manifest is not None and f is None:
                problems.append(f"member {e['member']!r} is not a file of the manifest")
            elif f is not None and (f.size, f.blake3, f.sha256) != (size, e["file_blake3"], e["file_sha256"]):
                problems.append(f"member {e['member']!r} says {size} bytes, the manifest {f.size} (or the hashes "
                                f"differ)")
        elif kind == "image" and (image is None or (image["file"], image["size"]) != (path, size)):
            problems.append(f"member {e['member']!r} ({size} bytes) is not the image the payloads record")
        elif kind == "kernel-cache" and caches.get(path) != size:
            problems.append(f"member {e['member']!r} ({size} bytes) is not a kernel-cache file the payloads record")
    return [f"{vol.path.name}: {p}" for p in problems]


def open_volume(path: Path) -> Volume:
    """Read a volume's headers and metadata; judge every member without extracting anything.

    Refused (nothing taken from the volume): unreadable index, a member that is not a regular file
    (symlink, hard link, device, fifo, directory), a name not in the index, a size that disagrees with
    the index, a member twice. Damaged (the rest is still usable): members missing or cut short.
    """
    vol = Volume(Path(path))
    name = vol.path.name
    file_size = os.stat(vol.path).st_size
    try:
        with tarfile.open(vol.path, "r:") as tf:
            first = tf.next()
            if first is None or not first.name.startswith(f"{META}/index-vol") or _kind_of(first):
                vol.refused.append(f"{name}: first member is not a bundle index (not an mm bundle volume?)")
                return vol
            vol.index_bytes = _read_member(tf, first, MAX_INDEX_BYTES)
            try:
                doc = load_json(vol.index_bytes, f"{name}: {first.name}", max_bytes=MAX_INDEX_BYTES)
            except Malformed as e:
                vol.refused.append(f"{name}: index {first.name}: {e.detail}")
                return vol
            vol.index = check_index(doc, f"{name}: {first.name}")
            if first.name != index_member(vol.number):
                vol.refused.append(f"{name}: index member {first.name!r} does not match volume {vol.number}")
            expected = {e["member"]: int(e["length"]) for e in vol.entries()}
            meta = expected_meta(vol.index)
            seen = {first.name}
            for info in tf:
                if info is first:  # iterating a TarFile yields the members already read, too
                    continue
                why = _kind_of(info)
                if why:
                    vol.refused.append(f"{name}: member {info.name!r} is {why}; refused")
                    continue
                if info.name in seen:
                    vol.refused.append(f"{name}: member {info.name!r} appears twice; refused")
                    continue
                seen.add(info.name)
                if info.name not in expected and info.name not in meta:
                    vol.refused.append(f"{name}: member {info.name!r} is not in the volume's index; refused")
                    continue
                if info.offset_data + info.size > file_size:
                    vol.damaged[info.name] = "truncated"
                    continue
                if info.name == MANIFEST_MEMBER:
                    vol.manifest_bytes = _read_member(tf, info, MAX_INDEX_BYTES)
                elif info.name in meta:
                    vol.meta[info.name] = info
                elif info.name in expected:
                    if info.size != expected[info.name]:
                        vol.refused.append(f"{name}: member {info.name!r} is {info.size} bytes in the tar but "
                                           f"{expected[info.name]} in the index; refused")
                        continue
                    vol.data[info.name] = info
            for missing in sorted((set(expected) | meta) - seen):
                vol.damaged[missing] = "missing (volume truncated?)"
    except BadInput as e:
        vol.refused.append(e.message if e.message.startswith(name) else f"{name}: {e.message}")
    except (tarfile.TarError, OSError, EOFError) as e:
        if vol.index is None:
            vol.refused.append(f"{name}: not a readable tar volume ({e})")
        else:
            vol.damaged["(tar)"] = f"unreadable after the last good member ({e})"
    if vol.index is not None and vol.manifest_bytes and b3(vol.manifest_bytes) != vol.index.get("manifest_blake3"):
        vol.damaged[MANIFEST_MEMBER] = "blake3 mismatch"
    elif vol.index is not None and not vol.manifest_bytes and MANIFEST_MEMBER not in vol.damaged:
        vol.damaged[MANIFEST_MEMBER] = "missing"
    return vol


def io_settings() -> tuple[int, float]:
    """Copy chunk size and a pause per chunk. MM_TEST_IO_CHUNK / MM_TEST_IO_DELAY exist for the kill -9
    tests only (they slow a run down so that it can be killed mid-file); never set them otherwise."""
    chunk = int(os.environ.get("MM_TEST_IO_CHUNK", "0")) or CHUNK
    return chunk, float(os.environ.get("MM_TEST_IO_DELAY", "0"))


class EarlyFlush:
    """Starts writeback while a copy goes on (fdatasync in a helper thread every STEP bytes), so the fsync
    that publishes the file finds little left to do; left to itself the kernel starts only when a tenth
    of RAM is dirty. Measured on the 4 GiB bench: bundle ~25% faster. Call wait() before closing FD."""

    STEP = 128 * 1024 * 1024

    def __init__(self, fd: int, enabled: bool = True):
        self.fd = fd
        self.enabled = enabled  # off when the file will not be fsynced either (nothing to get ahead of)
        self._since = 0
        self._thread: threading.Thread | None = None

    def wrote(self, n: int) -> None:
        if not self.enabled:
            return
        self._since += n
        if self._since >= self.STEP and (self._thread is None or not self._thread.is_alive()):
            self._since = 0
            self._thread = threading.Thread(target=self._sync, daemon=True)
            self._thread.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError:  # the caller's own fsync reports a real failure
            pass

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


class ChunkPipe:
    """Reads and hashes the next chunks in a helper thread while the caller writes the current one.

    blake3/sha256 and os.write all release the GIL, so on two cores hashing hides behind the write.
    A few page-aligned buffers (DEPTH x the chunk size) are reused: memory stays flat whatever the size.
    """

    DEPTH = 3

    def __init__(self):
        size, self.delay = io_settings()
        self._maps = [mmap.mmap(-1, size) for _ in range(self.DEPTH)]
        self._free: queue.Queue = queue.Queue()
        for m in self._maps:
            self._free.put(m)

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a stream abandoned by an exception still holds a view; GC frees it
                pass

    def stream(self, path: Path, offset: int, length: int, hashers=()):
        """Yield views of LENGTH bytes of PATH from OFFSET, each already fed to every hasher in HASHERS."""
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()

        def produce() -> None:
            try:
                with open(path, "rb", buffering=0) as f:
                    f.seek(offset)
                    left = length
                    while left and not stop.is_set():
                        buf = self._free.get()
                        view = memoryview(buf)
                        n = f.readinto(view[: min(len(buf), left)])
                        if not n:
                            view.release()
                            self._free.put(buf)
                            raise EOFError(f"{path}: ended {left} bytes early")
                        for h in hashers:
                            h.update(view[:n])
                        ready.put((buf, view, n))
                        left -= n
                        if self.delay:
                            time.sleep(self.delay)
                ready.put(None)
            except BaseException as e:  # handed to the consumer
                ready.put(e)

        worker = threading.Thread(target=produce, daemon=True)
        worker.start()
        try:
            while True:
                item = ready.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                buf, view, n = item
                try:
                    yield view[:n]
                finally:
                    view.release()
                    self._free.put(buf)
        finally:
            stop.set()
            while worker.is_alive() or not ready.empty():
                try:
                    item = ready.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(item, tuple):
                    item[1].release()
                    self._free.put(item[0])
            worker.join()
