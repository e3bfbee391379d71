"""What every command module shares: the consoles, JSON output, the one-line error and its exit code, and the
options (and their checks) that several commands take.

User errors (artifacts.errors.MMError) print one line `mm: <message>` on stderr and exit with the error's code
(see docs/exit-codes.md); they never show a traceback. Imports here stay light: `mm verify --help` loads
this module, so library modules and rich are imported inside the functions that use them.
"""
from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import click

from ..artifacts.errors import MMError

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from ..artifacts.edges.progress import ProgressSink


class _Consoles:
    """rich Consoles made on first print: `--json` never imports rich (~45 ms of start-up)."""

    @functools.cached_property
    def out(self) -> Console:
        return _console(stderr=False)

    @functools.cached_property
    def err(self) -> Console:
        return _console(stderr=True)


def _console(stderr: bool) -> Console:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # soft_wrap: never break a line at 80 columns when output goes to a pipe or a file; tables get room too.
    # emoji=False: a file named ":warning:.bin" is shown as it is named.
    return Console(stderr=stderr, soft_wrap=True, emoji=False, width=None if stream.isatty() else 200)


_consoles = _Consoles()


class _Lazy:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(getattr(_consoles, self._name), attr)

    @property
    def _stream(self):
        return sys.stderr if self._name == "err" else sys.stdout  # looked up now: a live bar may proxy it

    @property
    def is_terminal(self) -> bool:
        """rich's answer, without importing rich where it can only be no: the stream is no tty and neither
        variable that makes rich treat it as one (FORCE_COLOR, TTY_COMPATIBLE) is set."""
        try:
            tty = self._stream.isatty()
        except (AttributeError, ValueError):  # no stream, or a closed one
            tty = False
        if not tty and not {"FORCE_COLOR", "TTY_COMPATIBLE"} & os.environ.keys():
            return False
        return getattr(_consoles, self._name).is_terminal

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Console.print with control characters in text escaped (names from disks and servers are hostile).

        A plain line (text only; no markup, no highlighting, never wrapped) is written as it is: rich would
        write the same bytes, and importing it costs a short command a third of its time (~45 ms)."""
        from ..artifacts.edges.untrusted import printable, redact

        objects = tuple(printable(redact(o), keep_newlines=True) if isinstance(o, str) else o for o in objects)
        plain = kwargs == _PLAIN_LINE and all(isinstance(o, str) for o in objects)
        if plain or self._stream is None:  # (closed: write says what that means)
            self.write(" ".join(map(str, objects)) + "\n")
            return
        with self._named_if_it_fails():
            getattr(_consoles, self._name).print(*objects, **kwargs)

    def line(self, *objects: Any) -> None:
        """One plain line: the text as it is (no markup, no highlighting, never wrapped), the way mm writes a
        report line."""
        self.print(*objects, **_PLAIN_LINE)

    def write(self, text: str) -> None:
        """TEXT on this stream, flushed (as rich does: lines on stdout and stderr keep their order).

        A stream mm cannot write to is the user's situation, not a bug in mm: stdout closed (`mm verify DIR >&-`)
        is a one-line error (exit 3); a full disk under it (`> /dev/full`) is exit 7 naming that file, not the
        command's target (fail). stderr closed: what it would show is dropped, the exit code still says it."""
        stream = self._stream
        if stream is None:
            if self._name == "err":
                return
            raise MMError("standard output is closed, so mm cannot print its report; run it with its output going "
                          "to a file, a pipe or /dev/null")
        with self._named_if_it_fails():
            stream.write(text)
            stream.flush()

    @contextmanager
    def _named_if_it_fails(self) -> Iterator[None]:
        """An OSError writing this stream names the file it goes to (a reader gone away, EPIPE, stays unnamed:
        fail ends that quietly)."""
        try:
            yield
        except BrokenPipeError:
            raise
        except OSError as e:
            if e.filename is None:
                e.filename = _stream_path(self._stream, self._name)
            raise


def _stream_path(stream, name: str) -> str:
    """Where STREAM goes: its file's path (`/dev/full`, `/data/report.json`), else "standard output"."""
    try:
        target = os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (OSError, ValueError, AttributeError):
        target = ""
    return target if target.startswith("/") else f"standard {'error' if name == 'err' else 'output'}"


_PLAIN_LINE = {"markup": False, "highlight": False, "soft_wrap": True}


out = _Lazy("out")
err = _Lazy("err")


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)



# --- rendering helpers shared by every command ------------------------------------------------

def progress_for(json_out: bool) -> ProgressSink:
    """A live bar on a terminal; otherwise a plain line every MM_PROGRESS_INTERVAL seconds on stderr, or with
    --json one status event (a JSON object) a line there: stdout keeps the one JSON document."""
    from ..artifacts.edges.progress import periodic_progress, terminal_progress

    if json_out or not err.is_terminal:
        # a plain line is made printable (file names are hostile); json.dumps escapes control characters itself
        write = (lambda line: err.write(line + "\n")) if json_out else err.line
        return periodic_progress(write, os.environ, as_json=json_out)
    return terminal_progress(_consoles.err)


def to_jsonable(doc: Any) -> Any:
    from dataclasses import asdict, is_dataclass

    def walk(obj: Any) -> Any:
        if isinstance(obj, type):  # a typed outcome (an error class) is shown by name
            return obj.__name__
        if is_dataclass(obj) and not isinstance(obj, type):
            return walk(asdict(obj))
        if isinstance(obj, dict):
            return {str(k): walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple, set, frozenset)):
            return [walk(v) for v in obj]
        if hasattr(obj, "__fspath__"):
            return str(obj)
        return obj

    return walk(doc)


def emit_json(doc: Any) -> None:
    """DOC as one indented JSON document on stdout, written as it is encoded (a report may list a million files)."""
    from ..artifacts.edges.fsutil import json_text_chunks

    for chunk in json_text_chunks(_redacted(to_jsonable(doc)), indent=2):
        out.write(chunk)


def _redacted(doc: Any) -> Any:
    """Every string of a JSON document without credentials (see untrusted.redact)."""
    from ..artifacts.edges.untrusted import redact

    def walk(obj: Any) -> Any:
        if isinstance(obj, str):
            return redact(obj)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(doc)


# Where each command writes: a full disk or a read-only file system is reported against this path.
_WRITE_TARGETS = ("out_dir", "out_dirs", "dest", "local_dir", "out", "directory", "model_dir")


def _target_of(kwargs: dict) -> str | None:
    for name in _WRITE_TARGETS:
        value = kwargs.get(name)
        if isinstance(value, (tuple, list)):  # a repeatable option (bundle --out): the first
            value = value[0] if value else None
        if value is not None:
            return str(value)
    return None


def handles_errors(fn: Callable) -> Callable:
    """Map every failure of a command to one line and its documented exit code (see `fail`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (SystemExit, click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except BaseException as e:  # KeyboardInterrupt included: it ends as "interrupted", exit 130
            ctx = click.get_current_context(silent=True)
            fail(e, ctx.command_path if ctx else "mm", bool(kwargs.get("json_out")), _target_of(kwargs))

    return wrapper


def fail(exc: BaseException, operation: str, json_out: bool, target: str | None = None) -> None:
    """Print EXC as one line (and a JSON document with --json) and exit with its documented code.

    MMError: its message and code. OSError where it is the user's situation (a full disk: 7; a read-only,
    forbidden, wrong-kind or too-long path: 3; a connection: 4). Anything else is a bug in mm: exit 70 with
    the operation, the file when known and a bug-report hint; the traceback only with MM_DEBUG=1.
    """
    from ..artifacts.errors import INTERNAL_ERROR
    from ..artifacts.edges.oserrors import describe_os_error
    from ..artifacts.edges.progress import abandon_live
    from ..artifacts.edges.untrusted import printable, redact

    kind = type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C or SIGTERM: what is kept, the command that resumes, 130/143
        from ..artifacts.edges import interrupt
        interrupt.end(exc if isinstance(exc, interrupt.Interrupted) else interrupt.current(), flush=True)
    if isinstance(exc, MMError):
        code, message = exc.exit_code, exc.message
    elif isinstance(exc, BrokenPipeError) and exc.filename is None:
        quiet_stdout()
        sys.exit(141)  # the reader of our output went away (`mm verify DIR | head`): end as tools do, silently
    elif isinstance(exc, OSError) and (described := describe_os_error(exc, target)) is not None:
        code, message = described
    else:
        where = getattr(exc, "filename", None) or target
        code = INTERNAL_ERROR
        message = (f"internal error in `{operation}`{f' on {where}' if where else ''}: {kind}: "
                   f"{printable(str(exc))[:300]}; this is a bug in mm, please report it with the command line "
                   f"(MM_DEBUG=1 shows the traceback)")
    if code == INTERNAL_ERROR and os.environ.get("MM_DEBUG") == "1":
        import traceback
        traceback.print_exception(exc)
    message = redact(message)
    abandon_live()  # a bar cut short leaves the screen; the error line takes its place
    if json_out:
        try:
            emit_json({"ok": False, "error": message, "exit_code": code, "kind": kind})
        except (OSError, MMError):  # the output is what failed: the line below says so
            pass
    err.line(f"mm: {printable(message)}")
    sys.exit(code)


def report_interrupt(json_out: bool, argv: list[str], exc) -> None:
    """The interrupt's one line (and JSON document): the signal, what resumable work is kept where, and the command
    that resumes it. Written with os.write: it may run in the interrupt's watcher thread while the main thread
    is anywhere (in the middle of a rich render, too)."""
    import json
    from shlex import join

    from ..artifacts.edges.interrupt import kept_work, working_dirs
    from ..artifacts.edges.untrusted import printable, redact

    dirs = working_dirs()
    kept = kept_work(dirs) if dirs else []
    resume = redact(printable("mm " + join(argv))) if dirs else None
    message = f"interrupted by {exc.signal_name}"
    if dirs:
        message += f"; kept: {'; '.join(kept) if kept else 'nothing yet'}; resume with: {resume}"
    message = redact(printable(message))
    if json_out:
        doc = {"ok": False, "error": message, "exit_code": exc.exit_code, "kind": "Interrupted",
               "signal": exc.signal_name, "kept": [redact(printable(k)) for k in kept], "resume": resume}
        _write_all(1, (json.dumps(doc, indent=2) + "\n").encode())
    show_cursor = "\x1b[?25h" if sys.stderr.isatty() else ""  # a live progress bar hides it
    _write_all(2, f"{show_cursor}mm: {message}\n".encode("utf-8", "replace"))


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


def quiet_stdout() -> None:
    """stdout's reader is gone: point it at /dev/null so the interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass



# --- option values shared by several commands, checked where they are parsed (a bad value is a usage error: exit 2)

class _UserPath(click.Path):
    """click.Path whose value is a pathlib.Path, imported when a path is given: `mm verify --help` needs no
    pathlib (with the urllib.parse it loads, a quarter of what that help added to `import click`)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from pathlib import Path

        return Path(super().convert(value, param, ctx))


# A path the user names, as given: mm opens it itself and says in one line why it cannot (exit 3, README "Exit
# codes"). click's own readable check would answer a permission refused as a usage error (exit 2).
PATH = _UserPath(readable=False)


def check_repo_id(ctx, param, value):
    from ..artifacts.edges.untrusted import printable, repo_id_problem
    if value is not None and (problem := repo_id_problem(value)):
        raise click.BadParameter(f"{printable(value)[:120]!r}: {problem}")
    return value


def check_revision(ctx, param, value):
    if value is not None and (not value.strip() or len(value) > 256 or not value.isprintable() or value != value.strip()):
        from ..artifacts.edges.untrusted import printable
        raise click.BadParameter(f"{printable(value)[:60]!r}: expected a commit sha, branch or tag")
    return value


def check_identity(ctx, param, value):
    """A signer identity (an allowed_signers principal, e.g. alice@example.com): "" would pass as no identity."""
    if value is not None and (not value.strip() or len(value) > 256 or not value.isprintable() or value != value.strip()):
        from ..artifacts.edges.untrusted import printable
        raise click.BadParameter(f"{printable(value)[:60]!r}: expected a signer identity (a principal of the "
                                 f"allowed signers file, e.g. alice@example.com)")
    return value



json_option = click.option("--json", "json_out", is_flag=True, help="Print one JSON document instead of text.")


def examples(*lines: str) -> Callable[[click.Command], click.Command]:
    """The examples that end a command's --help (as `hf` does), written above the command they show: put it
    over the command's decorator. Each line is kept as written (click's "\\b" marker: no rewrapping)."""

    def attach(command: click.Command) -> click.Command:
        command.epilog = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)
        return command

    return attach


class DefaultGroup(click.Group):
    """A group whose default subcommand runs when the first argument names no subcommand.

    Lets `mm manifest DIR` and `mm manifest export DIR` (or `mm bundle DIR` and `mm bundle verify VOL`) coexist.
    """

    def __init__(self, *args, default: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.default_command = default

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            self._refuse_typo(ctx, args[0])
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def _refuse_typo(self, ctx: click.Context, word: str) -> None:
        """`mm bundle verfy VOL`: a word that names no file but nearly names a subcommand is a typo, not the
        default subcommand's argument (which would end in "Missing option '--out'")."""
        import difflib
        if word.startswith("-") or os.path.lexists(word):
            return
        others = [name for name in self.commands if name != self.default_command]
        close = difflib.get_close_matches(word, others, n=1, cutoff=0.6)
        if close:
            raise click.UsageError(f"No such command {word!r} (and no such file). Did you mean {close[0]!r}?", ctx)



def thread_failed(hook_args) -> None:
    """A worker thread died of an unexpected exception: one line, not Python's thread traceback."""
    if hook_args.exc_type is SystemExit or issubclass(hook_args.exc_type, KeyboardInterrupt):
        return  # a worker stopped by an interrupt: the CLI reports the interrupt
    if os.environ.get("MM_DEBUG") == "1":
        import traceback
        traceback.print_exception(hook_args.exc_value)
    from ..artifacts.edges.untrusted import printable
    err.line(f"mm: internal error in a worker thread: {hook_args.exc_type.__name__}: "
             f"{printable(str(hook_args.exc_value))[:300]}; this is a bug in mm, please report it")



# --- manifest signatures: the options and lines of the commands that consume or make one ------------------

def signature_options(fn: Callable) -> Callable:
    """--require-signature / --allowed-signers / --identity for commands that consume a manifest."""
    options = [
        click.option("--require-signature", is_flag=True,
                     help="Kept for scripts: --allowed-signers alone already requires a good signature."),
        click.option("--allowed-signers", type=PATH,
                     help="OpenSSH allowed_signers file (namespace mm-manifest): the manifest must carry a good "
                          "signature by a key it allows; unsigned or not good: exit 5, before anything is written. "
                          "The same meaning in verify, unbundle, pull and launch."),
        click.option("--identity", callback=check_identity,
                     help="With --allowed-signers: the signer identity (principal) to require."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def render_carried_signature(signature: dict | None, allowed_signers: Path | None) -> None:
    """The signature a bundle or an artifact carried, as unbundle and pull checked it."""
    from ..artifacts.integrity.signing import SignatureReport
    if signature:
        described = SignatureReport(signature["identity"], signature["key_type"], signature["fingerprint"], "",
                                    str(allowed_signers)).describe()
        out.line(f"signature: good, {described}")


def signature_policy(require_signature: bool, allowed_signers: Path | None, identity: str | None) -> bool:
    """True when a signature is required, which --allowed-signers means on its own everywhere (verify, unbundle,
    pull, launch): naming who may sign and then taking an unsigned manifest would be two meanings. Usage errors
    for options that make no sense together."""
    if require_signature and not allowed_signers:
        raise click.UsageError("--require-signature needs --allowed-signers FILE")
    if identity and not allowed_signers:
        raise click.UsageError("--identity needs --allowed-signers")
    return bool(allowed_signers)



def render_signed(result) -> None:
    from ..artifacts.integrity import signing
    out.line(f"signed {result.manifest_path} with {result.key_type} key {result.fingerprint}: "
             f"{result.signature_path}")
    out.line("check without mm: cd DIR/.mm && " + signing.verify_command())
