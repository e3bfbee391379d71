"""Filesystem edges shared by every capability: atomic writes, directory locks, path checks."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import unicodedata
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from .errors import BadInput, Busy, Refused
from .progress import human_bytes  # the one size format (decimal units); here for require_free_space

MM_DIR = ".mm"
# Files that tools put beside the weights; never payload.
NON_PAYLOAD_PREFIXES = (".mm/", ".cache/huggingface/")


def fsync_dir(path: Path) -> None:
    """fsync PATH opened read-only: a directory after a rename in it, or a file written and closed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write to a temporary name in the same directory, then publish it: never half a file."""
    path = Path(path)
    import tempfile  # here: its import costs ~8 ms of start-up, and `mm verify` never writes

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        publish(Path(tmp), path, mode=mode)
    except BaseException:
        with _ignore_missing():
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def publish(partial: Path, final: Path, sync: bool = True, mode: int | None = None) -> None:
    """The one atomic publish: a file fully written under a partial name (same filesystem) gets its final
    name: fsync it, set MODE, rename, fsync the directory. sync=False: the caller chose speed (--no-sync).

    Every writer of a final file goes through here (downloads, manifests, launch scripts, bundles).
    """
    if sync:
        fsync_dir(partial)
    if mode is not None:
        os.chmod(partial, mode)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, final)
    if sync:
        fsync_dir(final.parent)


def publish_fd(fd: int, partial: Path, final: Path, sync: bool = True) -> None:
    """A file written through FD under PARTIAL: close FD, then publish it (fsync, rename, fsync dir)."""
    os.close(fd)
    publish(partial, final, sync)


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
            raise Refused(f"{probe}: not enough free disk: {what} needs {human_bytes(need)} more, "
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
        from .hfcache import state_dir  # a Hugging Face cache snapshot keeps its .mm outside the cache

        lock_dir = state_dir(directory, MM_DIR)
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock_path = lock_dir / "lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
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


def is_payload(relpath: str) -> bool:
    """True for model files; False for tool metadata kept beside them."""
    return not any(relpath.startswith(prefix) for prefix in NON_PAYLOAD_PREFIXES)


def payload_files(root: Path) -> list[str]:
    """Relative POSIX paths of the regular files under ROOT that are model payload, sorted.

    Symlinks are listed too (verify judges where they point); tool metadata is not.
    """
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if is_payload(prefix + d + "/")]
        found.extend(prefix + name for name in filenames if is_payload(prefix + name))
    return sorted(found)
