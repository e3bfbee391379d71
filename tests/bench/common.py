"""Shared benchmark plumbing: work dirs, peer tools, measured child runs, a local Hub server."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]


def bench_dir(name: str) -> Path:
    path = ROOT / "bench-work" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def peer_bin(name: str) -> str:
    """A console script installed beside this Python (mm, hf), else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None, stdout: Path | None = None) -> tuple[float, int]:
    """Run CMD to completion; return its wall seconds and its own peak RSS in bytes (wait4, this child only).
    STDOUT: a file to keep the child's standard output in (e.g. `--json`), else it is dropped."""
    start = time.perf_counter()
    with open(stdout or os.devnull, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.read().decode()[-500:]}")
    return seconds, usage.ru_maxrss * 1024


@contextmanager
def start_hub_server(root: Path, shards: int, shard_bytes: int, server_args: tuple[str, ...] = ()
                     ) -> Iterator[tuple[str, str, str, int]]:
    """The local Hub server as a separate process (as a user would see it); yields url, repo, commit, bytes.
    SERVER_ARGS: more hubserver options, e.g. ("--conn-rate", "20000000", "--redirect-lfs", "--no-draft")."""
    from tests.support.gitrepo import tree_sizes

    shutil.rmtree(root, ignore_errors=True)
    repo_id = "MiniMaxAI/MiniMax-M3.1-Flash"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.hubserver", "--root", str(root), "--make-model",
                             repo_id, "--shards", str(shards), "--shard-bytes", str(shard_bytes), *server_args],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        match = re.match(r"HUB_URL=(\S+)", line)
        if not match:
            raise RuntimeError(f"hub server did not start: {line!r}")
        commit = subprocess.run(["git", "-C", str(root / repo_id), "rev-parse", "main"], capture_output=True,
                                text=True, check=True).stdout.strip()
        total = sum(tree_sizes(root / repo_id, commit).values())
        yield match.group(1), repo_id, commit, total
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
