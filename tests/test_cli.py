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
