"""mm command line: the root of the command tree.

The commands live in commands/, one module per area, each imported only when one of its commands runs (or shows its
--help): `mm verify --help` loads click, this module, commands/shared.py (what every command uses) and
commands/verify.py, and no library module; `mm --version` is answered before any of them (__main__.py). A command's
help, its line in `mm --help` (the help's first paragraph) and its examples live with it, in its module. This module
holds what the root needs without them: which module defines each command, the root's own examples, `mm version`,
and the guard that ends any failure in mm's one-line error and documented exit code. Commands parse their options,
call artifacts/, and render (rich on a terminal, or one JSON document); nothing else.
"""
from __future__ import annotations

import functools
import os
import sys
import threading

import click

from ._version import __version__
from .artifacts.errors import BadInput, BadValue
from .commands.shared import emit_json, examples, fail, json_option, report_interrupt, thread_failed

# Each module in commands/ and the top-level commands it defines under these names, each with its help (whose first
# paragraph is the command's line in `mm --help`) and its examples. A module is imported when one of its commands runs
# or shows its --help; `mm --help` imports them all, for their lines.
MODULES = {"bundle": "bundle unbundle", "fetch": "fetch manifest mirror", "image": "image",
           "launch": "launch warmup doctor diagnose", "oci": "push pull inspect preheat", "store": "ls use gc",
           "tiers": "fleet", "verify": "verify sign repair"}
COMMANDS = {name: module for module, names in MODULES.items() for name in names.split()}

# click 8.4 and later name the closest command in "No such command" (`mm verfy`: "Did you mean 'verify'?")
_NO_SUCH_COMMAND = getattr(click.exceptions, "NoSuchCommand", ())


class MMGroup(click.Group):
    """The top-level group: each command loaded from its module when it runs, click's usage errors in mm's
    one-line format (exit 2), and a last guard so that nothing, even outside a command, ends in a traceback or in
    exit 1."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            # the import statement's own path (importlib.import_module would hide it from python -X importtime)
            module = __import__(f"commands.{COMMANDS[cmd_name]}", globals(), fromlist=["_"], level=1)
            self.add_command(getattr(module, cmd_name), cmd_name)
        return self.commands.get(cmd_name)

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        if parent is None and "terminal_width" not in extra and click.formatting.FORCED_WIDTH is None:
            extra["terminal_width"] = _help_width()
        return super().make_context(info_name, args, parent, **extra)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            resolved = super().resolve_command(ctx, args)
        except _NO_SUCH_COMMAND as e:  # click suggests a close name among the commands loaded: offer them all
            raise type(e)(e.command_name, possibilities=self.list_commands(ctx), ctx=ctx) from None
        _start_up_over()
        return resolved

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = _json_after_command(list(sys.argv[1:] if args is None else args))
        json_out = "--json" in args
        threading.excepthook = thread_failed
        if threading.current_thread() is threading.main_thread():  # (click's test runner may call from elsewhere)
            from .artifacts.edges import interrupt
            interrupt.install(functools.partial(report_interrupt, json_out, args))
        try:
            rv = super().main(args, prog_name=prog_name or "mm", complete_var=complete_var, standalone_mode=False,
                              **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help() if e.ctx else "", err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx else ""
            fail(BadValue(f"{_named_elsewhere(e) or e.format_message()}{hint}"), "mm", json_out)
        except click.ClickException as e:
            fail(BadInput(e.format_message()), "mm", json_out)
        except click.exceptions.Abort:
            fail(KeyboardInterrupt(), "mm", json_out)
        except SystemExit:
            raise
        except BaseException as e:
            fail(e, "mm " + " ".join(a for a in args[:2] if not a.startswith("-")), json_out)
        sys.exit(rv if isinstance(rv, int) else 0)


# What a user carries over from one mm command (or another tool) to one that spells it otherwise: the model
# directory is --dest for unbundle and --local-dir for fetch and pull (hf download's name); written files go to --out.
_SPELLED_OTHERWISE = {"--dest": ("--local-dir",), "--local-dir": ("--dest",), "--output": ("--out",),
                      "--out-dir": ("--out",), "--output-dir": ("--out",), "--target": ("--local-dir", "--dest")}


def _named_elsewhere(e: click.UsageError) -> str | None:
    """`mm pull --dest D`: say the name this command gives it (--local-dir), not click's nearest spellings
    (--identity, --list)."""
    if not isinstance(e, click.exceptions.NoSuchOption) or e.ctx is None:
        return None
    own = {name for param in e.ctx.command.params for name in getattr(param, "opts", ())}
    named = [name for name in _SPELLED_OTHERWISE.get(e.option_name, ()) if name in own]
    return f"No such option {e.option_name!r}: {e.ctx.command_path} calls it {named[0]}" if named else None


def _start_up_over() -> None:
    """The command's module is loaded: the garbage collector, off since the console script started (__main__.py),
    comes back on, with every object made so far set aside for good (gc.freeze: modules, classes and functions,
    which live as long as the process) so that no collection walks them again."""
    import gc

    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _help_width() -> int:
    """The width click's help formatter gives itself (COLUMNS, else the terminal's, else 80; at most 78), found
    without shutil.get_terminal_size: importing shutil, with the compression modules it loads, cost `mm verify
    --help` twice what its own command module does."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return max(min(columns or 80, 80) - 2, 50)


def _json_after_command(args: list[str]) -> list[str]:
    """`mm --json COMMAND ...` is `mm COMMAND ... --json`: every command has --json, so it may come first too."""
    if "--json" not in args:
        return args
    at = args.index("--json")
    rest = args[:at] + args[at + 1:]
    if any(not a.startswith("-") for a in args[:at]) or all(a.startswith("-") for a in rest):
        return args  # after the command (its own option), or no command at all (click says so)
    end = rest.index("--") if "--" in rest else len(rest)
    return rest[:end] + ["--json"] + rest[end:]


@examples(
    "mm fetch --local-dir /data/models/MiniMax-M3.1-Flash      # the pinned revision",
    "mm verify /data/models/MiniMax-M3.1-Flash",
    "mm bundle /data/models/MiniMax-M3.1-Flash --out /media/disk1 --volume-size 500G",
    "mm unbundle /media/disk1 --dest /data/models/MiniMax-M3.1-Flash   # on the air-gapped host",
    "mm launch /data/models/MiniMax-M3.1-Flash --hardware b300 --out start.sh",
    "mm COMMAND --help    # each command's options and examples")
@click.group(cls=MMGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="mm")
def main() -> None:
    """mm: fetch a pinned model revision, prove every byte, carry it across an air gap, start it offline."""


@examples(
    "mm version",
    "mm -V",
    "mm version --json")
@main.command()
@json_option
def version(json_out):
    """Print mm's version (as `mm --version` and `mm -V` do)."""
    if json_out:
        emit_json({"ok": True, "version": __version__})
    else:
        click.echo(f"mm, version {__version__}")


if __name__ == "__main__":
    main()
