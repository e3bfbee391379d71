"""External tools mm runs (docker, nvidia-smi, rocm-smi, skopeo, ssh-keygen, pip): bounded, their output hostile.

Every subprocess of mm goes through here:
  - `run_tool(argv, what=..., timeout=...)`: the tool's stdout and stderr read at once, each up to MAX_OUTPUT
    bytes (a caller with larger documents passes its own cap), within a deadline;
  - `stream_tool(argv, ...)`: stdout (with stderr) read as a stream by the caller (`docker logs`), within a
    deadline.
The tool starts in its own session (start_new_session): it has no controlling terminal, so nothing it runs can
prompt on the user's terminal (ssh-keygen asking for a passphrase fails instead), and the terminal's Ctrl-C
reaches mm only. Its whole process group is killed (SIGKILL) when the deadline passes, when a stream passes its
cap, when mm is interrupted (interrupt.on_stop, registered in the same step that starts the tool, so a Ctrl-C
that lands while it starts kills it too: interrupt.starting_child), and once the tool itself has exited but
something it started still holds its output open (after LINGER): mm never waits on a pipe a grandchild keeps.
Standard input is /dev/null, or INPUT from a temporary file (never a pipe mm must feed).

Each caller names mm's own deadline for its tool (seconds: nvidia-smi and docker probes 60-180, skopeo's inspections
20-120 and its copy 3600, ssh-keygen 300, pip 1800); `MM_TOOL_TIMEOUT`, when set, is every tool's deadline
instead (`deadline`): an operator on a slow host raises it, one who wants a hung tool to fail fast lowers it.
A tool stopped at its deadline says so: "no answer within N s (MM_TOOL_TIMEOUT)".

Output is bytes; `ToolResult.stdout` / `.stderr` decode it as UTF-8 with replacement (any byte is readable
text), and what is parsed from it goes through the untrusted rules (`untrusted.load_json`, `small_int`).
Names from the user handed to a tool (container names, image references) are checked first (`check_name`),
and placed after `--` where the tool allows it, so that no name is ever taken as an option.
"""
from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Iterator, Mapping, Sequence

from . import interrupt
from ..errors import BadInput, BadValue
from .untrusted import env_number, printable

MAX_OUTPUT = 1024 * 1024  # bytes of each stream kept by default; over it the tool is stopped
LINGER = 0.5  # seconds a tool's leftover children may keep its output open after it exited
READ = 64 * 1024
MAX_LINE = 300  # characters of a tool's line quoted in a message


class ToolMissing(BadInput):
    """The tool is not installed (or cannot be executed)."""


@dataclass(frozen=True)
class ToolResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: mm stopped the tool (`stopped` says why)
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    stopped: str | None = None  # "no answer within 60 s", "more than 1 MiB of output on stdout"

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    def last_line(self) -> str:
        """Why it failed, in one printable line: why mm stopped it, else the last line of stderr (or stdout)."""
        if self.stopped:
            return self.stopped
        return last_line(self.stderr) or last_line(self.stdout) or f"exit status {self.returncode}"


def last_line(text: str) -> str:
    """TEXT's last non-blank line, printable and at most MAX_LINE characters ('' when there is none)."""
    for line in reversed(text.splitlines()):
        if line.strip():
            line = printable(line.strip())
            return line if len(line) <= MAX_LINE else line[:MAX_LINE] + "..."
    return ""


def deadline(timeout: float) -> float:
    """The seconds a tool may run: MM_TOOL_TIMEOUT when set (every tool's), else TIMEOUT, the caller's own."""
    return env_number("MM_TOOL_TIMEOUT") or timeout


def _late(timeout: float) -> str:
    return f"no answer within {timeout:g} s (MM_TOOL_TIMEOUT)"


def _start(argv: Sequence[str], stdin, stdout, stderr, cwd, env) -> subprocess.Popen:
    try:
        return subprocess.Popen(list(argv), stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd,
                                env=None if env is None else dict(env), start_new_session=True)
    except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
        raise ToolMissing(f"{argv[0]}: cannot run ({e.strerror or e}); is it installed?") from None


@contextmanager
def _running(argv: Sequence[str], stdin, stdout, stderr, cwd, env) -> Iterator[subprocess.Popen]:
    """The tool, started and registered for the stop as one step; on the way out, however it is left, its process
    group killed (leftovers, or the tool itself when stopped), the tool reaped and its pipes closed."""
    proc = unregister = None
    try:
        with interrupt.starting_child():
            proc = _start(argv, stdin, stdout, stderr, cwd, env)
            unregister = interrupt.on_stop(lambda: kill_group(proc))
        yield proc
    finally:
        if unregister is not None:
            unregister()
        if proc is not None:
            kill_group(proc)
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the tool's whole process group (its children too); nothing when it is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def argv_batches(head: Sequence[str], operands: Sequence[str], *, max_operands: int) -> Iterator[list[str]]:
    """HEAD followed by as many OPERANDS as one exec takes (`docker inspect -- ID...` for every running container):
    at most MAX_OPERANDS, and within half of what the kernel leaves of ARG_MAX beside this environment (mm's own
    margin), so that no list from a tool, however long, makes the next exec fail with E2BIG."""
    budget = _argv_budget() - sum(len(os.fsencode(a)) + 9 for a in head)  # each: its bytes, NUL, a pointer
    batch: list[str] = []
    used = 0
    for operand in operands:
        size = len(os.fsencode(operand)) + 9
        if batch and (used + size > budget or len(batch) >= max_operands):
            yield [*head, *batch]
            batch, used = [], 0
        batch.append(operand)
        used += size
    if batch:
        yield [*head, *batch]


def _argv_budget() -> int:
    try:
        arg_max = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        arg_max = 128 * 1024  # POSIX's least ARG_MAX is 4096; Linux before 2.6.23 had 128 KiB
    env = sum(len(k) + len(v) + 10 for k, v in os.environb.items())
    return max(16 * 1024, (arg_max - env) // 2)


def run_tool(argv: Sequence[str | os.PathLike], *, timeout: float, max_output: int = MAX_OUTPUT,
             input: bytes | None = None, cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
             passthrough: bool = False) -> ToolResult:
    """Run ARGV to its end, or stop it (see the module docstring). PASSTHROUGH: its output goes to mm's stderr
    (a tool's progress on the terminal) and only the deadline applies. Raises ToolMissing when it
    cannot be started, Interrupted when mm is."""
    argv = tuple(os.fspath(a) for a in argv)
    timeout = deadline(timeout)
    ends = time.monotonic() + timeout
    stdin_file = None
    if input is not None:
        stdin_file = tempfile.TemporaryFile()
        stdin_file.write(input)
        stdin_file.seek(0)
    try:  # passthrough: its stdout to mm's stderr (progress is not mm's output), its stderr as mm's
        with _running(argv, stdin_file or subprocess.DEVNULL, 2 if passthrough else subprocess.PIPE,
                      None if passthrough else subprocess.PIPE, cwd, env) as proc:
            if passthrough:
                out, err, stopped = b"", b"", _wait(proc, ends, timeout)
            else:
                out, err, stopped = _collect(proc, ends, timeout, max_output)
    finally:
        if stdin_file is not None:
            stdin_file.close()
    interrupt.check()
    return ToolResult(argv, None if stopped else proc.returncode, out, err, stopped)


def _wait(proc: subprocess.Popen, ends: float, timeout: float) -> str | None:
    while proc.poll() is None:
        if interrupt.requested():
            return "interrupted"
        if time.monotonic() >= ends:
            return _late(timeout)
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    return None


def _collect(proc: subprocess.Popen, ends: float, timeout: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr together until both end, each up to CAP bytes, within the deadline."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    exited_at = None
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if interrupt.requested():
                return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), "interrupted"
            if now >= ends:
                return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), _late(timeout)
            if proc.poll() is not None:
                exited_at = exited_at or now
                if now - exited_at >= LINGER:  # something the tool started holds its output open: not our wait
                    break
            for key, _ in sel.select(timeout=min(0.1, ends - now)):
                try:
                    chunk = os.read(key.fd, READ)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                room = cap - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:
                    return (bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]),
                            f"more than {cap} bytes of output on {names[key.fd]}")
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), None


@dataclass
class ToolStream:
    """A running tool whose stdout (stderr merged) the caller reads; after the `with`: returncode or stopped."""

    stdout: IO[bytes]
    returncode: int | None = None
    stopped: str | None = None
    _reason: list = field(default_factory=list, repr=False)


@contextmanager
def stream_tool(argv: Sequence[str | os.PathLike], *, timeout: float,
                env: Mapping[str, str] | None = None) -> Iterator[ToolStream]:
    """Run ARGV with its stdout and stderr on one pipe for the caller to read as a stream (bounded by the
    caller's reader). A guard thread kills the process group at the deadline, on an interrupt, and LINGER after
    the tool exited (a child holding the pipe): the caller's read then ends. Raises ToolMissing, Interrupted."""
    argv = tuple(os.fspath(a) for a in argv)
    timeout = deadline(timeout)
    with _running(argv, subprocess.DEVNULL, subprocess.PIPE, subprocess.STDOUT, None, env) as proc:
        stream = ToolStream(proc.stdout)
        done = threading.Event()
        guard = threading.Thread(target=_guard, args=(proc, time.monotonic() + timeout, timeout, done, stream._reason),
                                 name="mm-tool-guard", daemon=True)
        guard.start()
        try:
            yield stream
        finally:
            done.set()
            guard.join()
    stream.stopped = stream._reason[0] if stream._reason else None
    stream.returncode = None if stream.stopped else proc.returncode
    interrupt.check()


def _guard(proc: subprocess.Popen, ends: float, timeout: float, done: threading.Event, reason: list) -> None:
    exited_at = None
    while not done.wait(0.05):
        now = time.monotonic()
        if interrupt.requested():
            reason.append("interrupted")
        elif now >= ends:
            reason.append(_late(timeout))
        elif proc.poll() is not None:
            exited_at = exited_at or now
            if now - exited_at < LINGER:
                continue
        else:
            continue
        kill_group(proc)
        return


def start_detached(argv: Sequence[str | os.PathLike]) -> None:
    """Start ARGV in a session of its own and do not wait for it (cleanup that must outlive an interrupted mm,
    e.g. removing a warm-up container). Nothing when it cannot be started."""
    try:
        subprocess.Popen([os.fspath(a) for a in argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        pass


# --- names handed to tools --------------------------------------------------------------------------------

# Docker's own rule for container names ([a-zA-Z0-9][a-zA-Z0-9_.-]+); a container ID (hex) passes it too.
CONTAINER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")
# An image reference as docker and skopeo read it: [registry[:port]/]path[:tag][@digest]; never starts with '-'.
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}")


def check_name(value: str, what: str, pattern: re.Pattern = CONTAINER_NAME) -> str:
    """VALUE if it is a NAME of its kind for a tool (never something the tool could take as an option), else
    BadValue (exit 2) naming WHAT."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        shown = printable(str(value))[:80]
        raise BadValue(f"{what} {shown!r}: not a valid name (letters, digits, '_', '.', '-', starting with a letter or "
                       f"digit)" if pattern is CONTAINER_NAME else f"{what} {shown!r}: not a valid image reference")
    return value
