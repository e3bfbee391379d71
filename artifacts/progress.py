"""How long-running library calls report progress without knowing about terminals.

cli.py passes a rich-backed sink on a TTY and NULL_PROGRESS otherwise (and always with --json).
Sinks must be thread-safe: workers call advance() concurrently.
"""
from __future__ import annotations

from typing import Protocol


class ProgressSink(Protocol):
    def begin(self, total_bytes: int, label: str) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def note(self, message: str) -> None: ...

    def end(self) -> None: ...


class _NullProgress:
    def begin(self, total_bytes: int, label: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass


NULL_PROGRESS: ProgressSink = _NullProgress()
