"""The head start of `mm verify DIR` (artifacts/integrity/early.py): its large files hashed before the command tree
loads, the digests taken by verify only for exactly what was started and only for files unchanged since, and the
output the verify's own."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mm.artifacts.edges.interrupt import usable_cores
from mm.artifacts.edges.progress import NULL_PROGRESS
from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.integrity import early, reading
from mm.artifacts.integrity.reading import BIG_FILE
from mm.artifacts.integrity.verify import verify_dir
from tests.support.modelgen import write_model
from tests.support.run import mm_argv, run_mm
from tests.support.tty import run_on_tty

SHARD = "model-00001-of-00002.safetensors"  # BIG_FILE and more: hashed by the head start
TIMING = ("seconds", "bytes_per_second")
# the command tree without the console script (__main__.py): the same verify, with no head start
TREE = [sys.executable, "-c", "import sys; sys.argv[0] = 'mm'; from mm.cli import main; main()"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("head-start") / "MiniMax-M3.1-Flash"
    write_model(root, shards=2, shard_bytes=BIG_FILE)  # two shards a head start hashes, a draft it leaves to verify
    manifest_for_local_dir(root, "MiniMaxAI/MiniMax-M3.1-Flash", "ce7f4df87d2e05262f5775f373dac4772f134041",
                           offline=True)
    (root / ".mm" / "lock").touch()  # as a fetch leaves it (a head start shares the lock; verify makes it if absent)
    return root


@pytest.fixture
def model(pristine, tmp_path) -> Path:
    root = tmp_path / "MiniMax-M3.1-Flash"
    shutil.copytree(pristine, root, symlinks=True)
    return root


@pytest.fixture
def no_head_start_left():
    yield
    early.discard()


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def opened(tmp_path: Path, *args: object) -> list[str]:
    """The files `mm ARGS` opened, in order (strace)."""
    if shutil.which("strace") is None:
        pytest.skip("strace not installed")
    trace = tmp_path / "open.strace"
    r = run_mm(*args, prefix=["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(trace)])
    assert r.returncode == 0, r.stderr
    return [m.group(1) for m in re.finditer(r'openat\([^"]*"([^"]+)"', trace.read_text())]


def first(paths: list[str], part: str) -> int:
    return next(i for i, p in enumerate(paths) if part in p)


def test_a_plain_verify_opens_its_first_shard_before_click_loads(pristine, tmp_path):
    paths = opened(tmp_path, "verify", pristine)
    assert first(paths, SHARD) < first(paths, "/click/")


def test_a_verify_with_an_option_that_changes_the_hashing_starts_nothing_early(pristine, tmp_path):
    paths = opened(tmp_path, "verify", "--jobs", "1", pristine)
    assert first(paths, "/click/") < first(paths, SHARD)


def without_timing(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in TIMING}


@pytest.mark.parametrize("damage", ["none", "shard", "draft"])
def test_json_output_is_the_same_with_and_without_the_head_start(model, damage):
    if damage == "shard":
        flip_byte(model / SHARD, BIG_FILE // 2)  # in a file the head start hashes
    elif damage == "draft":
        flip_byte(model / "dspark" / "model-00001-of-00001.safetensors", 4096)  # in one it leaves to verify
    head = run_mm("verify", "--json", model)
    tree = subprocess.run([*TREE, "verify", "--json", str(model)], capture_output=True, text=True)
    assert head.returncode == tree.returncode == (0 if damage == "none" else 1)
    assert without_timing(json.loads(head.stdout)) == without_timing(json.loads(tree.stdout))


def test_text_output_is_the_same_with_and_without_the_head_start(model):
    flip_byte(model / SHARD, BIG_FILE // 2)

    def masked(text: str) -> str:
        return re.sub(r" hashed at [^,]+, [^.]+\.\d+ s\.", " hashed.", text)

    head = run_mm("verify", model)
    tree = subprocess.run([*TREE, "verify", str(model)], capture_output=True, text=True)
    assert head.returncode == tree.returncode == 1
    assert "HASH       model-00001-of-00002.safetensors: blake3 expected" in head.stdout
    assert masked(head.stdout) == masked(tree.stdout) and head.stderr == tree.stderr


def test_a_file_rewritten_after_the_head_start_hashed_it_is_hashed_again(model, no_head_start_left):
    early.begin(["verify", str(model)])
    head = early.current()
    assert head is not None
    head.wait()  # every large file hashed, intact
    flip_byte(model / SHARD, BIG_FILE // 2)
    report = verify_dir(model, head_start=True)
    assert [(p.path, p.kind) for p in report.problems] == [(SHARD, "hash")]


def test_a_head_start_verify_does_not_take_is_stopped_and_lets_go_of_the_lock(model, no_head_start_left):
    early.begin(["verify", str(model)])
    head = early.current()
    assert head is not None
    seen = []

    class Progress(type(NULL_PROGRESS)):
        def begin(self, total_bytes, label, files=None):
            seen.append(head.running)

    report = verify_dir(model, jobs=usable_cores() + 1, head_start=True, progress=Progress())  # another thread count
    assert report.ok and seen == [False] and early.current() is None
    with open(model / ".mm" / "lock", "rb") as f:  # no shared lock left behind: a writer may go on
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_verify_on_a_terminal_shows_one_bar_that_ends_at_its_total(pristine):
    run = run_on_tty("verify", pristine)
    assert run.returncode == 0, run.text
    percents = [int(p) for frame in run.frames for p in re.findall(r"(\d+)%", frame)]
    assert percents and max(percents) <= 100, run.frames
    assert run.screen[-1].endswith(". OK") and " 12 files, 151." in run.text


def test_a_head_start_told_to_stop_stops_within_a_window_and_lets_go_of_the_lock(model, monkeypatch,
                                                                               no_head_start_left):
    """Windows made to take half a second each (a slow disk): stopped mid-file, it ends within a second."""
    real = reading.fd_windows

    def slow(*args, **kwargs):
        for piece in real(*args, **kwargs):
            time.sleep(0.5)
            yield piece

    monkeypatch.setattr(reading, "fd_windows", slow)
    early.begin(["verify", str(model)])
    head = early.current()
    assert head is not None and head.running
    time.sleep(0.2)
    asked = time.monotonic()
    early.discard()
    assert time.monotonic() - asked < 1.0 and not head.running and early.current() is None
    with open(model / ".mm" / "lock", "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_ctrl_c_as_the_head_start_begins_ends_as_a_ctrl_c_in_verify(pristine):
    """SIGINT as soon as the first shard is open: before click loads or after, one line and exit 130."""
    proc = subprocess.Popen(mm_argv("verify", pristine), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        fds = Path(f"/proc/{proc.pid}/fd")
        deadline = time.monotonic() + 10
        while not any(target.endswith(SHARD) for target in _open_files(fds)):
            assert proc.poll() is None and time.monotonic() < deadline, "mm ended before its first shard was seen open"
            time.sleep(0.0005)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (130, "", "mm: interrupted by SIGINT\n")


def _open_files(fds: Path) -> list[str]:
    found = []
    try:
        for fd in fds.iterdir():
            try:
                found.append(os.readlink(fd))
            except OSError:  # closed meanwhile
                pass
    except OSError:
        pass
    return found
