"""`make demo` on a fresh machine: it installs every tool the demo runs, and a missing one is one line.

The tools are derived from the demo's own code, not listed by hand: every program that tests/support/demo.py and
the tests/support modules it uses (imported, or started as servers) run through subprocess, look up with
shutil.which, or name in the shell script the demo runs. Those from Debian's Essential packages (coreutils, dash,
util-linux: on every Debian machine) need nothing; every other one must be in the demo's NEEDS and installed by
the Makefile's demo target.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

from tests.support import demo

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = ROOT / "tests" / "support"
RUNS = {"subprocess.run", "subprocess.Popen", "subprocess.check_output", "subprocess.check_call", "subprocess.call",
        "run"}  # run: the demo's own step runner
SHELL_WORDS = {"set", "cd", "exec", "export", "if", "then", "else", "fi", "for", "do", "done", "echo", "exit", "true"}


def _dotted(node: ast.AST) -> str:
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def demo_modules() -> list[Path]:
    """demo.py and the tests/support modules it uses, transitively: imported, or started by name as servers."""
    todo, seen = ["demo"], {}
    while todo:
        name = todo.pop()
        path = SUPPORT / f"{name}.py"
        if name in seen or not path.exists():
            continue
        seen[name] = path
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "tests.support":
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.support."):
                todo.append(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.Call) and _dotted(node.func) == "start_server" and len(node.args) > 1:
                if isinstance(node.args[1], ast.Constant):
                    todo.append(node.args[1].value)
    return list(seen.values())


def programs_run_by(path: Path) -> set[str]:
    """The programs PATH's code runs: argv[0] of its subprocess calls (a literal, or a module constant such as
    REGISTRY_BIN = os.environ.get(..., "/usr/bin/docker-registry")), shutil.which's names, and the first word of
    each line of a shell script it holds."""
    tree = ast.parse(path.read_text())
    constants: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and _dotted(value.func) == "os.environ.get" and len(value.args) == 2:
                value = value.args[1]  # the default: what runs unless a test points elsewhere
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                constants[node.targets[0].id] = value.value
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name, first = _dotted(node.func), node.args[0]
        if name in RUNS and isinstance(first, (ast.List, ast.Tuple)) and first.elts:
            program = first.elts[0]
            if isinstance(program, ast.Constant) and isinstance(program.value, str):
                found.add(program.value)
            elif isinstance(program, ast.Name) and program.id in constants:
                found.add(constants[program.id])
        elif name == "shutil.which" and isinstance(first, ast.Constant):
            found.add(first.value)
    for text in constants.values():
        if text.startswith("#!/bin/sh") or "\nset -eu\n" in text:
            for line in text.splitlines():
                word = line.split("#", 1)[0].split()[:1]
                if word and re.fullmatch(r"[a-z][a-z0-9._+-]*", word[0]) and word[0] not in SHELL_WORDS:
                    found.add(word[0])
    return {Path(p).name for p in found}


@cache
def debian_package(program: str) -> tuple[str, bool] | None:
    """(the Debian package that installs PROGRAM here, whether it is Essential), or None when none does."""
    where = shutil.which(program, path=os.pathsep.join([os.environ["PATH"], "/usr/sbin", "/sbin"]))
    if where is None:
        return None
    for candidate in dict.fromkeys([where, os.path.realpath(where)]):
        for path in dict.fromkeys([candidate, re.sub(r"^/usr/", "/", candidate)]):  # merged /usr: dpkg knows /bin
            owner = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
            for line in owner.stdout.splitlines():
                packages, _, owned = line.partition(": ")
                if owned == path and not packages.startswith("diversion by"):
                    package = packages.split(",")[0].split(":")[0].strip()
                    essential = subprocess.run(["dpkg-query", "-W", "-f", "${Essential}", package],
                                               capture_output=True, text=True).stdout.strip() == "yes"
                    return package, essential
    return None


def test_the_tools_the_demo_runs_are_the_ones_make_demo_installs(tmp_path):
    modules = demo_modules()
    assert {p.stem for p in modules} >= {"demo", "hubserver", "msserver", "gitrepo", "registry", "fake_docker"}
    programs = set().union(*(programs_run_by(p) for p in modules))
    assert {"git", "docker-registry", "sha256sum", "unshare", "ip"} <= programs, programs  # the derivation works
    needed = {}
    for program in sorted(programs):
        found = debian_package(program)
        assert found is not None or program in demo.NEEDS, f"the demo runs {program}, which no Debian package installs"
        if found is None or not found[1]:
            needed[program] = found[0] if found else None
    assert set(needed) == set(demo.NEEDS), f"the demo runs {sorted(needed)}; its NEEDS are {sorted(demo.NEEDS)}"
    assert all(package in (None, demo.NEEDS[p]) for p, package in needed.items()), (needed, demo.NEEDS)
    make = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", "demo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert make.returncode == 0, make.stderr
    checks = [line for line in make.stdout.splitlines() if "apt-get install" in line]
    assert len(checks) == 1, f"make demo installs no tools (or installs them twice):\n{make.stdout}"
    check = checks[0]
    checked = re.search(r"for t in ([^;]*);", check).group(1).split()
    installed = re.search(r"apt-get install -y -qq ([^>]*)>", check).group(1).split()
    assert set(demo.NEEDS) <= set(checked) and set(demo.NEEDS.values()) <= set(installed), check


def test_a_missing_tool_stops_the_demo_in_one_line_before_it_starts(tmp_path):
    # A fresh machine: no git on PATH and no /usr/bin/docker-registry; the coreutils and Python are there.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in ("sh", "ls", "sha256sum", "sleep"):
        (bin_dir / program).symlink_to(shutil.which(program))
    env = dict(os.environ, PATH=str(bin_dir), MM_TEST_REGISTRY_BIN=str(tmp_path / "no" / "docker-registry"))
    done = subprocess.run([sys.executable, "-m", "tests.support.demo"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr == ("demo: not installed: git (Debian package git), docker-registry (Debian package "
                           "docker-registry); `make demo` installs them (apt-get, as root)\n"), done.stderr
