"""mm command line: parse options, call artifacts/, render (rich on a terminal, or one JSON document).

Nothing else lives here: every capability is a plain function in artifacts/.
User errors (artifacts.errors.MMError) print one line `mm: <message>` on stderr and exit with the
error's code (see README.md, "Exit codes"); they never show a traceback.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections import Counter
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from .artifacts.bundle.payloads import PAYLOAD_KINDS
from .artifacts.errors import BadInput, BadValue, IntegrityError, MMError, ProblemsFound
from .artifacts.progress import (NULL_PROGRESS, ProgressSink, abandon_live, human_bytes, human_duration, human_rate,
                                 terminal_progress)
from .artifacts.untrusted import printable, redact

if TYPE_CHECKING:  # library modules are imported inside the commands that use them (start-up time)
    from .artifacts.verify import VerifyReport
    from rich.console import Console

    from .artifacts import fetch as mm_fetch, launch as mm_launch, mirror as ms_mirror
    from .artifacts import repair as mm_repair, warmup as mm_warmup


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
    return Console(stderr=stderr, soft_wrap=True, width=None if stream.isatty() else 200)


_consoles = _Consoles()


class _Lazy:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(getattr(_consoles, self._name), attr)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Console.print with control characters in text escaped (names from disks and servers are hostile)."""
        getattr(_consoles, self._name).print(
            *(printable(redact(o), keep_newlines=True) if isinstance(o, str) else o for o in objects), **kwargs)


out = _Lazy("out")
err = _Lazy("err")


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)


# --- rendering helpers shared by every command ------------------------------------------------

def progress_for(json_out: bool) -> ProgressSink:
    if json_out or not err.is_terminal:
        return NULL_PROGRESS
    return terminal_progress(_consoles.err)


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, type):  # a typed outcome (an error class) is shown by name
        return obj.__name__
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
    click.echo(json.dumps(_redacted(to_jsonable(doc)), indent=2))


def _redacted(obj: Any) -> Any:
    """Every string of a JSON document without credentials (see untrusted.redact)."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: _redacted(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redacted(v) for v in obj]
    return obj


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
    from .artifacts.errors import INTERNAL_ERROR
    from .artifacts.oserrors import describe_os_error

    kind = type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C or SIGTERM: what is kept, the command that resumes, 130/143
        from .artifacts import interrupt
        interrupt.end(exc if isinstance(exc, interrupt.Interrupted) else interrupt.current(), flush=True)
    if isinstance(exc, MMError):
        code, message = exc.exit_code, exc.message
    elif isinstance(exc, BrokenPipeError) and exc.filename is None:
        _quiet_stdout()
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
        emit_json({"ok": False, "error": message, "exit_code": code, "kind": kind})
    err.print(f"mm: {printable(message)}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


def _report_interrupt(json_out: bool, argv: list[str], exc) -> None:
    """The interrupt's one line (and JSON document): the signal, what resumable work is kept where, and the command
    that resumes it. Written with os.write: it may run in the interrupt's watcher thread while the main thread
    is anywhere (in the middle of a rich render, too)."""
    from shlex import join

    from .artifacts.interrupt import kept_work, working_dirs

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


def _quiet_stdout() -> None:
    """stdout's reader is gone: point it at /dev/null so the interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


# --- option values, checked where they are parsed (a bad value is a usage error: exit 2) -----------

def _repo_id(ctx, param, value):
    from .artifacts.untrusted import repo_id_problem
    if value is not None and (problem := repo_id_problem(value)):
        raise click.BadParameter(f"{printable(value)[:120]!r}: {problem}")
    return value


def _revision(ctx, param, value):
    if value is not None and (not value.strip() or len(value) > 256 or not value.isprintable() or value != value.strip()):
        raise click.BadParameter(f"{printable(value)[:60]!r}: expected a commit sha, branch or tag")
    return value


def _identity(ctx, param, value):
    """A signer identity (an allowed_signers principal, e.g. alice@example.com): "" would pass as no identity."""
    if value is not None and (not value.strip() or len(value) > 256 or not value.isprintable() or value != value.strip()):
        raise click.BadParameter(f"{printable(value)[:60]!r}: expected a signer identity (a principal of the "
                                 f"allowed signers file, e.g. alice@example.com)")
    return value


def _hardware(ctx, param, value):
    """GPU names as users write them (B300, GB300, MI355X) are the guide's rows in any case."""
    return value.strip().lower() if value is not None else None


def _container_name(ctx, param, value):
    """A container name handed to docker: never something docker could take as an option (`--follow`)."""
    from .artifacts.tools import check_name
    if value is not None:
        try:
            check_name(value, param.opts[0])
        except MMError as e:
            raise click.BadParameter(e.message.removeprefix(f"{param.opts[0]} ")) from None
    return value


def _seconds(ctx, param, value):
    """A duration in seconds: finite, positive, at most a week (click's FloatRange lets NaN through)."""
    import math
    if value is not None and not (math.isfinite(value) and 0 < value <= 7 * 24 * 3600):
        raise click.BadParameter(f"{value}: expected seconds, more than 0 and at most {7 * 24 * 3600}")
    return value


def _cache_key_pairs(ctx, param, value):
    from .artifacts.cachekey import parse_cache_key
    try:
        parse_cache_key(value)
    except MMError as e:
        raise click.BadParameter(e.message) from None
    return value


class VolumeSize(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        from .artifacts.bundle.format import parse_size
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except MMError as e:
            self.fail(e.message, param, ctx)


json_option = click.option("--json", "json_out", is_flag=True, help="Print one JSON document instead of text.")


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


class MMGroup(click.Group):
    """The top-level group: click's usage errors in mm's one-line format (exit 2), and a last guard so that
    nothing, even outside a command, ends in a traceback or in exit 1."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        json_out = "--json" in args
        threading.excepthook = _thread_failed
        if threading.current_thread() is threading.main_thread():  # (click's test runner may call from elsewhere)
            from .artifacts import interrupt
            interrupt.install(functools.partial(_report_interrupt, json_out, args))
        try:
            rv = super().main(args, prog_name=prog_name or "mm", complete_var=complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help() if e.ctx else "", err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx else ""
            fail(BadValue(f"{e.format_message()}{hint}"), "mm", json_out)
        except click.ClickException as e:
            fail(BadInput(e.format_message()), "mm", json_out)
        except click.exceptions.Abort:
            fail(KeyboardInterrupt(), "mm", json_out)
        except SystemExit:
            raise
        except BaseException as e:
            fail(e, "mm " + " ".join(a for a in args[:2] if not a.startswith("-")), json_out)
        sys.exit(rv if isinstance(rv, int) else 0)


def _thread_failed(hook_args) -> None:
    """A worker thread died of an unexpected exception: one line, not Python's thread traceback."""
    if hook_args.exc_type is SystemExit or issubclass(hook_args.exc_type, KeyboardInterrupt):
        return  # a worker stopped by an interrupt: the CLI reports the interrupt
    if os.environ.get("MM_DEBUG") == "1":
        import traceback
        traceback.print_exception(hook_args.exc_value)
    err.print(f"mm: internal error in a worker thread: {hook_args.exc_type.__name__}: "
              f"{printable(str(hook_args.exc_value))[:300]}; this is a bug in mm, please report it",
              markup=False, highlight=False, soft_wrap=True)


@click.group(cls=MMGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(None, "--version", "-V", package_name="mm")
def main() -> None:
    """mm: fetch a pinned model revision, prove every byte, carry it across an air gap, start it offline."""


@main.command()
@json_option
def version(json_out):
    """Print mm's version (as `mm --version` and `mm -V` do)."""
    from importlib.metadata import version as dist_version
    if json_out:
        emit_json({"ok": True, "version": dist_version("mm")})
    else:
        click.echo(f"mm, version {dist_version('mm')}")


# --- fetch / manifest (issue 2) ----------------------------------------------------------------

def _fetch_request(repo: str | None, revision: str | None, local_dir: Path | None, **options) -> mm_fetch.FetchRequest:
    from .artifacts import fetch as mm_fetch
    from .artifacts.pins import pinned_target
    t = pinned_target(repo, revision)
    return mm_fetch.FetchRequest(repo_id=t.repo_id, revision=t.revision or "main",
                                 local_dir=local_dir or Path(t.repo_id.split("/")[-1]), **options)


def _with_pin_origin(e: MMError, repo: str | None, revision: str | None, req: mm_fetch.FetchRequest) -> MMError:
    """E, saying where a revision the user never typed came from (the pin), when it is about that revision."""
    from .artifacts.pins import pinned_target
    pin = pinned_target(repo, revision).pin
    if revision is not None or pin is None or req.revision not in e.message:
        return e
    e.message += (f" (no --revision given: {req.revision[:12]} is the revision of mm's pin {pin.name} for "
                  f"{req.repo_id}; pass --revision to fetch another)")
    return e


def _render_fetch(result: mm_fetch.FetchResult) -> None:
    if result.revision_kind != "commit":
        moving = " (a moving branch)" if result.revision_kind == "branch" else ""
        out.print(f"Resolved {result.requested_revision}{moving} -> {result.commit}; the manifest pins this commit.")
    counts = {s: [f for f in result.files if f.status == s] for s in FETCH_STATUSES}
    for f in counts["failed"]:
        err.print(f"FAILED {f.path}: {f.error}", markup=False)
    for f in result.files:
        if f.note:
            err.print(f"note: {f.path}: {f.note}", markup=False)
    resumed = [f for f in counts["downloaded"] if f.resumed_from]
    rate = result.bytes_transferred / result.seconds if result.seconds else 0
    moved = (f" ({human_bytes(result.bytes_transferred)} in {human_duration(result.seconds)}, {human_rate(rate)}"
             f"{f', {len(resumed)} resumed' if resumed else ''})") if counts["downloaded"] else ""
    adopted = f" ({human_bytes(sum(f.size for f in counts['adopted']))} already on disk, hashed here)" \
        if counts["adopted"] else ""
    out.print(f"{result.repo_id}@{result.commit[:12]}: {len(counts['downloaded'])} downloaded{moved}, "
              f"{len(counts['adopted'])} adopted{adopted}, {len(counts['present'])} already present, "
              f"{len(counts['failed'])} failed", highlight=False)
    t = result.transfer
    if t.get("requests"):
        retried = ", ".join(f"{n} {why}" for why, n in sorted(t["retries_by_reason"].items()))
        per_conn = rate / t["connections_used"] if t["connections_used"] else 0
        out.print(f"Connections: {t['connections_used']} of {t['connections']} used, {t['requests']} requests,"
                  f" {human_rate(per_conn)} per connection; retries: {t['retries']} of {t['retry_budget']}"
                  f"{f' ({retried})' if retried else ''}", highlight=False)
    sources = Counter(f.source for f in counts["downloaded"])
    if len(sources) > 1 or "hub" not in sources and sources:
        out.print("Sources: " + ", ".join(f"{n} from {label}" for label, n in sources.most_common()), highlight=False)
    out.print(f"Manifest: {result.manifest_path}", highlight=False)
    if result.draft is not None:  # the pin names a draft model
        out.print(f"DSpark draft ({result.draft.subfolder}): {'present' if result.draft.present else 'MISSING'}",
                  highlight=False)


FETCH_STATUSES = ("downloaded", "adopted", "present", "failed")


def _fetch_counts(files) -> dict[str, int]:
    """Files by outcome, every status named (0 included): what --json's "counts" holds."""
    return {status: sum(1 for f in files if f.status == status) for status in FETCH_STATUSES}


def _fetch_exit_code(result: mm_fetch.FetchResult) -> int:
    """The worst failure's code (the library reports each failure's class; only the CLI knows codes)."""
    return max((f.error_kind.exit_code for f in result.failed), default=0)


@main.command()
@click.argument("repo", required=False, callback=_repo_id)
@click.option("--revision", "-r", callback=_revision,
              help="Full or short commit, branch or tag. Default: the pin's revision (manifests/).")
@click.option("--local-dir", type=click.Path(path_type=Path), help="Target directory. Default: ./<repo name>.")
@click.option("--include", multiple=True, help="Only paths matching this glob (repeatable).")
@click.option("--exclude", multiple=True, help="Skip paths matching this glob (repeatable).")
@click.option("--connections", type=click.IntRange(1, 256), default=32, show_default=True,
              help="Most HTTP connections at once over all files (ranges of one big file, or many small files); "
                   "16 to start with, more while they raise the aggregate rate.")
@click.option("--workers", type=click.IntRange(1, 256), help="Files downloaded at once. Default: up to --connections.")
@click.option("--source", default="hub", show_default=True,
              help="hub, or modelscope[:OWNER/NAME[@REV]]: every file whose content matches the pin from that mirror, the rest from the Hub.")
@click.option("--mirror-only", is_flag=True, help="With --source modelscope: nothing from the Hub; fail naming the files the mirror cannot supply.")
@click.option("--pin-manifest", type=click.Path(path_type=Path),
              help="With --source modelscope: the pin's identities from this mm manifest, for when the Hub is unreachable.")
@click.option("--sign-with", type=click.Path(path_type=Path),
              help="Sign the manifest at the end (as `mm sign DIR --key KEY`) when every file was fetched.")
@click.option("--from", "base_dir", type=click.Path(path_type=Path),
              help="Another revision's directory on this host: files whose content it has are read from there, not "
                   "downloaded (each checked against the pin like a download).")
@json_option
@handles_errors
def fetch(repo, revision, local_dir, include, exclude, connections, workers, source, mirror_only, pin_manifest, sign_with,
          base_dir, json_out):
    """Download a pinned revision, verify every file against the Hub, write the manifest.

    Resumes across runs; the token comes from HF_TOKEN or the stored login, the endpoint from HF_ENDPOINT.
    """
    from .artifacts import fetch as mm_fetch
    req = _fetch_request(repo, revision, local_dir, include=tuple(include), exclude=tuple(exclude), workers=workers,
                         connections=connections, base_dir=base_dir)
    plan = _mirror_plan(req, source, mirror_only, pin_manifest)  # mirror (issue 4)
    if sign_with is not None and not Path(sign_with).exists():  # before the download, not after it
        raise MMError(f"{sign_with}: no such key file (give a private key, or KEY.pub with its key in ssh-agent)")
    try:
        result = mm_fetch.fetch(req, progress_for(json_out), plan=plan)
    except MMError as e:
        raise _with_pin_origin(e, repo, revision, req) from None
    signed = None
    if sign_with is not None and not result.failed:
        from .artifacts import signing
        signed = signing.sign_manifest(req.local_dir, sign_with)
    if json_out:
        emit_json({"ok": not result.failed, **to_jsonable(result), "counts": _fetch_counts(result.files),
                   "signed": to_jsonable(signed)})
    else:
        _render_fetch(result)
        if signed:
            _render_signed(signed)
        elif sign_with is not None:
            err.print("not signed: some files failed", markup=False)
    sys.exit(_fetch_exit_code(result))


@main.group(cls=DefaultGroup, default="create")
def manifest():
    """Write (`mm manifest DIR --repo R --revision REV`) or export (`mm manifest export DIR`) a manifest."""


@manifest.command("create")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--repo", callback=_repo_id,
              help="The Hub repo the directory holds, e.g. MiniMaxAI/MiniMax-M3.1-Flash. Default for a Hugging Face "
                   "cache snapshot: the repo its folder names.")
@click.option("--revision", callback=_revision, help="Its revision (full sha when offline). Default for a Hugging "
                                                     "Face cache snapshot: its commit.")
@click.option("--offline", is_flag=True, help="Do not ask the Hub; record local hashes only.")
@click.option("--jobs", type=click.IntRange(1, 64), default=2, show_default=True)
@json_option
@handles_errors
def manifest_create(directory, repo, revision, offline, jobs, json_out):
    """Hash a directory another tool filled (e.g. `hf download`) and write DIR/.mm/manifest.json."""
    import time

    from .artifacts import adopt
    from .artifacts.hfcache import snapshot_of
    started = time.monotonic()
    snapshot = snapshot_of(directory)
    if snapshot is not None:  # hf's cache layout names both
        repo, revision = repo or snapshot.repo_id, revision or snapshot.revision
    if not repo or not revision:
        raise click.UsageError("--repo and --revision are required (only a Hugging Face cache snapshot names them)")
    result = adopt.manifest_for_local_dir(directory, repo, revision, offline=offline, jobs=jobs, progress=progress_for(json_out))
    if json_out:
        emit_json({"ok": True, "manifest_path": result.manifest_path, "checked_upstream": result.checked_upstream,
                   "note": result.note, "files": len(result.manifest.files), "bytes": result.manifest.total_bytes,
                   "revision": result.manifest.revision})
        return
    if result.note:
        err.print(f"note: {result.note}", markup=False)
    checked = "checked against the Hub" if result.checked_upstream else "NOT checked against the Hub"
    out.print(f"{len(result.manifest.files)} files ({human_bytes(result.manifest.total_bytes)}) hashed in "
              f"{human_duration(time.monotonic() - started)} at {result.manifest.revision}, {checked}. "
              f"Manifest: {result.manifest_path}", highlight=False)
    if snapshot is not None:
        out.print(f"{directory} is a Hugging Face cache snapshot: its manifest is kept outside hf's cache (above), "
                  f"and mm verify, bundle, launch and push find it there", highlight=False, soft_wrap=True)


@manifest.command("export")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["sha256", "blake3", "both"]), default="both", show_default=True)
@json_option
@handles_errors
def manifest_export(directory, fmt, json_out):
    """Write SHA256SUMS / B3SUMS into DIR/.mm/ for `sha256sum -c` and `b3sum --check` (run from DIR)."""
    from .artifacts.manifest import export_sums_files
    written = export_sums_files(directory, ("sha256", "blake3") if fmt == "both" else (fmt,))
    if json_out:
        emit_json({"ok": True, "written": written})
        return
    for path in written:
        out.print(f"wrote {path}", highlight=False)
    out.print(f"check without mm: cd {directory} && sha256sum -c .mm/SHA256SUMS && b3sum --check .mm/B3SUMS",
              highlight=False)

# --- verify / repair (issue 3) -----------------------------------------------------------------



def _verify_doc(report: VerifyReport) -> dict:
    from .artifacts.verify import summary_counts
    return {"ok": report.ok, **to_jsonable(report), "bytes_per_second": report.bytes_per_second,
            "counts": summary_counts(report.problems)}


def _counts_text(problems) -> str:
    from .artifacts.verify import summary_counts
    return ", ".join(f"{n} {kind}" for kind, n in sorted(summary_counts(problems).items()))


def _render_verify(report: VerifyReport, title: str = "verify") -> None:
    for p in report.problems:
        out.print(f"{p.kind.upper():<10} {p.path}: {p.detail}", markup=False, highlight=False, soft_wrap=True)
    if report.left_out:
        shown = ", ".join(report.left_out[:3]) + (f" and {len(report.left_out) - 3} more" if len(report.left_out) > 3 else "")
        out.print(f"partial fetch ({report.asked}): {len(report.left_out)} file(s) of the revision left out, not "
                  f"judged: {shown}", markup=False, highlight=False, soft_wrap=True)
    read = ("presence, sizes, readability and shard headers (--quick: nothing hashed)" if report.quick else
            f"{human_bytes(report.bytes_checked)} hashed at {human_rate(report.bytes_per_second)}")
    failures = report.failures
    extras = len(report.problems) - len(failures)
    verdict = "OK" if report.ok else f"DAMAGED: {len(failures)} problem(s) ({_counts_text(failures)})"
    if extras:
        verdict += f"; {extras} extra file(s) reported, not failed (--strict fails on them)"
    out.print(f"{title} {report.model_dir} against {report.manifest_path}: {report.files_checked} files, {read}, "
              f"{human_duration(report.seconds)}. {verdict}", markup=False, highlight=False, soft_wrap=True)


def _problems_found(report: VerifyReport, what: str) -> None:
    raise ProblemsFound(f"{report.model_dir}: {len(report.failures)} problem(s) {what} "
                        f"({_counts_text(report.failures)}); see the lines above")


def _next_step(report: VerifyReport) -> str | None:
    """What a user runs after a verify that found damage: repair when a download fixes some of it."""
    from .artifacts.verify import REPAIRABLE
    import shlex
    fixable = [p for p in report.failures if p.kind in REPAIRABLE]
    if report.ok or report.manifest_path.startswith("hub:"):
        return None
    if fixable:
        return (f"next: mm repair {shlex.quote(report.model_dir)}   (re-fetches the {len(fixable)} missing or "
                f"damaged file(s) from the Hub, then verifies again)")
    return "next: nothing a download fixes; fix or remove the files named above by hand"


@main.command()
@click.argument("directory", type=click.Path(path_type=Path, readable=False))  # verify says why it cannot read
@click.option("--manifest", "manifest_file", type=click.Path(path_type=Path),
              help="Manifest to check against. Default: DIR/.mm/manifest.json.")
@click.option("--quick", is_flag=True, help="Presence, sizes, readability and shard headers only; no hashing.")
@click.option("--strict", is_flag=True, help="Files not in the manifest fail too (exit 1); by default they are "
                                             "reported and pass.")
@click.option("--jobs", type=click.IntRange(1, 256), help="Threads. Default: one per core.")
@click.option("--upstream", is_flag=True, help="Check against the Hub's own identities (LFS sha256, git blob sha1), "
                                               "not the manifest; needs the Hub.")
@click.option("--repo", callback=_repo_id, help="With --upstream: the Hub repo. Default: the manifest's.")
@click.option("--revision", callback=_revision, help="With --upstream: the revision. Default: the manifest's commit.")
@click.option("--allowed-signers", type=click.Path(path_type=Path),
              help="OpenSSH allowed_signers file (namespace mm-manifest): the manifest must carry a good signature by "
                   "a key it allows (unsigned or not good: exit 5), checked before every byte. The same meaning in "
                   "verify, unbundle, pull and launch.")
@click.option("--identity", callback=_identity, help="With --allowed-signers: the signer identity (principal) to require.")
@json_option
@handles_errors
def verify(directory, manifest_file, quick, strict, jobs, upstream, repo, revision, allowed_signers, identity, json_out):
    """Check every byte of DIR against its manifest, every file present, every safetensors shard and index
    sound; files not in the manifest are reported (and fail with --strict). A partial fetch is judged on what
    was asked for. Exit 0 all good, 1 problems found, 3 could not run, 5 bad signature."""
    from .artifacts.verify import upstream_target, verify_dir, verify_upstream
    progress = progress_for(json_out)
    signature = None
    if identity and not allowed_signers:
        raise click.UsageError("--identity needs --allowed-signers")
    if upstream:
        if allowed_signers:
            raise click.UsageError("--allowed-signers checks the manifest; --upstream does not use it")
        repo_id, rev = upstream_target(directory, manifest_file, repo, revision)
        report = verify_upstream(directory, repo_id, rev, quick=quick, jobs=jobs, progress=progress, strict=strict)
    else:
        if repo or revision:
            raise click.UsageError("--repo and --revision only apply with --upstream")
        manifest_obj = None
        if allowed_signers:
            signature, manifest_obj = _checked_signature(directory, allowed_signers, identity, manifest_file)
            if not json_out:
                _render_signature(signature)
        report = verify_dir(directory, manifest_obj, quick=quick, jobs=jobs, progress=progress,
                            manifest_file=manifest_file, strict=strict)
        if not quick and manifest_file is None:  # for `mm ls`: when this directory was last verified in full
            from .artifacts.store import record_verified
            record_verified(directory, report.ok, report.files_checked, report.bytes_checked, len(report.problems),
                            "mm verify")
    if json_out:
        emit_json({**_verify_doc(report), "next": _next_step(report),
                   **({"signature": to_jsonable(signature)} if signature else {})})
        sys.exit(0 if report.ok else ProblemsFound.exit_code)
    _render_verify(report)
    if (step := _next_step(report)) is not None:
        out.print(step, markup=False, highlight=False, soft_wrap=True)
    if not report.ok:
        _problems_found(report, "found")


def _checked_signature(directory: Path, allowed_signers: Path, identity: str | None, manifest_file: Path | None = None):
    """(SignatureReport, the Manifest parsed from exactly the bytes whose signature was checked)."""
    from .artifacts import signing
    from .artifacts.manifest import from_dict
    report, data = signing.verify_dir_signature(directory, allowed_signers, identity, manifest_file)
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise MMError(f"{report.signature_path}: signed manifest is not valid JSON ({e})") from None
    return report, from_dict(doc, str(report.signature_path).removesuffix(".sig"))


def _render_signature(report) -> None:
    out.print(f"signature: good, {report.describe()}, allowed by {report.allowed_signers}",
              markup=False, highlight=False, soft_wrap=True)


def _signature_options(fn: Callable) -> Callable:
    """--require-signature / --allowed-signers / --identity for commands that consume a manifest."""
    options = [
        click.option("--require-signature", is_flag=True,
                     help="Kept for scripts: --allowed-signers alone already requires a good signature."),
        click.option("--allowed-signers", type=click.Path(path_type=Path),
                     help="OpenSSH allowed_signers file (namespace mm-manifest): the manifest must carry a good "
                          "signature by a key it allows; unsigned or not good: exit 5, before anything is written. "
                          "The same meaning in verify, unbundle, pull and launch."),
        click.option("--identity", callback=_identity, help="With --allowed-signers: the signer identity (principal) to require."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _render_carried_signature(signature: dict | None, allowed_signers: Path | None) -> None:
    """The signature a bundle or an artifact carried, as unbundle and pull checked it."""
    from .artifacts.signing import SignatureReport
    if signature:
        described = SignatureReport(signature["identity"], signature["key_type"], signature["fingerprint"], "",
                                    str(allowed_signers)).describe()
        out.print(f"signature: good, {described}", highlight=False, markup=False, soft_wrap=True)


def _signature_policy(require_signature: bool, allowed_signers: Path | None, identity: str | None) -> bool:
    """True when a signature is required, which --allowed-signers means on its own everywhere (verify, unbundle,
    pull, launch): naming who may sign and then taking an unsigned manifest would be two meanings. Usage errors
    for options that make no sense together."""
    if require_signature and not allowed_signers:
        raise click.UsageError("--require-signature needs --allowed-signers FILE")
    if identity and not allowed_signers:
        raise click.UsageError("--identity needs --allowed-signers")
    return bool(allowed_signers)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--key", required=True, type=click.Path(path_type=Path),
              help="SSH key for `ssh-keygen -Y sign`: a private key file, or KEY.pub whose key ssh-agent holds "
                   "(keys with a passphrase, hardware keys).")
@json_option
@handles_errors
def sign(directory, key, json_out):
    """Sign DIR/.mm/manifest.json with ssh-keygen (namespace mm-manifest), writing .mm/manifest.json.sig.

    mm never reads the private key: ssh-keygen does, or ssh-agent signs (SSH_AUTH_SOCK)."""
    from .artifacts import signing
    result = signing.sign_manifest(directory, key)
    if json_out:
        emit_json({"ok": True, **to_jsonable(result)})
        return
    _render_signed(result)


def _render_signed(result) -> None:
    from .artifacts import signing
    out.print(f"signed {result.manifest_path} with {result.key_type} key {result.fingerprint}: "
              f"{result.signature_path}", markup=False, highlight=False, soft_wrap=True)
    out.print("check without mm: cd DIR/.mm && " + signing.verify_command(), markup=False, highlight=False,
              soft_wrap=True)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path, readable=False))
@click.option("--jobs", type=click.IntRange(1, 256), help="Verify threads. Default: one per core.")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Files downloaded in parallel.")
@json_option
@handles_errors
def repair(directory, jobs, workers, json_out):
    """Re-fetch only the files verify finds missing or corrupt (from the Hub, at the manifest's commit),
    then verify again. Good files are never touched. Exit 0 repaired, 1 problems remain."""
    from .artifacts import repair as mm_repair
    report = mm_repair.repair_dir(directory, source=mm_repair.HubRepairSource(workers=workers), jobs=jobs, progress=progress_for(json_out))
    if json_out:
        emit_json({"ok": report.ok, "model_dir": report.model_dir, "source": report.source,
                   "restored": report.restored, "before": _verify_doc(report.before), "after": _verify_doc(report.after)})
        sys.exit(0 if report.ok else ProblemsFound.exit_code)
    if not report.restored:  # one pass: the verify that found nothing to re-fetch is the verdict
        _render_verify(report.after, "verify")
        out.print(f"{directory}: nothing to re-fetch (no missing or corrupt files)", highlight=False)
    for path in report.restored:
        out.print(f"RESTORED   {path} (from {report.source})", markup=False, highlight=False)
    if report.restored:
        out.print("re-verify: the restored file(s) hashed; the others were hashed once, before, and not rewritten",
                  markup=False, highlight=False, soft_wrap=True)
        _render_verify(report.after, "re-verify")
    if not report.ok:
        _problems_found(report.after, "remain that re-fetching cannot fix (fix or remove them by hand)")

# --- mirror (issue 4) --------------------------------------------------------------------------




def _render_reconciliation(rec: ms_mirror.Reconciliation) -> None:
    from .artifacts import mirror as ms_mirror
    from rich.table import Table

    table = Table(title=escape(f"{rec.label} vs {rec.repo_id}@{rec.revision[:12]} (pin from {rec.pin_origin})"))
    table.add_column("path", overflow="fold")
    for column in ("status", "pin size", "mirror size", "compared by"):
        table.add_column(column, justify="right" if "size" in column else "left", no_wrap=True)
    style = {ms_mirror.IDENTICAL: "green", ms_mirror.DIFFERENT: "red", ms_mirror.MISSING: "red", ms_mirror.EXTRA: "yellow"}
    for f in rec.files:
        status = f"[{style[f.status]}]{f.status}[/]" + (f" ({escape(f.note)})" if f.note else "")
        table.add_row(escape(f.path), status, "-" if f.pin_size is None else str(f.pin_size),
                      "-" if f.mirror_size is None else str(f.mirror_size), f.compared_by or "-")
    out.print(table)
    out.print(f"Verdict: {rec.label} can supply {rec.supplied_files} of {rec.pin_files} files "
              f"({human_bytes(rec.supplied_bytes)} of {human_bytes(rec.pin_bytes)}) of {rec.repo_id}@{rec.revision[:12]}"
              + ("." if rec.complete else f"; from the Hub: {', '.join(rec.unsupplied())}"), highlight=False, markup=False)


def _render_ranking(ranking: ms_mirror.RevisionRanking) -> None:
    from rich.table import Table

    table = Table(title=f"ModelScope {ranking.modelscope_id}: branches and tags by coverage of the pin")
    for column in ("rank", "revision", "kind", "files", "bytes", "note"):
        table.add_column(column)
    for i, c in enumerate(ranking.ranking, 1):
        table.add_row(str(i), c.ms_revision, c.kind, f"{c.supplied_files}/{c.pin_files}",
                      f"{human_bytes(c.supplied_bytes)}/{human_bytes(c.pin_bytes)}", c.error or "")
    out.print(table)
    if ranking.best is not None:
        _render_reconciliation(ranking.best)


def _mirror_plan(req: mm_fetch.FetchRequest, source: str, mirror_only: bool,
                 pin_manifest: Path | None) -> mm_fetch.SourcePlan | None:
    """`mm fetch --source modelscope[...]`: byte sources from the mirror for the files that match the pin."""
    if source == "hub":
        if mirror_only or pin_manifest:
            raise click.UsageError("--mirror-only and --pin-manifest need --source modelscope")
        return None
    from .artifacts import mirror as ms_mirror
    from .artifacts.pins import pinned_target
    pin = pinned_target(req.repo_id, req.revision).pin
    return ms_mirror.plan_fetch(req, source, pin.modelscope_id if pin else None, mirror_only=mirror_only,
                                pin_manifest=pin_manifest)[0]


def _reconciliation_json(rec: ms_mirror.Reconciliation | None) -> dict | None:
    return None if rec is None else {**to_jsonable(rec), "complete": rec.complete, "label": rec.label}


@main.group()
def mirror():
    """ModelScope mirrors: compare a mirror with the pinned revision by content."""


@mirror.command("reconcile")
@click.argument("repo", required=False, callback=_repo_id)
@click.option("--revision", "-r", callback=_revision, help="The pinned Hub revision. Default: the pin's (manifests/).")
@click.option("--modelscope-id", callback=_repo_id, help="The mirror, OWNER/NAME on ModelScope. Default: the pin's.")
@click.option("--ms-revision", callback=_revision, help="Mirror branch or tag. Default: master (ModelScope's default branch).")
@click.option("--all-revisions", is_flag=True, help="Rank every branch and tag of the mirror by how much of the pin it supplies.")
@click.option("--pin-manifest", "manifest_file", type=click.Path(path_type=Path),
              help="Take the pin's hashes from this mm manifest instead of the Hub (offline from the Hub).")
@click.option("--ms-endpoint", help="ModelScope endpoint. Default: MODELSCOPE_ENDPOINT, else https://modelscope.cn.")
@json_option
@handles_errors
def mirror_reconcile(repo, revision, modelscope_id, ms_revision, all_revisions, manifest_file, ms_endpoint, json_out):
    """Report each file as identical, different, missing on the mirror or extra on it, and what the mirror can supply.

    Matches on path, size and content hash (sha256; git blob sha1 of the mirror's bytes for small non-LFS
    files). Exit 0 whatever the verdict; 4 when the mirror or the Hub cannot be listed.
    """
    from .artifacts import mirror as ms_mirror
    if all_revisions and ms_revision:
        raise click.UsageError("--ms-revision and --all-revisions exclude each other")
    target = ms_mirror.target(repo, revision, modelscope_id)
    pinned = ms_mirror.pinned_for(target, manifest_file)
    if all_revisions:
        ranking = ms_mirror.rank_revisions(pinned, target.modelscope_id, endpoint=ms_endpoint)
        if json_out:
            emit_json({"ok": True, "modelscope_id": ranking.modelscope_id, "ranking": to_jsonable(ranking.ranking),
                       "best": _reconciliation_json(ranking.best)})
        else:
            _render_ranking(ranking)
        return
    rec = ms_mirror.reconcile(pinned, target.modelscope_id, ms_revision or ms_mirror.DEFAULT_MS_REVISION,
                              endpoint=ms_endpoint)
    if json_out:
        emit_json({"ok": True, **_reconciliation_json(rec)})
    else:
        _render_reconciliation(rec)


# --- bundle / unbundle (issue 5) ---------------------------------------------------------------



def payload_options(side: str) -> Callable:
    """One option per payload kind (artifacts/bundle/payloads.py): what `mm bundle` carries (side "source")
    or where `mm unbundle` puts it (side "dest")."""
    def apply(fn: Callable) -> Callable:
        for k in reversed(PAYLOAD_KINDS):
            if side == "source":
                option = click.option(k.source_option, k.source_param, multiple=k.many, type=click.Path(path_type=Path),
                                      help=k.source_help)
            else:
                option = click.option(k.dest_option, k.dest_param, type=click.Path(path_type=Path), help=k.dest_help)
            fn = option(fn)
        return fn
    return apply


def _payload_sources(kw: dict) -> dict[str, list[Path]]:
    values = {k.kind: kw.pop(k.source_param) for k in PAYLOAD_KINDS}
    return {kind: list(v) if isinstance(v, tuple) else ([v] if v else []) for kind, v in values.items()}


@main.group(cls=DefaultGroup, default="create")
def bundle():
    """Pack a model into volumes (`mm bundle DIR --out OUT --volume-size 500G`) or check them (`mm bundle verify VOL...`)."""


@bundle.command("create")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.option("--out", "out_dirs", required=True, multiple=True, type=click.Path(path_type=Path),
              help="Directory for the volume files: one per disk, repeatable (--out /media/disk1 --out /media/disk2): "
                   "filled in order, each volume where it fits (free space is checked before writing).")
@click.option("--volume-size", type=VolumeSize(),
              help="Size of each volume, decimal as disks are sold: 750M, 4G (=4,000,000,000 bytes), 500G, 1.8T; "
                   "binary with 'i': 4GiB. Volume 1 must hold mm's wheelhouse whole.")
@click.option("--name", help="Bundle name used in volume file names. Default: <repo name>-<revision[:12]>.")
@payload_options("source")
@click.option("--cache-key", "cache_key", multiple=True, metavar="KEY=VALUE", callback=_cache_key_pairs,
              help="Key for kernel caches without mm-cache-key.json (gpu=, compute_capability=, driver=, image=, "
                   "recipe=); repeatable. Without either the cache is bundled as unkeyed.")
@click.option("--no-mm", "no_mm", is_flag=True, envvar="MM_BUNDLE_NO_MM",
              help="Leave mm itself out (by default the bundle carries install-mm.sh and a locked wheelhouse of mm and "
                   "its dependencies in volume 1). Environment: MM_BUNDLE_NO_MM=1.")
@click.option("--only-mm", "only_mm", is_flag=True,
              help="No model: write install-mm.sh and wheelhouse/ into --out (to upgrade mm on a host that has the model).")
@click.option("--target-platform", "target_platforms", multiple=True, metavar="linux/amd64|linux/arm64",
              help="The air-gapped host's platform for the wheelhouse (repeatable; default: this host's). "
                   "GB200/GB300 nodes are linux/arm64.")
@click.option("--target-python", "target_pythons", multiple=True, metavar="3.X",
              help="The air-gapped host's CPython minor version (repeatable; default: this host's).")
@click.option("--image-ref", default=None,
              help="The pinned reference --image must be (default: the pin's engine image).")
@click.option("--allow-other-image", is_flag=True,
              help="Carry an --image that is not (or cannot be proven to be) the pinned image; the bundle and the "
                   "start script say so.")
@click.option("--insecure-registry", is_flag=True, help="Plain HTTP or unverified TLS when proving --image against a "
                                                        "registry that is not on loopback (loopback always is).")
@click.option("--no-sync", "no_sync", is_flag=True,
              help="Do not fsync the volumes (a staging disk you copy from with other tools). A rerun still re-checks "
                   "every volume before keeping it; flush (`sync`, unmount) before unplugging the disk.")
@click.option("--parity", type=click.IntRange(0, 31), default=0, show_default=True,
              help="Reed-Solomon parity volumes to add: any that many lost or damaged volumes can be rebuilt "
                   "(e.g. 2 for ten data volumes).")
@click.option("--yes", is_flag=True, help="Write a plan of more than 10,000 volumes (refused otherwise: most likely a "
                                          "--volume-size typo, 100K for 100G).")
@click.option("--base", type=click.Path(path_type=Path),
              help="Make a delta: carry only the files whose content this base revision lacks (its manifest file, "
                   "its model directory, or a volume of its bundle); the destination takes the rest from its copy "
                   "of the base (mm unbundle --from).")
@json_option
@handles_errors
def bundle_create(directory, out_dirs, volume_size, name, cache_key, no_mm, only_mm, target_platforms, target_pythons,
                  image_ref, allow_other_image, insecure_registry, no_sync, parity, yes, base, json_out, **kw):
    """Write the model (and payloads, and mm itself) as self-describing tar volumes, plus --parity volumes; a
    rerun resumes."""
    import contextlib

    from .artifacts import wheelhouse
    from .artifacts.bundle.pack import create_bundle, precheck_volume_count
    from .artifacts.bundle.payloads import CollectOptions
    from .artifacts.errors import BadInput
    sources = _payload_sources(kw)
    if only_mm:
        if directory or volume_size or any(sources.values()) or parity or base:
            raise BadInput("--only-mm writes only install-mm.sh and wheelhouse/ into --out: give no model directory, "
                           "--volume-size or payload")
        if len(out_dirs) > 1:
            raise BadInput("--only-mm writes into one --out directory")
        report = wheelhouse.build_wheelhouse(out_dirs[0], wheelhouse.targets_for(target_platforms, target_pythons),
                                             progress_for(json_out))
        if json_out:
            emit_json({"ok": True, **to_jsonable(report), "size": report.size})
            return
        for s in report.sets:
            out.print(f"{s.name}: {len(s.wheels)} wheels, {human_bytes(s.size)}", highlight=False, markup=False)
        out.print(f"wrote {report.out}/install-mm.sh and {report.out}/wheelhouse/ (mm {report.mm_version}, "
                  f"{human_bytes(report.size)}); on the air-gapped host: sh install-mm.sh [DIR]",
                  highlight=False, markup=False, soft_wrap=True)
        return
    if directory is None or volume_size is None:
        raise BadInput("give the model DIRECTORY and --volume-size (or --only-mm for mm alone)")
    if no_mm and sources.get("mm"):
        raise BadInput("--no-mm and --wheelhouse: choose one")
    if (no_mm or sources.get("mm")) and (target_platforms or target_pythons):
        raise BadInput("--target-platform/--target-python choose the wheelhouse mm bundle builds; "
                       "not with --no-mm or --wheelhouse")
    precheck_volume_count(directory, volume_size, yes)  # a typo in --volume-size ends here, before any work
    progress = progress_for(json_out)
    with contextlib.ExitStack() as stack:
        if not no_mm and not sources.get("mm"):  # built in mm's cache directory, removed after the run
            sources["mm"] = [stack.enter_context(wheelhouse.bundle_wheelhouse(target_platforms, target_pythons,
                                                                              progress))]
        result = create_bundle(directory, list(out_dirs), volume_size, name=name, payloads=sources,
                               cache_key=cache_key, progress=progress, sync=not no_sync, parity=parity,
                               collect=CollectOptions(image_ref=image_ref, allow_other_image=allow_other_image,
                                                      tls_verify=not insecure_registry),
                               yes=yes, on_plan=None if json_out else _render_bundle_plan, base=base)
    if json_out:  # each payload kind under its own key, beside the rest
        emit_json({key: value for field_name, v in to_jsonable(result).items()
                   for key, value in (v.items() if field_name == "payloads" else [(field_name, v)])})
        return
    for note in result.notes:
        err.print(f"note: {note}", markup=False)
    for v in result.volumes:
        out.print(f"{'kept ' if v.kept else 'wrote'} {v.path} ({human_bytes(v.size)})", highlight=False, markup=False, soft_wrap=True)
    for v in result.parity_volumes:
        out.print(f"wrote {v.path} ({human_bytes(v.size)}, parity {v.number} of {len(result.parity_volumes)})",
                  highlight=False, markup=False, soft_wrap=True)
    if result.signed:
        out.print("the manifest's signature travels in every volume (MMBUNDLE/manifest.json.sig)",
                  highlight=False, markup=False, soft_wrap=True)
    parity_part = f" + {len(result.parity_volumes)} parity" if result.parity_volumes else ""
    out.print(f"bundle {result.name} (id {result.bundle_id}): {len(result.volumes)} volume(s){parity_part}, "
              f"{result.files} files, {human_bytes(result.total_bytes)} of data in {human_duration(result.seconds)}. "
              f"Check the disks with: mm bundle verify {' '.join(result.outs)}",
              highlight=False, markup=False, soft_wrap=True)
    if result.delta:
        from .artifacts.bundle.delta import describe
        out.print(f"{describe(result.delta)}; at the destination: mm unbundle VOLUMES --dest NEW_DIR --from BASE_DIR",
                  highlight=False, markup=False, soft_wrap=True)
    carried = result.payloads.get("mm")
    if carried:
        out.print(f"mm {carried['mm_version']} ({', '.join(carried['sets'])}) travels whole in volume 1; on the "
                  f"air-gapped host, where the volumes lie: sh install-mm.sh [DIR]", highlight=False, markup=False,
                  soft_wrap=True)
    if not result.synced:
        out.print(f"not synced (--no-sync): run `sync` or unmount before removing the disk holding "
                  f"{' and '.join(result.outs)}", highlight=False, markup=False, soft_wrap=True)


def _render_bundle_plan(plan) -> None:
    """The plan, before a byte is written: how many volumes, how large, which disk holds which (on stderr, with
    the progress: stdout keeps the results)."""
    parity = f" + {plan.parity} parity volume(s)" if plan.parity else ""
    last = f" (the last {human_bytes(plan.last)})" if plan.volumes > 1 else ""
    err.print(f"plan: {plan.files} files, {human_bytes(plan.data_bytes)}, in {plan.volumes} volume(s) of up to "
              f"{human_bytes(plan.volume_size)}{last}{parity}; {human_bytes(plan.total_bytes)} to the disks",
              highlight=False, markup=False, soft_wrap=True)
    for d in plan.disks:
        err.print(f"  {d.out}: {d.holds} ({human_bytes(d.to_write)} to write, {human_bytes(d.free)} free)",
                  highlight=False, markup=False, soft_wrap=True)
    for note in plan.notes:
        err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)


@bundle.command("verify")
@click.argument("volumes", nargs=-1, required=True, type=click.Path(path_type=Path))
@json_option
@handles_errors
def bundle_verify(volumes, json_out):
    """Check each volume on its own (any order, any subset): OK / CORRUPT / FOREIGN, then the missing ones.

    Exit 0 when every volume given is OK (missing volumes are reported, not failed); 1 otherwise.
    """
    from .artifacts.bundle.check import verify_volumes
    report = verify_volumes(list(volumes), progress=progress_for(json_out))
    if json_out:
        emit_json(report)
    else:
        for v in report.verdicts:
            what = "parity" if v.kind == "parity" else "volume"
            out.print(f"{v.status:<8} {v.path}" + (f"  ({what} {v.volume} of {v.volumes})" if v.volume else ""),
                      highlight=False, markup=False, soft_wrap=True)
            for problem in v.problems:
                out.print(f"         {problem}", highlight=False, markup=False, soft_wrap=True)
        missing = ", ".join(str(n) for n in report.missing) or "none"
        out.print(f"checked {report.files_checked} volume file(s), {human_bytes(report.bytes_checked)} in "
                  f"{human_duration(report.seconds)}", highlight=False, markup=False, soft_wrap=True)
        if report.bundle_id is None:
            out.print("no readable bundle volume among those given", highlight=False, markup=False, soft_wrap=True)
        else:
            out.print(f"bundle {report.name} ({report.bundle_id}): {report.volumes} volume(s); missing: {missing}",
                      highlight=False, markup=False, soft_wrap=True)
            if report.install_mm:
                out.print(f"install: {report.install_mm}", highlight=False, markup=False, soft_wrap=True)
            if report.delta:
                from .artifacts.bundle.delta import describe
                out.print(f"{describe(report.delta)}: mm unbundle VOLUMES --dest NEW_DIR --from BASE_DIR",
                          highlight=False, markup=False, soft_wrap=True)
            if report.parities:
                gone = ", ".join(str(n) for n in report.parity_missing) or "none"
                out.print(f"parity: {report.parities} volume(s); missing: {gone}", highlight=False, markup=False,
                          soft_wrap=True)
            if report.recovery:
                out.print(report.recovery, highlight=False, markup=False, soft_wrap=True)
    if not report.ok:
        bad = [f"{Path(v.path).name} {v.status}" for v in report.verdicts if v.status != "OK"]
        err.print(f"mm: bundle verify: {', '.join(bad)}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(ProblemsFound.exit_code)


@bundle.command("repair-volume")
@click.argument("volumes", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(path_type=Path),
              help="Where rebuilt volume files go. Default: beside the first volume given.")
@click.option("--no-sync", "no_sync", is_flag=True, help="Do not fsync the rebuilt volumes.")
@json_option
@handles_errors
def bundle_repair_volume(volumes, out_dir, no_sync, json_out):
    """Write lost or damaged volume files back from the others and the parity volumes, byte-identical.

    Every volume given is checked first; a rebuilt data volume gets its name only when its whole-file blake3 is
    the one the parity index records. Exit 0 repaired (or nothing to repair), 1 too many volumes lost (the
    message says which would be enough), 3 no usable parity volume."""
    import time

    from .artifacts.bundle.repair import repair_volumes
    started = time.monotonic()
    report = repair_volumes(list(volumes), out_dir, sync=not no_sync, progress=progress_for(json_out))
    if json_out:
        emit_json(report)
        return
    for note in report.notes:
        err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    for path in report.rebuilt:
        out.print(f"rebuilt  {path} (byte-identical, blake3 checked)", highlight=False, markup=False, soft_wrap=True)
    for path in report.parity_rewritten:
        out.print(f"rewrote  {path} (parity)", highlight=False, markup=False, soft_wrap=True)
    written = [Path(p) for p in report.rebuilt + report.parity_rewritten]
    if not written:
        out.print(f"bundle {report.name}: nothing to repair ({len(report.intact)} data volume(s) intact)",
                  highlight=False, markup=False, soft_wrap=True)
    else:
        out.print(f"bundle {report.name}: {len(written)} volume file(s) written, "
                  f"{human_bytes(sum(p.stat().st_size for p in written))}, "
                  f"in {human_duration(time.monotonic() - started)}",
                  highlight=False, markup=False, soft_wrap=True)


@main.command()
@click.argument("volumes", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="The model directory to fill.")
@payload_options("dest")
@click.option("--no-sync", "no_sync", is_flag=True,
              help="Do not fsync imported files (a scratch copy): files are still named only once their hashes match, "
                   "and the final verify still runs; a crash can lose what the page cache held.")
@click.option("--readback", is_flag=True,
              help="Also read each file back from the disk once fsynced (its pages dropped from the page cache) and "
                   "name it only if it still matches: proves the disk holds the bytes, at the cost of a second read.")
@click.option("--from", "base_dir", type=click.Path(path_type=Path),
              help="A delta bundle's base: the directory holding the base revision. Files the delta does not carry are "
                   "taken from there (reflink where the file system clones, else a copy), each hashed.")
@click.option("--link", is_flag=True,
              help="With --from, where no reflink is possible: hard-link the base files instead of copying them. The "
                   "two directories then share one inode per file: damage to one shows in both.")
@_signature_options
@json_option
@handles_errors
def unbundle(volumes, dest, no_sync, readback, base_dir, link, require_signature, allowed_signers, identity, json_out,
             **kw):
    """Import volumes (files or directories, any order, some now and the rest later) into DEST, then verify.

    Exit 0 imported (volumes may still be missing), 5 a volume or member was refused (or a file read back
    with --readback differed), 1 the final verify failed, 7 not enough space.
    """
    import time

    from .artifacts.bundle.unpack import Outcome, unbundle as import_volumes
    if link and base_dir is None:
        raise click.UsageError("--link hard-links files of the base: it needs --from BASE_DIR")
    required = _signature_policy(require_signature, allowed_signers, identity)
    started = time.monotonic()
    report = import_volumes(list(volumes), dest, payload_dests={k.kind: kw[k.dest_param] for k in PAYLOAD_KINDS},
                            progress=progress_for(json_out), sync=not no_sync, allowed_signers=allowed_signers,
                            identity=identity, require_signature=required, readback=readback, base_dir=base_dir,
                            link=link)
    exit_code, why = {Outcome.IMPORTED: (0, ""),
                      Outcome.REFUSED: (IntegrityError.exit_code, "volumes or members refused"),
                      Outcome.VERIFY_FAILED: (ProblemsFound.exit_code, "final verify found problems")}[report.outcome]
    if json_out:
        doc = to_jsonable(report)
        emit_json({"ok": doc.pop("ok"), "exit_code": exit_code, **doc})
    else:
        _render_carried_signature(report.signature, allowed_signers)
        for line in report.refused + report.corrupt:
            err.print(f"refused: {line}", markup=False, highlight=False, soft_wrap=True)
        for note in report.notes:
            err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        if report.rebuilt:
            out.print(f"rebuilt from parity {', '.join(map(str, report.parity_used))}: volume(s) "
                      f"{', '.join(map(str, report.rebuilt))} (each checked whole, then imported)",
                      highlight=False, markup=False, soft_wrap=True)
        if report.recovery:
            out.print(report.recovery, highlight=False, markup=False, soft_wrap=True)
        out.print(f"{len(report.imported)} file(s) imported, {report.skipped} already present, from "
                  f"{len(report.used)} volume(s) of {report.name} ({report.bundle_id}) in "
                  f"{human_duration(time.monotonic() - started)}.", highlight=False, markup=False, soft_wrap=True)
        if report.delta and report.delta.get("mode"):
            d = report.delta
            how = {"reflink": "by reflink (no bytes copied)", "link": "by hard link (--link)",
                   "copy": "by copy (no reflink on this file system)"}[d["mode"]]
            out.print(f"{d['taken']} file(s), {human_bytes(d['taken_bytes'])} taken from the base {d['from']} {how}, "
                      f"each hashed; {d['files_from_base'] - d['taken']} already in place", highlight=False,
                      markup=False, soft_wrap=True)
        if report.complete:
            v = report.verify
            checked = sum(v[k]["bytes"] for k in ("hashed_as_written", "named_earlier_unchanged", "hashed_now"))
            out.print(f"verify {dest}: {'OK' if v['ok'] else 'PROBLEMS'} ({v['files_checked']} files, "
                      f"{human_bytes(checked)}: {v['hashed_as_written']['files']} hashed as they were written, "
                      + (f"{v['named_earlier_unchanged']['files']} named by an earlier run and unchanged, "
                         if v['named_earlier_unchanged']['files'] else "")
                      + f"{v['hashed_now']['files']} hashed now ({human_bytes(v['hashed_now']['bytes'])}); "
                      f"sizes and shard headers checked)", highlight=False, markup=False, soft_wrap=True)
            out.print(f"proven: {v['proven']}", highlight=False, markup=False, soft_wrap=True)
            for problem in v["problems"]:
                out.print(f"  {problem}", highlight=False, markup=False, soft_wrap=True)
            for cmd in report.next_commands:
                out.print(f"next: {cmd}", highlight=False, markup=False, soft_wrap=True)
        else:
            missing = ", ".join(str(n) for n in report.missing_volumes) or "none"
            out.print(f"still missing: volume(s) {missing} of {report.volumes}; {len(report.waiting)} file(s) "
                      f"waiting. Run again with the rest.", highlight=False, markup=False, soft_wrap=True)
        if not report.synced:
            out.print(f"not synced (--no-sync): run `sync` before relying on {dest} surviving a crash",
                      highlight=False, markup=False, soft_wrap=True)
    if exit_code:
        if not json_out:
            err.print(f"mm: unbundle {dest}: {why}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(exit_code)


# --- revisions side by side: ls / use / gc (issue 22) ------------------------------------------

root_option = click.option("--root", type=click.Path(path_type=Path), envvar="MM_ROOT", default=".", show_default=True,
                           help="The model root (ROOT/<repo id>/<revision dir>/). Environment: MM_ROOT.")


@main.command("ls")
@click.argument("root", required=False, type=click.Path(path_type=Path), envvar="MM_ROOT", default=".")
@json_option
@handles_errors
def ls_command(root, json_out):
    """The revisions under ROOT (ROOT/<repo id>/<dir>/): sizes, bytes shared on disk, which is current, when each was
    verified, signatures, containers mounting them."""
    from .artifacts.store import ls
    report = ls(root)
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    for note in report.notes:
        err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    repos = sorted({r.repo_id for r in report.revisions})
    out.print(f"{report.root}: {len(report.revisions)} revision(s) of {len(repos)} repo(s), "
              f"{human_bytes(report.size)} of files, {human_bytes(report.on_disk)} on disk"
              + (f" (sharing saves {human_bytes(report.size - report.on_disk)})" if report.size > report.on_disk else ""),
              highlight=False, markup=False, soft_wrap=True)
    for repo in repos:
        out.print(f"{repo}  (current: {report.pointers.get(repo) or 'none; mm use sets it'})", highlight=False,
                  markup=False, soft_wrap=True)
        for r in (r for r in report.revisions if r.repo_id == repo):
            out.print("  " + _revision_line(r), highlight=False, markup=False, soft_wrap=True)


def _revision_line(r) -> str:
    v = r.verified
    verified = ("never verified in full here" if v is None else
                f"verified {'OK' if v['ok'] else 'with PROBLEMS'} {v['time']} ({v['by']})"
                + ("" if v["current"] else ", before its manifest changed"))
    signature = {"none": "unsigned", "good": f"signed ({r.signer})", "stale": "signature STALE (manifest changed)",
                 "unchecked": "signed (not checked: no ssh-keygen)"}[r.signature]
    mounted = f"; mounted by {', '.join(r.mounted_by)}" if r.mounted_by else ""
    return (f"{'*' if r.current else ' '} {r.revision[:12]}  {r.dir}/  {r.files} files, {human_bytes(r.size)}, "
            f"{human_bytes(r.on_disk)} on disk ({human_bytes(r.shared)} shared); {verified}; {signature}{mounted}")


@main.command("use")
@click.argument("repo", callback=_repo_id)
@click.argument("revision")
@root_option
@json_option
@handles_errors
def use_command(repo, revision, root, json_out):
    """Make REVISION (a commit prefix or its directory name) the current one of REPO under the model root: the
    ROOT/REPO/current symlink is replaced atomically, once `verify --quick` passes on it. A rollback is the same
    command with the earlier revision; a start script that names ROOT/REPO/current serves it at its next start."""
    from .artifacts.store import use
    result = use(root, repo, revision)
    if json_out:
        emit_json({"ok": True, **to_jsonable(result)})
        return
    if not result.changed:
        out.print(f"{result.pointer} -> {result.dir} already ({result.revision[:12]})", highlight=False, markup=False,
                  soft_wrap=True)
        return
    out.print(f"{result.pointer} -> {result.dir} ({result.revision[:12]}); was {result.previous or 'unset'}. "
              f"Containers started through the pointer serve it from their next start"
              + (f"; roll back with: mm use {repo} {result.previous} --root {root}" if result.previous else ""),
              highlight=False, markup=False, soft_wrap=True)


@main.command("gc")
@click.argument("root", required=False, type=click.Path(path_type=Path), envvar="MM_ROOT", default=".")
@click.option("--keep", type=click.IntRange(0, 10_000), default=1, show_default=True,
              help="Revisions to keep besides the current one, the most recently current (or imported) first.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed and freed; remove nothing.")
@json_option
@handles_errors
def gc_command(root, keep, dry_run, json_out):
    """Remove the revisions under ROOT that are not current, not kept (--keep) and not mounted by a running
    container (docker is asked), and say what it frees. Interrupted, it leaves every revision whole or gone;
    the next run finishes."""
    from .artifacts.store import gc
    report = gc(root, keep=keep, dry_run=dry_run)
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    for note in report.notes:
        err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    verb = "would remove" if dry_run else "removed"
    for path in report.leftovers:
        out.print(f"{verb} {path} (left by an interrupted gc)", highlight=False, markup=False, soft_wrap=True)
    for r in report.removed:
        out.print(f"{verb} {r['repo_id']}@{r['revision'][:12]} ({r['dir']}/, {human_bytes(r['size'])} of files)",
                  highlight=False, markup=False, soft_wrap=True)
    for r in report.kept:
        out.print(f"kept   {r['repo_id']}@{r['revision'][:12]} ({r['dir']}/): {r['why']}", highlight=False,
                  markup=False, soft_wrap=True)
    out.print(f"{'would free' if dry_run else 'freed'} {human_bytes(report.freed)} on disk", highlight=False,
              markup=False, soft_wrap=True)


# --- image / doctor (issue 12) ------------------------------------------------------------------

@main.group()
def image():
    """The pinned engine image by identity (`mm image save --out FILE`)."""


@image.command("save")
@click.argument("reference", required=False)
@click.option("--platform", "platform_", default=None, help="linux/amd64 or linux/arm64 (default: this host's).")
@click.option("--out", "out_file", required=True, type=click.Path(path_type=Path), help="The archive to write.")
@click.option("--format", "fmt", type=click.Choice(["docker-archive", "oci-archive"]), default="docker-archive",
              show_default=True, help="docker-archive loads on every Docker; oci-archive needs Docker 25 or newer.")
@click.option("--insecure-registry", is_flag=True, help="Plain HTTP or unverified TLS to a registry that is not on "
                                                         "loopback (loopback always is, as for push and pull).")
@json_option
@handles_errors
def image_save(reference, platform_, out_file, fmt, insecure_registry, json_out):
    """Write REFERENCE (default: the pinned engine image) for one platform to FILE by digest, with skopeo, and the
    chain pinned digest -> platform manifest -> config (image ID) -> layers in FILE.mm-image.json beside it."""
    from .artifacts import image as mm_image
    from .artifacts.pins import default_pin
    ref = reference or default_pin().image
    platform = mm_image.parse_platform(platform_) if platform_ else mm_image.host_platform()
    report = mm_image.save_image(ref, out_file, platform, fmt, tls_verify=not insecure_registry,
                                 show_progress=not json_out and err.is_terminal)
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    c = report.chain
    for line in (f"pinned    {c.reference} ({c.pinned_media_type.rsplit('.', 2)[-2]})",
                 f"platform  {c.platform}: manifest {c.platform_manifest}",
                 f"image ID  {c.config} (config digest; what `docker images --no-trunc` shows after `docker load`)",
                 f"layers    {len(c.layers)}, {human_bytes(sum(layer.size for layer in c.layers))} compressed",
                 f"wrote     {report.archive} ({report.format}, {human_bytes(report.size)}, tag {report.tag})",
                 f"record    {report.record}",
                 f"next: mm bundle MODEL_DIR --image {report.archive} ...  (the bundle proves it is the pinned image)"):
        out.print(line, markup=False, highlight=False, soft_wrap=True)

# --- OCI registry: push / pull / inspect (issue 14) -------------------------------------------

def registry_options(fn: Callable) -> Callable:
    """Auth and transport options shared by push, pull and inspect. The password only ever comes from stdin."""
    for option in reversed([
        click.option("--username", help="Registry user (with --password-stdin). Default: ~/.docker/config.json, or "
                                        "REGISTRY_AUTH_FILE; else anonymous."),
        click.option("--password-stdin", is_flag=True, help="Read the password (or token) from standard input."),
        click.option("--plain-http", is_flag=True, help="Plain HTTP to a registry that is not on loopback (loopback always is)."),
        click.option("--ca-file", type=click.Path(path_type=Path, dir_okay=False),
                     help="PEM CA bundle for the registry's HTTPS certificate. Default: the system's CAs."),
    ]):
        fn = option(fn)
    return fn


def _registry_access(ref_text: str, username: str | None, password_stdin: bool, plain_http: bool, ca_file: Path | None):
    from .artifacts.oci import client as oci_client
    ref = oci_client.parse_reference(ref_text)
    password = None
    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
        if not password:
            raise click.UsageError("--password-stdin: nothing on standard input")
    if password_stdin and not username:
        raise click.UsageError("--password-stdin needs --username")
    creds = oci_client.load_credentials(ref.registry, username, password)
    return creds, oci_client.Transport(plain_http=plain_http, ca_file=ca_file)


def _transfer_summary(items, nbytes: int, seconds: float) -> tuple[Counter, str]:
    """Counts by status, and "(bytes, rate[, N resumed])" for a push or pull report's blobs or files."""
    resumed = sum(1 for item in items if item.resumed_from)
    rate = nbytes / seconds if seconds else 0
    return Counter(item.status for item in items), (f"({human_bytes(nbytes)} in {human_duration(seconds)}, "
                                                    f"{human_rate(rate)}{f', {resumed} resumed' if resumed else ''})")


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.argument("reference")
@registry_options
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Blobs uploaded in parallel.")
@click.option("--chunk-size", default="64MiB", show_default=True, help="Upload big blobs in chunks of this size (PATCH).")
@click.option("--mount-from", metavar="REPOSITORY", help="Another repository of the same registry holding some of the "
                                                         "blobs: mount them instead of uploading.")
@click.option("--max-blob-size", help="Refuse (exit 7, nothing pushed) a file above this size: the registry's single-blob "
                                      "limit (e.g. 100G for distribution on S3 with default parts, 20G for Kraken).")
@json_option
@handles_errors
def push(directory, reference, username, password_stdin, plain_http, ca_file, workers, chunk_size, mount_from,
         max_blob_size, json_out):
    """Push a verified model directory to an OCI registry as a CNCF ModelPack artifact.

    REFERENCE is host[:port]/repository[:tag]; the tag defaults to the manifest's short revision. Refuses
    (exit 1) a directory whose `mm verify --quick` fails. A rerun skips what the registry has and resumes uploads.
    """
    from .artifacts.bundle.format import parse_size
    from .artifacts.oci import push as oci_push
    creds, transport = _registry_access(reference, username, password_stdin, plain_http, ca_file)
    options = oci_push.PushOptions(credentials=creds, transport=transport, workers=workers,
                                   chunk_size=parse_size(chunk_size), mount_from=mount_from,
                                   max_blob_size=parse_size(max_blob_size) if max_blob_size else None)
    report = oci_push.push(directory, reference, options, progress_for(json_out))
    if json_out:
        emit_json({"ok": True, **to_jsonable(report)})
        return
    for note in report.notes:
        err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    counts, moved = _transfer_summary(report.blobs, report.bytes_sent, report.seconds)
    out.print(f"pushed {report.reference} ({report.repo_id}@{report.revision[:12]}): {counts['uploaded']} uploaded "
              f"{moved}, {counts['present']} already there, {counts['mounted']} mounted", markup=False, highlight=False,
              soft_wrap=True)
    out.print(f"digest: {report.digest}", markup=False, highlight=False)
    out.print(f"pull with: mm pull {report.reference.rsplit(':', 1)[0]}@{report.digest} --local-dir DIR",
              markup=False, highlight=False, soft_wrap=True)


def _render_inspect(report) -> None:
    out.print(f"{report.reference} -> {report.digest}", markup=False, highlight=False, soft_wrap=True)
    out.print(f"model: {report.repo_id or '?'} revision {report.revision or '?'}", markup=False, highlight=False)
    fields = ", ".join(f"{k} {v}" for k, v in report.config.items() if isinstance(v, str))
    if fields:
        out.print(f"config: {fields}", markup=False, highlight=False, soft_wrap=True)
    for f in report.files:
        kind = f["media_type"].rsplit(".model.", 1)[-1]
        out.print(f"{human_bytes(f['size']):>10}  {kind:<22} {f['path']}", markup=False, highlight=False, soft_wrap=True)
    signed = {None: "unknown (not pushed by mm)", True: "yes (check with mm pull --allowed-signers FILE)",
              False: "no"}[report.signed]
    out.print(f"{len(report.files)} files, {human_bytes(report.total_bytes)}; mm manifest: "
              f"{'yes' if report.mm_manifest else 'no'}; signed: {signed}", markup=False, highlight=False, soft_wrap=True)


@main.command()
@click.argument("reference")
@click.option("--local-dir", type=click.Path(path_type=Path), help="Target directory (required unless --list).")
@click.option("--list", "list_only", is_flag=True, help="Show the artifact's files, sizes and revision; download nothing.")
@registry_options
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Blobs downloaded in parallel.")
@_signature_options
@json_option
@handles_errors
def pull(reference, local_dir, list_only, username, password_stdin, plain_http, ca_file, workers, require_signature,
         allowed_signers, identity, json_out):
    """Pull a ModelPack artifact that mm pushed, proving every byte (sha256 and blake3) before naming a file.

    The tag is resolved to a digest once; resumes across runs; ends with the quick verify (exit 1 if it fails).
    With --allowed-signers the manifest's signature is checked before anything is written (exit 5 if not good).
    """
    from .artifacts.oci import pull as oci_pull
    required = _signature_policy(require_signature, allowed_signers, identity)
    creds, transport = _registry_access(reference, username, password_stdin, plain_http, ca_file)
    if list_only:
        report = oci_pull.inspect(reference, creds, transport)
        emit_json({"ok": True, **to_jsonable(report)}) if json_out else _render_inspect(report)
        return
    if local_dir is None:
        raise click.UsageError("--local-dir is required (or --list)")
    report = oci_pull.pull(reference, local_dir, creds, transport, workers=workers, progress=progress_for(json_out),
                           allowed_signers=allowed_signers, identity=identity, require_signature=required)
    code = max((f.error_kind.exit_code for f in report.failed), default=0) or (ProblemsFound.exit_code if report.verify_problems else 0)
    if json_out:
        emit_json({"ok": code == 0, **to_jsonable(report)})
        sys.exit(code)
    _render_carried_signature(report.signature, allowed_signers)
    for f in report.failed:
        err.print(f"FAILED {f.path}: {f.error}", markup=False, highlight=False, soft_wrap=True)
    counts, moved = _transfer_summary(report.files, report.bytes_transferred, report.seconds)
    out.print(f"{report.source}: {report.repo_id}@{report.revision[:12]}: {counts['downloaded']} downloaded {moved}, "
              f"{counts['present']} already present, {counts['failed']} failed", markup=False, highlight=False, soft_wrap=True)
    if report.removed:
        out.print(f"removed {len(report.removed)} file(s) of the earlier revision: {', '.join(report.removed[:5])}",
                  markup=False, highlight=False, soft_wrap=True)
    if not report.failed:
        verdict = "OK" if not report.verify_problems else f"{len(report.verify_problems)} problem(s)"
        out.print(f"verify --quick {report.local_dir}: {verdict}", markup=False, highlight=False, soft_wrap=True)
        for problem in report.verify_problems:
            out.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
        out.print(f"Manifest: {report.manifest_path}", markup=False, highlight=False, soft_wrap=True)
        if report.draft_subfolder:  # the pin names a draft model (as fetch says it)
            out.print(f"DSpark draft ({report.draft_subfolder}): {'present' if report.draft_present else 'MISSING'}",
                      markup=False, highlight=False)
    if code:
        if not report.failed:
            err.print(f"mm: {report.local_dir}: quick verify after pull found problems", markup=False, highlight=False)
        sys.exit(code)


@main.command()
@click.argument("reference")
@registry_options
@json_option
@handles_errors
def inspect(reference, username, password_stdin, plain_http, ca_file, json_out):
    """Show a registry artifact's files, sizes, revision and signature status (same as `mm pull --list`)."""
    from .artifacts.oci import pull as oci_pull
    creds, transport = _registry_access(reference, username, password_stdin, plain_http, ca_file)
    report = oci_pull.inspect(reference, creds, transport)
    emit_json({"ok": True, **to_jsonable(report)}) if json_out else _render_inspect(report)


# --- launch / warmup (issue 6) -----------------------------------------------------------------




def _int_list(lo: int, hi: int, what: str, example: str, distinct: str = "") -> Callable:
    """A click callback for a comma-separated list of integers in [LO, HI] (GPU indices, ports); with
    DISTINCT, a value named twice is refused saying why (ports: the plan names what they collide with)."""

    def parse(ctx, param, value):
        if value is None:
            return None
        parts = value.split(",")
        numbers = tuple(int(p) for p in parts if p.strip().isdigit() and len(p.strip()) <= 6)
        if len(numbers) != len(parts) or any(not lo <= n <= hi for n in numbers):
            raise click.BadParameter(f"{printable(value)[:60]!r}: expected {what} like {example} (integers {lo} to {hi})")
        if distinct and len(set(numbers)) != len(numbers):
            raise click.BadParameter(f"{value}: {distinct}")
        return numbers

    return parse


_gpu_list = _int_list(0, 1023, "GPU indices", "0,1,2,3", distinct="a GPU is listed twice (no GPU may serve two replicas)")
_port_list = _int_list(1, 65535, "ports", "30001,30002")


def recipe_options(fn: Callable) -> Callable:
    """The options `mm launch` and `mm warmup` share: they must produce the same command line."""
    options = [
        click.argument("model_dir", type=click.Path(path_type=Path)),
        click.option("--hardware", required=True, callback=_hardware,
                     help="b300, gb300, b200, gb200, h200, h100 (vLLM), mi355x, mi350x (any case: B300 is b300)."),
        click.option("--recipe", default=None, help="balanced, low-latency, high-throughput, ... (default: the hardware's reference)."),
        click.option("--engine", type=click.Choice(["sglang", "vllm"]), default="sglang", show_default=True),
        click.option("--gpus", callback=_gpu_list, default=None,
                     help="GPU indices, e.g. 0,1,2,3 (default: 0..N-1); more than one replica needs: one replica per group."),
        click.option("--replicas", type=click.IntRange(1, 1024), default=None,
                     help="Servers behind the SGLang router (default: as many as --gpus holds; 1 keeps one server, no router)."),
        click.option("--port", type=click.IntRange(1, 65535), default=30000, show_default=True,
                     help="The server's port; with replicas, the router's."),
        click.option("--replica-ports", callback=_port_list, default=None,
                     help="With replicas: their ports on 127.0.0.1 (default: --port+1, --port+2, ...)."),
        click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, help="With replicas: the router's metrics port on 127.0.0.1 (default 29000)."),
        click.option("--tp", type=click.IntRange(1, 1024), default=None,
                     help="Override the recipe's tensor parallel size (revalidate)."),
        click.option("--context-length", type=click.IntRange(1, 2**31 - 1), default=None,
                     help="Cap the context (refused above the recipe's limit)."),
        click.option("--dspark", is_flag=True, help="Require DSpark speculative decoding (refused where the guide says it fails)."),
        click.option("--image", default=None, help="Engine image by digest (default: the pinned SGLang image)."),
        click.option("--image-archive", type=click.Path(path_type=Path), default=None,
                     help="Image archive carried in the bundle; the script runs `docker load -i` when the image is absent."),
        click.option("--cache-root", type=click.Path(path_type=Path), default=None,
                     help="Host directory for kernel caches (default: DIR/../mm-kernel-cache/<recipe>)."),
        click.option("--name", default=None, callback=_container_name,
                     help="Container name. Default: the pin's container_name (minimax-m3-1-flash)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _launch_options(kw: dict, **extra) -> mm_launch.LaunchOptions:
    from .artifacts import launch as mm_launch
    keys = ("hardware", "recipe", "engine", "gpus", "port", "tp", "context_length", "dspark", "image",
            "image_archive", "cache_root", "name", "replicas", "replica_ports", "metrics_port")
    return mm_launch.LaunchOptions(**{k: kw[k] for k in keys}, **extra)


@main.command()
@recipe_options
@click.option("--expose", is_flag=True, help="Publish on all interfaces; then the API key is read from --api-key-env at run time.")
@click.option("--api-key-env", default="MM_API_KEY", show_default=True, help="Environment variable holding the API key (with --expose).")
@click.option("--format", "fmt", type=click.Choice(["sh", "json"]), default="sh", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write it here atomically (a script gets mode 0755, a JSON plan 0644).")
@_signature_options
@json_option
@handles_errors
def launch(model_dir, expose, api_key_env, fmt, out, require_signature, allowed_signers, identity, json_out, **kw):
    """Print (or write) the offline start for MODEL_DIR on the given hardware (replicas behind the router on a node)."""
    from .artifacts import launch as mm_launch, router as mm_router
    signature = _launch_signature(model_dir, require_signature, allowed_signers, identity, json_out)
    node = mm_router.plan_node(model_dir, _launch_options(kw, expose=expose, api_key_env=api_key_env))
    doc = mm_router.node_document(node)
    text = mm_router.render_node_script(node) if fmt == "sh" else json.dumps(doc, indent=2) + "\n"
    if out is not None:
        mm_launch.write_output(text, out, executable=fmt == "sh")
    if json_out:
        emit_json({"ok": True, "out": str(out) if out else None, "format": fmt, "plan": doc,
                   "signature": to_jsonable(signature), **({"script": text} if out is None and fmt == "sh" else {})})
        return
    plan = node.first
    if out is None:
        click.echo(text, nl=False)
    else:
        err.print(f"wrote {out} ({plan.recipe.id}, {plan.recipe.status}, {len(node.replicas)} replica(s))",
                  markup=False, highlight=False)
    for warning in plan.warnings:
        err.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)


def _launch_signature(model_dir: Path, require_signature: bool, allowed_signers: Path | None, identity: str | None,
                      json_out: bool):
    """Check the model's manifest signature before anything is planned or written (exit 5 when refused)."""
    from .artifacts import signing
    if not _signature_policy(require_signature, allowed_signers, identity):
        return None
    report, _ = signing.verify_dir_signature(model_dir, allowed_signers, identity)
    if not json_out:
        err.print(f"signature: good, {report.describe()}", markup=False, highlight=False, soft_wrap=True)
    return report


@main.command()
@recipe_options
@click.option("--timeout", type=float, default=3600, show_default=True, callback=_seconds,
              help="Seconds to wait for /health (a first start compiles kernels).")
@click.option("--report", type=click.Path(path_type=Path), default=None, help="JSON report path (default: <cache root>/mm-warmup-report.json).")
@click.option("--image-file", type=click.Path(path_type=Path), default=None, help="Local PNG for the image check (default: a tiny PNG made in code).")
@click.option("--gpu-info", default=None, help="'NAME, COMPUTE_CAP, DRIVER' for the cache key instead of asking nvidia-smi (required on AMD).")
@json_option
@handles_errors
def warmup(model_dir, timeout, report, image_file, gpu_info, json_out, **kw):
    """Start the server once so kernel caches compile, run the guide's checks, stop it, write a report."""
    from .artifacts import router as mm_router
    from .artifacts import warmup as mm_warmup
    node = mm_router.plan_node(model_dir, _launch_options(kw))
    image_png = mm_warmup.read_image_file(image_file) if image_file else None
    result = mm_warmup.run_warmup(node, timeout=timeout, image_png=image_png, gpu_info=gpu_info,
                                  progress=progress_for(json_out))
    report_path = report or mm_warmup.default_report_path(node.first)
    mm_warmup.write_report(result, report_path, root=None if report else report_path.parent)
    if json_out:
        emit_json({"report": str(report_path), **to_jsonable(result)})
        if not result.ok:
            sys.exit(ProblemsFound.exit_code)
        return
    for check in result.checks:
        mark = "[green]ok[/]" if check.ok else "[red]FAILED[/]"
        where = f"{escape(check.target)}: " if check.target else ""
        out.print(f"{mark} {where}{check.name}: {escape(check.detail)}")
    if result.log_tail:
        err.print(f"last {len(result.log_tail)} log lines of {', '.join(result.containers)}:", markup=False)
        for line in result.log_tail:
            err.print("  " + line, markup=False, highlight=False, soft_wrap=True)
    if result.diagnosis:
        out.print("the guide's troubleshooting table:")
        _render_findings(result.diagnosis)
    out.print(f"report: {escape(str(report_path))}")
    if not result.ok:
        failed = ", ".join(f"{c.name} ({c.detail})" for c in result.failed)
        raise ProblemsFound(result.error or f"warm-up checks failed: {failed}")


@main.command()
@recipe_options
@json_option
@handles_errors
def doctor(model_dir, json_out, **kw):
    """Will this host start MODEL_DIR with this recipe? GPUs, driver, docker, the image by identity, port, /dev/shm,
    host memory, cache disk and key, the model. One line per check with its fix; exit 1 when a check fails."""
    from .artifacts import doctor as mm_doctor
    from .artifacts.pins import default_pin
    report = mm_doctor.run_doctor(model_dir, _launch_options(kw), default_pin())
    if json_out:
        emit_json({"ok": report.ok, **to_jsonable(report), "counts": report.counts})
    else:
        marks = {"ok": "[green]ok  [/]", "warn": "[yellow]WARN[/]", "fail": "[red]FAIL[/]"}
        for c in report.checks:
            fix = f" -> fix: {escape(c.fix)}" if c.fix and c.status != "ok" else ""
            out.print(f"{marks[c.status]} {c.name}: {escape(c.detail)}{fix}", highlight=False, soft_wrap=True)
        n = report.counts
        verdict = "ready to start" if report.ok else "NOT ready"
        out.print(f"doctor {escape(report.model_dir)} ({report.recipe}): {n['ok']} ok, {n['warn']} warning(s), "
                  f"{n['fail']} failed: {verdict}", highlight=False, soft_wrap=True)
    if not report.ok:
        sys.exit(ProblemsFound.exit_code)


@main.command()
@click.argument("logfile", required=False, type=click.Path(path_type=Path))
@click.option("--container", default=None, callback=_container_name,
              help="Read `docker logs NAME` and its mounts instead of a file.")
@click.option("--answer", "answers", multiple=True, type=click.Path(path_type=Path),
              help="A saved HTTP answer or request body (repeatable).")
@click.option("--model-dir", type=click.Path(path_type=Path), default=None,
              help="The model directory: adapt each fix to its recipe (with --hardware and the launch options).")
@click.option("--hardware", default=None, callback=_hardware, help="With --model-dir: the hardware of the launch.")
@click.option("--recipe", default=None)
@click.option("--engine", type=click.Choice(["sglang", "vllm"]), default=None,
              help="The engine that served (its detectors and fixes). Default: the one the logs show, else sglang.")
@click.option("--gpus", callback=_gpu_list, default=None)
@click.option("--port", type=click.IntRange(1, 65535), default=30000, show_default=True)
@click.option("--cache-root", type=click.Path(path_type=Path), default=None)
@click.option("--image", default=None)
@click.option("--host-checks", is_flag=True, help="Also run the table's host checks for that recipe on this host.")
@click.option("--gpu-info", default=None, help="'NAME, COMPUTE_CAP, DRIVER' lines for the GPU host check.")
@json_option
@handles_errors
def diagnose(logfile, container, answers, model_dir, hardware, recipe, engine, gpus, port, cache_root, image,
             host_checks, gpu_info, json_out):
    """Match a server log (or a container's) against the guide's troubleshooting table; exit 1 when a row matches."""
    from .artifacts import diagnose as mm_diagnose, launch as mm_launch
    launch = (mm_launch.LaunchOptions(hardware=hardware, recipe=recipe, engine=engine or "sglang", gpus=gpus, port=port,
                                      cache_root=cache_root, image=image) if hardware else None)
    result = mm_diagnose.run_diagnosis(mm_diagnose.DiagnoseRequest(
        logfile=logfile, container=container, answers=tuple(answers), model_dir=model_dir, launch=launch,
        host_checks=host_checks, gpu_info=gpu_info, engine=engine))
    if json_out:
        emit_json({"ok": result.ok, **to_jsonable(result)})
    else:
        _render_findings(result.findings)
        verdict = (f"{len(result.findings)} row(s) of the guide's troubleshooting table match" if result.findings
                   else "no row of the guide's troubleshooting table matches")
        out.print(f"{verdict} ({result.lines_read} lines read, engine {result.engine} ({result.engine_from})"
                  f"{', recipe ' + result.recipe if result.recipe else ''})", markup=False, highlight=False)
    if not result.ok:
        sys.exit(ProblemsFound.exit_code)


def _render_findings(findings) -> None:
    for f in findings:
        at = f" line {f.line_number}" if f.line_number else ""
        out.print(f"[red]row {f.guide_row}[/] {escape(f.row)}: {escape(f.symptom)}")
        out.print(f"  seen in {escape(f.where)}{at}: {escape(f.line)}", highlight=False)
        out.print(f"  cause: {escape(f.cause)}", highlight=False)
        out.print(f"  fix: {escape(f.fix)}", highlight=False)


# --- examples at the end of every --help (as `hf` does), in one place -----------------------------------------

EXAMPLES: dict[str, tuple[str, ...]] = {
    "mm": ("mm fetch --local-dir /data/models/MiniMax-M3.1-Flash      # the pinned revision",
           "mm verify /data/models/MiniMax-M3.1-Flash",
           "mm bundle /data/models/MiniMax-M3.1-Flash --out /media/disk1 --volume-size 500G",
           "mm unbundle /media/disk1 --dest /data/models/MiniMax-M3.1-Flash   # on the air-gapped host",
           "mm launch /data/models/MiniMax-M3.1-Flash --hardware b300 --out start.sh",
           "mm COMMAND --help    # each command's options and examples"),
    "mm version": ("mm version", "mm -V", "mm version --json"),
    "mm fetch": ("mm fetch --local-dir /data/models/MiniMax-M3.1-Flash             # the pin's repo and revision",
                 "mm fetch Qwen/Qwen3-8B --revision main --local-dir /data/models/Qwen3-8B",
                 "mm fetch --local-dir ./m --include '*.json'                        # a partial fetch, recorded",
                 "mm fetch --local-dir ./m --source modelscope                       # the mirror, then the Hub",
                 "mm fetch --local-dir ./m --json | jq .counts",
                 "mm fetch REPO -r NEW --local-dir ROOT/REPO/NEW --from ROOT/REPO/current   # download what changed"),
    "mm manifest": ("mm manifest ./model --repo Qwen/Qwen3-8B --revision main",
                    "mm manifest ~/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/COMMIT",
                    "mm manifest export ./model"),
    "mm manifest create": ("mm manifest ./model --repo Qwen/Qwen3-8B --revision main      # filled by hf download",
                           "mm manifest ./model --repo Qwen/Qwen3-8B --revision FULL_SHA --offline",
                           "mm manifest ~/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/COMMIT"),
    "mm manifest export": ("mm manifest export ./model && cd ./model && sha256sum -c .mm/SHA256SUMS",
                           "mm manifest export ./model --format blake3"),
    "mm verify": ("mm verify /data/models/MiniMax-M3.1-Flash",
                  "mm verify --quick /data/models/MiniMax-M3.1-Flash          # no hashing: the pre-flight check",
                  "mm verify --strict /data/models/MiniMax-M3.1-Flash         # files not in the manifest fail too",
                  "mm verify --upstream /data/models/MiniMax-M3.1-Flash       # against the Hub's own hashes",
                  "mm verify DIR --allowed-signers allowed_signers --identity release@example.com"),
    "mm sign": ("mm sign /data/models/MiniMax-M3.1-Flash --key ~/.ssh/id_ed25519",
                "mm sign /data/models/MiniMax-M3.1-Flash --key ~/.ssh/id_ed25519.pub   # the key in ssh-agent"),
    "mm repair": ("mm repair /data/models/MiniMax-M3.1-Flash",
                  "mm repair /data/models/MiniMax-M3.1-Flash --json | jq .restored"),
    "mm mirror": ("mm mirror reconcile", "mm mirror reconcile --all-revisions"),
    "mm mirror reconcile": ("mm mirror reconcile                                  # the pin's repo, revision and mirror",
                            "mm mirror reconcile --ms-revision v1.0",
                            "mm mirror reconcile --all-revisions",
                            "mm mirror reconcile --pin-manifest DIR/.mm/manifest.json     # no Hub needed"),
    "mm bundle": ("mm bundle /data/models/MiniMax-M3.1-Flash --out /media/disk1 --volume-size 500G",
                  "mm bundle verify /media/disk1 /media/disk2",
                  "mm bundle repair-volume /media/disk1 /media/disk2"),
    "mm bundle create": ("mm bundle /data/models/MiniMax-M3.1-Flash --out /media/disk1 --volume-size 500G",
                         "mm bundle DIR --out /media/disk1 --volume-size 1.8T --parity 2 --image sglang.tar",
                         "mm bundle --only-mm --out ./mm-upgrade       # mm itself, for a host that has the model",
                         "mm bundle ROOT/REPO/NEW --base ROOT/REPO/OLD --out /media/disk1 --volume-size 500G   # a delta"),
    "mm bundle verify": ("mm bundle verify /media/disk1 /media/disk2",
                         "mm bundle verify /media/disk1/MiniMax-M3.1-Flash-ce7f4df87d2e.vol001-of-003.tar --json"),
    "mm bundle repair-volume": ("mm bundle repair-volume /media/disk1 /media/disk2 /media/parity",
                                "mm bundle repair-volume /media/disk1 --out /media/spare"),
    "mm unbundle": ("mm unbundle /media/disk1 /media/disk2 --dest /data/models/MiniMax-M3.1-Flash",
                    "mm unbundle /media/disk1 --dest DIR        # some volumes now, the rest later",
                    "mm unbundle /media/disk1 --dest DIR --allowed-signers allowed_signers",
                    "mm unbundle /media/disk1 --dest ROOT/REPO/NEW --from ROOT/REPO/OLD   # a delta: the rest from OLD"),
    "mm ls": ("mm ls /data/models",
              "mm ls /data/models --json | jq '.revisions[] | {dir, current, shared}'"),
    "mm use": ("mm use MiniMaxAI/MiniMax-M3.1-Flash 2f3a91c0 --root /data/models",
               "mm use MiniMaxAI/MiniMax-M3.1-Flash ce7f4df8 --root /data/models    # the rollback"),
    "mm gc": ("mm gc /data/models --dry-run",
              "mm gc /data/models --keep 2"),
    "mm image": ("mm image save --out sglang.tar",),
    "mm image save": ("mm image save --out sglang.tar                      # the pinned engine image, this platform",
                      "mm image save --platform linux/arm64 --out sglang-arm64.tar      # for GB200/GB300 nodes",
                      "mm image save 127.0.0.1:5000/lmsysorg/sglang@sha256:DIGEST --out sglang.tar"),
    "mm push": ("mm push /data/models/MiniMax-M3.1-Flash registry.example.com/models/minimax-m3.1-flash",
                "mm push DIR 127.0.0.1:5000/models/flash:v1                # loopback: plain HTTP",
                "echo \"$TOKEN\" | mm push DIR registry.example.com/models/flash --username ci --password-stdin"),
    "mm pull": ("mm pull registry.example.com/models/minimax-m3.1-flash:ce7f4df87d2e --local-dir DIR",
                "mm pull registry.example.com/models/flash@sha256:DIGEST --local-dir DIR --allowed-signers allowed_signers",
                "mm pull registry.example.com/models/flash:ce7f4df87d2e --list"),
    "mm inspect": ("mm inspect registry.example.com/models/minimax-m3.1-flash:ce7f4df87d2e",
                   "mm inspect 127.0.0.1:5000/models/flash:v1 --json | jq .files"),
    "mm launch": ("mm launch /data/models/MiniMax-M3.1-Flash --hardware b300 --out start.sh",
                  "mm launch DIR --hardware B300 --recipe low-latency --format json",
                  "mm launch DIR --hardware h200 --engine vllm --gpus 0,1,2,3,4,5,6,7",
                  "mm launch DIR --hardware b300 --gpus 0,1,2,3,4,5,6,7 --replicas 2   # two servers behind the router"),
    "mm warmup": ("mm warmup /data/models/MiniMax-M3.1-Flash --hardware b300",
                  "mm warmup DIR --hardware b300 --timeout 7200 --report warmup.json"),
    "mm doctor": ("mm doctor /data/models/MiniMax-M3.1-Flash --hardware b300",
                  "mm doctor DIR --hardware gb300 --json"),
    "mm diagnose": ("mm diagnose server.log",
                    "mm diagnose --container minimax-m3-1-flash",
                    "mm diagnose server.log --model-dir DIR --hardware b300 --host-checks"),
}


def _add_examples(cmd: click.Command, path: str = "mm") -> None:
    """Every command's --help ends with its EXAMPLES ("\b": click keeps the lines as written)."""
    cmd.epilog = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[path])
    for name, sub in getattr(cmd, "commands", {}).items():
        _add_examples(sub, f"{path} {name}")


_add_examples(main)


if __name__ == "__main__":
    main()
