"""The `mm` console script (and `python -m mm`): `mm --version` and `mm -V` answered before click loads, `mm verify
DIR` given a head start (its hashing begins before click loads: artifacts/integrity/early.py), the rest handed to the
command tree (cli.main).

Importing click and the root costs ~35 ms of CPU, most of a start; a version check (scripts, `make` targets, the
install check) needs none of it. The line is click's version_option's (`mm, version X`), printed by cli.main too
when --version comes with other arguments.
"""
from __future__ import annotations

import gc
import os
import sys


def main() -> int:
    if sys.argv[1:] in (["--version"], ["-V"]) and "_MM_COMPLETE" not in os.environ:
        return _print_version()
    # No garbage collection while the command tree loads: imports make long-lived objects and almost no garbage,
    # and each collection would walk them all again (click and the command's module: ~10% of `mm verify --help`).
    # The tree turns it back on once the command is known (cli._start_up_over).
    gc.disable()
    if sys.argv[1:2] != ["verify"]:
        return _command_tree()
    # `mm verify DIR`: its large files start hashing now, in threads, while the tree loads (~0.2 s of a start on two
    # of the GPU host's cores); the verify takes their digests if it is exactly what was started (early.py)
    from .artifacts.integrity import early
    try:
        early.begin(sys.argv[1:])
        return _command_tree()
    except KeyboardInterrupt:
        return _interrupted()
    finally:
        early.discard()


def _command_tree() -> int:
    try:
        from .cli import main as command_tree
        return command_tree()
    except KeyboardInterrupt:
        return _interrupted()


def _interrupted() -> int:
    """Ctrl-C before the tree took SIGINT over (interrupt.install): the line and exit code of one after."""
    from .artifacts.edges.interrupt import Interrupted
    from .commands.shared import report_interrupt
    interrupted = Interrupted()
    report_interrupt("--json" in sys.argv[1:], sys.argv[1:], interrupted)
    return interrupted.exit_code


def _print_version() -> int:
    from ._version import __version__

    if sys.stdout is None:  # no stdout at all: nothing to say (as click.echo does)
        return 0
    try:
        sys.stdout.write(f"mm, version {__version__}\n")
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`mm --version | true`): end as tools do, silently (as fail does)
        from .commands.shared import quiet_stdout
        quiet_stdout()
        return 141
    return 0


if __name__ == "__main__":
    sys.exit(main())
