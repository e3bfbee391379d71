"""User-facing failures. Each class carries the exit code the CLI returns for it.

The CLI prints `mm: <message>` on one line for these and never a traceback.
Exit codes (documented in docs/exit-codes.md):
  0  success
  1  problems found (verify/bundle verify found damage; a check failed; the quick-verify gate refused)
  2  usage error (unknown option, missing argument, or an option/argument value that is malformed or out of range)
  3  bad input (a file, directory, manifest or volume is missing, unreadable or malformed)
  4  remote error (Hub, mirror or registry unreachable, repo/revision/file/tag not found, auth refused)
  5  integrity error (downloaded or imported bytes do not match the expected identity; a required manifest
     signature is missing or not good)
  6  busy (another mm process holds the directory's lock)
  7  refused (a combination the deployment guide says fails, or not enough disk)
  8  incomplete: an import is waiting for more volumes (everything given was imported; run it again with the rest)
 70  internal error: a bug in mm (an unexpected exception; one line, never a traceback unless MM_DEBUG=1)
130  interrupted (SIGINT; the work is kept: artifacts/edges/interrupt.py)
143  stopped by SIGTERM (the same)
"""
from __future__ import annotations


class MMError(Exception):
    exit_code = 3

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ProblemsFound(MMError):
    exit_code = 1


class BadValue(MMError):
    """An option or argument value that is malformed or out of range (the same code as click's usage errors)."""

    exit_code = 2


class QuickVerifyFailed(ProblemsFound):
    """The one pre-flight gate (`mm verify --quick`) failed before bundle, launch or push."""


class BadInput(MMError):
    exit_code = 3


class NotInRoot(BadInput):
    """The model root holds no such repo or revision (perhaps it is not the root the user meant)."""


class RemoteError(MMError):
    exit_code = 4


class RetryLater(RemoteError):
    """A request failed in a way worth retrying (cut, 429, 5xx, expired signed URL, wrong answer): the range engine
    (fetching/ranges.py) and the registry client ask again, after AFTER seconds when the server said so."""

    def __init__(self, message: str, reason: str = "error", after: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.after = after


class IntegrityError(MMError):
    exit_code = 5


class Busy(MMError):
    exit_code = 6


class Refused(MMError):
    exit_code = 7


class Waiting(MMError):
    """Not a failure of what was given: the work is incomplete until more input (the rest of a bundle's volumes)
    comes. A script's `mm unbundle DISK --dest D && mm launch D` must not go on with a partial model."""

    exit_code = 8


def first_line(e: BaseException) -> str:
    """The first line of an exception's text (clients put URLs, bodies and tracebacks after it)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


EXIT_CODES = {
    0: "success",
    1: "problems found (verification found damage, or a check failed)",
    2: "usage error (unknown option, missing argument, or an option or argument value that is malformed or out of range)",
    3: "bad input (missing, unreadable or malformed file, directory, manifest or volume)",
    4: "remote error (Hub, mirror or registry unreachable; repo, revision, file or tag not found; auth refused)",
    5: "integrity error (bytes do not match the expected identity; a manifest signature missing or not good)",
    6: "busy (another mm process holds the directory lock)",
    7: "refused (unsupported combination per the deployment guide, or not enough disk)",
    8: "incomplete: an import is waiting for more volumes (what was given is imported; run it again with the rest)",
    70: "internal error: a bug in mm (please report it; MM_DEBUG=1 shows the traceback)",
    130: "interrupted by Ctrl-C (SIGINT); the work done so far is kept",
    143: "stopped by SIGTERM; the work done so far is kept",
}

INTERNAL_ERROR = 70
