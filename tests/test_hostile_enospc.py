"""A run stopped by a full disk resumes once a little room is made: the free-space check counts what is still
missing, not what the partial files already hold on disk.

Family (parametrized): `mm fetch`, `mm pull` and `mm unbundle` into a real small file system (a tmpfs, root
only: tests/support/fsimages.py) filled to ENOSPC mid-run (exit 7, the work kept), then freed by less than the
whole model needs but more than is still missing, then run again: exit 0, and the model verifies.
"""
from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest

from mm.artifacts.bundle.pack import BundleOptions, create_bundle
from tests.support.fsimages import fill, tmpfs_mount
from tests.support.modelgen import write_fetched_model
from tests.support.run import run_mm
from tests.support.slowio import slow_io_env

REV = "ce7f4df87d2e05262f5775f373dac4772f134041"
SLACK = 192 * 1024  # room beyond what is missing: mm's own files (manifest, journal, maps) and block rounding


def on_disk(root: Path) -> int:
    """Bytes allocated to the files under ROOT (what a resumed run does not need again)."""
    total = 0
    for p in root.rglob("*"):
        try:
            st = p.lstat()
        except FileNotFoundError:  # renamed or removed while mm runs
            continue
        total += st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0
    return total


SLOW_WRITES = '''\
"""sitecustomize installed by tests: the download engine pauses after each write to the partial file."""
import time

from mm.artifacts.fetching import ranges

_write = ranges._pwrite_all


def _slow(fd, pieces, offset):
    _write(fd, pieces, offset)
    time.sleep({delay})


ranges._pwrite_all = _slow
'''


def slow_writes_env(directory: Path, delay: float = 0.02) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SLOW_WRITES.format(delay=delay))
    return {"PYTHONPATH": str(directory)}


def _fill_now(mnt: Path) -> None:
    """Take every free byte of MNT (while mm writes there too: retried a little smaller when it raced)."""
    for _ in range(50):
        free = shutil.disk_usage(mnt).free
        try:
            with open(mnt / "filler", "ab") as f:
                os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, max(free, 4096))
        except OSError:
            continue
        if shutil.disk_usage(mnt).free < 4096:
            return


@pytest.fixture
def source(tmp_path_factory) -> Path:
    """A model of ~2.5 MB in eight shards (the run stops between and inside shards)."""
    root = tmp_path_factory.mktemp("src") / "MiniMax-M3.1-Flash"
    return write_fetched_model(root, REV, shards=8, shard_bytes=320 * 1024, draft=False, seed=7)


def _size(model: Path) -> int:
    return sum(p.stat().st_size for p in model.rglob("*") if p.is_file() and ".mm" not in p.relative_to(model).parts)


def _resume_after_enospc(tmp_path: Path, total: int, run, slow: dict) -> tuple:
    """RUN(dest, env) once with room for the whole model, the disk filled to ENOSPC once a third of it is on disk;
    then room made for what is missing (plus SLACK) but not for the whole model; RUN again."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    with tmpfs_mount(tmp_path / "disk", size=2 * total + 4 * SLACK) as mnt:
        dest = mnt / "m"
        fill(mnt, leave=total + 2 * SLACK)  # the up-front check passes
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                if on_disk(dest) > total // 3:
                    _fill_now(mnt)
                    return
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            first = run(dest, slow)
        finally:
            stop.set()
            watcher.join()
        held = on_disk(dest)
        for filler in (mnt / "filler",):
            filler.unlink()
        fill(mnt, leave=total - held + SLACK)
        second = run(dest, {})
        verify = run_mm("verify", dest)
        return first, held, second, verify


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "REGISTRY_AUTH", "DOCKER_CONFIG"))}
    return dict(env, HF_HOME=str(tmp_path / "hf-home"), DOCKER_CONFIG=str(tmp_path / "docker-config"),
                NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")


def _fetch(hub_root: Path, hub_url: str, source: Path, tmp_path: Path):
    from tests.support.gitrepo import commit_dir

    plain = tmp_path / "plain"  # the repo's files, without the manifest mm wrote beside them
    shutil.copytree(source, plain, ignore=shutil.ignore_patterns(".mm"))
    repo = f"enospc-org/{tmp_path.name[-30:].strip('_-.') or 'model'}"
    commit = commit_dir(hub_root / repo, plain, "upload")
    env = dict(_env(tmp_path), HF_ENDPOINT=hub_url)
    return lambda dest, extra: run_mm("fetch", repo, "--revision", commit, "--local-dir", dest, env={**env, **extra})


@pytest.mark.parametrize("command", ["fetch", "pull", "unbundle"])
def test_a_run_stopped_by_a_full_disk_resumes_once_what_is_missing_fits(command, source, tmp_path, request):
    total = _size(source)
    if command == "fetch":
        hub_root, server = request.getfixturevalue("hub_root"), request.getfixturevalue("hub_server")
        fetch = _fetch(hub_root, server.url, source, tmp_path)
        run, slow = fetch, slow_writes_env(tmp_path / "slow")
    elif command == "pull":
        registry = request.getfixturevalue("registry")
        ref = f"{registry.host}/enospc/model:v1"
        r = run_mm("push", source, ref, env=_env(tmp_path))
        assert r.returncode == 0, r.stderr
        run = lambda dest, extra: run_mm("pull", ref, "--local-dir", dest, env={**_env(tmp_path), **extra})  # noqa: E731
        slow = slow_writes_env(tmp_path / "slow")
    else:
        vols = tmp_path / "vols"
        create_bundle(source, BundleOptions((vols,), 10 ** 9))
        run = lambda dest, extra: run_mm("unbundle", vols, "--dest", dest, extra_env=extra)  # noqa: E731
        slow = slow_io_env(tmp_path)
    first, held, second, verify = _resume_after_enospc(tmp_path, total, run, slow)
    assert first.returncode == 7 and "Traceback" not in first.stderr, first.stdout + first.stderr
    assert held > SLACK, held
    assert second.returncode == 0 and "Traceback" not in second.stderr, (held, total, second.stderr)
    assert verify.returncode == 0, verify.stdout + verify.stderr
