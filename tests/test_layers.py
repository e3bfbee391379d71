"""The house's layers, read from the code's own imports (every import, those inside functions too): the library
never imports the command line, no two library modules import each other in a loop, each area imports only the
areas below it, and bundle/'s modules import only those its __init__ lists above them."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import mm.artifacts

LIBRARY = Path(mm.artifacts.__file__).parent

# The areas from the ground up (docs/architecture.md): each imports only areas before it in this list.
AREAS = ("errors", "units", "paths", "edges", "pins", "integrity", "fetching", "oci", "serving", "store", "bundle")
# Arrows that run up on purpose, each loaded inside the one function that needs it (none today).
UPWARD: set[tuple[str, str]] = set()
# The most floors of imports file by file (a module stands one floor above everything it imports, the ground is 1):
# a ceiling, so that the chains a constant or a helper in the wrong module made do not grow back. Lower it when a
# change shortens them; raise it only for a chain that is truly one capability built on another.
MOST_FLOORS = 12


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The library modules PATH imports (names under mm.artifacts), and 'OUTSIDE:<name>' for mm outside it."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            up = node.level - 1
            if up > len(package):  # above mm.artifacts: mm's own top (commands, cli)
                found.add(f"OUTSIDE:{node.module}")
                continue
            base = package[:len(package) - up] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                whole = ".".join([*base, alias.name])
                found.add(whole if library_path(whole) else ".".join(base))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mm."):
            found.add(node.module.removeprefix("mm.artifacts.") if node.module.startswith("mm.artifacts.")
                      else f"OUTSIDE:{node.module}")
    return {m for m in found if m and (m.startswith("OUTSIDE:") or library_path(m))} - {name}


def library_path(name: str) -> Path | None:
    path = LIBRARY.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(LIBRARY.rglob("*.py")) if p.name != "__init__.py"}


def test_the_library_never_imports_the_command_line():
    assert {m: sorted(i for i in deps if i.startswith("OUTSIDE:")) for m, deps in graph().items()
            if any(i.startswith("OUTSIDE:") for i in deps)} == {}


def test_no_two_library_modules_import_each_other_in_a_loop():
    edges = {m: {d for d in deps if not d.startswith("OUTSIDE:") and library_path(d).name != "__init__.py"}
             for m, deps in graph().items()}
    loops = []
    for start in edges:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    loops.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))
    assert loops == []


def test_each_area_imports_only_the_areas_below_it():
    def area(name: str) -> str:
        return name.split(".")[0]

    up = {(m, d) for m, deps in graph().items() for d in deps
          if not d.startswith("OUTSIDE:") and AREAS.index(area(d)) > AREAS.index(area(m))}
    assert up == UPWARD


def test_bundles_modules_import_only_those_listed_above_them():
    order = re.findall(r"^  ([a-z_]+) ", (LIBRARY / "bundle" / "__init__.py").read_text(), re.M)
    assert sorted(order) == sorted(p.stem for p in (LIBRARY / "bundle").glob("*.py") if p.stem != "__init__")
    late = {(m, d) for m in order for d in imports(LIBRARY / "bundle" / f"{m}.py")
            if d.startswith("bundle.") and order.index(d.removeprefix("bundle.")) >= order.index(m)}
    assert late == set()


def floors() -> dict[str, int]:
    """Each library module's floor, from every import (inside functions too; a loop counts once)."""
    edges = {m: {d for d in deps if not d.startswith("OUTSIDE:")} for m, deps in graph().items()}
    found: dict[str, int] = {}

    def floor(m: str, below: tuple[str, ...] = ()) -> int:
        if m not in found:
            found[m] = 1 + max((floor(d, below + (m,)) for d in edges.get(m, ()) if d not in below), default=0)
        return found[m]

    return {m: floor(m) for m in edges}


def test_no_chain_of_imports_is_taller_than_the_ceiling():
    tall = {m: f for m, f in floors().items() if f > MOST_FLOORS}
    assert tall == {}, f"{max(tall, key=tall.get)} stands on {max(tall.values())} floors (ceiling {MOST_FLOORS})"
