"""What mm loads to start: each command's module only when that command runs, no library module, rich
or numpy before a command needs it; `mm --help` lists every command with the first paragraph of its own help.
Speed itself is measured in `make bench` (tests/bench/startup.py), not here."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import click
import pytest

from mm import cli
from tests.support.modelgen import write_model


def loaded_modules(run_mm, *args) -> set[str]:
    """The modules `mm ARGS` imported (python -X importtime, written on stderr), after checking it succeeded."""
    r = run_mm(*args, extra_env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}


def command_modules(modules: set[str]) -> set[str]:
    return {m.removeprefix("mm.commands.") for m in modules if m.startswith("mm.commands.")} - {"shared"}


def test_the_version_flags_load_neither_click_nor_metadata(run_mm):
    for args in (["--version"], ["-V"]):
        assert not {"click", "mm.cli", "importlib.metadata"} & loaded_modules(run_mm, *args), args
    modules = loaded_modules(run_mm, "version")  # the command: through click, but no command module
    assert command_modules(modules) == set() and not {"importlib.metadata", "rich"} & modules


def test_a_commands_help_loads_its_module_alone_and_no_library(run_mm):
    modules = loaded_modules(run_mm, "verify", "--help")
    assert command_modules(modules) == {"verify"}
    assert not {m for m in modules if m.startswith(("mm.artifacts.integrity.verify", "rich", "numpy", "huggingface_hub"))}
    assert command_modules(loaded_modules(run_mm, "bundle", "verify", "--help")) == {"bundle"}


def test_a_commands_help_loads_neither_pathlib_nor_shutil_nor_json(run_mm):
    """What click needs to show a help, and no more: pathlib (with urllib.parse), shutil (with bz2 and lzma) and
    json were nearly half of what `mm verify --help` added to `import click`."""
    assert not {"pathlib", "shutil", "json"} & loaded_modules(run_mm, "verify", "--help")


@pytest.mark.parametrize("columns", ["50", "79", "100", "", "abc"])
def test_a_help_is_wrapped_at_the_width_click_would_choose(run_mm, monkeypatch, columns):
    """mm finds the help's width without shutil: the same as click's own (COLUMNS, else the terminal, else 80)."""
    monkeypatch.setenv("COLUMNS", columns)
    root = click.Context(cli.main, info_name="mm", **cli.main.context_settings)  # click's own width (shutil)
    command = cli.main.get_command(root, "verify")
    command._help_option = None  # click caches it per command: a test before may have built it without mm's -h
    expected = command.get_help(click.Context(command, info_name="verify", parent=root))
    assert run_mm("verify", "--help", extra_env={"COLUMNS": columns}).stdout == expected + "\n"


def test_the_garbage_collector_is_off_while_the_tree_loads_and_back_on_for_the_command():
    """A command's work (hours of fetch or bundle) runs with the collector on; what the start-up made is set
    aside for good (gc.freeze), so collections do not walk the modules again."""
    code = """if True:
        import gc, sys
        from mm.__main__ import main
        sys.argv = ["mm", "version"]
        try:
            main()
        except SystemExit:
            pass
        print(gc.isenabled(), gc.get_freeze_count() > 0)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "True True"


def test_the_top_level_help_lists_every_command_with_the_first_paragraph_of_its_own_help(run_mm):
    r = run_mm("--help")
    assert r.returncode == 0, r.stderr
    rows = r.stdout.split("Commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    listed = dict(row.split(None, 1) for row in rows)  # one line each: the paragraph's start, cut to the width
    ctx = click.Context(cli.main, info_name="mm")
    assert sorted(listed) == cli.main.list_commands(ctx)
    for name, line in listed.items():
        first_paragraph = " ".join(cli.main.get_command(ctx, name).help.split("\n\n", 1)[0].split())
        assert len(line) > 30 and first_paragraph.startswith(line.removesuffix("...")), name


def test_every_command_a_module_defines_is_named_in_the_root_with_that_module():
    """The root finds a command by the module COMMANDS names for it: a command added to a module and not there
    would be unreachable; one named there and not in its module would fail only when asked for."""
    defined = {}
    for module_name in cli.MODULES:
        module = importlib.import_module(f"mm.commands.{module_name}")
        commands = {obj for obj in vars(module).values() if isinstance(obj, click.Command)}
        subcommands = {sub for c in commands if isinstance(c, click.Group) for sub in c.commands.values()}
        defined.update({c.name: module_name for c in commands - subcommands})
    assert defined == cli.COMMANDS


def test_a_quick_verify_loads_neither_numpy_nor_openssl_nor_another_command(run_mm, tmp_path):
    """It hashes nothing, so hashlib (OpenSSL, ~8 ms), blake3 and mm's hashing stay unloaded too."""
    model = tmp_path / "model"
    write_model(model, shards=2, shard_bytes=4096)
    assert run_mm("manifest", model, "--repo", "o/r", "--revision", "a" * 40, "--offline").returncode == 0
    modules = loaded_modules(run_mm, "verify", model, "--quick")
    assert command_modules(modules) == {"verify"}
    assert not {"numpy", "hashlib", "blake3", "mm.artifacts.integrity.hashing"} & modules
    assert "mm.artifacts.integrity.safetensors_check" in modules


def test_a_verify_whose_output_goes_to_a_pipe_loads_no_rich(run_mm, tmp_path):
    """Plain lines into a pipe are written as they are: rich (~45 ms) is for a terminal's bar and styles."""
    model = tmp_path / "model"
    write_model(model, shards=2, shard_bytes=4096)
    assert run_mm("manifest", model, "--repo", "o/r", "--revision", "a" * 40, "--offline").returncode == 0
    assert not {m for m in loaded_modules(run_mm, "verify", model, "--quick") if m.startswith("rich")}


def test_a_full_verify_loads_no_numpy_either(run_mm, tmp_path):
    """The structure checks read headers with safetensors.deserialize: importing numpy beside the hashing (~70 ms of
    CPU) bought nothing and held every verify back."""
    model = tmp_path / "model"
    write_model(model, shards=2, shard_bytes=4096)
    assert run_mm("manifest", model, "--repo", "o/r", "--revision", "a" * 40, "--offline").returncode == 0
    modules = loaded_modules(run_mm, "verify", model)
    assert "numpy" not in modules and "mm.artifacts.integrity.safetensors_check" in modules


def test_a_top_level_typo_names_the_command_it_was_near(run_mm):
    r = run_mm("verfy", "DIR")
    assert r.returncode == 2 and "No such command 'verfy'" in r.stderr
    if hasattr(click.exceptions, "NoSuchCommand"):  # click 8.4 and later suggest; mm offers every command to it
        assert "Did you mean 'verify'?" in r.stderr


def test_the_version_printed_is_the_installed_distributions(run_mm):
    installed = importlib.metadata.version("mm")
    line = f"mm, version {installed}\n"
    assert run_mm("--version").stdout == run_mm("-V").stdout == run_mm("version").stdout == line
    assert run_mm("-V", "version").stdout == line  # --version among other arguments: click's version option
    assert json.loads(run_mm("version", "--json").stdout)["version"] == installed


def test_the_version_into_a_closed_pipe_ends_quietly():
    from tests.support.run import mm_argv
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before mm writes: EPIPE, as `mm --version | true` can meet
    try:
        r = subprocess.run(mm_argv("--version"), stdout=write_end, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write_end)
    assert r.returncode == 141 and r.stderr == b""
