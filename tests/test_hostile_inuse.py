"""`mm gc` never removes what is in use, however it is named (README "Revisions side by side", the "in use" rule).

A revision is in use when a running container mounts it (the revision, a directory above it, a path inside it, or
the `current` pointer while it named the revision) or when an mm process reads or writes it (it holds the
revision's DIR/.mm/lock: writers whole, readers shared; gc takes it whole before it removes a revision).

Families (each parametrized):
  mount spelling   the container's mount source names the pointer or a revision another way than gc's root:
                   through a symlinked root, `..`, a trailing slash, `//`, a symlink to the pointer, a bind mount
                   of the root (a duplicate name with the same device and inode), a directory inside
  root spelling    gc's ROOT named another way than the mount: the symlinked root, relative, `.` after a `cd`
                   through the link, a trailing slash, `..`
  readers          an mm process reading a revision when gc runs: a delta import taking files from it
                   (unbundle --from), fetch --from, bundle, push, verify; each stopped (SIGSTOP) while it holds
                   the lock, gc keeps the revision naming the reader, and the reader then completes
Each case: gc exits 0, the revision in use is kept (with why), the one not in use is removed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mm.artifacts.bundle.pack import BundleOptions, create_bundle
from tests.support import fake_docker
from tests.support.run import mm_argv, run_mm
from tests.support.slowio import slow_io_env
from tests.test_store import REPO, make_root

OWNER, NAME = REPO.split("/")


@pytest.fixture
def site(tmp_path):
    """ROOT = tmp/data/models (physical), tmp/srv/m -> ROOT (a symlinked root), revisions A, B, C of REPO; a
    stand-in docker on PATH. Yields a namespace; containers are stopped at the end."""
    root = tmp_path / "data" / "models"
    revs = make_root(root)
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "m").symlink_to(root)
    state = tmp_path / "docker-state"
    fake_docker.install(tmp_path / "bin", state)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    procs, binds = [], []

    class Site:
        pass

    s = Site()
    s.tmp, s.root, s.revs, s.env, s.binds = tmp_path, root, revs, env, binds

    def container(name: str, source: str) -> None:
        procs.append(fake_docker.add_container(state, name, [f"{source}:/models/x:ro"]))

    s.container = container
    yield s
    for p in procs:
        fake_docker.stop_container(p)
    for point in reversed(binds):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _bind(site, name: str) -> Path:
    """A bind mount of ROOT at tmp/NAME: the same directories under another name (root only)."""
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root (CI runs as root)")
    point = site.tmp / name
    point.mkdir()
    r = subprocess.run(["mount", "--bind", str(site.root), str(point)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {r.stderr.strip()}")
    site.binds.append(point)
    return point


def _gc(site, root: object, cwd: Path | None = None) -> dict:
    r = run_mm("gc", root, "--keep", "0", "--json", env={**site.env, "PWD": str(cwd or os.getcwd())}, cwd=cwd)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def _use(site, rev: str) -> None:
    r = run_mm("use", REPO, rev, "--root", site.root, env=site.env)
    assert r.returncode == 0, r.stderr


# --- mount spelling ------------------------------------------------------------------------------------------------

POINTER_MOUNTS = {  # how the container's mount source names ROOT/REPO/current (relative to the test's tmp)
    "symlinked root": lambda s: f"{s.tmp}/srv/m/{REPO}/current",
    "dot-dot": lambda s: f"{s.tmp}/data/models/{OWNER}/../{OWNER}/{NAME}/current",
    "trailing slash": lambda s: f"{s.tmp}/srv/m/{REPO}/current/",
    "double slashes": lambda s: f"{s.tmp}//srv/m//{REPO}//current",
    "symlink to the pointer": lambda s: _link(s.tmp / "latest", s.root / REPO / "current"),
    "bind mount of the root": lambda s: f"{_bind(s, 'dup')}/{REPO}/current",
    "a directory inside, through the link": lambda s: f"{s.tmp}/srv/m/{REPO}/current/dspark",
}


def _link(link: Path, target: Path) -> str:
    link.symlink_to(target)
    return str(link)


@pytest.mark.parametrize("spelling", sorted(POINTER_MOUNTS))
def test_mount_of_the_pointer_by_any_spelling_keeps_the_revision_it_served(site, spelling):
    _use(site, "aaaa")
    site.container("server-1", POINTER_MOUNTS[spelling](site))
    time.sleep(0.05)
    _use(site, "cccc")  # the container still serves A; the pointer names C now
    doc = _gc(site, site.root)
    kept = {k["dir"]: k["why"] for k in doc["kept"]}
    assert kept[site.revs["A"].name].startswith("mounted by running container(s) server-1"), doc
    assert [r["dir"] for r in doc["removed"]] == [site.revs["B"].name]
    assert site.revs["A"].is_dir()


REVISION_MOUNTS = {  # the mount names revision A itself (not current) another way
    "through the symlinked root": lambda s: f"{s.tmp}/srv/m/{REPO}/{s.revs['A'].name}",
    "through a bind mount of the root": lambda s: f"{_bind(s, 'dup')}/{REPO}/{s.revs['A'].name}",
    "a file inside through the symlinked root": lambda s: f"{s.tmp}/srv/m/{REPO}/{s.revs['A'].name}/config.json",
    "the repo directory above it, through the link": lambda s: f"{s.tmp}/srv/m/{OWNER}/../{OWNER}/{NAME}",
}


@pytest.mark.parametrize("spelling", sorted(REVISION_MOUNTS))
def test_mount_of_a_revision_by_any_spelling_keeps_it(site, spelling):
    _use(site, "cccc")
    site.container("server-a", REVISION_MOUNTS[spelling](site))
    doc = _gc(site, site.root)
    kept = {k["dir"]: k["why"] for k in doc["kept"]}
    assert kept[site.revs["A"].name].startswith("mounted by running container(s) server-a"), doc
    assert site.revs["A"].is_dir()


# --- root spelling -------------------------------------------------------------------------------------------------

ROOTS = {  # (gc's ROOT argument, the directory it runs in)
    "physical": lambda s: (s.root, None),
    "symlinked": lambda s: (s.tmp / "srv" / "m", None),
    "relative": lambda s: ("data/models", s.tmp),
    "dot after cd through the link": lambda s: (".", s.tmp / "srv" / "m"),
    "trailing slash": lambda s: (f"{s.tmp}/srv/m/", None),
    "dot-dot from inside, through the link": lambda s: ("../models", s.tmp / "srv" / "m"),
    "dot-dot after the link": lambda s: (f"{s.tmp}/srv/m/{OWNER}/..", None),
}


@pytest.mark.parametrize("spelling", sorted(ROOTS))
def test_gc_root_by_any_spelling_keeps_what_a_container_started_through_the_pointer_serves(site, spelling):
    _use(site, "aaaa")
    site.container("server-1", f"{site.tmp}/srv/m/{REPO}/current")  # as `mm launch /srv/m/R/current` mounts it
    time.sleep(0.05)
    _use(site, "cccc")
    root, cwd = ROOTS[spelling](site)
    doc = _gc(site, root, cwd)
    kept = {k["dir"]: k["why"] for k in doc["kept"]}
    assert kept[site.revs["A"].name].startswith("mounted by running container(s) server-1"), doc
    assert kept[site.revs["C"].name] == "current"
    assert [r["dir"] for r in doc["removed"]] == [site.revs["B"].name] and site.revs["A"].is_dir()


# --- readers ------------------------------------------------------------------------------------------------------

def _holds_lock_on(pid: int, path: Path) -> bool:
    """PID holds a flock on PATH (the kernel's lock table names its device and inode)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK" and parts[4] == str(pid):
            major, minor, ino = parts[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino):
                return True
    return False


def _delta_volumes(site) -> Path:
    """A delta bundle of revision C against B (B is the base the import reads)."""
    out = site.tmp / "delta"
    create_bundle(site.revs["C"], BundleOptions((out,), 10 ** 9, base=site.revs["B"]))
    return out


def _fetch_from(s, request) -> tuple[list, dict]:
    repo = request.getfixturevalue("model_repo")
    env = {**s.env, "HF_ENDPOINT": request.getfixturevalue("hub_server").url, "HF_HOME": str(s.tmp / "hf-home"),
           "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    return ["fetch", repo.repo_id, "--revision", repo.head, "--local-dir", s.tmp / "new", "--from", s.revs["B"]], env


def _push(s, request) -> tuple[list, dict]:
    registry = request.getfixturevalue("registry")
    env = {**{k: v for k, v in s.env.items() if k not in ("REGISTRY_AUTH_FILE", "DOCKER_CONFIG")},
           "DOCKER_CONFIG": str(s.tmp / "docker-config"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    return ["push", s.revs["B"], f"{registry.host}/inuse/{s.tmp.name[-24:].strip('_-.').lower() or 'm'}:b"], env


def _talking(pid: int) -> bool:
    """PID has a socket open: past its checks of the model (quick verify), talking to the server."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


READERS = {  # (argv, env) of a reader of revision B (the one gc would remove: not current, not among --keep 0),
    # and when it is well into its work (past the quick verify of B, whose own shared lock is not the point here)
    "unbundle --from (a delta's base)": (
        lambda s, rq: (["unbundle", *sorted(_delta_volumes(s).glob("*.tar")), "--dest", s.tmp / "new",
                        "--from", s.revs["B"]], s.env),
        lambda s, pid: (s.tmp / "new" / ".mm" / "unbundle").is_dir()),
    "fetch --from": (_fetch_from, lambda s, pid: _talking(pid)),
    "bundle": (lambda s, rq: (["bundle", s.revs["B"], "--out", s.tmp / "vols", "--volume-size", "1G"],
                              {**s.env, **slow_io_env(s.tmp)}),
               lambda s, pid: (s.tmp / "vols").is_dir() and any((s.tmp / "vols").iterdir())),
    "push": (_push, lambda s, pid: _talking(pid)),
    "verify": (lambda s, rq: (["verify", s.revs["B"]], s.env), lambda s, pid: True),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_gc_keeps_a_revision_an_mm_process_is_reading(site, reader, request):
    _use(site, "cccc")
    start, busy = READERS[reader]
    argv, env = start(site, request)
    lock = site.revs["B"] / ".mm" / "lock"
    proc = subprocess.Popen(mm_argv(*argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (_holds_lock_on(proc.pid, lock) and busy(site, proc.pid)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the reader never took the revision's lock"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGSTOP)  # it holds the lock: gc runs now, while it reads
        doc = _gc(site, site.root)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    kept = {k["dir"]: k["why"] for k in doc["kept"]}
    assert kept[site.revs["B"].name].startswith("in use: `mm "), doc
    assert f"(pid {proc.pid}) is reading it" in kept[site.revs["B"].name]
    assert [r["dir"] for r in doc["removed"]] == [site.revs["A"].name]
    assert proc.returncode == 0, err  # the reader completes: its input was never removed


def test_a_reader_that_starts_while_gc_removes_the_revision_is_refused_naming_gc(site):
    """gc holds the revision's lock whole from its decision to the end of the removal: a reader arriving then
    is refused (exit 6) naming gc, rather than reading a directory that vanishes under it."""
    import fcntl

    _use(site, "cccc")
    fd = os.open(site.revs["B"] / ".mm" / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # stands for gc between its decision and the rename
    try:
        r = run_mm("bundle", site.revs["B"], "--out", site.tmp / "vols", "--volume-size", "1G", env=site.env)
    finally:
        os.close(fd)
    assert r.returncode == 6 and "Traceback" not in r.stderr, r.stderr
    assert "mm bundle cannot start" in r.stderr and "is writing it" in r.stderr


# --- the real engine ------------------------------------------------------------------------------------------------

def test_real_dockerd_keeps_the_mount_as_named_and_gc_keeps_the_revision_it_serves(real_docker, tmp_path):
    """Debian's dockerd records a bind's source as named (cleaned, not resolved) and the kernel follows the pointer
    when the container starts: gc, given the physical root, keeps what the container serves."""
    from tests.support import standin_image

    root = tmp_path / "data" / "models"
    revs = make_root(root)
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "m").symlink_to(root)
    env = real_docker.env
    image = standin_image.build(real_docker, "mm-inuse/standin:1", {})
    name = f"mm-inuse-{os.getpid()}"

    def docker(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *map(str, args)], env=env, capture_output=True, text=True, timeout=120)

    assert run_mm("use", REPO, "aaaa", "--root", tmp_path / "srv" / "m", env=env).returncode == 0
    started = docker("run", "-d", "--name", name, "--entrypoint", "/bin/busybox",
                     "-v", f"{tmp_path}/srv/m/{REPO}/current/:/models/x:ro", image, "sleep", "600")
    assert started.returncode == 0, started.stderr
    try:
        mounts = json.loads(docker("inspect", "-f", "{{json .Mounts}}", name).stdout)
        assert [m["Source"] for m in mounts] == [f"{tmp_path}/srv/m/{REPO}/current"]
        served = docker("exec", name, "cat", "/models/x/generation_config.json").stdout
        assert served == (revs["A"] / "generation_config.json").read_text()
        assert run_mm("use", REPO, "cccc", "--root", root, env=env).returncode == 0
        r = run_mm("gc", root, "--keep", "0", "--json", env=env)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        kept = {k["dir"]: k["why"] for k in doc["kept"]}
        assert kept[revs["A"].name].startswith(f"mounted by running container(s) {name}"), doc
        assert [x["dir"] for x in doc["removed"]] == [revs["B"].name]
        assert docker("exec", name, "cat", "/models/x/generation_config.json").stdout == served
    finally:
        docker("rm", "-f", name)
