"""How long-running library calls report progress (sizes, rates and durations written as units.py writes them).

Library calls report through a ProgressSink: cli.py passes terminal_progress(console) on a TTY and NULL_PROGRESS
otherwise (and always with --json). A *phase* is begin() .. end(): while it runs, one live bar (percent, bytes,
rate, elapsed, ETA and the current file, as restic shows them); at end() the bar goes and one summary line
stays ("bundle X: 14 files, 628.9 MB in 1.5 s (419.3 MB/s)"). A begin() while a phase runs relabels it, so a
command never shows two bars, and no finished bar stays on screen.
Sinks must be thread-safe: workers call advance() and item() concurrently.
"""
from __future__ import annotations

import re
import threading
import time
from typing import TYPE_CHECKING, Protocol

from ..units import human_bytes, human_duration, human_rate

if TYPE_CHECKING:
    from rich.console import Console

def clock(seconds: float | None) -> str:
    """A bar's elapsed time or ETA: 'H:MM:SS', '-:--:--' when not known yet."""
    if seconds is None:
        return "-:--:--"
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def phase_summary(label: str, nbytes: int, seconds: float, files: int | None = None) -> str:
    """The line a finished phase leaves: 'verify: 14 files, 628.9 MB in 1.5 s (419.3 MB/s)'."""
    counted = f"{files} file{'' if files == 1 else 's'}, " if files else ""
    rate = f" ({human_rate(nbytes / seconds)})" if seconds >= 0.05 and nbytes else ""
    return f"{label}: {counted}{human_bytes(nbytes)} in {human_duration(seconds)}{rate}"


class ProgressSink(Protocol):
    def begin(self, total_bytes: int, label: str, files: int | None = None) -> None:
        """Start a phase of TOTAL_BYTES (FILES files, when known); while one runs: relabel it."""

    def advance(self, nbytes: int) -> None: ...

    def item(self, name: str) -> None:
        """The file (or volume) being worked on now, shown at the end of the bar."""

    def note(self, message: str) -> None: ...

    def end(self) -> None:
        """End the phase: the bar goes, its summary line stays."""


class _NullProgress:
    def begin(self, total_bytes: int, label: str, files: int | None = None) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def item(self, name: str) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass


NULL_PROGRESS: ProgressSink = _NullProgress()

ITEM_WIDTH = 100  # characters of the current file's name kept (its end: the file name itself); the line crops more


def _crop(name: str, width: int = ITEM_WIDTH) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


class TerminalProgress:
    """A ProgressSink drawing one live bar on CONSOLE (a terminal) with rich, one phase at a time."""

    def __init__(self, console: Console):
        self._console = console
        self._lock = threading.Lock()
        self._live = None  # (rich Progress, task id) while a phase runs
        self._label = ""
        self._files: int | None = None
        self._items: set[str] = set()
        self._started = 0.0

    def begin(self, total_bytes: int, label: str, files: int | None = None) -> None:
        with self._lock:
            self._label, self._files = label, files if files is not None else self._files
            if self._live is not None:
                progress, task = self._live
                progress.update(task, total=max(total_bytes, 0), description=label)
                return
            self._items, self._started = set(), time.monotonic()
            progress = _rich_progress(self._console)
            task = progress.add_task(label, total=max(total_bytes, 0), item="")
            progress.start()
            self._live = (progress, task)
            _LIVE.add(self)

    def advance(self, nbytes: int) -> None:
        live = self._live
        if live is not None:
            live[0].advance(live[1], nbytes)

    def item(self, name: str) -> None:
        live = self._live
        if live is not None:
            with self._lock:
                self._items.add(name)
            live[0].update(live[1], item=_crop(name))

    def note(self, message: str) -> None:
        self._console.print(message, markup=False, highlight=False, soft_wrap=True)

    def end(self) -> None:
        self._stop(summary=True)

    def _stop(self, summary: bool) -> None:
        with self._lock:
            if self._live is None:
                return
            progress, _ = self._live
            self._live = None
            _LIVE.discard(self)
            done = int(progress.tasks[0].completed)
            progress.stop()  # transient: the bar leaves the screen
            files = self._files if self._files is not None else (len(self._items) or None)
            self._files = None
            if summary:
                # a label counting files ("fetch X 3/14 files") drops the count: the summary says it
                label = re.sub(r" \d+/\d+ files$", "", self._label) if files else self._label
                self._console.print(phase_summary(label, done, time.monotonic() - self._started, files),
                                    markup=False, highlight=False, soft_wrap=True)


_LIVE: set[TerminalProgress] = set()  # sinks with a phase running


def abandon_live() -> None:
    """Take every running bar off the screen without a summary (the command failed: its error line follows)."""
    for sink in list(_LIVE):
        sink._stop(summary=False)


def terminal_progress(console: Console) -> ProgressSink:
    return TerminalProgress(console)


BAR_WIDTH = 20
BAR_MIN = 8  # a narrower bar says nothing: it goes, and the label takes its room
LABEL_MIN = 12  # a label is cut to this before the bar narrows


def figures(completed: float, total: float, speed: float | None, elapsed: float | None, eta: float | None) -> str:
    """'30%  40.0 MB / 133.9 MB  68.6 MB/s  0:00:01 ETA 0:00:02': never more than 100% of the total."""
    done = min(completed, total) if total else completed
    percent = 100 * done / total if total else 100.0
    rate = human_rate(speed) if speed else "? B/s"
    return (f"{percent:3.0f}%  {human_bytes(done):>8} / {human_bytes(total)}  {rate:>10}  {clock(elapsed)} "
            f"ETA {clock(eta if speed else None)}")


def _rich_progress(console: Console):
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
                text = figures(task.completed, task.total or 0, task.finished_speed or task.speed, task.elapsed,
                               task.time_remaining)
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

    return OneBar(console=console, transient=True)
