"""Delta bundles: carry only the bytes the destination does not already have.

`mm bundle NEW_DIR --base BASE` (pack.py) plans against BASE, the manifest of the revision the destination holds
(a manifest file, a model directory, or a volume of that revision's bundle): a model file whose content (sha256,
size and blake3) is some base file's is not carried but taken from that base file at the destination (same
content, maybe another path: a renamed shard costs nothing); only the rest travels. Every volume's index records
the base manifest's identity (the sha256 of the document and its revision) and the files taken (index.DeltaNote).

`mm unbundle DELTA --dest NEW_DIR --from BASE_DIR` (unpack.py) refuses (BadInput, exit 3) unless BASE_DIR's
manifest is the recorded base byte for byte and `verify --quick` passes on it, and unless every file to take is a
base file with the recorded size and hashes. It takes each file by reflink where the file system clones (FICLONE),
else by hard link when the user asked (`--link`: the two names share later damage, so never silently), else by a
copy; what it took is hashed (blake3) against the new manifest before it gets its name, so a base file changed
since its verify never slips in (it is named, not taken, and the outcome is `refused`). The import then ends with a
full verify of NEW_DIR, as for a full bundle.
"""
from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import blake3

from ..errors import BadInput, BadValue, QuickVerifyFailed
from ..edges.fsutil import make_dirs, open_file, parent_dir, publish, read_local_file, unlink_file
from ..integrity.hashing import StreamHasher, blake3_file
from ..integrity.manifest import MAX_MANIFEST_BYTES, Manifest, from_json
from ..paths import manifest_path
from ..edges.progress import NULL_PROGRESS, ProgressSink
from ..units import human_bytes
from ..edges.sharing import LINK, REFLINK, clone_file
from .copyio import HASH_THREADS, ChunkPipe, WriteBehind, write_all
from .format import MANIFEST_MEMBER, PARITY_RE, VOLUME_RE
from .index import DeltaNote, Take
from .volume import open_volume

@dataclass(frozen=True)
class Base:
    """The base revision as `mm bundle --base` sees it: its manifest and that document's sha256."""

    manifest: Manifest
    sha256: str
    where: str


def load_base(path: Path) -> Base:
    """BASE as a manifest file, a model directory (DIR/.mm/manifest.json), or a bundle volume of that revision
    (a volume file, or a directory holding volumes): the manifest document and its sha256."""
    path = Path(path)
    if path.is_dir() and manifest_path(path).is_file():
        data, where = _read_bytes(manifest_path(path)), str(manifest_path(path))
    elif path.is_dir() or VOLUME_RE.match(path.name) or PARITY_RE.match(path.name):
        data, where = _manifest_of_volume(path)
    elif path.is_file():
        data, where = _read_bytes(path), str(path)
    else:
        raise BadInput(f"--base {path}: no such manifest, model directory or bundle volume")
    manifest = from_json(data, where)
    return Base(manifest, hashlib.sha256(data).hexdigest(), where)


def _read_bytes(path: Path) -> bytes:
    """The base manifest document: a regular file, bounded (read whole to hash it)."""
    return read_local_file(path, what="base manifest", max_bytes=MAX_MANIFEST_BYTES)


def _manifest_of_volume(path: Path) -> tuple[bytes, str]:
    """The manifest a bundle volume carries (checked against its index's blake3, as unbundle does)."""
    candidates = [path] if path.is_file() else sorted(p for p in path.iterdir()
                                                       if VOLUME_RE.match(p.name) or PARITY_RE.match(p.name))
    why = "no bundle volume there"
    for candidate in candidates:
        vol = open_volume(candidate)
        data = vol.manifest_bytes if not vol.refused and vol.has_manifest else b""
        if not data:
            why = (vol.refused or [f"{candidate.name}: its manifest is damaged or missing"])[0]
            continue
        return data, f"{candidate}: {MANIFEST_MEMBER}"
    raise BadInput(f"--base {path}: cannot read the base manifest from a volume ({why})")


def plan_delta(manifest: Manifest, base: Base) -> DeltaNote:
    """Which files of MANIFEST are taken from BASE (same sha256, size and blake3; the same path preferred)."""
    by_content: dict[tuple, list[str]] = {}
    for f in base.manifest.files:
        if f.proven and f.sha256:
            by_content.setdefault((f.sha256, f.size, f.blake3), []).append(f.path)
    take = []
    for f in manifest.files:
        paths = by_content.get((f.sha256, f.size, f.blake3)) if f.proven and f.sha256 else None
        if paths:
            take.append(Take(f.path, f.path if f.path in paths else paths[0], f.size, f.sha256, f.blake3))
    m = base.manifest
    return DeltaNote(m.repo_id, m.revision, base.sha256, tuple(take))


def describe(doc: dict) -> str:
    """One line for a DeltaNote.summary(): 'delta of REPO@REV (manifest sha256 ...): N files, X from the base; ...'."""
    carried = (f"; {doc['files_carried']} file(s), {human_bytes(doc['bytes_carried'])} carried"
               if doc.get("files_carried") is not None else "")
    return (f"delta of base {doc['base_repo_id']}@{doc['base_revision'][:12]} (manifest sha256 "
            f"{doc['base_manifest_sha256'][:12]}): {doc['files_from_base']} file(s), "
            f"{human_bytes(doc['bytes_from_base'])} from the base directory{carried}")


# --- RESTORE.txt ------------------------------------------------------------------------------------

def restore_intro(note: DeltaNote, files: int) -> list[str]:
    return [f"DELTA: this bundle carries {files - len(note.take)} of the {files} model files. The other "
            f"{len(note.take)} ({human_bytes(note.taken_bytes)})",
            f"are taken from the base revision {note.base_repo_id}@{note.base_revision} (its manifest has sha256",
            f"{note.base_manifest_sha256}), which must already be on this host:",
            "  with mm:    mm unbundle VOLUMES... --dest NEW_DIR --from BASE_DIR",
            "  without mm: give the script below the base model directory (mm's earlier DEST, or ./restore/model",
            "              of an earlier restore): sh restore.sh BASE_DIR. It copies those files from there (cp), and",
            "              sha256sum -c checks every byte of the new revision, the copied files included.",
            ""]


def restore_script_head() -> list[str]:
    """The script's first lines: the base directory, an absolute path (the script changes directory)."""
    return ['BASE=$(cd "${1:?usage: sh restore.sh BASE_DIR (the directory holding the base revision)}" && pwd)']


def restore_takes(note: DeltaNote, model_prefix: str, quote: Callable[[str], str]) -> list[str]:
    """Lines (run inside ./restore) that copy each taken file from the base directory."""
    lines, made = [f"mkdir -p {quote(model_prefix)}"], set()
    for t in note.take:
        parent = t.path.rsplit("/", 1)[0] if "/" in t.path else ""
        if parent and parent not in made:
            made.add(parent)
            lines.append(f"mkdir -p {quote(f'{model_prefix}/{parent}')}")
        lines.append(f'cp "$BASE"/{quote(t.base_path)} {quote(f"{model_prefix}/{t.path}")}')
    return lines


# --- the destination: check the base, take its files --------------------------------------------------

@dataclass(frozen=True)
class BaseDir:
    path: Path
    manifest: Manifest


def open_base(base_dir: Path | None, note: DeltaNote, where: str, dest: Path) -> BaseDir:
    """BASE_DIR checked against the delta's NOTE before anything is written (BadInput, exit 3, otherwise):
    its manifest is the recorded base byte for byte, `verify --quick` passes on it, and every file to take is one
    of its files with the recorded size and hashes. WHERE names the volume whose index holds NOTE."""
    from ..integrity.verify import require_quick_verify  # here: verify imports the safetensors checks

    base_name = f"{note.base_repo_id}@{note.base_revision[:12]}"
    if base_dir is None:
        raise BadInput(f"{where}: a delta bundle of base {base_name}: give --from BASE_DIR, the directory holding "
                       f"that revision")
    base_dir = Path(base_dir)
    if not base_dir.is_dir():
        raise BadInput(f"--from {base_dir}: not a directory")
    if os.path.realpath(base_dir) == os.path.realpath(dest):
        raise BadValue(f"--from {base_dir}: is --dest itself; the new revision goes into its own directory")
    mpath = manifest_path(base_dir)
    if not mpath.is_file():
        raise BadInput(f"--from {base_dir}: no manifest ({mpath}); not the base revision {base_name}")
    data = _read_bytes(mpath)
    if hashlib.sha256(data).hexdigest() != note.base_manifest_sha256:
        have = from_json(data, str(mpath))
        raise BadInput(f"--from {base_dir}: holds {have.repo_id}@{have.revision[:12]} (manifest sha256 "
                       f"{hashlib.sha256(data).hexdigest()[:12]}), not the delta's base {base_name} (manifest sha256 "
                       f"{note.base_manifest_sha256[:12]}); refused")
    manifest = from_json(data, str(mpath))
    try:
        require_quick_verify(base_dir, manifest, before="taking files from it")
    except QuickVerifyFailed as e:
        raise BadInput(f"--from {e.message}") from None
    files = manifest.by_path()
    for t in note.take:
        f = files.get(t.base_path)
        if f is None:
            raise BadInput(f"{where}: takes {t.path!r} from base file {t.base_path!r}, which the base {base_name} "
                           f"does not hold; refused")
        if (f.size, f.sha256, f.blake3) != (t.size, t.sha256, t.blake3):
            raise BadInput(f"{where}: takes {t.path!r} from base file {t.base_path!r} as {t.size} bytes with other "
                           f"hashes than the base manifest gives it ({f.size} bytes); refused")
    return BaseDir(base_dir, manifest)


@dataclass
class Taken:
    """What taking files from the base did."""

    mode: str  # reflink | link | copy
    files: list[str] = field(default_factory=list)  # paths given their final name
    bytes: int = 0
    copied_bytes: int = 0  # bytes written (a copy); reflinks and links write none
    refused: list[str] = field(default_factory=list)  # base files whose bytes were not the recorded ones


def take_from_base(base: BaseDir, take: list[Take], mode: str, final: Callable[[str], Path],
                   partial: Callable[[str], Path], root: Path, sync: bool = True,
                   progress: ProgressSink = NULL_PROGRESS, readback: Callable | None = None) -> Taken:
    """Make each file of TAKE (not yet in place) from its base file by MODE, hash it, and publish it under
    FINAL(path) only when its blake3 is the recorded one; PARTIAL(path) is where it is made. Both names lie under
    ROOT and are reached by fsutil's target rule (never through a link). READBACK(path, size, pipe, hashers): a
    copy's bytes read back from the disk (--readback) and matched again before it is named."""
    out = Taken(mode)
    pipe = ChunkPipe()
    try:
        for t in take:
            progress.item(t.path)
            target, work = final(t.path), partial(t.path)
            make_dirs(root, work.parent)
            source = _base_file(base, t)
            got, copied = _make(source, work, root, t.size, mode, pipe, progress)
            if copied and readback is not None and got == t.blake3:
                again = StreamHasher(sha256=False, blake3_threads=HASH_THREADS)
                readback(work, t.size, pipe, (again,))
                got = again.digests().blake3
            if got != t.blake3:
                unlink_file(root, work)
                out.refused.append(f"{source}: does not match the base manifest (blake3); the base file changed since "
                                   f"it was verified: not taken (run `mm verify {base.path}`)")
                continue
            publish(work, target, sync=sync, root=root)
            out.files.append(t.path)
            out.bytes += t.size
            out.copied_bytes += t.size if copied else 0
    finally:
        pipe.close()
    return out


def _base_file(base: BaseDir, t: Take) -> Path:
    """The base file, refused when it (or a directory above it) leads outside the base directory."""
    path = base.path / t.base_path
    root = os.path.realpath(base.path)
    if os.path.realpath(path) != os.path.join(root, *t.base_path.split("/")):
        raise BadInput(f"{path}: a symlink in the base directory; refusing to take it")
    return path


def _make(source: Path, work: Path, root: Path, size: int, mode: str, pipe: ChunkPipe,
          progress: ProgressSink) -> tuple[str, bool]:
    """WORK (under ROOT) made from SOURCE by MODE: (the blake3 of what WORK holds, whether it was copied). The hash
    is read back from WORK after a reflink or a link, or computed in the pass that writes a copy. A reflink the
    file system refuses for this one file falls back to a copy. A source that is not a regular file of SIZE bytes
    (a FIFO is never opened blocking) hashes as 'changed'."""
    unlink_file(root, work)
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            progress.advance(size)
            return "changed", False
        if mode == LINK:
            with parent_dir(root, work) as (dfd, name):
                os.link(source, name, dst_dir_fd=dfd, follow_symlinks=False)
        elif mode != REFLINK or not clone_file(source, work, root=root):  # a copy, or a reflink refused for this file
            unlink_file(root, work)
            return _copy(source, work, root, size, pipe, progress), True
    finally:
        os.close(src)
    return blake3_file(work, threads=blake3.blake3.AUTO, on_bytes=progress.advance), False


def _copy(source: Path, work: Path, root: Path, size: int, pipe: ChunkPipe, progress: ProgressSink) -> str:
    h = StreamHasher(sha256=False, blake3_threads=HASH_THREADS)
    fd = open_file(root, work, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # never through a link (fsutil's rule)
    flush = WriteBehind(fd)  # the pages stay cached: the engine reads the model next
    try:
        for view in pipe.stream(source, 0, size, (h,)):
            try:
                n = write_all(fd, view)
            except OSError as e:  # DEST is full or read-only: name it (the CLI maps the errno)
                e.filename = str(work)
                raise
            flush.wrote(n)
            progress.advance(n)
    except EOFError:  # the base file shrank since it was opened
        return "changed"
    finally:
        os.close(fd)
    return h.digests().blake3
