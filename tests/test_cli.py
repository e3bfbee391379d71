"""The command line as a whole: every command speaks JSON, user errors never show a traceback."""
from __future__ import annotations

import json
import shlex

import click

from mm import cli
from mm.commands.shared import DefaultGroup


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


def every_command(command: click.Command, path: str = "mm"):
    """(path, command) for the root, every group and every command under it (the root loads each module here)."""
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command, info_name=path)
        for name in command.list_commands(ctx):
            yield from every_command(command.get_command(ctx, name), f"{path} {name}")


def command_run_by(example: str) -> str:
    """The path of the command an example line runs (`mm bundle DIR ...` runs `mm bundle create`, `mm -V` runs
    `mm version`)."""
    argv = next(part for part in example.replace("&&", "|").split("|") if part.strip().startswith("mm"))
    words = shlex.split(argv, comments=True)[1:]
    if words[:1] in (["-V"], ["--version"]):
        return "mm version"
    path, command = "mm", cli.main
    for word in words:
        if not isinstance(command, click.Group):
            break
        sub = command.get_command(click.Context(command, info_name=path), word)
        if sub is None and isinstance(command, DefaultGroup):
            word, sub = command.default_command, command.commands[command.default_command]
        if sub is None:
            break
        path, command = f"{path} {word}", sub
    return path


def test_a_commands_help_ends_with_its_own_examples_and_no_other_commands():
    """Examples are written over the command they show (commands/*.py): each --help ends with them, and every line
    runs that command (a group's lines, it or its subcommands), never another's."""
    for path, command in every_command(cli.main):
        with click.Context(command, info_name=path) as ctx:
            help_text = command.get_help(ctx)
        assert "\n  Examples:\n" in help_text, path
        shown = [line.strip() for line in help_text.split("\n  Examples:\n", 1)[1].splitlines() if line.strip()]
        assert shown and help_text.rstrip().endswith(shown[-1]), path
        for line in shown:
            runs = command_run_by(line)
            assert path == "mm" or runs == path or runs.startswith(f"{path} "), (path, line)


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


def _verified_model(tmp_path):
    from mm.artifacts.fetching.adopt import manifest_for_local_dir
    from tests.support.modelgen import write_model

    model = tmp_path / "model"
    write_model(model, shards=2, shard_bytes=4096)
    manifest_for_local_dir(model, "o/r", "a" * 40, offline=True)
    return model


def _with_stdout(redirect: str) -> tuple[str, ...]:
    """A run_mm prefix: mm started by sh with its stdout redirected (REDIRECT, e.g. `>&-`)."""
    return ("sh", "-c", f'exec "$0" "$@" {redirect}')


def test_output_to_a_full_disk_names_that_file_not_the_model_and_exits_7(run_mm, tmp_path):
    model = _verified_model(tmp_path)
    for json_flag in ((), ("--json",)):
        r = run_mm("verify", model, "--quick", *json_flag, prefix=_with_stdout("> /dev/full"))
        assert r.returncode == 7, r.stderr
        assert r.stderr.startswith("mm: /dev/full: no space left on device") and str(model) not in r.stderr
        assert len(r.stderr.splitlines()) == 1


def test_a_closed_stdout_is_one_line_and_exit_3_not_a_bug(run_mm, tmp_path):
    model = _verified_model(tmp_path)
    for json_flag in ((), ("--json",)):
        r = run_mm("verify", model, "--quick", *json_flag, prefix=_with_stdout(">&-"))
        assert r.returncode == 3, r.stderr
        assert r.stderr == ("mm: standard output is closed, so mm cannot print its report; run it with its output "
                            "going to a file, a pipe or /dev/null\n")


def test_a_closed_stderr_still_ends_with_the_errors_exit_code(run_mm, tmp_path):
    r = run_mm("verify", tmp_path / "absent", prefix=("sh", "-c", 'exec "$0" "$@" 2>&-'))
    assert r.returncode == 3 and r.stdout == ""
