"""The wheelhouse: mm and every dependency as wheels, per target (machine x CPython minor), locked with sha256.

Built on the connected host from the package index pip is configured for (`pip download --only-binary=:all:
--platform ... --python-version ... --implementation cp`), plus the mm wheel itself (packed from the installed
package, so a checkout and a pip-installed mm give the same wheel) and the `uv` wheel (a static binary inside, for
hosts whose python3 has no venv/pip). Installed on the air-gapped host by `install-mm.sh` (beside this module),
offline: `--no-index --find-links SET --require-hashes -r SET/requirements.lock`.

Layout written under OUT:
  install-mm.sh
  wheelhouse/wheelhouse.json                (schema mm-wheelhouse/2: the sets, their wheels, sizes, sha256)
  wheelhouse/wheels/*.whl                   every wheel once: a pure-Python or abi3 wheel serves every set that
                                            installs it, so another CPython adds only its version-specific wheels
  wheelhouse/linux-<machine>-cp<XY>/requirements.lock   one set per target: `name==version --hash=sha256:...`,
                                                        one line a wheel of wheels/
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..errors import BadInput, IntegrityError, RemoteError
from ..edges.fsutil import atomic_write_text, dir_lock, fsync_dir, read_json_file, read_local_file, remove_tree
from ..integrity.hashing import upstream_digest
from ..edges.progress import NULL_PROGRESS, ProgressSink
from ..edges.tools import ToolMissing, run_tool

SCHEMA = "mm-wheelhouse/2"
WHEELHOUSE_DIR = "wheelhouse"
WHEELS_DIR = "wheels"  # under wheelhouse/: the wheels of every set, each once
INSTALL_SCRIPT = "install-mm.sh"
LOCK_NAME = "requirements.lock"
MAX_LOCK_BYTES = 1024 * 1024  # a lock: one line a wheel (install-mm.sh's bound too)
INDEX_NAME = "wheelhouse.json"
# modelscope pulls in cryptography, whose wheels need glibc 2.28 or newer; every set targets manylinux_2_28.
GLIBC_MIN = (2, 28)
MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
OLDEST_PYTHON = (3, 10)  # setup.cfg python_requires
# The hosts mm installs on by default: the system python3 of the distributions GPU servers run, each CPython
# from mm's oldest on. Ubuntu 22.04 ships 3.10, Debian 12 3.11, Ubuntu 24.04 3.12, Debian 13 and Fedora 41 3.13
# (their python3 packages); RHEL 9's 3.9 is older than mm supports (python_requires). The connected host's own
# Python is added when it is not among them. Each set past the first costs only its version-specific wheels
# (docs/python-targets.md has the sizes).
DEFAULT_PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# linux/amd64 always (the GPU servers of the guide's hardware matrix but GB200/GB300); linux/arm64 (GB200/GB300
# nodes: NVIDIA Grace) when this host is one or an image the bundle carries is (targets_for's `also`).
DEFAULT_MACHINES = ("x86_64",)
EXTRA_WHEELS = ("uv",)  # the fallback installer for a python3 without venv/pip
PIP_TIMEOUT = 1800  # seconds for one `pip download` (mm's margin: a slow index, dozens of wheels)
PIP_OUTPUT = 4 * 1024 * 1024  # bytes of pip's output kept (it runs --quiet: errors only)
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same mm gives the same wheel, byte for byte


@dataclass(frozen=True)
class Platform:
    machine: str  # x86_64 | aarch64
    python: str  # "3.11"

    @property
    def version(self) -> tuple[int, int]:
        major, minor = self.python.split(".")
        return int(major), int(minor)

    @property
    def cp(self) -> str:
        return "cp%d%d" % self.version

    @property
    def name(self) -> str:
        return f"linux-{self.machine}-{self.cp}"

    def platforms(self) -> list[str]:
        """manylinux platform tags this target accepts, newest first (glibc 2.28 down to 2.17)."""
        tags = [f"manylinux_2_{minor}_{self.machine}" for minor in range(GLIBC_MIN[1], 16, -1)]
        return tags + [f"manylinux2014_{self.machine}"]


def describe_targets(targets: list[Platform]) -> str:
    """linux/amd64 CPython 3.10, 3.11; linux/arm64 CPython 3.12: the hosts a wheelhouse installs mm on."""
    by_machine: dict[str, list[str]] = {}
    for t in targets:
        by_machine.setdefault(t.machine, []).append(t.python)
    arch = {"x86_64": "amd64", "aarch64": "arm64"}
    return "; ".join(f"linux/{arch[m]} CPython {', '.join(v)}" for m, v in by_machine.items())


def installer_python() -> tuple[str, Platform | None, str]:
    """(the interpreter install-mm.sh would use here: $PYTHON or python3 on PATH, its target or None, why not):
    asked with `-c`, bounded, so `mm bundle verify` can say before anything is installed whether a bundle's sets
    cover this host."""
    name = os.environ.get("PYTHON") or "python3"
    machine = MACHINES.get(platform.machine().lower())
    if machine is None:
        return name, None, f"this machine ({platform.machine()}) is neither x86_64 nor aarch64"
    try:
        proc = run_tool([name, "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2], "
                                           "sys.implementation.name)"], timeout=10, max_output=4096)
    except ToolMissing:
        return name, None, f"{name}: not found (install-mm.sh needs CPython 3.10 or newer)"
    words = proc.stdout.split() if proc.returncode == 0 and not proc.stopped else []
    if len(words) != 2 or words[1] != "cpython" or not re.fullmatch(r"3\.\d{1,2}", words[0]):
        return name, None, f"{name}: not a CPython that runs"
    return name, Platform(machine, words[0]), ""


def coverage(sets: tuple[str, ...] | list[str]) -> str:
    """One line: whether SETS (a bundle's wheel sets) install mm with this host's python3, before anything is."""
    name, target, why = installer_python()
    if target is None:
        return f"this host: {why}"
    if target.name in sets:
        return f"this host is covered: {name} is CPython {target.python} on {target.machine}, set {target.name}"
    if target.version < OLDEST_PYTHON:
        return (f"this host is NOT covered: {name} is CPython {target.python}, older than mm supports (3.10 or newer); "
                f"install a newer CPython the bundle holds a set for ({', '.join(sets) or 'none'}) and run "
                f"PYTHON=python3.X sh install-mm.sh")
    return (f"this host is NOT covered: {name} is CPython {target.python} on {target.machine} and the bundle holds "
            f"{', '.join(sets) or 'no set'}; build one on the connected host with: mm bundle --only-mm --out DIR "
            f"--target-platform linux/{target.machine} --target-python {target.python} (or PYTHON=another "
            f"python3 sh install-mm.sh)")


def parse_machine(value: str) -> str:
    """linux/amd64, linux/arm64, x86_64, aarch64, amd64, arm64 -> x86_64 | aarch64."""
    raw = value.strip().lower()
    os_part, _, arch = raw.rpartition("/") if "/" in raw else ("linux", "", raw)
    if os_part not in ("linux", "") or arch not in MACHINES:
        raise BadInput(f"--target-platform {value!r}: expected linux/amd64 (x86_64) or linux/arm64 (aarch64)")
    return MACHINES[arch]


def parse_python(value: str) -> str:
    """3.11, cp311, 311 -> "3.11"; at least Python 3.10 (mm's python_requires)."""
    m = re.fullmatch(r"(?:cp)?3\.?(\d{1,2})", value.strip().lower())
    if not m or (3, int(m.group(1))) < OLDEST_PYTHON:
        raise BadInput(f"--target-python {value!r}: expected a CPython minor version such as 3.11 (3.10 or newer)")
    return f"3.{int(m.group(1))}"


def host_target() -> Platform:
    machine = MACHINES.get(platform.machine().lower())
    if machine is None:
        raise BadInput(f"this host's machine {platform.machine()!r}: mm's wheelhouse knows x86_64 and aarch64; "
                       f"give --target-platform")
    return Platform(machine, "%d.%d" % sys.version_info[:2])


def targets_for(platforms: tuple[str, ...] = (), pythons: tuple[str, ...] = (),
                also: tuple[str, ...] = ()) -> list[Platform]:
    """Every (platform, python) pair. Without platforms: linux/amd64, this host's machine and ALSO (the platforms
    of what the bundle carries, e.g. an arm64 image); without pythons: DEFAULT_PYTHONS and this host's Python."""
    host = host_target() if not platforms or not pythons else None
    machines = [parse_machine(p) for p in platforms] or [*DEFAULT_MACHINES, host.machine,
                                                          *(parse_machine(p) for p in also)]
    versions = [parse_python(p) for p in pythons] or sorted({*DEFAULT_PYTHONS, host.python},
                                                            key=lambda v: tuple(map(int, v.split("."))))
    seen: dict[str, Platform] = {}
    for machine in machines:
        for version in versions:
            t = Platform(machine, version)
            seen.setdefault(t.name, t)
    return list(seen.values())


# --- the mm wheel, packed from the installed package ---------------------------------------------

def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _zip_write(zf: zipfile.ZipFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
    info.external_attr = (0o100000 | mode) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(info, data)


# mm's file list, as setup.cfg declares it: its packages (`packages =`, as directories under the `mm` package) and
# their package data (`[options.package_data]`). tests/test_userpath.py holds the two in step. The wheel is built
# from this list, never by walking a directory: a plain `pip install -e .` makes the checkout itself the `mm`
# package, and a walk would pack its .git/, tests/ and .venv/.
PACKAGES = ("", "commands", "artifacts", "artifacts/bundle", "artifacts/edges", "artifacts/fetching",
            "artifacts/integrity", "artifacts/oci", "artifacts/serving")
PACKAGE_DATA = {"": ("manifests/*.json",), "artifacts/bundle": ("*.sh",)}


def package_files() -> dict[str, bytes]:
    """{path inside the wheel: bytes} of the installed `mm` package: each package's modules and its package data
    (no bytecode, nothing else that lies beside them)."""
    # mm/ from mm/artifacts/bundle/; not resolved: an editable install links each file into its own tree
    root = Path(__file__).parents[2]
    files: dict[str, bytes] = {}
    for package in PACKAGES:
        for pattern in ("*.py", *PACKAGE_DATA.get(package, ())):
            for path in sorted((root / package).glob(pattern)):
                if path.is_file():
                    files[f"mm/{path.relative_to(root).as_posix()}"] = path.read_bytes()
    if "mm/cli.py" not in files:
        raise BadInput(f"{root}: not the mm package (no cli.py); reinstall mm")
    return dict(sorted(files.items()))


def _mm_distribution() -> importlib.metadata.Distribution:
    """The installed mm's .dist-info (a checkout's stray mm.egg-info on sys.path has no METADATA)."""
    for dist in importlib.metadata.distributions(name="mm"):
        if dist.read_text("METADATA") and dist.read_text("entry_points.txt"):
            return dist
    raise BadInput("mm's installed metadata (METADATA, entry_points.txt) is missing; reinstall mm")


def mm_version() -> str:
    return _mm_distribution().version


def build_mm_wheel(dest_dir: Path) -> Path:
    """Write mm-<version>-py3-none-any.whl into DEST_DIR from the installed package and its metadata."""
    dist = _mm_distribution()
    version = dist.version
    info = f"mm-{version}.dist-info"
    metadata = dist.read_text("METADATA")
    entry_points = dist.read_text("entry_points.txt")
    members = dict(package_files())
    members[f"{info}/METADATA"] = metadata.encode()
    members[f"{info}/entry_points.txt"] = entry_points.encode()
    members[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: mm\nRoot-Is-Purelib: true\nTag: py3-none-any\n\n"
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in members.items())
    record += f"{info}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            _zip_write(zf, name, data)
        _zip_write(zf, f"{info}/RECORD", record.encode())
    dest_dir.mkdir(parents=True, exist_ok=True)
    wheel = dest_dir / f"mm-{version}-py3-none-any.whl"
    wheel.write_bytes(buf.getvalue())
    return wheel


# --- tags ------------------------------------------------------------------------------------------

def accepted_tags(target: Platform) -> set:
    """Every wheel tag a CPython of TARGET's version on TARGET's machine (glibc 2.28) accepts (packaging.tags)."""
    from packaging import tags

    plats = target.platforms()
    return set(tags.cpython_tags(target.version, platforms=plats)) | set(
        tags.compatible_tags(target.version, target.cp, plats))


def wheel_fits(filename: str, target: Platform, accepted: set | None = None) -> bool:
    from packaging.utils import parse_wheel_filename

    accepted = accepted if accepted is not None else accepted_tags(target)
    return bool(parse_wheel_filename(filename)[3] & accepted)


def _wheel_paths(wheels: Path | list[Path]) -> list[Path]:
    """The wheels of a set: a directory's *.whl (a set being built) or a list (`set_wheels` of a wheelhouse)."""
    return sorted(Path(wheels).glob("*.whl")) if isinstance(wheels, (str, Path)) else list(wheels)


def misfits(wheels: Path | list[Path], target: Platform) -> list[str]:
    """Wheels of a set that a CPython of TARGET would not install (should be none)."""
    accepted = accepted_tags(target)
    return sorted(w.name for w in _wheel_paths(wheels) if not wheel_fits(w.name, target, accepted))


# --- building ------------------------------------------------------------------------------------

@dataclass
class Wheel:
    file: str
    name: str
    version: str
    size: int
    sha256: str


@dataclass
class WheelSet:
    name: str
    machine: str
    python: str
    wheels: list[Wheel]
    lock: str  # path relative to the wheelhouse directory

    @property
    def size(self) -> int:
        return sum(w.size for w in self.wheels)


@dataclass
class WheelhouseReport:
    out: Path
    mm_version: str
    glibc_min: str
    sets: list[WheelSet]
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Bytes of wheels carried: a wheel shared by several sets counts once."""
        return sum({w.file: w.size for s in self.sets for w in s.wheels}.values())

    @property
    def files(self) -> list[str]:
        """Every file under OUT (relative POSIX paths), the script first: what the bundle payload carries."""
        names = [INSTALL_SCRIPT, f"{WHEELHOUSE_DIR}/{INDEX_NAME}"]
        names += [f"{WHEELHOUSE_DIR}/{WHEELS_DIR}/{f}" for f in sorted({w.file for s in self.sets for w in s.wheels})]
        return names + [f"{WHEELHOUSE_DIR}/{s.lock}" for s in self.sets]


def _sha256(path: Path) -> str:
    return upstream_digest(path, "lfs-sha256")  # the file's sha256, memory bounded


def _pip_download(target: Platform, requirements: list[str], dest: Path) -> None:
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-input",
            "--only-binary=:all:", "--implementation", "cp", "--python-version", target.python,
            "--abi", target.cp, "--abi", "abi3", "--abi", "none"]
    for plat in target.platforms():
        argv += ["--platform", plat]
    argv += ["--dest", str(dest), *requirements]
    try:
        proc = run_tool(argv, timeout=PIP_TIMEOUT, max_output=PIP_OUTPUT)
    except ToolMissing as e:
        raise RemoteError(f"pip download for {target.name}: {e.message}") from None
    if proc.stopped:
        raise RemoteError(f"pip download for {target.name}: {proc.stopped}; stopped")
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.splitlines()[-1:]
        if "No module named pip" in proc.stderr:
            raise BadInput(f"{sys.executable}: has no pip; the wheelhouse is built with `python -m pip download`")
        raise RemoteError(f"pip download for {target.name} (from the index pip is configured for): "
                          f"{' '.join(lines) or 'failed'}; without an index, give --wheelhouse DIR (from "
                          f"`mm bundle --only-mm`) or --no-mm")


def marker_environment(target: Platform) -> dict[str, str]:
    """The PEP 508 marker values of a CPython of TARGET's version on Linux on TARGET's machine."""
    return {"python_version": target.python, "python_full_version": f"{target.python}.0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": target.machine,
            "platform_python_implementation": "CPython", "implementation_name": "cpython",
            "implementation_version": f"{target.python}.0", "platform_release": "", "platform_version": ""}


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8", "replace")
    head = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith("Requires-Dist:")]


def unmet_requirements(target: Platform, set_wheels: Path | list[Path]) -> tuple[list[str], set[str]]:
    """(requirements no wheel of the set satisfies, names of the wheels the target needs), with every marker
    evaluated for TARGET: pip download evaluates markers for the Python running it, not --python-version."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = marker_environment(target)
    wheels = {_wheel_name_version(w.name)[0]: w for w in _wheel_paths(set_wheels)}
    versions = {name: _wheel_name_version(w.name)[1] for name, w in wheels.items()}
    roots = ["mm", *EXTRA_WHEELS]
    todo = [(canonicalize_name(r), frozenset()) for r in roots]
    seen: set[tuple[str, frozenset]] = set()
    unmet: list[str] = []
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in wheels:
            continue
        for line in _requires(wheels[name]):
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
                continue
            dep = canonicalize_name(req.name)
            if dep not in wheels or not req.specifier.contains(versions[dep], prereleases=True):
                unmet.append(str(req).split(";")[0].strip())
            else:
                todo.append((dep, frozenset(req.extras)))
    return sorted(set(unmet)), {n for n, _ in seen if n in wheels}


def complete_for_target(target: Platform, set_dir: Path, rounds: int = 5) -> None:
    """Download what TARGET's markers need and pip skipped (e.g. exceptiongroup on 3.10 when pip runs on 3.11),
    and drop what only the running Python's markers wanted; IntegrityError if it does not settle."""
    for _ in range(rounds):
        unmet, needed = unmet_requirements(target, set_dir)
        if not unmet:
            for w in set_dir.glob("*.whl"):
                if _wheel_name_version(w.name)[0] not in needed:
                    w.unlink()
            return
        _pip_download(target, unmet, set_dir)
    raise IntegrityError(f"{set_dir}: the wheels for {target.name} still miss {', '.join(unmet)}")


def _wheel_name_version(filename: str) -> tuple[str, str]:
    from packaging.utils import canonicalize_name, parse_wheel_filename

    name, version, _build, _tags = parse_wheel_filename(filename)
    return canonicalize_name(name), str(version)


def build_set(target: Platform, mm_wheel: Path, set_dir: Path) -> WheelSet:
    """Download mm's dependencies and uv for TARGET into SET_DIR, add the mm wheel, check tags, write the lock."""
    set_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(mm_wheel, set_dir / mm_wheel.name)
    # pip resolves mm's dependencies from the wheel's own metadata, exactly as the install will.
    _pip_download(target, [str(set_dir / mm_wheel.name), *EXTRA_WHEELS], set_dir)
    complete_for_target(target, set_dir)
    bad = misfits(set_dir, target)
    if bad:
        raise IntegrityError(f"{set_dir}: {', '.join(bad)}: no tag a CPython {target.python} on {target.machine} "
                             f"(glibc {GLIBC_MIN[0]}.{GLIBC_MIN[1]}) accepts")
    wheels = []
    for path in sorted(set_dir.glob("*.whl")):
        name, version = _wheel_name_version(path.name)
        wheels.append(Wheel(path.name, name, version, path.stat().st_size, _sha256(path)))
    names = [w.name for w in wheels]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise IntegrityError(f"{set_dir}: more than one wheel for {', '.join(dupes)}")
    _write_lock(set_dir, wheels)
    return WheelSet(target.name, target.machine, target.python, wheels, f"{target.name}/{LOCK_NAME}")


def _write_lock(set_dir: Path, wheels: list[Wheel]) -> None:
    (set_dir / LOCK_NAME).write_text("".join(f"{w.name}=={w.version} --hash=sha256:{w.sha256}\n" for w in wheels))


def _share_wheels(work: Path, sets: list[WheelSet]) -> None:
    """Where sets of one machine took different wheels of one release (cryptography's cp39-abi3 for 3.10 and its
    cp311-abi3 for 3.11 on), the one that every set of them accepts (by its tags) serves them all: the same
    release and code, built against an older stable ABI, and the volume carries it once."""
    groups: dict[tuple[str, str, str], list[tuple[WheelSet, Wheel]]] = {}
    for s in sets:
        for w in s.wheels:
            groups.setdefault((s.machine, w.name, w.version), []).append((s, w))
    for users in groups.values():
        files = {w.file: (s, w) for s, w in users}
        if len(files) < 2:
            continue
        fits = [f for f in files if all(wheel_fits(f, Platform(s.machine, s.python)) for s, _ in users)]
        if not fits:
            continue
        best = max(fits, key=lambda f: sum(w.file == f for _, w in users))  # the one most sets took already
        owner, chosen = files[best]
        for s, w in users:
            if w.file != best:
                shutil.copy2(work / owner.name / best, work / s.name / best)
                (work / s.name / w.file).unlink()
                s.wheels[s.wheels.index(w)] = chosen
                s.wheels.sort(key=lambda x: x.file)
                _write_lock(work / s.name, s.wheels)


def install_script_text() -> str:
    return (Path(__file__).with_name(INSTALL_SCRIPT)).read_text()


def build_wheelhouse(out: Path, targets: list[Platform], progress: ProgressSink = NULL_PROGRESS,
                     cache: Path | None = None) -> WheelhouseReport:
    """Write OUT/install-mm.sh and OUT/wheelhouse/ for TARGETS; OUT/wheelhouse appears only when complete.

    CACHE: a directory of earlier sets by name (same mm wheel bytes) to copy instead of downloading again.
    """
    if not targets:
        raise BadInput("no target: give --target-platform / --target-python")
    started = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    final = out / WHEELHOUSE_DIR
    work = Path(tempfile.mkdtemp(prefix=".wheelhouse.", dir=out))
    try:
        mm_wheel = build_mm_wheel(work / "_mm")
        sets = []
        for i, target in enumerate(targets):
            progress.note(f"wheelhouse: {target.name} ({i + 1}/{len(targets)})")
            cached = cache / target.name if cache else None
            if cached and (cached / mm_wheel.name).is_file() and (cached / mm_wheel.name).read_bytes() == mm_wheel.read_bytes():
                shutil.copytree(cached, work / target.name)
                sets.append(_read_set(work / target.name, target))
            else:
                sets.append(build_set(target, mm_wheel, work / target.name))
                if cache:
                    shutil.rmtree(cache / target.name, ignore_errors=True)
                    shutil.copytree(work / target.name, cache / target.name)
        shutil.rmtree(work / "_mm")
        _share_wheels(work, sets)
        _pool_wheels(work, sets)
        dist_version = mm_version()
        index = {"schema": SCHEMA, "mm_version": dist_version, "glibc_min": "%d.%d" % GLIBC_MIN,
                 "install": f"sh {INSTALL_SCRIPT} [DIR]",
                 "sets": [{"name": s.name, "machine": s.machine, "python": s.python, "lock": s.lock,
                           "wheels": [w.__dict__ for w in s.wheels]} for s in sets]}
        (work / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        for path in work.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        remove_tree(out, final)  # an earlier wheelhouse; a link planted there is refused, never followed
        os.replace(work, final)
        fsync_dir(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    atomic_write_text(out / INSTALL_SCRIPT, install_script_text(), mode=0o755, root=out)
    normalize_mtimes(out)
    return WheelhouseReport(out, dist_version, "%d.%d" % GLIBC_MIN, sets, time.monotonic() - started)


def _pool_wheels(work: Path, sets: list[WheelSet]) -> None:
    """Move each set's wheels into WORK/wheels/, one file a wheel name: the sets share what they have in common
    (a wheel's file name names its tags, so the same name for two sets is the same wheel, checked by sha256)."""
    pool = work / WHEELS_DIR
    pool.mkdir()
    for s in sets:
        for w in s.wheels:
            src, dst = work / s.name / w.file, pool / w.file
            if dst.exists():
                if _sha256(dst) != w.sha256:
                    raise IntegrityError(f"{w.file}: two different wheels of one name for {s.name} and another set")
                src.unlink()
            else:
                os.replace(src, dst)


def set_wheels(wheelhouse: Path, name: str) -> list[Path]:
    """The wheel files of set NAME in a written wheelhouse (under wheels/), as its index lists them."""
    doc = read_index(wheelhouse)
    s = next((s for s in doc["sets"] if s["name"] == name), None)
    if s is None:
        raise BadInput(f"{wheelhouse}: no set {name}")
    return [Path(wheelhouse) / WHEELS_DIR / w["file"] for w in s["wheels"]]


def _read_set(set_dir: Path, target: Platform) -> WheelSet:
    wheels = []
    for line in (set_dir / LOCK_NAME).read_text().splitlines():
        spec, _, digest = line.partition(" --hash=sha256:")
        name, _, version = spec.partition("==")
        path = next(p for p in set_dir.glob("*.whl") if _wheel_name_version(p.name) == (name, version))
        if _sha256(path) != digest:
            raise IntegrityError(f"{path}: sha256 differs from {set_dir / LOCK_NAME}")
        wheels.append(Wheel(path.name, name, version, path.stat().st_size, digest))
    return WheelSet(target.name, target.machine, target.python, wheels, f"{target.name}/{LOCK_NAME}")


def read_index(wheelhouse: Path) -> dict:
    """wheelhouse.json, parsed and checked (a hostile file: names must be plain)."""
    path = Path(wheelhouse) / INDEX_NAME
    doc = read_json_file(path, what="wheelhouse index")
    try:
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError(f"expected schema {SCHEMA!r}")
        for s in doc["sets"]:
            if not isinstance(s.get("name"), str) or not re.fullmatch(r"linux-(x86_64|aarch64)-cp3\d{1,2}", s["name"]):
                raise ValueError(f"bad set name {str(s.get('name'))[:80]!r}")
            if s.get("lock") != f"{s['name']}/{LOCK_NAME}":  # a path read from the disk: never anywhere else
                raise ValueError(f"set {s['name']}: lock {str(s.get('lock'))[:80]!r} is not {s['name']}/{LOCK_NAME}")
            for w in s["wheels"]:
                if not isinstance(w.get("file"), str) or "/" in w["file"] or not w["file"].endswith(".whl") \
                        or not isinstance(w.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", w["sha256"]) \
                        or not all(isinstance(w.get(k), str) and len(w[k]) <= 200 for k in ("name", "version")) \
                        or type(w.get("size")) is not int or w["size"] < 0:
                    raise ValueError(f"bad wheel entry {str(w.get('file'))[:80]!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path}: not a wheelhouse index ({e})") from None
    return doc


def check_wheelhouse(wheelhouse: Path) -> list[str]:
    """Every wheel present with its size and sha256, every lock line matching: problems, one line each."""
    doc = read_index(wheelhouse)
    problems = []
    checked: set[str] = set()
    for s in doc["sets"]:
        lock = Path(wheelhouse) / s["lock"]
        expected = "".join(f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}\n" for w in s["wheels"])
        try:
            same = read_local_file(lock, what="lock", max_bytes=MAX_LOCK_BYTES) == expected.encode()
        except BadInput:  # missing, not a regular file, too large
            same = False
        if not same:
            problems.append(f"{lock}: missing or not the lock wheelhouse.json records")
        for w in s["wheels"]:
            path = Path(wheelhouse) / WHEELS_DIR / w["file"]
            if w["file"] in checked:
                continue
            checked.add(w["file"])
            if not path.is_file():
                problems.append(f"{path}: missing")
            elif path.stat().st_size != w["size"] or _sha256(path) != w["sha256"]:
                problems.append(f"{path}: bytes differ from wheelhouse.json")
    return problems


# --- the bundle payload ----------------------------------------------------------------------------------

FIXED_MTIME = 315532800  # 1980-01-01: a rebuilt wheelhouse with the same bytes keeps a rerun's bundle id


def normalize_mtimes(out: Path) -> None:
    """Give every file under OUT (install-mm.sh, wheelhouse/) one fixed mtime: same bytes, same stamps."""
    for path in [Path(out) / INSTALL_SCRIPT, *(Path(out) / WHEELHOUSE_DIR).rglob("*")]:
        if path.is_file():
            os.utime(path, (FIXED_MTIME, FIXED_MTIME))


def payload_files(out: Path) -> tuple[dict, list[tuple[str, Path, int]]]:
    """What a bundle carries from OUT (`build_wheelhouse`'s, or `mm bundle --only-mm --out OUT`): the record
    (mm version, sets, files) and (path under the kind's root, source, size), install-mm.sh first."""
    out = Path(out)
    if not (out / INSTALL_SCRIPT).is_file():
        raise BadInput(f"{out}: no {INSTALL_SCRIPT}; give a directory written by `mm bundle --only-mm --out DIR`")
    doc = read_index(out / WHEELHOUSE_DIR)
    problems = check_wheelhouse(out / WHEELHOUSE_DIR)
    if problems:
        raise IntegrityError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    files = [(INSTALL_SCRIPT, out / INSTALL_SCRIPT), (f"{WHEELHOUSE_DIR}/{INDEX_NAME}", out / WHEELHOUSE_DIR / INDEX_NAME)]
    shared = sorted({w["file"] for s in doc["sets"] for w in s["wheels"]})
    files += [(f"{WHEELHOUSE_DIR}/{WHEELS_DIR}/{f}", out / WHEELHOUSE_DIR / WHEELS_DIR / f) for f in shared]
    files += [(f"{WHEELHOUSE_DIR}/{s['lock']}", out / WHEELHOUSE_DIR / s["lock"]) for s in doc["sets"]]
    record = {"mm_version": str(doc["mm_version"]), "sets": [str(s["name"]) for s in doc["sets"]]}
    return record, [(rel, src, src.stat().st_size) for rel, src in files]


def cache_dir() -> Path:
    """mm's cache directory: $XDG_CACHE_HOME/mm, else ~/.cache/mm (the XDG base directory default; a relative
    XDG_CACHE_HOME is ignored, as the specification says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "mm"


def sets_cache() -> Path:
    """Sets downloaded by an earlier run, by name, each with the mm wheel it was made for."""
    return cache_dir() / "wheelhouse" / "sets"


@contextlib.contextmanager
def bundle_wheelhouse(targets: list[Platform], progress: ProgressSink = NULL_PROGRESS) -> Iterator[Path]:
    """The wheelhouse `mm bundle` carries by default, built in mm's cache directory, never on the output disks:
    CACHE/wheelhouse/build-XXXX for this run (locked while it runs, removed after; one a kill left is removed by
    the next run). Sets downloaded by an earlier run (same mm wheel, byte for byte) are copied from
    CACHE/wheelhouse/sets, so a rerun downloads nothing and, with the same bytes and fixed mtimes, keeps the bundle
    id (its volumes are kept)."""
    root = cache_dir() / "wheelhouse"
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(root)
    fresh = Path(tempfile.mkdtemp(prefix=".build-", dir=root))  # a dot: no cleaner takes it before it is locked
    build = root / fresh.name[1:]
    try:
        with dir_lock(fresh, "mm bundle", leave_nothing=True):
            os.replace(fresh, build)  # the lock is on the directory itself: it moves with it
            build_wheelhouse(build, targets, progress, cache=sets_cache())
            yield build
    finally:
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(fresh, ignore_errors=True)


def _remove_abandoned_builds(root: Path) -> None:
    """Remove the build directories no running `mm bundle` holds (a kill -9 left them)."""
    for build in root.glob("build-*"):
        try:
            fd = os.open(build, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a run holds it
        else:
            shutil.rmtree(build, ignore_errors=True)
        finally:
            os.close(fd)
