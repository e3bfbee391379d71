"""What mm loads to start: each command's module only when that command runs, no library module, rich
or numpy before a command needs it, and `mm --help` from the registry in cli.py, which must say what each command's
own help says. Speed itself is measured in `make bench` (tests/bench/startup.py), not here."""
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


def test_the_top_level_help_loads_no_command(run_mm):
    assert command_modules(loaded_modules(run_mm, "--help")) == set()


def test_a_quick_verify_loads_neither_numpy_nor_openssl_nor_another_command(run_mm, tmp_path):
    """It hashes nothing, so hashlib (OpenSSL, ~8 ms) stays unloaded too."""
    model = tmp_path / "model"
    write_model(model, shards=2, shard_bytes=4096)
    assert run_mm("manifest", model, "--repo", "o/r", "--revision", "a" * 40, "--offline").returncode == 0
    modules = loaded_modules(run_mm, "verify", model, "--quick")
    assert command_modules(modules) == {"verify"}
    assert not {"numpy", "hashlib"} & modules and "mm.artifacts.integrity.safetensors_check" in modules


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


@pytest.mark.parametrize("limit", [20, 45, 60, 80, 300])
def test_the_registry_line_is_the_commands_own_short_help(limit):
    ctx = click.Context(cli.main, info_name="mm")
    for name, (module, summary) in cli.COMMANDS.items():
        command = cli.main.get_command(ctx, name)
        assert command is not None and command.name == name, name
        assert command.callback.__module__ == f"mm.commands.{module}", name
        assert click.Command(name, help=summary).get_short_help_str(limit) == command.get_short_help_str(limit), name


def test_the_top_level_help_is_the_same_before_and_after_every_command_is_loaded():
    # a fresh interpreter: in this one, other tests may have loaded commands already
    code = """if True:
        import json, sys, click
        from mm.cli import main
        helps = {}
        for width in (60, 80):
            helps[width] = main.get_help(click.Context(main, info_name="mm", terminal_width=width))
        loaded = sorted(m for m in sys.modules if m.startswith("mm.commands.") and m != "mm.commands.shared")
        ctx = click.Context(main, info_name="mm")
        every = [main.get_command(ctx, name).name for name in main.list_commands(ctx)]
        full = {w: main.get_help(click.Context(main, info_name="mm", terminal_width=w)) for w in (60, 80)}
        print(json.dumps({"lazy": helps, "full": full, "loaded": loaded, "every": every}))
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["loaded"] == [] and doc["lazy"] == doc["full"]
    assert len(doc["every"]) == len(cli.COMMANDS) + 1  # and `mm version`, defined in cli.py
    assert all(f"  {name} " in doc["lazy"]["80"] for name in doc["every"])


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
