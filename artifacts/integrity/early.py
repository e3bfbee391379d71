"""A head start for `mm verify DIR`: its large files hashed from the first milliseconds of the process, while the
command tree (click, the command modules) loads.

__main__.py calls `begin(argv)` before it loads anything else. Only a plain `mm verify DIR` (with at most --json and
--strict, which change nothing that is hashed) starts one; any other command line starts nothing. The head start
only produces digests: each file's blake3 with the identity (device, inode, size, mtime, ctime) of the file it read.
verify_dir takes it (`claim`) only when asked for exactly what was started (HeadStartKey: the resolved directory and
manifest and the thread count); anything else stops it and verify runs as without. verify uses a digest only for a
file whose identity is still the same when verify comes to it, and judges it as it judges its own; a file the head
start skipped (a symlink, not the manifest's size, a read that failed) or whose identity changed is hashed by verify
itself, so every problem, line and exit code is verify's own.

While the tree loads, the head start hashes on every core but one, the tree's (a third thread on two cores would
only trade places with the tree's, and take the GIL from it at every window); once verify waits for it (`join`), on
all. One core: no head start. Same bounds as verify's own hashing: the same schedule (hash_schedule) and window budget
(window_size), never both at once (verify waits for the head start, or stops it, before it hashes), only files of BIG_FILE and more (so its table
of digests stays small whatever the number of files), under a shared read lock taken before the first byte (no mm
writer can change the directory between the head start and verify, which takes its own). Its threads are daemons and
stop between two windows when told: verify stops it on its way out, whatever ends it (Ctrl-C too, raised where verify
waits for it), and __main__ stops one that no verify claimed.
"""
from __future__ import annotations

import os
import stat
import threading
import time
from collections import namedtuple

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing: see below
if TYPE_CHECKING:
    from ..edges.progress import ProgressSink

# Every module imported here delays the first byte: this one and reading.py import only what json brings anyway
# (os, re, collections); the manifest is read with json alone (verify reads it again, as it always does, and judges).

# The options of `mm verify` that change nothing that is hashed: a command line with others starts no head start.
NEUTRAL_OPTIONS = frozenset({"--json", "--strict"})
# A larger manifest starts no head start (mm's own margin: a model of a few thousand files takes ~1 MB; reading a
# manifest twice costs more than a head start saves where it is most of the model, with the files small).
MAX_MANIFEST = 4 * 1024 * 1024
SWITCH_INTERVAL = 0.0002  # seconds (mm's own margin, see begin): a hashing thread waits at most this for the GIL


def file_id(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells one content of a file from another without reading it: a rewrite changes mtime or ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class HeadStartKey(namedtuple("HeadStartKey", "model_dir manifest_file jobs")):
    """What a head start hashed for: the real paths (str) of the directory and the manifest, and the threads (int)."""

    __slots__ = ()

    @classmethod
    def of(cls, model_dir: os.PathLike | str, manifest_file: os.PathLike | str, jobs: int) -> HeadStartKey:
        return cls(os.path.realpath(model_dir), os.path.realpath(manifest_file), jobs)


class EarlyDigest(namedtuple("EarlyDigest", "blake3 identity")):
    """A file's blake3 (hex str) and the identity (file_id) of the file read, taken before its first byte and
    unchanged after its last."""

    __slots__ = ()


class _File:
    """A file to hash as hash_schedule sees it (verify.Expected, which is a dataclass: dataclasses costs ~10 ms)."""

    __slots__ = ("path", "size", "algorithm")

    def __init__(self, path: str, size: int):
        self.path, self.size, self.algorithm = path, size, "blake3"


class _Stopped(Exception):
    pass


class HeadStart:
    """The large blake3 files of one manifest, hashed in daemon threads; `join` hands the digests to verify."""

    def __init__(self, key: HeadStartKey, files: list[_File], lock_fd: int):
        self.key = key
        self.started = time.perf_counter()
        self._files = files
        self._lock_fd = lock_fd  # holds the directory's read lock (shared flock), given back by stop()
        self._digests: dict[str, EarlyDigest] = {}
        self._stop = threading.Event()
        self._done = threading.Event()
        self._opened = threading.Event()  # its first file is open (or it has ended)
        self._claimed = threading.Event()  # verify waits for it: the core the tree loaded on is the head start's too
        self._lock = threading.Lock()  # guards the progress hand-over below
        self._sink: ProgressSink | None = None
        self._unreported = 0  # bytes hashed before verify's progress sink was handed over
        self._in_flight: set[str] = set()
        self._interval: float | None = None  # the switch interval to restore (begin shortened it)
        self._thread = threading.Thread(target=self._run, name="mm-head-start", daemon=True)
        self._thread.start()

    # --- verify's side

    def join(self, progress: ProgressSink) -> dict[str, EarlyDigest]:
        """Report to PROGRESS from now on (with what was hashed so far), wait for the last file, and give the
        digests (path -> EarlyDigest) of the files hashed in full. Interruptible (Ctrl-C raises here)."""
        self._restore_interval()
        self._claimed.set()
        with self._lock:
            self._sink = progress
            for name in sorted(self._in_flight):
                progress.item(name)
            if self._unreported:
                progress.advance(self._unreported)
                self._unreported = 0
        while not self._done.wait(0.05):
            pass
        return dict(self._digests)

    @property
    def running(self) -> bool:
        """Still hashing (or holding its threads)."""
        return self._thread.is_alive()

    def wait(self) -> None:
        """Until the last file is hashed (or the head start stopped), on all cores: the caller's is free."""
        self._claimed.set()
        self._thread.join()

    def stop(self) -> None:
        """Stop hashing (within a window per thread), wait for the threads, and give the read lock back."""
        self._restore_interval()
        self._stop.set()
        self._claimed.set()
        self._thread.join()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _restore_interval(self) -> None:
        if self._interval is not None:
            import sys
            sys.setswitchinterval(self._interval)
            self._interval = None

    # --- the threads

    def _stopped(self) -> bool:
        return self._stop.is_set()

    def _advance(self, n: int) -> None:
        with self._lock:
            if self._sink is not None:
                self._sink.advance(n)
            else:
                self._unreported += n

    def _item(self, name: str, begins: bool) -> None:
        with self._lock:
            (self._in_flight.add if begins else self._in_flight.discard)(name)
            if self._sink is not None:
                (self._sink.item if begins else self._sink.item_done)(name)

    def _run(self) -> None:
        from blake3 import blake3

        from .reading import hash_schedule, window_size
        try:
            jobs = self.key.jobs
            per_core, one_at_a_time = hash_schedule(self._files, jobs)
            window = window_size(jobs)
            todo = iter(per_core)
            take = threading.Lock()

            def worker(spare: bool) -> None:
                if spare:
                    self._claimed.wait()
                while not self._stopped():
                    with take:
                        exp = next(todo, None)
                    if exp is None:
                        return
                    self._hash(exp, 1, window)

            count = min(jobs, len(per_core))  # the last waits for the core the tree loads on (see begin)
            threads = [threading.Thread(target=worker, args=(i == jobs - 1,), name="mm-head-start", daemon=True)
                       for i in range(count)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            threads_for_one = blake3.AUTO if jobs == usable_cores() else jobs
            for exp in one_at_a_time:
                if self._stopped():
                    break
                self._hash(exp, threads_for_one if self._claimed.is_set() else jobs - 1, window_size(1))
        finally:
            self._opened.set()
            self._done.set()

    def _hash(self, exp: _File, threads: int, window: int) -> None:
        """EXP's digest into the table, or nothing when it is not what verify would hash (a symlink on the way, not
        a regular file of the manifest's size), fails to read, or the head start is stopped: verify reads it."""
        from blake3 import blake3

        from .reading import fd_windows
        path = os.path.join(self.key.model_dir, exp.path)
        if not path.startswith(self.key.model_dir + os.sep) or os.path.realpath(path) != path:
            return  # a link on the way (verify judges where it leads), or a path verify refuses
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        self._opened.set()
        self._item(exp.path, True)
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode) or before.st_size != exp.size:
                return
            h = blake3(max_threads=threads)
            for piece in fd_windows(fd, path, window, self._advance):
                if self._stopped():
                    raise _Stopped
                h.update(piece)
            if file_id(os.fstat(fd)) == file_id(before):
                self._digests[exp.path] = EarlyDigest(h.hexdigest(), file_id(before))
        except Exception:  # (the read's own error, or _Stopped): verify reads the file itself and says why
            return
        finally:
            os.close(fd)
            self._item(exp.path, False)


_started: HeadStart | None = None


def usable_cores() -> int:
    """interrupt.usable_cores, which verify asks (that module imports ~10 ms of what the first byte does not need)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def begin(argv: list[str]) -> None:
    """Start hashing for ARGV (the console script's arguments) when it is a plain `verify DIR`; else nothing. Never
    raises: anything in the way (no manifest, a bad one, a writer holding the lock) leaves it to verify to say."""
    global _started
    if _started is not None or not argv or argv[0] != "verify" or "_MM_COMPLETE" in os.environ:
        return
    given = [a for a in argv[1:] if a not in NEUTRAL_OPTIONS]
    if len(given) != 1 or not given[0] or given[0].startswith("-"):
        return
    directory = given[0]
    lock_fd = -1
    try:
        import fcntl
        import json

        state = os.path.join(directory, ".mm")  # paths.manifest_path, but for a Hugging Face cache snapshot's
        manifest_file = os.path.join(state, "manifest.json")  # (whose key then differs: discarded)
        # the lock verify shares (fsutil.read_lock); none there yet: verify makes it, and no head start
        lock_fd = os.open(os.path.join(state, "lock"), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fd = os.open(manifest_file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST:
                raise ValueError("not a manifest for a head start")
            data = os.read(fd, MAX_MANIFEST + 1)
        finally:
            os.close(fd)
        import blake3  # noqa: F401 (loaded here, before the threads: they start on a file at once)

        from .reading import BIG_FILE
        files = [_File(f["path"], f["size"]) for f in json.loads(data)["files"]
                 if isinstance(f, dict) and isinstance(f.get("path"), str) and type(f.get("size")) is int
                 and f["size"] >= BIG_FILE and isinstance(f.get("blake3"), str)]
        if files and usable_cores() > 1:  # one core: the tree would only wait for its turn on it
            import sys
            _started = HeadStart(HeadStartKey.of(directory, manifest_file, usable_cores()), files, lock_fd)
            # While the tree loads, this thread holds the GIL for long stretches, and a hashing thread that wants it
            # back (after each window's blake3, each probe and madvise) waits up to the switch interval (5 ms: about
            # a 32 MiB window's hashing); handed over sooner until verify takes the head start (or stops it).
            _started._interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL)
            # the first file open before this thread goes on to load the tree (a millisecond: the GIL would
            # otherwise keep the threads waiting behind the imports' first stretch)
            _started._opened.wait(0.1)
            return
    except Exception:  # whatever it is, verify meets it again and says so
        pass
    if lock_fd >= 0:
        os.close(lock_fd)


def current() -> HeadStart | None:
    """The head start begun and not claimed yet, if any."""
    return _started


def claim(key: HeadStartKey) -> HeadStart | None:
    """The head start begun for exactly KEY, now the caller's (who must stop() it); any other is stopped."""
    global _started
    head, _started = _started, None
    if head is not None and head.key != key:
        head.stop()
        return None
    return head


def discard() -> None:
    """Stop a head start nobody claimed (the command ended before its verify, or was no verify)."""
    global _started
    head, _started = _started, None
    if head is not None:
        head.stop()
