"""Ctrl-C and SIGTERM: every worker stops within a second, the work done so far is kept, like kill -9 keeps it.

One process-wide stop flag (`STOP`), set when SIGINT or SIGTERM arrives (`install`, called by the CLI):
  - the main thread gets `Interrupted` (a KeyboardInterrupt) raised where it is, and unwinds to the CLI;
  - workers check `requested()` between chunks and sleep with `STOP.wait()`, so they return within one chunk
    (the ranged engine lands its last batch and saves its range map on the way out);
  - tools mm runs (`tools.py`) are in their own process group, killed at once (`on_stop`); a tool is started and
    registered for that as one step (`starting_child`), so a signal landing in between cannot leave it running;
  - a watcher thread, woken by the signal itself (`signal.set_wakeup_fd`: even while the main thread sits in a
    system call), ends the process after GRACE seconds whatever is still running, and a second signal ends it
    at once. What is on disk then is what kill -9 leaves, which every engine resumes from (partial files and
    range maps, the journal, published volumes).
The CLI prints what is kept and the command that resumes (`kept_work`), and exits 128 + the signal number
(130 for SIGINT, 143 for SIGTERM). Nothing here cleans up: cleanup paths must not delete resumable work.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

STOP = threading.Event()
GRACE = 0.7  # seconds the workers get to land their last batch before the process ends regardless
# seconds the end waits for a child being started to be registered (mm's own margin: a fork and exec takes
# milliseconds even on a loaded host; past it the process ends anyway)
STARTING_WAIT = 2.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)

_signum = signal.SIGINT
_callbacks: dict[int, Callable[[], None]] = {}
_callbacks_lock = threading.RLock()  # re-entered by the signal handler when it interrupts on_stop
_ending = threading.Lock()  # held by whoever ends the process (the CLI after unwinding, or the watcher)
_finisher: Callable[["Interrupted"], None] | None = None
_working: list[Path] = []  # where the running command keeps resumable work (`keeps`)
_starting = threading.Condition()  # guards _children_starting; notified when a start is over
_children_starting = 0  # children being started in any thread and not yet registered with on_stop
_main_defers = 0  # the main thread is inside starting_child: its Interrupted waits for the block's end
_owed = False  # a signal came while the main thread deferred: the block's end raises its Interrupted


class Interrupted(KeyboardInterrupt):
    """The user (SIGINT) or the system (SIGTERM) asked mm to stop. A KeyboardInterrupt, so that no `except
    Exception` (nor `except MMError`) turns it into a reported failure on the way out."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def requested() -> bool:
    return STOP.is_set()


def current() -> Interrupted:
    return Interrupted(_signum)


def check() -> None:
    """Raise Interrupted once a stop was requested (a worker's check between chunks)."""
    if STOP.is_set():
        raise Interrupted(_signum)


def on_stop(callback: Callable[[], None]) -> Callable[[], None]:
    """Call CALLBACK (quick, non-blocking: e.g. kill a child's process group) when a stop is requested, or at once
    if it already was. Returns the function that unregisters it."""
    key = id(callback)
    with _callbacks_lock:
        _callbacks[key] = callback
    if STOP.is_set():
        _run(callback)

    def remove() -> None:
        with _callbacks_lock:
            _callbacks.pop(key, None)
    return remove


@contextmanager
def starting_child() -> Iterator[None]:
    """Start a child process and register its kill with on_stop inside this block, as one step. Between fork and
    registration the child is mm's but nothing would kill it: so a signal landing in the block is acted on only
    when it ends (in the main thread, Interrupted is raised there, not inside Popen), and the process does not end
    while any thread is in such a block (`end` waits for it). Once a stop was requested no child is started."""
    global _children_starting, _main_defers, _owed
    main = threading.current_thread() is threading.main_thread()
    if main:
        _main_defers += 1  # first: from here on the main thread's Interrupted waits for the end of the block
    counted = False
    try:
        with _starting:
            _children_starting += 1
            counted = True
        check()
        yield
    finally:
        if counted:
            with _starting:
                _children_starting -= 1
                _starting.notify_all()
        if main:
            _main_defers -= 1
            if not _main_defers and _owed:
                _owed = False
                raise Interrupted(_signum)


def _run(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # a child already gone; nothing else to do on the way out
        pass


def keeps(directory: Path) -> None:
    """The running command keeps resumable work under DIRECTORY (an engine says so when it starts writing there):
    an interrupt describes what lies there (`kept_work`) and prints the command that resumes."""
    from pathlib import Path  # here: the CLI installs this module before `--help`, which needs no pathlib

    directory = Path(directory)
    if directory not in _working:
        _working.append(directory)


def working_dirs() -> list[Path]:
    return list(_working)


def request(signum: int) -> None:
    """Stop: set the flag (once) and run the stop callbacks."""
    global _signum
    with _callbacks_lock:
        if STOP.is_set():
            return
        _signum = signum
        STOP.set()
        callbacks = list(_callbacks.values())
    for callback in callbacks:
        _run(callback)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset), not the machine's
    count, which os.cpu_count gives before Python 3.13. A thread per core beyond them only waits its turn."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextmanager
def worker_pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A ThreadPoolExecutor that, when left by an interrupt, starts no queued work: the running workers see the
    stop flag and return within a chunk (a plain `with ThreadPoolExecutor` would run every queued item first)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        yield pool
    except BaseException as e:
        pool.shutdown(wait=True, cancel_futures=isinstance(e, KeyboardInterrupt) or STOP.is_set())
        raise
    pool.shutdown(wait=True)


# --- the signal side (the CLI calls install once, from the main thread) ------------------------------------

def install(finisher: Callable[[Interrupted], None]) -> None:
    """Catch SIGINT and SIGTERM for the rest of the process. FINISHER(exc) prints what is kept; it is called once,
    by `end` (the CLI, after unwinding) or by the watcher when GRACE ran out, and must not block."""
    global _finisher
    _finisher = finisher
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in SIGNALS:
        signal.signal(signum, _raise_in_main_thread)
    threading.Thread(target=_watch, args=(read_fd,), name="mm-interrupt", daemon=True).start()


_raised = threading.Event()  # the main thread got its Interrupted (the watcher may have set STOP before)


def _raise_in_main_thread(signum: int, frame) -> None:
    global _owed
    request(signum)
    if not _raised.is_set():
        _raised.set()
        if _main_defers:  # starting a child: raised when that block ends (starting_child)
            _owed = True
            return
        raise Interrupted(_signum)


def _watch(read_fd: int) -> None:
    """Woken by the signal's byte on the wakeup pipe (whatever the main thread is doing): stop, then end the
    process after GRACE, or at once on a second signal."""
    signum = _next_signal(read_fd, None)
    if signum is None:
        return
    request(signum)
    deadline = time.monotonic() + GRACE
    while (left := deadline - time.monotonic()) > 0 and _next_signal(read_fd, left) is None:
        pass
    if os.environ.get("MM_DEBUG") == "1":  # where each thread was when the process ends
        import faulthandler
        faulthandler.dump_traceback(all_threads=True)
    end(Interrupted(_signum))


def _next_signal(read_fd: int, timeout: float | None) -> int | None:
    """The next SIGINT/SIGTERM on the wakeup pipe; None when TIMEOUT passes first (or the pipe fails)."""
    while True:
        try:
            if not select.select([read_fd], [], [], timeout)[0]:
                return None
            data = os.read(read_fd, 64)
        except OSError:
            return None
        found = [s for s in data if s in SIGNALS]
        if found:
            return found[0]
        if timeout is not None:
            return None  # another signal's byte; the caller measures the time left


def end(exc: Interrupted, flush: bool = False) -> None:
    """Print what is kept (once) and end the process with EXC's exit code, without waiting for any thread: what
    is on disk is what kill -9 would leave, and every engine resumes from that. FLUSH (the main thread, after
    unwinding): flush what mm printed before, first; the watcher never flushes (a stream's lock may be held by
    the thread it interrupts)."""
    if flush:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    with _starting:  # a child being started is registered (and so killed) before the process ends
        _starting.wait_for(lambda: not _children_starting, timeout=STARTING_WAIT)
    _ending.acquire()  # never released: the one caller ends the process, any other waits for that
    try:
        if _finisher is not None:
            _finisher(exc)
        else:
            os.write(2, f"mm: interrupted by {exc.signal_name}\n".encode())
    finally:
        os._exit(exc.exit_code)


# --- what an interrupted command leaves -------------------------------------------------------------

def kept_work(directories: list[Path]) -> list[str]:
    """What resumable work lies in DIRECTORIES, one line per kind: partial downloads and their range maps, files
    already proven, unbundle state, push upload state, complete volumes. Read from disk, bounded (scandir only)."""
    from pathlib import Path

    from ..paths import MM_DIR
    from ..units import human_bytes

    lines: list[str] = []
    for d in dict.fromkeys(Path(p) for p in directories):
        state = d / MM_DIR
        for where, label in ((state / "partial", "partial download"), (state / "unbundle" / "partial", "partial file")):
            count, size = _partials(where)
            if count:
                lines.append(f"{count} {label}(s), {human_bytes(size)} on disk, in {where}")
        proven = _lines(state / "journal.jsonl")
        if proven:
            lines.append(f"{proven} file(s) proven this run ({state / 'journal.jsonl'})")
        imported = _done_volumes(state / "unbundle" / "state.json")
        if imported:
            lines.append(f"{imported} volume(s) imported ({state / 'unbundle' / 'state.json'})")
        uploads = sum(_entries(p, ".json") for p in _dirs(state / "oci-push"))
        if uploads:
            lines.append(f"upload state of {uploads} blob(s) in {state / 'oci-push'} (blobs the registry holds are "
                         f"skipped by the rerun)")
        volumes = [n for n in _names(d) if n.endswith(".tar") and (".vol" in n or ".par" in n) and "-of-" in n]
        if volumes:
            lines.append(f"{len(volumes)} complete volume file(s) in {d}")
    return lines


def _names(d: Path) -> list[str]:
    try:
        with os.scandir(d) as it:
            return [e.name for e in it]
    except OSError:
        return []


def _dirs(d: Path) -> list[Path]:
    from pathlib import Path

    try:
        with os.scandir(d) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _entries(d: Path, suffix: str) -> int:
    return sum(1 for n in _names(d) if n.endswith(suffix))


def _partials(d: Path) -> tuple[int, int]:
    count = size = 0
    try:
        with os.scandir(d) as it:
            for e in it:
                if e.name.endswith(".part") and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    count += 1
                    size += min(st.st_size, st.st_blocks * 512)  # a ranged partial is sparse: count what is there
    except OSError:
        pass
    return count, size


def _done_volumes(path: Path) -> int:
    """How many volumes unbundle's state records as imported (0 when it has none, or is not readable as such)."""
    from ..errors import BadInput
    from .untrusted import load_json

    try:
        if not path.is_file():  # (a FIFO planted there would never answer)
            return 0
        with open(path, "rb") as f:
            doc = load_json(f.read(16 << 20), str(path))
    except (OSError, BadInput):
        return 0
    done = doc.get("done_volumes") if isinstance(doc, dict) else None
    return len(done) if isinstance(done, list) else 0


def _lines(path: Path, limit: int = 1 << 20) -> int:
    try:
        if not path.is_file():
            return 0
        with open(path, "rb") as f:
            return f.read(limit).count(b"\n")
    except OSError:
        return 0
