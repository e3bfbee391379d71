"""mm command line: parse options, call artifacts/, render (rich on a terminal, or one JSON document).

Nothing else lives here: every capability is a plain function in artifacts/.
User errors (artifacts.errors.MMError) print one line `mm: <message>` on stderr and exit with the
error's code (see README.md, "Exit codes"); they never show a traceback.
"""
from __future__ import annotations

import functools
import json
import sys
import threading
from dataclasses import asdict, is_dataclass
from typing import Any, Callable

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from artifacts.errors import MMError
from artifacts.progress import NULL_PROGRESS, ProgressSink

out = Console()
err = Console(stderr=True)


# --- rendering helpers shared by every command ------------------------------------------------

class RichProgress:
    """A byte progress bar (bytes, rate, ETA) for long work on a terminal."""

    def __init__(self, console: Console):
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=console, transient=False,
        )
        self._task = None
        self._lock = threading.Lock()

    def begin(self, total_bytes: int, label: str) -> None:
        with self._lock:
            if self._task is None:
                self._progress.start()
                self._task = self._progress.add_task(label, total=total_bytes)
            else:
                self._progress.update(self._task, total=total_bytes, description=label)

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, nbytes)

    def note(self, message: str) -> None:
        self._progress.console.print(message)

    def end(self) -> None:
        with self._lock:
            if self._task is not None:
                self._progress.stop()
                self._task = None


def progress_for(json_out: bool) -> ProgressSink:
    if json_out or not err.is_terminal:
        return NULL_PROGRESS
    return RichProgress(err)


def to_jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "__fspath__"):
        return str(obj)
    return obj


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(to_jsonable(doc), indent=2))


def handles_errors(fn: Callable) -> Callable:
    """Map user-facing errors to one line and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MMError as e:
            json_out = kwargs.get("json_out")
            if json_out:
                emit_json({"ok": False, "error": e.message, "exit_code": e.exit_code, "kind": type(e).__name__})
            err.print(f"mm: {e.message}", markup=False, highlight=False, soft_wrap=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            err.print("mm: interrupted", markup=False)
            sys.exit(130)

    return wrapper


json_option = click.option("--json", "json_out", is_flag=True, help="Print one JSON document instead of text.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mm")
def main() -> None:
    """mm: fetch a pinned model revision, prove every byte, carry it across an air gap, start it offline."""


# --- fetch / manifest (issue 2) ----------------------------------------------------------------

# --- verify / repair (issue 3) -----------------------------------------------------------------

# --- mirror (issue 4) --------------------------------------------------------------------------

# --- bundle / unbundle (issue 5) ---------------------------------------------------------------

# --- launch / warmup (issue 6) -----------------------------------------------------------------


if __name__ == "__main__":
    main()
