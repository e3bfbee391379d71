"""How long-running library calls report progress (sizes, rates and durations written as units.py writes them).

Library calls report through a ProgressSink: commands pass terminal_progress(console) on a TTY; when stderr is not a
terminal, periodic_progress() writes one plain line every MM_PROGRESS_INTERVAL seconds (a log under nohup, systemd
or CI), and with --json a status event per interval, one JSON object a line on stderr (restic's --json status
lines are the model); the one JSON document stays on stdout. A *phase* is begin() .. end(): while it runs, one live bar (percent, bytes,
rate, elapsed, ETA and the current file, as restic shows them); at end() the bar goes and one summary line
stays ("bundle X: 14 files, 628.9 MB in 1.5 s (419.3 MB/s)"). A begin() while a phase runs relabels it, so a
command never shows two bars, and no finished bar stays on screen.
Sinks must be thread-safe: workers call advance() and item() concurrently.
"""
from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from ..units import human_bytes, human_duration, human_rate
from .interrupt import requested as interrupt_requested

if TYPE_CHECKING:
    from rich.console import Console

def clock(seconds: float | None) -> str:
    """A bar's elapsed time or ETA: 'H:MM:SS', '-:--:--' when not known yet."""
    if seconds is None:
        return "-:--:--"
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def phase_summary(label: str, nbytes: int, seconds: float, files: int | None = None, unit: str = "file") -> str:
    """The line a finished phase leaves: 'verify: 14 files, 628.9 MB in 1.5 s (419.3 MB/s)'; UNIT names what FILES
    counts where it is not files (preheat's blobs, each warmed at every tier)."""
    counted = f"{files} {unit}{'' if files == 1 else 's'}, " if files else ""
    rate = f" ({human_rate(nbytes / seconds)})" if seconds >= 0.05 and nbytes else ""
    return f"{label}: {counted}{human_bytes(nbytes)} in {human_duration(seconds)}{rate}"


class ProgressSink(Protocol):
    def begin(self, total_bytes: int, label: str, files: int | None = None, unit: str = "file") -> None:
        """Start a phase of TOTAL_BYTES (FILES files, or FILES of UNIT, when known); while one runs: relabel it."""

    def advance(self, nbytes: int) -> None: ...

    def item(self, name: str) -> None:
        """Work on the file (or volume) NAME begins: shown under the bar while it is in flight."""

    def item_done(self, name: str) -> None:
        """Work on NAME is over. Callers working on several files at once say so, so that the line shows what is
        in flight (a sequential caller need not: its next item() supersedes the last)."""

    def note(self, message: str) -> None: ...

    def end(self) -> None:
        """End the phase: the bar goes, its summary line stays (not when Ctrl-C or SIGTERM cut it short: the
        phase did not finish, and the interruption's own line says what is kept)."""


class _NullProgress:
    def begin(self, total_bytes: int, label: str, files: int | None = None, unit: str = "file") -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def item(self, name: str) -> None:
        pass

    def item_done(self, name: str) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass


NULL_PROGRESS: ProgressSink = _NullProgress()


@contextmanager
def working_on(progress: ProgressSink, name: str) -> Iterator[None]:
    """item(NAME) .. item_done(NAME) around the work on one of several files in flight at once."""
    progress.item(name)
    try:
        yield
    finally:
        progress.item_done(name)

ITEM_WIDTH = 100  # characters of the current file's name kept (its end: the file name itself); the line crops more


def _crop(name: str, width: int = ITEM_WIDTH) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


class InFlight:
    """The files a phase works on now: begun (item) and not yet over (item_done), in the order they began. The line
    names the newest still in flight, and how many others are, once the caller says when files are over; a caller
    that never does works on one at a time, and its newest is its current file. Not thread-safe: the sinks lock."""

    def __init__(self):
        self.open: dict[str, None] = {}  # in the order they began
        self.seen: set[str] = set()
        self.closing = False  # the caller reports item_done: the open files are truly in flight

    def begin(self, name: str) -> None:
        self.seen.add(name)
        self.open.pop(name, None)
        self.open[name] = None

    def done(self, name: str) -> None:
        self.closing = True
        self.open.pop(name, None)

    @property
    def current(self) -> list[str]:
        """The files in flight, the newest last (a caller that never says item_done: its newest alone)."""
        names = list(self.open)
        return names if self.closing else names[-1:]

    def line(self) -> str:
        """'model-00002.safetensors', or 'model-00004.safetensors (+3 more in flight)', or '' when none."""
        names = self.current
        if not names:
            return ""
        more = f" (+{len(names) - 1} more in flight)" if len(names) > 1 else ""
        return _crop(names[-1], ITEM_WIDTH - len(more)) + more

    @property
    def finished(self) -> int:
        """Files begun and over (one at a time: those begun before the current one)."""
        return len(self.seen) - len(self.open) if self.closing else max(len(self.seen) - 1, 0)


class TerminalProgress:
    """A ProgressSink drawing one live bar on CONSOLE (a terminal) with rich, one phase at a time."""

    def __init__(self, console: Console, clock: Callable[[], float] = time.monotonic):
        self._console = console
        self._clock = clock  # rich's too: elapsed, rate and ETA (tests inject one)
        self._lock = threading.Lock()
        self._live = None  # (rich Progress, task id) while a phase runs
        self._label = ""
        self._files: int | None = None
        self._unit = "file"
        self._items = InFlight()
        self._started = 0.0

    def begin(self, total_bytes: int, label: str, files: int | None = None, unit: str = "file") -> None:
        with self._lock:
            self._label, self._files = label, files if files is not None else self._files
            self._unit = unit
            if self._live is not None:
                progress, task = self._live
                progress.update(task, total=max(total_bytes, 0), description=label)
                return
            self._items, self._started = InFlight(), self._clock()
            progress = _rich_progress(self._console, self._clock)
            task = progress.add_task(label, total=max(total_bytes, 0), item="")
            progress.start()
            self._live = (progress, task)
            _LIVE.add(self)

    def advance(self, nbytes: int) -> None:
        live = self._live
        if live is not None:
            live[0].advance(live[1], nbytes)

    def item(self, name: str) -> None:
        self._item(lambda items: items.begin(name))

    def item_done(self, name: str) -> None:
        self._item(lambda items: items.done(name))

    def _item(self, change: Callable[[InFlight], None]) -> None:
        live = self._live
        if live is not None:
            with self._lock:
                change(self._items)
                line = self._items.line()
            live[0].update(live[1], item=line)

    def note(self, message: str) -> None:
        self._console.print(message, markup=False, highlight=False, soft_wrap=True)

    def end(self) -> None:
        self._stop(summary=not interrupt_requested())

    def _stop(self, summary: bool) -> None:
        with self._lock:
            if self._live is None:
                return
            progress, _ = self._live
            self._live = None
            _LIVE.discard(self)
            done = int(progress.tasks[0].completed)
            progress.stop()  # transient: the bar leaves the screen
            files = self._files if self._files is not None else (len(self._items.seen) or None)
            self._files = None
            if summary:
                # a label counting files ("fetch X 3/14 files") drops the count: the summary says it
                label = _FILES_IN_LABEL.sub("", self._label) if files else self._label
                self._console.print(phase_summary(label, done, self._clock() - self._started, files, self._unit),
                                    markup=False, highlight=False, soft_wrap=True)


_LIVE: set = set()  # sinks with a phase running (each has _stop(summary))


def abandon_live() -> None:
    """Take every running bar off the screen without a summary (the command failed: its error line follows)."""
    for sink in list(_LIVE):
        sink._stop(summary=False)


def terminal_progress(console: Console) -> ProgressSink:
    return TerminalProgress(console)


BAR_WIDTH = 20
BAR_MIN = 8  # a narrower bar says nothing: it goes, and the label takes its room
LABEL_MIN = 12  # a label is cut to this before the bar narrows


# mm's own margin: a rate measured over the first second (connection and TLS set-up, TCP slow start, a first file
# hashed before any byte moves) says "27 hours" for a fetch that takes twenty minutes. The ETA waits until the
# phase has run ETA_MIN_SECONDS and moved ETA_MIN_BYTES (or a tenth of a smaller total); "-:--:--" until then.
ETA_MIN_SECONDS = 5.0
ETA_MIN_BYTES = 10_000_000


def eta(done: float, total: float, rate: float | None, elapsed: float | None) -> float | None:
    """Seconds left at RATE, or None while the rate is not measured over enough time and bytes (above)."""
    if not total or not rate or elapsed is None or elapsed < ETA_MIN_SECONDS or done < min(ETA_MIN_BYTES, total / 10):
        return None
    return max(total - done, 0) / rate


def figures(completed: float, total: float, speed: float | None, elapsed: float | None, eta: float | None) -> str:
    """'30%  40.0 MB / 133.9 MB  68.6 MB/s  0:00:01 ETA 0:00:02': never more than 100% of the total."""
    done = min(completed, total) if total else completed
    percent = 100 * done / total if total else 100.0
    rate = human_rate(speed) if speed else "? B/s"
    return (f"{percent:3.0f}%  {human_bytes(done):>8} / {human_bytes(total)}  {rate:>10}  {clock(elapsed)} "
            f"ETA {clock(eta if speed else None)}")


def _rich_progress(console: Console, clock: Callable[[], float] = time.monotonic):
    # Imported here: only a terminal needs rich's progress, and it costs start-up time for every command.
    from rich.progress import Progress
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    class OneBar(Progress):
        """Label, bar and figures on one line, fitted to the terminal (the label is cut first, then the bar; the
        figures stay whole), then the current file on a line of its own (as restic shows it)."""

        def get_renderables(self):
            for task in self.tasks:
                speed = task.finished_speed or task.speed
                text = figures(task.completed, task.total or 0, speed, task.elapsed,
                               eta(task.completed, task.total or 0, speed, task.elapsed))
                room = self.console.width - len(text) - 1
                whole = len(task.description)
                label = min(whole, max(room - BAR_WIDTH - 1, min(whole, LABEL_MIN)))
                bar = min(BAR_WIDTH, room - label - 1)
                if bar < BAR_MIN:
                    bar, label = 0, max(0, min(whole, room))
                line = Table.grid(padding=(0, 1))
                if label:
                    line.add_column(width=label, no_wrap=True, overflow="ellipsis")
                if bar:
                    line.add_column(width=bar)
                line.add_column(no_wrap=True)
                cells = ([task.description] if label else []) + \
                    ([ProgressBar(total=max(task.total or 0, 1), completed=min(task.completed, task.total or 0),
                                  width=bar)] if bar else []) + [text]
                line.add_row(*cells)
                yield line
                if task.fields.get("item"):
                    yield Text(f"  {task.fields['item']}", style="dim", no_wrap=True, overflow="ellipsis")

    return OneBar(console=console, transient=True, get_time=clock)


# mm's own margin: often enough that a log shows a long fetch moving, rare enough that an hour is ~360 lines.
PROGRESS_INTERVAL = 10.0
INTERVAL_ENV = "MM_PROGRESS_INTERVAL"


def progress_interval(environ: dict[str, str]) -> float:
    """Seconds between two progress lines: MM_PROGRESS_INTERVAL (a positive number), else PROGRESS_INTERVAL."""
    from ..errors import BadValue

    text = environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return PROGRESS_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 86400:
        raise BadValue(f"{INTERVAL_ENV}={text!r} is not a number of seconds between 0 and 86400 "
                         f"(unset it for the default, {PROGRESS_INTERVAL:g})")
    return seconds


class PeriodicProgress:
    """A ProgressSink for a stderr that is not a terminal: every INTERVAL seconds of a phase, one complete line
    (plain text, or with as_json one status event) through WRITE; never a line that grows or redraws.
    A phase shorter than the interval writes nothing; one that wrote lines ends with its summary line
    (plain) or a last status event with "done": true (JSON)."""

    def __init__(self, write, interval: float, as_json: bool = False, clock: Callable[[], float] = time.monotonic):
        self._write, self._interval, self._json, self._clock = write, interval, as_json, clock
        self._lock = threading.Lock()
        self._label, self._total, self._done = "", 0, 0
        self._files: int | None = None
        self._unit = "file"
        self._items = InFlight()
        self._started = 0.0
        self._wrote = False
        self._stopped: threading.Event | None = None

    def begin(self, total_bytes: int, label: str, files: int | None = None, unit: str = "file") -> None:
        with self._lock:
            self._label, self._total = label, max(total_bytes, 0)
            self._files, self._unit = files if files is not None else self._files, unit
            if self._stopped is not None:
                return
            self._done, self._items, self._wrote = 0, InFlight(), False
            self._started = self._clock()
            self._stopped = threading.Event()
            _LIVE.add(self)
        threading.Thread(target=self._tick, args=(self._stopped,), daemon=True, name="mm-progress").start()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes

    def item(self, name: str) -> None:
        with self._lock:
            self._items.begin(name)

    def item_done(self, name: str) -> None:
        with self._lock:
            self._items.done(name)

    def note(self, message: str) -> None:
        pass  # notes are for a watcher at a terminal; the command's report says what matters

    def end(self) -> None:
        self._stop(summary=not interrupt_requested())

    def _tick(self, stopped: threading.Event) -> None:
        while not stopped.wait(self._interval):
            with self._lock:
                if stopped.is_set():
                    return
                line = self.status(final=False)
                self._wrote = True
            self._emit(line)

    def _emit(self, line: str) -> None:
        try:
            self._write(line)
        except Exception:  # a log that cannot be written must not stop the work it reports on
            pass

    def _stop(self, summary: bool) -> None:
        with self._lock:
            stopped, self._stopped = self._stopped, None
            if stopped is None:
                return
            stopped.set()
            _LIVE.discard(self)
            line = self.status(final=True) if summary and self._wrote else None
            self._files = None
        if line is not None:
            self._emit(line)

    def status(self, final: bool = False) -> str:
        """The line (or JSON status event) an interval writes now; FINAL: the phase's summary (or last event)."""
        elapsed = self._clock() - self._started
        done = min(self._done, self._total) if self._total else self._done
        rate = done / elapsed if elapsed > 0 else 0.0
        left = eta(done, self._total, rate, elapsed)
        total_files = self._files if self._files is not None else (len(self._items.seen) or None)
        counted = _FILES_IN_LABEL.search(self._label)  # a phase counting files itself ("fetch X 3/14 files")
        label = _FILES_IN_LABEL.sub("", self._label)
        if counted:
            files_done, total_files = int(counted[1]), int(counted[2])
        else:  # files begun and over (one at a time: those before the current one)
            files_done = self._items.finished
        if final:
            files_done = total_files
        current = [] if final else self._items.current
        if self._json:
            import json

            event = {"message_type": "status", "phase": label, "seconds_elapsed": round(elapsed, 1),
                     "seconds_remaining": None if left is None else round(left), "percent_done":
                     round(done / self._total, 4) if self._total else (1.0 if final else 0.0),
                     "total_bytes": self._total, "bytes_done": done, "bytes_per_second": round(rate),
                     "total_files": total_files, "files_done": files_done,
                     "current_files": current}
            if final:
                event["done"] = True
            return json.dumps(event)
        if final:
            return phase_summary(label, done, elapsed, total_files, self._unit)
        counted = f"  {files_done}/{total_files} {self._unit}s" if total_files else ""
        now = f"  {self._items.line()}" if current else ""
        return f"{label}: {figures(done, self._total, rate, elapsed, left)}{counted}{now}"


_FILES_IN_LABEL = re.compile(r" (\d+)/(\d+) files$")


def periodic_progress(write, environ: dict[str, str], as_json: bool = False) -> ProgressSink:
    return PeriodicProgress(write, progress_interval(environ), as_json=as_json)
