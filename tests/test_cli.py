"""The command line as a whole: every command speaks JSON, user errors never show a traceback."""
from __future__ import annotations

import json

import click

from mm import cli


def leaf_commands(group: click.Group, prefix: str = "mm") -> dict[str, click.Command]:
    found = {}
    ctx = click.Context(group, info_name=prefix)
    for name in group.list_commands(ctx):  # the root loads each command's module here
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            found.update(leaf_commands(command, f"{prefix} {name}"))
        else:
            found[f"{prefix} {name}"] = command
    return found


def test_every_command_has_a_json_option():
    missing = [name for name, command in leaf_commands(cli.main).items()
               if "--json" not in {opt for p in command.params for opt in getattr(p, "opts", [])}]
    assert missing == []


def test_a_user_error_with_json_prints_one_json_document(run_mm, tmp_path):
    r = run_mm("verify", str(tmp_path), "--json")
    assert r.returncode == 3
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 3 and str(tmp_path) in doc["error"]
    assert "Traceback" not in r.stderr


def test_bare_directory_argument_runs_the_default_subcommand(run_mm, tmp_path):
    r = run_mm("manifest", str(tmp_path), "--repo", "o/r", "--revision", "main", "--offline")
    assert r.returncode == 2 and "full 40-hex commit" in r.stderr


def test_a_name_that_spells_an_emoji_code_is_printed_as_named(capsys):
    """rich turns ":warning:" into a sign by default; a file or directory name must read as it is named."""
    from mm.commands.shared import _console

    _console(stderr=False).print("repair /models/:warning:.bin: nothing to re-fetch", highlight=False)
    assert capsys.readouterr().out == "repair /models/:warning:.bin: nothing to re-fetch\n"


def test_a_plain_line_is_written_as_rich_would_write_it(capsys):
    """The plain-line shortcut (no rich import) writes the bytes rich would: tabs and control characters escaped,
    long lines never wrapped."""
    from mm.commands.shared import _console, out

    line = "EXTRA      " + "x" * 300 + "\tname\x1b[31m :warning:"
    out.print(line, markup=False, highlight=False, soft_wrap=True)
    shortcut = capsys.readouterr().out
    _console(stderr=False).print(printable_line := shortcut.removesuffix("\n"), markup=False, highlight=False,
                                 soft_wrap=True)
    assert capsys.readouterr().out == shortcut == printable_line + "\n"
    assert "\\t" in shortcut and "\\x1b" in shortcut
