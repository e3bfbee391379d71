"""Revisions side by side: a model root ROOT/<repo id>/<dir>/ whose revisions share bytes, a `current`
pointer switched by `mm use`, `mm ls`, and `mm gc` that never removes the current revision or one a running
container mounts (a stand-in docker on PATH answers `ps` and `inspect`), killed at every step of its work.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.edges.sharing import DiskUse, layout
from mm.artifacts.store import gc, scan, use
from mm.artifacts.integrity.verify import verify_dir
from tests.support import fake_docker, fake_gpu
from tests.support.killstep import kill_at_step_env
from tests.support.modelgen import write_model
from tests.support.run import run_mm

REPO = "MiniMaxAI/MiniMax-M3.1-Flash"  # the pin's repo: `mm launch` plans it
REVS = {"A": "a" * 40, "B": "b" * 40, "C": "c" * 40}


def make_root(root: Path, draft: bool = True) -> dict[str, Path]:
    """Revisions A, B, C of REPO under ROOT; B and C were imported with --link from the one before (hard links),
    each with its own generation_config.json. DRAFT: with the dspark/ draft (the b300 recipes use it)."""
    dirs = {}
    previous = None
    for n, (label, rev) in enumerate(REVS.items()):
        d = root / REPO / rev[:12]
        if previous is None:
            write_model(d, shards=2, shard_bytes=256 * 1024, seed=3, draft=draft)
        else:
            shutil.copytree(previous, d, copy_function=os.link, ignore=shutil.ignore_patterns(".mm"))
            (d / "generation_config.json").unlink()
            (d / "generation_config.json").write_text(json.dumps({"temperature": 1.0 - n / 10}) + "\n")
        manifest_for_local_dir(d, REPO, rev, offline=True)
        dirs[label] = previous = d
    return dirs


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "models"


@pytest.fixture
def revs(root) -> dict[str, Path]:
    return make_root(root)


@pytest.fixture
def docker(tmp_path):
    """A stand-in docker on PATH (tests/support/fake_docker.py); yields (env, add) where add(name, volumes,
    started) records a running container; stopped at the end."""
    state = tmp_path / "docker-state"
    fake_docker.install(tmp_path / "bin", state)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    procs = []

    def add(name: str, volumes: list[str], started: float | None = None) -> None:
        procs.append(fake_docker.add_container(state, name, volumes, started))

    yield env, add
    for p in procs:
        fake_docker.stop_container(p)


def mm(env, *args):
    return run_mm(*args, env=env)


def pointer(root: Path) -> str:
    return os.readlink(root / REPO / "current")


def ls(env, root) -> dict:
    r = mm(env, "ls", root, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --- mm use ----------------------------------------------------------------------------------------------------

def test_use_switches_the_pointer_and_a_rollback_is_one_command(root, revs, docker):
    env, _ = docker
    r = mm(env, "use", REPO, "aaaa", "--root", root)
    assert r.returncode == 0 and pointer(root) == revs["A"].name, r.stderr
    r = mm(env, "use", REPO, "b" * 40, "--root", root)
    assert r.returncode == 0 and pointer(root) == revs["B"].name
    assert f"roll back with: mm use {REPO} {revs['A'].name}" in r.stdout
    r = mm(env, "use", REPO, revs["A"].name, "--root", root, "--json")
    assert json.loads(r.stdout)["previous"] == revs["B"].name and pointer(root) == revs["A"].name
    r = mm(env, "use", REPO, "dddd", "--root", root)
    assert r.returncode == 3 and "no revision 'dddd'" in r.stderr and pointer(root) == revs["A"].name


def test_use_without_a_root_in_the_wrong_directory_names_root_and_mm_root(root, revs, docker, tmp_path):
    env, _ = docker
    env = {k: v for k, v in env.items() if k != "MM_ROOT"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_mm("use", REPO, "aaaa", env=env, cwd=elsewhere)
    assert r.returncode == 3 and r.stderr.strip().endswith(
        "the model root is the current directory when none is given: add --root DIR or set MM_ROOT"), r.stderr
    given = run_mm("use", REPO, "aaaa", "--root", elsewhere, env=env)
    assert given.returncode == 3 and "MM_ROOT" not in given.stderr  # a root the user named is the one they meant
    assert run_mm("use", REPO, "aaaa", env={**env, "MM_ROOT": str(root)}, cwd=elsewhere).returncode == 0


def test_use_refuses_a_revision_that_fails_its_quick_verify(root, revs, docker):
    env, _ = docker
    assert mm(env, "use", REPO, "aaaa", "--root", root).returncode == 0
    (revs["C"] / "model-00002-of-00002.safetensors").unlink()
    r = mm(env, "use", REPO, "cccc", "--root", root)
    assert r.returncode == 1 and "quick verify" in r.stderr and pointer(root) == revs["A"].name


def test_launch_of_the_pointer_mounts_the_pointer_so_the_next_start_serves_the_current_revision(root, revs, docker):
    env, _ = docker
    assert mm(env, "use", REPO, "bbbb", "--root", root).returncode == 0
    r = mm(env, "launch", root / REPO / "current", "--hardware", "b300")
    assert r.returncode == 0, r.stderr
    assert f"-v {root / REPO / 'current'}:/models/MiniMax-M3.1-Flash:ro" in r.stdout
    r = mm(env, "launch", revs["C"], "--hardware", "b300")  # any revision directory
    assert r.returncode == 0 and f"-v {revs['C']}:/models/MiniMax-M3.1-Flash:ro" in r.stdout, r.stderr


def start(script: Path) -> subprocess.CompletedProcess:
    """Run a start script on a host without docker (an empty PATH): what it says at every start, before docker."""
    empty = script.parent / "empty-path"
    empty.mkdir(exist_ok=True)
    return subprocess.run(["/bin/bash", str(script)], capture_output=True, text=True, env={"PATH": str(empty)},
                          timeout=30)


def launch_script(env, model: Path, out: Path, *args) -> tuple[subprocess.CompletedProcess, str]:
    """`mm launch MODEL --out OUT` (b300) and what the script says when started."""
    r = mm(env, "launch", model, "--hardware", "b300", "--out", out, *args)
    assert r.returncode == 0, r.stderr
    return r, start(out).stderr


def test_a_revision_mm_use_chose_starts_without_a_warning_and_one_nobody_chose_warns_at_every_start(root, revs, docker):
    env, _ = docker
    assert mm(env, "use", REPO, "bbbb", "--root", root).returncode == 0
    r, said = launch_script(env, root / REPO / "current", root / "start.sh")
    assert "WARNING" not in said and "docker: not found" in said  # it got as far as docker, silently
    assert "warning" not in r.stderr and f"revision: model revision {'b' * 40} (not the guide's pin" in r.stderr
    assert "was chosen: `mm use` at" in r.stderr and "# Revision: model revision " + "b" * 40 in (root / "start.sh").read_text()
    r, said = launch_script(env, revs["C"], root / "start.sh")  # never `mm use`d
    assert f"WARNING: model revision {'c' * 40} is not the guide's pin" in said and "nobody chose it" in said
    assert f"warning: model revision {'c' * 40} is not the guide's pin" in r.stderr
    assert "the start script warns so at every start" in r.stderr and "revision:" not in r.stderr


def test_a_manifest_changed_after_mm_use_warns_until_mm_use_records_it_again(root, revs, docker):
    env, _ = docker
    assert mm(env, "use", REPO, "bbbb", "--root", root).returncode == 0
    mpath = revs["B"] / ".mm" / "manifest.json"  # the directory swapped (here: its manifest) behind mm's back
    mpath.write_text(mpath.read_text().replace("b" * 40, "e" * 40))
    r, said = launch_script(env, root / REPO / "current", root / "start.sh")
    assert f"WARNING: model revision {'e' * 40} is not the guide's pin" in said
    assert f"{mpath} changed after `mm use` chose {revs['B'].name}" in r.stderr
    assert f"record it: mm use {REPO} {revs['B'].name} --root {root}" in r.stderr
    r = mm(env, "use", REPO, revs["B"].name, "--root", root)
    assert r.returncode == 0 and "the choice is recorded again" in r.stdout
    r, said = launch_script(env, root / REPO / "current", root / "start.sh")
    assert "WARNING" not in said and "warning" not in r.stderr and "was chosen: `mm use`" in r.stderr


def test_launch_revision_states_the_choice_and_refuses_a_directory_that_holds_another(root, revs, docker):
    env, _ = docker
    r, said = launch_script(env, revs["C"], root / "start.sh", "--revision", "cccccccc")
    assert "WARNING" not in said and "warning" not in r.stderr
    assert "was chosen: --revision cccccccc on the command line" in r.stderr
    (root / "start.sh").unlink()
    r = mm(env, "launch", revs["C"], "--hardware", "b300", "--out", root / "start.sh", "--revision", "bbbb")
    assert r.returncode == 7 and f"holds revision {'c' * 40}, not --revision bbbb" in r.stderr
    assert not (root / "start.sh").exists()


def test_a_revision_signed_by_a_trusted_signer_starts_without_a_warning(root, revs, docker, keys):
    env, _ = docker
    assert mm(env, "sign", revs["C"], "--key", keys["alice"]).returncode == 0
    r, said = launch_script(env, revs["C"], root / "start.sh", "--allowed-signers", keys["allowed"])
    assert "WARNING" not in said and "warning" not in r.stderr
    assert "was chosen: its manifest is signed by alice@example.com" in r.stderr


def test_doctor_checks_the_revision_the_pointer_names(root, revs, docker, tmp_path):
    env, _ = docker
    fake_gpu.install(tmp_path / "bin", 4 * [fake_gpu.B300])
    assert mm(env, "use", REPO, "bbbb", "--root", root).returncode == 0
    (revs["B"] / "tokenizer.json").unlink()  # the model check must be B's, read through the pointer
    r = mm(env, "doctor", root / REPO / "current", "--hardware", "b300", "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert r.returncode == 1 and checks["model"]["status"] == "fail" and "tokenizer.json" in checks["model"]["detail"]


# --- mm ls -------------------------------------------------------------------------------------------------------

def test_ls_shows_sizes_shared_bytes_current_verification_signatures_and_mounts(root, revs, docker, keys):
    env, add = docker
    assert mm(env, "use", REPO, "cccc", "--root", root).returncode == 0
    assert mm(env, "verify", revs["A"]).returncode == 0
    assert mm(env, "sign", revs["B"], "--key", keys["alice"]).returncode == 0
    add("server-1", [f"{revs['A']}:/models/x:ro"])
    doc = ls(env, root)
    by_dir = {r["dir"]: r for r in doc["revisions"]}
    a, b, c = (by_dir[revs[k].name] for k in "ABC")
    assert [r["current"] for r in (a, b, c)] == [False, False, True]
    assert a["verified"]["ok"] and a["verified"]["by"] == "mm verify" and b["verified"] is None
    assert (a["signature"], b["signature"], c["signature"]) == ("none", "good", "none")
    assert a["mounted_by"] == ["server-1"] and c["mounted_by"] == []
    shard = layout(revs["A"] / "model-00001-of-00002.safetensors")
    assert a["shared"] >= shard.allocated and a["on_disk"] >= a["shared"]  # its shard is hard-linked into B and C
    everything = DiskUse(layout(p) for d in revs.values() for p in d.rglob("*.safetensors")).bytes
    assert doc["on_disk"] < doc["size"] and doc["on_disk"] >= everything
    assert doc["pointers"] == {REPO: revs["C"].name}
    text = mm(env, "ls", root).stdout
    assert f"* {'c' * 12}" in text and "mounted by server-1" in text and "signed (ssh-ed25519" in text


def test_ls_reads_its_records_as_hostile(root, revs, docker):
    env, _ = docker
    assert mm(env, "use", REPO, "bbbb", "--root", root).returncode == 0
    (root / ".mm" / "uses.jsonl").write_bytes(b'{"time": 1e400}\n[[[[\n\xff\xfe\n{"time": true, "dir": 5}\n')
    (revs["A"] / ".mm" / "verified.json").write_bytes(b'{"schema": "mm-verified/1", "time": "\\ud800", "ok": 1}')
    (revs["C"] / ".mm" / "manifest.json").write_text("{" * 100_000)
    r = mm(env, "ls", root, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {x["dir"] for x in doc["revisions"]} == {revs["A"].name, revs["B"].name}
    assert [x["verified"] for x in doc["revisions"]] == [None, None]
    assert any(str(revs["C"]) in n and "not listed" in n for n in doc["notes"])


# --- mm gc -------------------------------------------------------------------------------------------------------

def test_gc_keeps_the_current_the_kept_and_the_mounted_revisions_and_says_what_it_frees(root, revs, docker):
    env, add = docker
    assert mm(env, "use", REPO, "bbbb", "--root", root).returncode == 0
    add("server-c", [f"{revs['C']}:/models/x:ro"])
    a_alone = {p.relative_to(revs["A"]) for p in revs["A"].rglob("*") if p.is_file()
               and p.stat().st_nlink == 1 and ".mm" not in p.parts}
    expect = sum(layout(revs["A"] / p).allocated for p in a_alone)
    dry = json.loads(mm(env, "gc", root, "--keep", "0", "--dry-run", "--json").stdout)
    assert [r["dir"] for r in dry["removed"]] == [revs["A"].name] and dry["freed"] == expect
    assert {r["dir"]: r["why"] for r in dry["kept"]} == {
        revs["B"].name: "current", revs["C"].name: "mounted by running container(s) server-c"}
    assert revs["A"].is_dir()
    r = mm(env, "gc", root, "--keep", "0")
    assert r.returncode == 0 and f"removed {REPO}@{'a' * 12}" in r.stdout, r.stderr
    assert not revs["A"].exists() and revs["B"].is_dir() and revs["C"].is_dir()
    assert verify_dir(revs["B"]).ok and verify_dir(revs["C"]).ok  # hard links into A's files kept their bytes


def test_gc_frees_a_revisions_payloads_with_it_and_ls_shows_their_size(root, revs, docker):
    env, _ = docker
    assert mm(env, "use", REPO, "cccc", "--root", root).returncode == 0
    for label in ("A", "C"):  # what unbundle puts beside a revision: mm's wheels, an engine image archive
        payload = revs[label].with_name(revs[label].name + ".payload")
        (payload / "image").mkdir(parents=True)
        (payload / "image" / "engine.tar").write_bytes(os.urandom(300_000))
    listed = json.loads(mm(env, "ls", root, "--json").stdout)
    sizes = {r["dir"]: r["payload"] for r in listed["revisions"]}
    assert sizes[revs["A"].name] >= 300_000 and sizes[revs["B"].name] == 0
    text = mm(env, "ls", root).stdout
    assert f"{revs['A'].name}.payload/ " in text, text
    dry = json.loads(mm(env, "gc", root, "--keep", "0", "--dry-run", "--json").stdout)
    assert dry["freed"] >= 300_000 and {r["dir"]: r["payload"] for r in dry["removed"]} == {
        revs["A"].name: sizes[revs["A"].name], revs["B"].name: 0}
    r = mm(env, "gc", root, "--keep", "0")
    assert r.returncode == 0 and f"and {revs['A'].name}.payload/ (" in r.stdout, r.stdout
    assert not revs["A"].exists() and not revs["A"].with_name(revs["A"].name + ".payload").exists()
    assert revs["C"].with_name(revs["C"].name + ".payload").is_dir()  # the current revision's stay


def test_gc_keeps_the_revision_a_container_started_through_the_pointer_mounts(root, revs, docker):
    env, add = docker
    assert mm(env, "use", REPO, "aaaa", "--root", root).returncode == 0
    add("server-1", [f"{root / REPO / 'current'}:/models/x:ro"])
    time.sleep(0.05)
    assert mm(env, "use", REPO, "cccc", "--root", root).returncode == 0
    # the container started while A was current; the pointer names C now
    doc = json.loads(mm(env, "gc", root, "--keep", "0", "--json").stdout)
    kept = {r["dir"]: r["why"] for r in doc["kept"]}
    assert kept[revs["A"].name].startswith("mounted by running container(s) server-1") and kept[revs["C"].name] == "current"
    assert [r["dir"] for r in doc["removed"]] == [revs["B"].name]


def docker_down(tmp_path: Path) -> dict[str, str]:
    """An environment whose `docker` is installed but its daemon does not answer (a stand-in first on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_gc_removes_nothing_when_docker_cannot_say_what_runs(root, revs, tmp_path):
    env = docker_down(tmp_path)
    r = mm(env, "gc", root, "--keep", "0")
    assert r.returncode == 7 and "Cannot connect to the Docker daemon" in r.stderr, r.stderr
    assert "`mm gc --without-docker` removes them without asking docker: a container still serving a removed " \
           "revision loses its files" in r.stderr, r.stderr
    assert all(d.is_dir() for d in revs.values())


def test_gc_without_docker_removes_what_it_would_with_docker_stopped_and_says_what_it_did_not_ask(root, revs,
                                                                                                   tmp_path):
    env = docker_down(tmp_path)
    assert mm(env, "use", REPO, "cccc", "--root", root).returncode == 0
    r = mm(env, "gc", root, "--keep", "0", "--without-docker")
    assert r.returncode == 0, r.stderr
    assert "note: docker not asked (--without-docker)" in r.stderr
    assert not revs["A"].exists() and not revs["B"].exists() and revs["C"].is_dir()


def test_gc_dry_run_without_docker_answering_says_what_would_go_and_that_mounts_are_unknown(root, revs, tmp_path):
    env = docker_down(tmp_path)
    r = mm(env, "gc", root, "--keep", "0", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dry_run"] and {r["dir"] for r in doc["removed"]} == {revs["A"].name, revs["B"].name}
    assert any("Cannot connect to the Docker daemon" in n and "if no container mounted" in n for n in doc["notes"])
    assert all(d.is_dir() for d in revs.values())


def crowded_docker(tmp_path: Path, count: int, mounter: int, mount: Path, started: str) -> dict[str, str]:
    """A docker whose `ps` lists COUNT running containers (ids 0..COUNT-1, 64 digits); `inspect` answers for the
    ids it is given, container MOUNTER mounting MOUNT, each started at STARTED (sh: a few ms a call). Each
    inspect's operand count goes to tmp_path/inspect-sizes."""
    bin_dir = tmp_path / "crowded-bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f"""#!/bin/sh
case "$1" in
ps) seq -f %064.0f 0 {count - 1} ;;
inspect) shift 2; echo $# >> '{tmp_path / "inspect-sizes"}'; printf '['; sep=; mounter=$(printf %064d {mounter})
  for id; do
    printf '%s{{"Id":"%s","Name":"/c%s","State":{{"Running":true,"StartedAt":"%s"}},"Mounts":[' "$sep" $id $id '{started}'
    [ "$id" = "$mounter" ] && printf '{{"Source":"%s"}}' '{mount}'
    printf ']}}'; sep=,
  done; printf ']' ;;
esac
""")
    (bin_dir / "docker").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_gc_asks_docker_about_50000_containers_more_than_one_exec_takes_in_batches_and_keeps_what_the_last_one_mounts(root, revs, tmp_path):
    env = crowded_docker(tmp_path, 50_000, 49_999, revs["A"], "2026-01-01T10:00:00Z")
    doc = json.loads(mm(env, "gc", root, "--keep", "0", "--dry-run", "--json").stdout)
    assert {r["dir"]: r["why"] for r in doc["kept"]}[revs["A"].name] == f"mounted by running container(s) c{49_999:064d}"
    sizes = [int(n) for n in (tmp_path / "inspect-sizes").read_text().split()]
    assert sum(sizes) == 50_000 and max(sizes) <= 256


@pytest.mark.parametrize("started", ["9999-99-99T99:99:99Z", "2026-02-30T10:00:00Z", "2026-01-01T24:61:00+25:99"])
def test_gc_reads_a_start_time_no_calendar_has_as_unknown(root, revs, tmp_path, started):
    env = crowded_docker(tmp_path, 2, 1, revs["A"], started)
    r = mm(env, "gc", root, "--keep", "0", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {r["dir"]: r["why"] for r in doc["kept"]}[revs["A"].name].startswith(f"mounted by running container(s) c{1:064d}")
    assert revs["A"].is_dir()


# --- interrupted at every step --------------------------------------------------------------------------------

def quiet_docker(tmp_path: Path) -> dict:
    """A docker with no running container, answering at once (the kill loop runs mm many times)."""
    bin_dir = tmp_path / "quiet-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "docker").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def assert_consistent(root: Path, allowed: set[str]) -> None:
    """Whatever point a kill hit: the root scans, the pointer names a listed revision, and every listed revision is
    whole (its quick verify passes); half-removed revisions are only ever under their .mm-removing- name."""
    repo = scan(root).repo(REPO)
    names = {r.name for r in repo.revisions}
    assert names <= allowed and repo.pointer_problem is None and repo.current in names
    for r in repo.revisions:
        assert verify_dir(r.path, quick=True).ok, r.path


def kill_at_every_step(pristine: Path, tmp_path: Path, env: dict, args: list, allowed: set[str], finish) -> int:
    """For N = 1, 2, ...: a fresh copy of the root PRISTINE (hard links kept), `mm ARGS` killed just before its Nth
    file-system step, the root checked consistent, then FINISH(root) (the library call a rerun makes) and the root
    checked again; until a run does fewer than N steps and completes. Returns the steps that run took."""
    for step in range(1, 200):
        root = Path(tempfile.mkdtemp(dir=tmp_path, prefix=f"step-{step}-")) / "models"
        subprocess.run(["cp", "-a", str(pristine), str(root)], check=True)
        argv = [str(root) if a is ROOT else a for a in args]
        r = run_mm(*argv, env={**env, **kill_at_step_env(tmp_path / "kill", step)})
        if r.returncode == 0:
            return step - 1
        assert r.returncode == -9, r.stderr
        assert_consistent(root, allowed)
        finish(root)
        shutil.rmtree(root.parent)
    raise AssertionError("never completed")


ROOT = object()  # stands for the copy of the root in kill_at_every_step's arguments


def test_use_and_gc_killed_at_every_step_leave_the_root_consistent_and_a_rerun_finishes(root, tmp_path):
    revs = make_root(root, draft=False)  # fewer files: fewer steps to kill at
    env = quiet_docker(tmp_path)
    docker = str(tmp_path / "quiet-bin" / "docker")
    everything = {d.name for d in revs.values()}
    assert mm(env, "use", REPO, "bbbb", "--root", root).returncode == 0

    def use_finishes(copy: Path) -> None:
        use(copy, REPO, "cccc")
        assert os.readlink(copy / REPO / "current") == revs["C"].name
        assert_consistent(copy, everything)

    steps = kill_at_every_step(root, tmp_path, env, ["use", REPO, "cccc", "--root", ROOT], everything, use_finishes)
    assert steps >= 4  # log, symlink, rename, fsync
    assert mm(env, "use", REPO, "cccc", "--root", root).returncode == 0

    def gc_finishes(copy: Path) -> None:
        report = gc(copy, keep=1, docker=docker)
        assert {p.name for p in (copy / REPO).iterdir() if not p.is_symlink()} == {revs["B"].name, revs["C"].name}
        assert report.removed == [] or [r["dir"] for r in report.removed] == [revs["A"].name]
        assert_consistent(copy, {revs["B"].name, revs["C"].name})

    steps = kill_at_every_step(root, tmp_path, env, ["gc", ROOT, "--keep", "1"], everything, gc_finishes)
    assert steps >= 12  # a rename, then every file and directory of A
