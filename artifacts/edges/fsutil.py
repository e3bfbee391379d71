"""Filesystem edges shared by every capability: atomic writes, directory locks, path checks, the rule that a
target directory is mm's only (no write through a symlink under it), and bounded reads of local files."""
from __future__ import annotations

import errno
import fcntl
import functools
import itertools
import json
import os
import stat
import sys
import unicodedata
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Sequence

from ..errors import BadInput, Busy, Refused
from ..paths import MM_DIR, state_dir, state_root
from .untrusted import MAX_DOCUMENT, load_json
from ..units import human_bytes  # the one size format (decimal units); here for require_free_space

# Files that tools put beside the weights; never model files.
NOT_MODEL_PREFIXES = (".mm/", ".cache/huggingface/")


def fsync_dir(path: Path) -> None:
    """fsync PATH opened read-only: a directory after a rename in it, or a file written and closed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes | Iterable[bytes], mode: int = 0o644, *, root: Path,
                       allowed: Allowed = (), sync: bool = True) -> None:
    """Write PATH (under ROOT) to a temporary name in its directory, then publish it: never half a file. DATA: the
    bytes, or chunks of them (a large document written as it is rendered, never held whole).

    Every directory from ROOT down is reached without following a symlink (see `parent_dir`). sync=False: no
    fsync (state a kill -9 keeps in the page cache, and a power cut may lose)."""
    import secrets  # here: start-up time (`mm verify` never writes)

    path = Path(path)
    with parent_dir(root, path, create=True, allowed=allowed) as (dfd, name):
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
                    f.write(chunk)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
                os.fchmod(f.fileno(), mode)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # a link at NAME is replaced, never followed
            if sync:
                os.fsync(dfd)
        except BaseException:
            with _ignore_missing():
                os.unlink(tmp, dir_fd=dfd)
            raise


def atomic_write_text(path: Path, text: str, mode: int = 0o644, *, root: Path, allowed: Allowed = ()) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode, root=root, allowed=allowed)


def atomic_write_json(path: Path, obj: object, *, root: Path, allowed: Allowed = (), indent: int | None = 2,
                      default: Callable[[object], object] | None = None) -> None:
    """INDENT None: one line, by json's C encoder, a slice at a time (json_line_chunks). An indented document is written as its Python encoder yields it,
    a megabyte at a time (json.dumps makes a list of every token first: for mm's own record of a million files,
    hundreds of MB). DEFAULT: json's, for values of mm's own compact types."""
    if indent is None:
        atomic_write_bytes(path, (chunk.encode("utf-8") for chunk in json_line_chunks(obj, default)), root=root,
                           allowed=allowed)
        return
    atomic_write_bytes(path, (chunk.encode("utf-8") for chunk in json_text_chunks(obj, indent, default)), root=root,
                       allowed=allowed)


def json_record(doc: object, indent: int, lead: str = "") -> str:
    """json.dumps(DOC, indent=INDENT) with LEAD after each of its newlines (a record of a list nested in a larger
    document). A flat record of strings, integers and nulls (a manifest's file, an index's member) is joined here
    with json's C string encoder: the same bytes, without json's pure-Python indenting encoder (dozens of calls
    a record, and a document may list a million)."""
    if type(doc) is dict and doc and all(type(k) is str and (v is None or type(v) is str or type(v) is int)
                                         for k, v in doc.items()):
        inner = "\n" + lead + " " * indent
        return ("{" + inner + ("," + inner).join(
            f"{_json_string(k)}: {'null' if v is None else _json_string(v) if type(v) is str else int.__repr__(v)}"
            for k, v in doc.items()) + "\n" + lead + "}")
    return json.dumps(doc, indent=indent).replace("\n", "\n" + lead)


_json_string = json.encoder.encode_basestring_ascii  # what json.dumps (ensure_ascii) writes for a string


_SLICE = 10_000  # members of a large object or list rendered at a time (mm's own margin: ~1 MB of text)


def json_line_chunks(obj: object, default: Callable[[object], object] | None = None) -> Iterator[str]:
    """json.dumps(OBJ, default=DEFAULT) + "\n", the same bytes (one line, json's C encoder), with each large value
    of a top-level object (an object or a list of more than _SLICE members) rendered _SLICE members at a time: the
    whole text and its encoded copy are never held (mm's import state has a stamp a file: ~100 MB of text at a
    million files, saved after each volume)."""
    def dumps(value: object) -> str:
        return json.dumps(value, default=default)

    if type(obj) is not dict or not all(type(k) is str for k in obj):
        yield dumps(obj) + "\n"
        return
    yield "{"
    for i, (key, value) in enumerate(obj.items()):
        yield (", " if i else "") + dumps(key) + ": "
        if type(value) is dict and len(value) > _SLICE:
            items, sep = iter(value.items()), ""
            yield "{"
            while part := dict(itertools.islice(items, _SLICE)):
                yield sep + dumps(part)[1:-1]
                sep = ", "
            yield "}"
        elif type(value) is list and len(value) > _SLICE:
            yield "["
            for at in range(0, len(value), _SLICE):
                yield (", " if at else "") + dumps(value[at:at + _SLICE])[1:-1]
            yield "]"
        else:
            yield dumps(value)
    yield "}\n"


def json_text_chunks(obj: object, indent: int, default: Callable[[object], object] | None = None) -> Iterator[str]:
    """json.dumps(OBJ, indent=INDENT) + "\n", about a megabyte at a time: json.dumps makes a list of every token
    of the document first (for a report or record of a million files, hundreds of MB)."""
    batch: list[str] = []
    held = 0
    for token in json.JSONEncoder(indent=indent, default=default).iterencode(obj):
        batch.append(token)
        held += len(token)
        if held >= 1 << 20:
            yield "".join(batch)
            batch, held = [], 0
    batch.append("\n")
    yield "".join(batch)


def publish(partial: Path, final: Path, sync: bool = True, mode: int | None = None, *, root: Path,
            allowed: Allowed = ()) -> None:
    """The one atomic publish: a file fully written under a partial name (under ROOT, same filesystem) gets its
    final name under ROOT: fsync it, set MODE, rename, fsync the directory. sync=False: the caller chose speed
    (--no-sync). Neither name is reached through a symlink; a symlink at the final name is replaced (the file it
    pointed to is untouched).

    Every writer of a final file goes through here (downloads, manifests, launch scripts, bundles).
    """
    with parent_dir(root, partial, allowed=allowed) as (pfd, pname), \
            parent_dir(root, final, create=True, allowed=allowed) as (ffd, fname):
        if sync or mode is not None:
            fd = os.open(pname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
            try:
                if sync:
                    os.fsync(fd)
                if mode is not None:
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
        os.rename(pname, fname, src_dir_fd=pfd, dst_dir_fd=ffd)  # a link at the final name is replaced, not followed
        if sync:
            os.fsync(ffd)


def publish_many(pairs: Sequence[tuple[Path, Path]], *, root: Path) -> None:
    """publish() for many files fully written under partial names (PARTIAL, FINAL pairs under ROOT), durable at a
    cost a batch, not two flushes a file: every partial file's data first (one syncfs of ROOT's file system, else an
    fsync a file), then the renames, then one fsync of each directory that got a final name. A crash meanwhile
    leaves a file under its partial name or complete under its final one, as publish does: no final name is given
    before every byte of the batch is on the disk."""
    if not pairs:
        return
    if not sync_file_system(root):
        for partial, _ in pairs:
            with parent_dir(root, partial) as (pfd, pname):
                fd = os.open(pname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    folders: dict[Path, Path] = {}
    for partial, final in pairs:
        publish(partial, final, sync=False, root=root)
        folders.setdefault(final.parent, final)
    for final in folders.values():
        with parent_dir(root, final) as (dfd, _):
            os.fsync(dfd)


def sync_file_system(path: Path) -> bool:
    """syncfs(2) of the file system holding PATH: its dirty data written and flushed to its device in one call (an
    fsync a file costs a journal commit each on ext4 and xfs). False where libc has none (the caller fsyncs)."""
    fn = libc_function("syncfs", "c_int")
    if fn is None:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if fn(fd) != 0:
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)
    return True


@functools.cache
def libc_function(name: str, *argtypes: str):
    """libc's NAME with its ctypes ARGTYPES (named: "c_int", ...), for Linux calls Python's os lacks (syncfs,
    sync_file_range), or None where libc has none. ctypes is imported only by the callers that need it."""
    import ctypes

    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [getattr(ctypes, t) for t in argtypes]
    return fn


def publish_fd(fd: int, partial: Path, final: Path, sync: bool = True, *, root: Path) -> None:
    """A file written through FD under PARTIAL: close FD, then publish it (fsync, rename, fsync dir)."""
    os.close(fd)
    publish(partial, final, sync, root=root)


# --- a target directory is mm's, and only its own ----------------------------------------------------
# The rule: a directory the user names (--local-dir, --dest, --out, --cache-root, ...) is taken as given, a
# symlink included (the user's choice); below it, mm writes, renames and deletes only through real directories.
# Each parent is opened from the root one component at a time with O_NOFOLLOW (openat), so a symlink planted
# inside the target, or swapped in while mm runs, is refused (exit 3, naming the link) and never followed; the
# operation then runs on that directory's descriptor. ALLOWED: roots that a symlink may point into (a layout
# that links by design, e.g. a Hugging Face cache's snapshots/ into its blobs/).

Allowed = Iterable[Path]
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def user_path(path: Path) -> Path:
    """A file or directory the user named, its symlinks followed (the user's choice): what a writer takes as root."""
    return Path(os.path.realpath(path))


def _rel_parts(root: Path, path: Path) -> list[str]:
    top, full = os.fspath(root).rstrip("/") + "/", os.fspath(path)
    if full.startswith(top) and top != "/":  # the plain case, without relpath's normalising of both (per file)
        parts = full[len(top):].split("/")
        if "" not in parts and "." not in parts and ".." not in parts:
            return parts
    rel = os.path.relpath(path, root)
    if rel == ".":
        return []
    parts = rel.split(os.sep)
    if parts[0] == "..":
        raise ValueError(f"{path} is not under {root}")  # a bug in the caller, not the user's input
    return parts


def _link_allowed(link: Path | str, allowed: Allowed) -> bool:
    real = os.path.realpath(link)
    for root in allowed:
        top = os.path.realpath(root)
        if real == top or real.startswith(top.rstrip("/") + "/"):
            return True
    return False


def link_refused(link: Path | str, root: Path) -> BadInput:
    try:
        to = os.readlink(link)
    except OSError:
        to = "?"
    return BadInput(f"{link}: is a symlink (to {to}) inside {root}; mm never writes through a link under the "
                    f"directory it works in: remove the link, or name the real directory")


def _refuse_link_at(dfd: int, name: str, full: Path | str, root: Path, allowed: Allowed) -> os.stat_result | None:
    """The lstat of NAME in DFD (None if absent); a symlink there is refused unless ALLOWED lets it in."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode) and not _link_allowed(full, allowed):
        raise link_refused(full, root)
    return st


def _open_dir_at(dfd: int, name: str, full: Path | str, root: Path, create: bool, allowed: Allowed) -> int:
    for attempt in range(3):
        try:
            return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dfd)
        except FileNotFoundError:
            if not create or attempt == 2:
                raise
            with suppress(FileExistsError):  # made meanwhile by another: the next open judges what it is
                os.mkdir(name, 0o755, dir_fd=dfd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = _refuse_link_at(dfd, name, full, root, allowed)
            if st is not None and stat.S_ISLNK(st.st_mode):  # allowed: follow it
                return os.open(name, _DIR_FLAGS, dir_fd=dfd)
            raise BadInput(f"{full}: is not a directory, and mm needs one there") from None
    raise FileNotFoundError(errno.ENOENT, "vanished while created", str(full))


def _walk(root: Path, parts: list[str], create: bool, allowed: Allowed) -> int:
    """A descriptor of ROOT/PARTS..., each component opened without following a symlink (created if CREATE)."""
    if create and not os.path.isdir(root):
        os.makedirs(root, exist_ok=True)  # the root itself: the user's path, as named
    fd = os.open(root, _DIR_FLAGS)
    here = os.fspath(root)  # a str: a Path per component costs more than the open (a million files)
    try:
        for part in parts:
            here = f"{here.rstrip('/')}/{part}"
            nfd = _open_dir_at(fd, part, here, root, create, allowed)
            os.close(fd)
            fd = nfd
    except OSError as e:
        os.close(fd)
        _full_names(e, Path(here).parent)
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def _full_names(e: OSError, where: Path) -> None:
    """An error of a call relative to a directory descriptor names the file by its full path (the CLI shows it)."""
    if e.filename is not None and not os.path.isabs(os.fsdecode(e.filename)):
        e.filename = str(where / os.fsdecode(e.filename))
    if e.filename2 is not None and not os.path.isabs(os.fsdecode(e.filename2)):
        e.filename2 = str(where / os.fsdecode(e.filename2))


@contextmanager
def parent_dir(root: Path, path: Path, *, create: bool = False, allowed: Allowed = ()) -> Iterator[tuple[int, str]]:
    """(descriptor of PATH's directory, PATH's last name), reached from ROOT without following a symlink.

    CREATE: make the missing directories (each one judged again once made). A symlink on the way is refused
    (BadInput naming it) unless it points into one of ALLOWED; a missing directory is FileNotFoundError."""
    parts = _rel_parts(root, path)  # ROOT and PATH as given (str or Path): no Path made per call
    if not parts:
        raise ValueError(f"{path}: the root itself has no parent under it")
    fd = _walk(root, parts[:-1], create, allowed)
    try:
        yield fd, parts[-1]
    except OSError as e:
        _full_names(e, Path(path).parent)
        raise
    finally:
        os.close(fd)


def make_dirs(root: Path, path: Path, *, allowed: Allowed = ()) -> Path:
    """mkdir -p PATH under ROOT, through real directories only (a symlink on the way is refused)."""
    os.close(_walk(Path(root), _rel_parts(Path(root), Path(path)), True, allowed))
    return Path(path)


def check_inside(root: Path, path: Path, *, allowed: Allowed = ()) -> Path:
    """PATH, once every existing component of it below ROOT is known not to be a symlink (refused, naming it).

    For callers that hand a path to a library (tarfile, huggingface_hub): check before, and after it created."""
    try:
        with parent_dir(root, path, allowed=allowed) as (dfd, name):
            _refuse_link_at(dfd, name, Path(path), Path(root), allowed)
    except (FileNotFoundError, ValueError):
        pass
    return Path(path)


def check_targets(root: Path, relpaths: Iterable[str], *, allowed: Allowed = ()) -> None:
    """Before a command moves a byte: every path it will write or rename under ROOT (relative paths) is reached
    through real directories (refused, naming the first link). A link at a final name itself is harmless: the
    file is published over it by rename."""
    root = Path(root)
    for parent in sorted({(root / rel).parent for rel in relpaths} - {root}):
        check_inside(root, parent, allowed=allowed)


def open_file(root: Path, path: Path, flags: int, mode: int = 0o644, *, allowed: Allowed = ()) -> int:
    """os.open of PATH under ROOT: parents through real directories (created with O_CREAT), PATH itself not a
    symlink and a regular file. A file opened for writing must have no other hard link (writing would change
    the bytes under the other name too). Returns the descriptor."""
    writing = bool(flags & (os.O_WRONLY | os.O_RDWR))
    with parent_dir(root, path, create=bool(flags & os.O_CREAT), allowed=allowed) as (dfd, name):
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise link_refused(Path(path), Path(root)) from None
            if e.errno == errno.ENXIO:  # a FIFO without a reader
                raise BadInput(f"{path}: is a FIFO, not a regular file") from None
            raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{path}: is {file_kind(st.st_mode)}, not a regular file")
        if writing and st.st_nlink > 1:
            raise BadInput(f"{path}: has {st.st_nlink} hard links; mm will not write into it (the bytes under the "
                           f"other names would change too): remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_file(root: Path, path: Path, *, missing_ok: bool = True, allowed: Allowed = ()) -> None:
    """Remove PATH under ROOT, reached through real directories (a symlink at PATH itself is removed, as a name:
    what it points to is untouched)."""
    try:
        with parent_dir(root, path, allowed=allowed) as (dfd, name):
            os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        if not missing_ok:
            raise


def remove_tree(root: Path, path: Path, *, allowed: Allowed = ()) -> None:
    """rm -rf PATH under ROOT; nothing outside it: PATH reached through real directories, and links (PATH itself
    included) are removed as names, never followed (shutil.rmtree's descriptor-based walk)."""
    import shutil

    try:
        with parent_dir(root, path, allowed=allowed) as (dfd, name):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dfd)
            elif sys.version_info >= (3, 11):
                shutil.rmtree(name, dir_fd=dfd)
            else:  # Python 3.10: no dir_fd; the path was just proven free of links
                shutil.rmtree(path)
    except FileNotFoundError:
        pass


def file_kind(mode: int) -> str:
    """'a directory', 'a FIFO', ... for an st_mode that is not a regular file."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


# --- local files: regular, bounded ----------------------------------------------------------------------------

def open_local_file(path: Path | str, *, what: str = "file", max_bytes: int | None = None) -> BinaryIO:
    """A local file the user or a model directory gave, opened for reading: a regular file (a FIFO, a device such
    as /dev/zero, a socket or a directory is refused, and opening never blocks), its size from fstat within
    MAX_BYTES. The caller reads it bounded (read_local_file, or a stream with its own cap)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such {what}") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read {what}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise BadInput(f"{path}: is a directory, expected a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{path}: is {file_kind(st.st_mode)}, not a regular file; mm reads a {what} only "
                           f"from a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise BadInput(f"{path}: {what} of {human_bytes(st.st_size)}, larger than the {human_bytes(max_bytes)} "
                           f"mm reads for it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_local_file(path: Path | str, *, what: str = "file", max_bytes: int) -> bytes:
    """The bytes of a small local file (a manifest, a signature, a key, an auth file, a lock): see open_local_file.
    At most MAX_BYTES are read, even from a file that grows while it is read."""
    with open_local_file(path, what=what, max_bytes=max_bytes) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise BadInput(f"{path}: cannot read {what}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise BadInput(f"{path}: {what} grew past the {human_bytes(max_bytes)} mm reads for it while it was read")
    return data


def read_json_file(path: Path | str, *, what: str = "file", max_bytes: int = MAX_DOCUMENT) -> Any:
    """Read and parse PATH (untrusted.load_json); a missing, unreadable, oversized or not regular file (FIFO,
    device) is BadInput naming it."""
    return load_json(read_local_file(path, what=what, max_bytes=max_bytes), str(path), max_bytes=max_bytes, what=what)


def still_to_write(partial: Path, size: int, recorded: int = 0) -> int:
    """Bytes a file of SIZE still needs on disk, continuing PARTIAL: less what PARTIAL already holds, whether
    RECORDED (its range map, an import's state) or only allocated (reserved up front, or written after the
    record was last saved, as when a full disk stopped the run); a hole still needs its bytes."""
    try:
        st = os.lstat(partial)
        held = min(st.st_size, st.st_blocks * 512) if stat.S_ISREG(st.st_mode) else 0
    except OSError:
        held = 0
    return max(0, size - max(recorded, held))


def require_free_space(needs: Iterable[tuple[Path, int]], what: str) -> None:
    """Refuse up front (exit 7) rather than fail hours later with a full disk.

    NEEDS: (path where bytes will be written, bytes still to write); paths on one file system are added up,
    and a path not created yet is judged by its nearest existing parent.
    """
    import shutil  # here: it pulls in bz2/lzma/zlib, ~6 ms of every start-up

    by_device: dict[int, tuple[Path, int]] = {}
    for path, need in needs:
        probe = Path(path)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        dev = probe.stat().st_dev
        seen = by_device.get(dev, (probe, 0))
        by_device[dev] = (seen[0], seen[1] + need)
    for probe, need in by_device.values():
        free = shutil.disk_usage(probe).free
        if need > free:
            raise Refused(f"{probe}: not enough free disk: {what} needs {human_bytes(need)}, "
                          f"{human_bytes(free)} free")


@contextmanager
def _ignore_missing() -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        pass


@contextmanager
def dir_lock(directory: Path, what: str = "mm", leave_nothing: bool = False) -> Iterator[None]:
    """Hold an exclusive, non-blocking lock on DIR/.mm/lock for the duration of the block.

    flock is released by the kernel when the process dies, so a kill -9 leaves no stale lock.
    leave_nothing: lock the directory itself instead (removable media: nothing of mm's is left on them).
    """
    if leave_nothing:
        lock_path = Path(directory)
        fd = os.open(lock_path, os.O_RDONLY | os.O_DIRECTORY)
    else:
        # a Hugging Face cache snapshot keeps its .mm outside the cache (state_dir)
        lock_path = state_dir(directory, MM_DIR) / "lock"  # reached without following a link (a target's rule)
        fd = open_file(state_root(directory), lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise Busy(f"{directory}: {what} cannot start: {lock_holder(fd, lock_path)}; wait for it or stop it") from None
            raise
        if not leave_nothing:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


@contextmanager
def read_lock(directory: Path, what: str, after: str = "wait for it or stop it") -> Iterator[None]:
    """Share DIR/.mm/lock while mm reads DIR as its input (verify, bundle, push, a delta's base, fetch --from).
    Writers (fetch, unbundle, manifest) hold it whole, and `mm gc` takes it whole before it removes a revision,
    so what is being read is never half-written nor removed underneath: a reader's lock, as writers have theirs.
    The lock file is created where DIR's .mm is a real directory (never through a link); a model on a read-only
    mount, or without .mm, is read without it (nothing of mm's can write or remove it there either)."""
    lock = state_dir(directory, MM_DIR) / "lock"  # a Hugging Face cache snapshot keeps its .mm outside the cache
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO there never blocks
    except OSError:
        fd = None
        if lock.parent.is_dir() and not lock.parent.is_symlink():
            with suppress(OSError, BadInput):
                fd = open_file(state_root(directory), lock, os.O_RDWR | os.O_CREAT, 0o644)
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            # dir_lock records the holder's pid: our own caller (e.g. unbundle verifying its DEST) may read it.
            if os.pread(fd, 32, 0).strip() != str(os.getpid()).encode():
                raise Busy(f"{directory}: {what} cannot start: {lock_holder(fd, lock)}; {after}") from None
        yield
    finally:
        os.close(fd)


def lock_holder(fd: int, lock_path: Path) -> str:
    """Who holds the flock on the file open as FD: "`mm verify DIR` (pid N) is reading it (lock PATH)".

    Read from /proc/locks (the kernel's own table: right even when the holder is a reader that could not
    record itself); "another mm process" when it cannot be told.
    """
    st = os.fstat(fd)
    holders = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6 or parts[1] != "FLOCK" or parts[0].endswith("->"):
                    continue
                dev_ino = parts[5].split(":")
                if len(dev_ino) == 3 and dev_ino[2].isdigit() and int(dev_ino[2]) == st.st_ino \
                        and int(dev_ino[1], 16) == os.minor(st.st_dev) and int(dev_ino[0], 16) == os.major(st.st_dev):
                    holders.append((int(parts[4]), parts[3]))
    except (OSError, ValueError):
        pass
    described = []
    for pid, mode in holders:
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
        except OSError:
            argv = []
        command = _mm_command(argv)
        doing = "is writing it" if mode == "WRITE" else "is reading it"
        described.append(f"`{command}` (pid {pid}) {doing}" if command else f"process {pid} {doing}")
    who = "; ".join(sorted(set(described))) or "another mm process holds it"
    return f"{who} (lock {lock_path})"


def _mm_command(argv: list[str]) -> str | None:
    """`mm verify DIR` from a process's argv (python .../mm verify DIR), or None when it is not mm."""
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "mm" or arg.endswith("mm.cli"):
            return " ".join(["mm", *argv[i + 1 :]])[:200]
    return None


def check_relpath(path: str, where: str = "manifest") -> str:
    """Return PATH if it is a safe, normalised, relative POSIX path; raise BadInput otherwise."""
    if not path:
        raise BadInput(f"{where}: empty path")
    bad = None if path.isprintable() and "\\" not in path else next(
        (c for c in path if c == "\\" or unicodedata.category(c) in ("Cc", "Cs")), None)
    if bad is not None and "\udc80" <= bad <= "\udcff":
        raise BadInput(f"{where}: path {path!r} is not UTF-8 (byte {ord(bad) - 0xdc00:#04x}), which mm refuses in file names")
    if bad is not None:
        what = {"\\": "a backslash", "\x00": "a NUL byte", "\n": "a newline", "\r": "a carriage return",
                "\t": "a tab"}.get(bad, f"the control character {bad!r}")
        raise BadInput(f"{where}: path {path!r} holds {what}, which mm refuses in file names")
    if path.startswith("/"):
        raise BadInput(f"{where}: absolute path {path!r} is not allowed")
    # Plain string parts, not PurePosixPath: this runs once a manifest entry (10,000-file repos) at every load.
    if any(part in ("..", ".", "") for part in path.split("/")):
        raise BadInput(f"{where}: path {path!r} is not normalised or escapes the directory")
    return path


RESERVED_DIRS = (MM_DIR, ".mm-partial")  # mm's own state beside a model or a payload (bundle.payloads.PAYLOAD_PARTIAL)


def check_model_path(path: str, where: str = "manifest") -> str:
    """check_relpath, and not inside a directory mm keeps for itself (.mm/): no manifest, index, listing or
    journal may name a file there (a `.mm/lock` entry would have repair fight the lock)."""
    check_relpath(path, where)
    top = path.split("/", 1)[0]
    if top in RESERVED_DIRS:
        raise BadInput(f"{where}: path {path!r} is inside {top}/, which mm keeps for its own state; no manifest may "
                       f"name a file there")
    return path


def is_model_file(relpath: str) -> bool:
    """True for model files; False for tool metadata kept beside them."""
    return not any(relpath.startswith(prefix) for prefix in NOT_MODEL_PREFIXES)


def model_files(root: Path) -> list[str]:
    """Relative POSIX paths of the regular files under ROOT that are the model's files, sorted.

    Symlinks are listed too (verify judges where they point); tool metadata is not.
    """
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if is_model_file(prefix + d + "/")]
        found.extend(prefix + name for name in filenames if is_model_file(prefix + name))
    return sorted(found)
