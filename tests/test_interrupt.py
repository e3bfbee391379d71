"""Ctrl-C and SIGTERM keep the work: a real signal in the middle of each transfer, then a rerun.

Each case starts the real `mm` in a subprocess, slows its transfer from the test side (the Hub test server's rate
limit, a rate-limited proxy in front of the real docker-registry, the bundle copy loop's test pause), sends SIGINT
or SIGTERM once work is on disk, and asserts: the process ends within STOP_LIMIT of the signal (the goal is one
second; the limit leaves room for a loaded machine) with 130 (SIGINT) or 143 (SIGTERM), one line naming what is
kept and the command that resumes, no traceback; the partial files (and range maps) are still there; and the
rerun transfers at most 1.25x what was missing. Measured signal-to-exit times are printed (pytest -s).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mm.artifacts.paths import manifest_path
from tests.support.countproxy import CountingProxy
from tests.support.run import mm_argv, run_mm
from tests.support.slowio import slow_io_env, slow_stripes_env
from tests.test_oci import REV_A, env_for, make_model, missing_bytes, partial_bytes, tree

STOP_LIMIT = 2.0  # seconds from the signal to the exit; mm's own deadline is 0.7 s (interrupt.GRACE)
TIMES: dict[str, float] = {}


def start(*args, env: dict, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(mm_argv(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd)


def wait_until(proc: subprocess.Popen, ready, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"mm ended (exit {proc.returncode}) before {what}: {err[-2000:]}")
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.01)


def interrupt(proc: subprocess.Popen, signum: int, case: str) -> tuple[str, str, float]:
    """Send SIGNUM; (stdout, stderr, seconds from the signal to the exit). Asserts the exit code and STOP_LIMIT."""
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{case}: still running 30 s after {signum!r}: {err[-2000:]}")
    took = time.monotonic() - sent
    TIMES[case] = took
    print(f"\n{case}: signal to exit {took:.3f} s")
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    assert "Traceback" not in err and "internal error" not in err, err
    assert took < STOP_LIMIT, f"{case}: {took:.2f} s from the signal to the exit"
    return out, err, took


def one_line(err: str, signame: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("mm: ")]
    assert len(lines) == 1, err
    assert f"interrupted by {signame}" in lines[0] and "resume with: mm " in lines[0], lines[0]
    return lines[0]


def settle(hub_server) -> None:
    """Wait until the Hub test server stops sending to the ended mm (a throttled response goes on until its socket
    fails), so that the rerun's count holds only the rerun's bytes."""
    last, quiet_since = -1, time.monotonic()
    while time.monotonic() - quiet_since < 0.3:
        now = hub_server.total_bytes_served
        if now != last:
            last, quiet_since = now, time.monotonic()
        time.sleep(0.05)
    hub_server.reset()


def range_map_bytes(dest: Path) -> int:
    total = 0
    for state in (dest / ".mm" / "partial").glob("*.ranges"):
        try:
            total += sum(e - s for s, e in json.loads(state.read_text())["done"])
        except FileNotFoundError:  # the file was completed meanwhile
            pass
    return total


# --- fetch --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_fetch_interrupted_keeps_the_partial_and_the_rerun_fetches_only_the_rest(run_mm, hub_env, big_repo, hub_server,
                                                                                 tmp_path, signum):
    repo_id, commit, big_file, size = big_repo
    dest = tmp_path / "m"
    hub_server.rate_limit = 512 * 1024  # bytes/s per response (4 of them): the signal lands mid-file
    args = ("fetch", repo_id, "--revision", commit, "--local-dir", dest, "--connections", "4")
    as_json = ("--json",) if signum == signal.SIGTERM else ()
    proc = start(*args, *as_json, env={**hub_env, "MM_PROGRESS_INTERVAL": "0.1"})  # progress lines in the log
    wait_until(proc, lambda: (dest / ".mm" / "partial").is_dir() and range_map_bytes(dest) >= size // 4,
               "a quarter of the file on disk")
    out, err, _ = interrupt(proc, signum, f"fetch {signum.name}")
    line = one_line(err, signum.name)
    print(line)
    # the interruption is the last word: no summary of the cut phase ("fetch X: 1 file, 3.1 MB in 2.0 s"), which
    # reads as a success, nor the JSON stream's last event ("done": true)
    assert err.splitlines()[-1] == line and '"done": true' not in err, err
    assert not [ln for ln in err.splitlines() if re.search(r": \d+ files?, \S+ \S+ in \S+ s", ln)], err
    assert "partial download(s)" in line and str(dest / ".mm" / "partial") in line
    assert f"mm fetch {repo_id} --revision {commit} --local-dir {dest}" in line
    if as_json:
        doc = json.loads(out)
        assert doc["ok"] is False and doc["exit_code"] == 143 and doc["kind"] == "Interrupted"
        assert doc["signal"] == "SIGTERM" and doc["resume"] == f"mm {' '.join(map(str, args))} --json"
        assert any("partial download(s)" in k for k in doc["kept"])
    kept = range_map_bytes(dest)
    assert size // 4 <= kept < size
    partials = list((dest / ".mm" / "partial").glob("*.part"))
    assert partials
    missing = size - kept
    settle(hub_server)
    r = run_mm(*args, env=hub_env)
    assert r.returncode == 0, r.stderr
    served = hub_server.bytes_served.get(big_file, 0)
    print(f"fetch {signum.name}: missing {missing}, rerun served {served} ({served / missing:.3f}x)")
    assert served <= 1.25 * missing, (served, missing)
    assert not any(p.exists() for p in partials)


# --- pull and push (the real docker-registry, behind a rate-limited counting proxy) ----------------------

def oci_env(tmp_path: Path) -> dict[str, str]:
    return {k: v for k, v in env_for(tmp_path).items() if k != "SSH_AUTH_SOCK"}


@pytest.mark.parametrize("signum", [signal.SIGINT])
def test_pull_interrupted_keeps_the_partials_and_the_rerun_pulls_only_the_rest(registry, tmp_path, signum):
    model = make_model(tmp_path / "m", seed=31 + signum, revision=REV_A)
    ref = f"{registry.host}/interrupt/pull{signum}:t"
    assert run_mm("push", model, ref, env=oci_env(tmp_path)).returncode == 0
    dest = tmp_path / "pulled"
    total = sum(len(b) for b in tree(model).values())
    with CountingProxy("127.0.0.1", registry.port, rate=2_000_000) as proxy:
        args = ("pull", ref.replace(registry.host, proxy.host), "--local-dir", dest)
        proc = start(*args, env=oci_env(tmp_path))
        wait_until(proc, lambda: partial_bytes(dest) >= 2 * 1024 * 1024, "2 MiB of partial files")
        _, err, _ = interrupt(proc, signum, f"pull {signum.name}")
        proxy.drop_connections()
        line = one_line(err, signum.name)
        assert "partial download(s)" in line and f"resume with: mm pull {proxy.host}/" in line
        done = sum((dest / p).stat().st_size for p in tree(model) if (dest / p).is_file())
        kept = partial_bytes(dest)
        assert kept >= 2 * 1024 * 1024
        missing = total - done - kept
        assert 0 < missing < total
        proxy.rate = None
        proxy.reset()
        r = run_mm(*args, "--json", env=oci_env(tmp_path))
        assert r.returncode == 0, r.stderr
        print(f"pull {signum.name}: missing {missing}, rerun received {proxy.received} ({proxy.received / missing:.3f}x)")
        assert proxy.received <= 1.25 * missing, (proxy.received, missing)
    assert any(f["resumed_from"] > 0 for f in json.loads(r.stdout)["files"])
    assert tree(dest) == tree(model)


@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_push_interrupted_keeps_the_upload_state_and_the_rerun_sends_only_what_the_registry_lacks(registry, tmp_path,
                                                                                                   signum):
    model = make_model(tmp_path / "m", seed=41 + signum, revision=REV_A)
    repo = f"interrupt/push{signum}"
    with CountingProxy("127.0.0.1", registry.port, rate=4_000_000) as proxy:
        args = ("push", model, f"{proxy.host}/{repo}:t", "--chunk-size", "1MiB")
        proc = start(*args, env=oci_env(tmp_path))
        wait_until(proc, lambda: proxy.sent >= 4 * 1024 * 1024, "4 MiB sent")
        _, err, _ = interrupt(proc, signum, f"push {signum.name}")
        proxy.drop_connections()
        line = one_line(err, signum.name)
        assert f"resume with: mm push {model} {proxy.host}/{repo}:t --chunk-size 1MiB" in line
        time.sleep(0.5)  # the registry finishes with what reached it
        missing = missing_bytes(registry, repo, manifest_path(model))
        assert missing > 0
        proxy.rate = None
        proxy.reset()
        r = run_mm(*args, env=oci_env(tmp_path))
        assert r.returncode == 0, r.stderr
        print(f"push {signum.name}: missing {missing}, rerun sent {proxy.sent} ({proxy.sent / missing:.3f}x)")
        assert proxy.sent <= 1.25 * missing, (proxy.sent, missing)
    assert missing_bytes(registry, repo, manifest_path(model)) == 0


# --- bundle, unbundle, parity rebuilds (slowed by the test-side copy loop and stripe pauses) -----------------

VOLUME_SIZE = 500_000  # smaller than every shard: shards are split across volumes

IO_REPORT = '''\
"""sitecustomize installed by tests: at exit, the bytes this mm process wrote (write syscalls, /proc/self/io)."""
import atexit
import os


def _report():
    with open("/proc/self/io") as f:
        wchar = next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    with open(os.environ["MM_TEST_IO_REPORT"], "w") as f:
        f.write(str(wchar))


atexit.register(_report)
'''


def run_counting_writes(tmp_path: Path, *args) -> tuple[subprocess.CompletedProcess, int]:
    """Run mm; (its result, the bytes it wrote)."""
    hook = tmp_path / "io-report"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(IO_REPORT)
    report = tmp_path / "io-report.txt"
    r = run_mm(*args, extra_env={"PYTHONPATH": str(hook), "MM_TEST_IO_REPORT": str(report), "SSH_AUTH_SOCK": ""})
    return r, int(report.read_text())


def bundle_model(root: Path, seed: int) -> Path:
    return make_model(root, seed=seed, revision=REV_A, shard_bytes=600 * 1024)


def bundled(tmp_path: Path, seed: int) -> tuple[Path, Path]:
    """(model, its volumes in TMP_PATH/reference), bundled by the CLI."""
    model = bundle_model(tmp_path / "model", seed=seed)
    vols = tmp_path / "reference"
    assert run_mm("bundle", model, "--out", vols, "--volume-size", VOLUME_SIZE, "--no-sync").returncode == 0
    return model, vols


def bytes_final(dest: Path, payload: dict[str, bytes]) -> int:
    """Bytes of PAYLOAD's files that have their final name (and size) in DEST."""
    return sum(len(data) for rel, data in payload.items() if (dest / rel).is_file()
               and (dest / rel).stat().st_size == len(data))


def volumes_in(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(".tar"))


def identity(paths: list[Path]) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


@pytest.mark.parametrize("signum", [signal.SIGINT])
def test_bundle_interrupted_keeps_the_finished_volumes_and_the_rerun_writes_only_the_rest(tmp_path, signum):
    model, reference = bundled(tmp_path, seed=51)
    out = tmp_path / "vols"
    args = ("bundle", model, "--out", out, "--volume-size", VOLUME_SIZE, "--no-sync")
    proc = start(*args, env={**os.environ, **slow_io_env(tmp_path)})
    wait_until(proc, lambda: out.is_dir() and len(volumes_in(out)) >= 1
               and any(p.name.endswith(".partial") for p in out.iterdir()), "volume 1 done, volume 2 begun")
    _, err, _ = interrupt(proc, signum, f"bundle {signum.name}")
    line = one_line(err, signum.name)
    kept = volumes_in(out)
    assert kept and f"{len(kept)} complete volume file(s) in {out}" in line
    assert f"resume with: mm bundle {model} --out {out}" in line
    before = identity(kept)
    missing = sum(p.stat().st_size for p in volumes_in(reference)) - sum(p.stat().st_size for p in kept)
    r, _ = run_counting_writes(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    after = volumes_in(out)
    assert {k: v for k, v in identity(after).items() if k in before} == before  # not written again
    rewritten = sum(p.stat().st_size for p in after if p.name not in before)
    print(f"bundle {signum.name}: missing {missing}, rerun wrote {rewritten} of volumes ({rewritten / missing:.3f}x)")
    assert rewritten <= 1.25 * missing
    assert [p.read_bytes() for p in after] == [p.read_bytes() for p in volumes_in(reference)]


@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_unbundle_interrupted_keeps_what_is_imported_and_the_rerun_writes_only_the_rest(tmp_path, signum):
    model, vols = bundled(tmp_path, seed=61)
    dest = tmp_path / "dest"
    state = dest / ".mm" / "unbundle"
    args = ("unbundle", vols, "--dest", dest, "--no-sync")
    proc = start(*args, env={**os.environ, **slow_io_env(tmp_path)})
    wait_until(proc, lambda: (state / "state.json").is_file()
               and json.loads((state / "state.json").read_text()).get("done_volumes"), "volume 1 imported")
    _, err, _ = interrupt(proc, signum, f"unbundle {signum.name}")
    line = one_line(err, signum.name)
    assert f"resume with: mm unbundle {vols} --dest {dest}" in line
    assert (state / "state.json").is_file()
    pieces = json.loads((state / "state.json").read_text())["pieces"]
    in_place = sum(p[1] for file_pieces in pieces.values() for p in file_pieces.values())
    payload = tree(model)
    missing = sum(len(b) for b in payload.values()) - bytes_final(dest, payload) - in_place
    assert missing < sum(len(b) for b in payload.values()) and missing > 0
    r, wrote = run_counting_writes(tmp_path, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"unbundle {signum.name}: missing {missing}, rerun wrote {wrote} ({wrote / missing:.3f}x)")
    assert wrote <= 1.25 * missing
    assert tree(dest) == payload


def parity_bundle(tmp_path: Path, seed: int) -> tuple[Path, Path]:
    """(model, volumes) with 2 parity volumes in 4 KiB stripes (many stripes: a signal lands mid-rebuild)."""
    from mm.artifacts.bundle.pack import BundleOptions, create_bundle

    model = bundle_model(tmp_path / "model", seed=seed)
    vols = tmp_path / "vols"
    create_bundle(model, BundleOptions((vols,), VOLUME_SIZE, parity=2, stripe=4096, sync=False))
    return model, vols


def test_unbundle_interrupted_while_rebuilding_from_parity_then_rerun_completes(tmp_path):
    model, vols = parity_bundle(tmp_path, seed=71)
    lost = [p for p in volumes_in(vols) if ".vol" in p.name][1]
    lost_size = lost.stat().st_size
    lost.unlink()
    dest = tmp_path / "dest"
    rebuilt = dest / ".mm" / "unbundle" / "rebuilt"
    args = ("unbundle", vols, "--dest", dest, "--no-sync")
    proc = start(*args, env={**os.environ, **slow_stripes_env(tmp_path)})
    wait_until(proc, lambda: rebuilt.is_dir() and any(p.name.endswith(".partial") for p in rebuilt.iterdir()),
               "the rebuild begun")
    _, err, _ = interrupt(proc, signal.SIGINT, "unbundle (parity rebuild) SIGINT")
    line = one_line(err, "SIGINT")
    assert "volume(s) imported" in line  # the intact volumes stay imported
    payload = tree(model)
    done = bytes_final(dest, payload)
    r, wrote = run_counting_writes(tmp_path, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rebuilt from parity 1: volume(s) 2" in r.stdout
    missing = lost_size + sum(len(b) for b in payload.values()) - done  # the volume to rebuild, the files to import
    print(f"unbundle rebuild: missing {missing}, rerun wrote {wrote} ({wrote / missing:.3f}x)")
    assert wrote <= 1.25 * missing
    assert tree(dest) == payload


def test_repair_volume_interrupted_then_rerun_writes_only_the_lost_volume(tmp_path):
    _, vols = parity_bundle(tmp_path, seed=81)
    lost = [p for p in volumes_in(vols) if ".vol" in p.name][2]
    original = lost.read_bytes()
    lost.unlink()
    args = ("bundle", "repair-volume", vols, "--no-sync")
    proc = start(*args, env={**os.environ, **slow_stripes_env(tmp_path)})
    wait_until(proc, lambda: any(p.name.endswith(".partial") for p in vols.iterdir()), "the rebuild begun")
    _, err, _ = interrupt(proc, signal.SIGTERM, "bundle repair-volume SIGTERM")
    line = one_line(err, "SIGTERM")
    assert f"complete volume file(s) in {vols}" in line and f"resume with: mm bundle repair-volume {vols}" in line
    assert not lost.exists()
    r, wrote = run_counting_writes(tmp_path, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"repair-volume: missing {len(original)}, rerun wrote {wrote} ({wrote / len(original):.3f}x)")
    assert wrote <= 1.25 * len(original)
    assert lost.read_bytes() == original


# --- repair (the fetch engine re-fetching damaged files) ---------------------------------------------------

def test_repair_interrupted_keeps_the_partial_and_the_rerun_fetches_only_the_rest(run_mm, hub_env, big_repo,
                                                                                   hub_server, tmp_path):
    repo_id, commit, big_file, size = big_repo
    dest = tmp_path / "m"
    assert run_mm("fetch", repo_id, "--revision", commit, "--local-dir", dest, env=hub_env).returncode == 0
    (dest / big_file).unlink()
    hub_server.reset()
    hub_server.rate_limit = 2 * 1024 * 1024
    proc = start("repair", dest, "--workers", "1", env=hub_env)
    wait_until(proc, lambda: (dest / ".mm" / "partial").is_dir() and range_map_bytes(dest) >= size // 4,
               "a quarter of the file on disk")
    _, err, _ = interrupt(proc, signal.SIGINT, "repair SIGINT")
    line = one_line(err, "SIGINT")
    assert "partial download(s)" in line and f"resume with: mm repair {dest} --workers 1" in line
    missing = size - range_map_bytes(dest)
    settle(hub_server)
    r = run_mm("repair", dest, env=hub_env)
    assert r.returncode == 0, r.stdout + r.stderr
    served = hub_server.bytes_served.get(big_file, 0)
    print(f"repair SIGINT: missing {missing}, rerun served {served} ({served / missing:.3f}x)")
    assert served <= 1.25 * missing
    assert run_mm("verify", dest).returncode == 0


# --- the deadline: a main thread stuck in a system call does not keep mm running ------------------------------

STUCK = '''\
"""sitecustomize installed by tests: mm's main thread blocks SIGINT/SIGTERM and sleeps where the fetch engine starts
(as a thread stuck in a long system call, e.g. an fsync on a slow disk, never runs Python's signal handler)."""
import signal
import time

from mm.artifacts.fetching import download

_clean = download._clean_stale_partials


def _stuck(*args, **kwargs):
    _clean(*args, **kwargs)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    time.sleep(600)


download._clean_stale_partials = _stuck
'''


def test_a_main_thread_stuck_in_a_system_call_still_ends_within_the_deadline(run_mm, hub_env, big_repo, tmp_path):
    repo_id, commit, _, _ = big_repo
    hook = tmp_path / "stuck"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STUCK)
    dest = tmp_path / "m"
    proc = start("fetch", repo_id, "--revision", commit, "--local-dir", dest, env={**hub_env, "PYTHONPATH": str(hook)})
    wait_until(proc, lambda: (dest / ".mm" / "partial").is_dir(), "the fetch started")
    time.sleep(0.3)
    _, err, took = interrupt(proc, signal.SIGTERM, "fetch, main thread stuck, SIGTERM")
    line = one_line(err, "SIGTERM")
    assert "kept: nothing yet" in line
    assert took >= 0.5  # ended by the watcher's deadline (interrupt.GRACE), not by the main thread


# --- warm-up: the container goes too ---------------------------------------------------------------------

def test_warmup_interrupted_removes_its_container_without_waiting_for_docker(tmp_path):
    from tests.support import fake_docker
    from tests.test_launch import make_model_dir

    state = tmp_path / "docker-state"
    bin_dir = tmp_path / "bin"
    fake_docker.install(bin_dir, state)
    model = make_model_dir(tmp_path / "models")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NO_PROXY": "127.0.0.1",
           "FAKE_SGLANG_NEVER_READY": "1"}
    proc = start("warmup", model, "--hardware", "b300", "--cache-root", tmp_path / "cache", env=env)
    wait_until(proc, lambda: list(state.glob("*.json")), "the container started")
    _, err, _ = interrupt(proc, signal.SIGINT, "warmup SIGINT")
    assert err.strip() == "mm: interrupted by SIGINT"
    deadline = time.monotonic() + 30
    while list(state.glob("*.json")):  # `docker rm -f` runs on after mm ended
        assert time.monotonic() < deadline, "the warm-up container was left behind"
        time.sleep(0.05)
    assert ["rm", "-f", "--", "mm-warmup-sglang-b300-balanced"] in [
        json.loads(line)[:4] for line in (state / "calls.jsonl").read_text().splitlines()]
