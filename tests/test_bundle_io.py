"""How mm bundle and mm unbundle touch the disk: unbundle reads each byte once, --readback reads each
file back from the disk itself, and every file is synced before it gets its name.

The syscalls are seen with strace (-ff: one trace file per thread, -ttt: timestamps to merge them in order, -y: the
file behind each descriptor). The read-back is proven on a real ext4 on a loop device: a byte is changed on the
device (in the loop device's backing file, below the file system's page cache) after mm synced the file and before
it reads it back; only a read that really goes to the device sees it.
"""
from __future__ import annotations

import json
import random
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.bundle.format import b3
from mm.artifacts.bundle.volume import open_volume
from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from tests.support.modelgen import write_model
from tests.support.run import mm_argv, run_mm

REVISION = "ce7f4df87d2e05262f5775f373dac4772f134041"
VOLUME_SIZE = 4_000_000  # smaller than a shard: shards are split across volumes
SYSCALL = re.compile(r"^(\w+)\((.*)\) += (-?\d+|0x[0-9a-f]+)")
FD_PATH = re.compile(r"^\d+<([^>]*)>")


@pytest.fixture(scope="module")
def strace_works() -> None:
    if shutil.which("strace") is None or subprocess.run(["strace", "-o", os.devnull, "true"]).returncode != 0:
        pytest.skip("strace cannot trace here (missing, or ptrace forbidden); `make tools` installs it")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("io-src") / "model"
    write_model(root, shards=3, shard_bytes=3 * 1024 * 1024)
    manifest_for_local_dir(root, "MiniMaxAI/MiniMax-M3.1-Flash", REVISION, offline=True)
    return root


DURABILITY = "write,pwrite64,fsync,fdatasync,syncfs,rename,renameat,renameat2"
READS = "read,pread64,readv,preadv,preadv2,mmap"


@pytest.fixture(scope="module")
def traced_bundle(model, tmp_path_factory, strace_works):
    """The model bundled once under strace: (volume directory, syscalls)."""
    tmp = tmp_path_factory.mktemp("io-bundle")
    r, calls = traced(tmp, DURABILITY, "bundle", model, "--out", tmp / "vols", "--volume-size", VOLUME_SIZE)
    assert r.returncode == 0, r.stderr
    assert len(list((tmp / "vols").glob("*.tar"))) >= 3
    return tmp / "vols", calls


@pytest.fixture(scope="module")
def vols(traced_bundle) -> Path:
    return traced_bundle[0]


@pytest.fixture(scope="module")
def traced_unbundle(vols, tmp_path_factory):
    """The volumes imported once under strace: (destination, syscalls, the --json report)."""
    tmp = tmp_path_factory.mktemp("io-unbundle")
    r, calls = traced(tmp, f"{READS},{DURABILITY}", "unbundle", vols, "--dest", tmp / "dest", "--json")
    assert r.returncode == 0, r.stderr
    return tmp / "dest", calls, json.loads(r.stdout)


def files_of(model: Path):
    return read_manifest(manifest_path(model)).files


def partial_name(path: str) -> str:
    return b3(f"model:{path}".encode())[:32] + ".part"


def traced(tmp_path: Path, calls: str, *args, inject: tuple[str, ...] = ()):
    """Run `mm ARGS` under strace; returns (result, [(time, syscall, args, return value)] of every thread in time
    order)."""
    prefix = tmp_path / "trace" / "t"
    prefix.parent.mkdir()
    r = run_mm(*args, prefix=["strace", "-ff", "-ttt", "-y", "-qq", "-s", "0", "-e", "signal=none",
                              "-e", f"trace={calls}", *inject, "-o", str(prefix)])
    calls_seen = []
    for f in prefix.parent.iterdir():
        for line in f.read_text().splitlines():
            stamp, _, rest = line.partition(" ")
            m = SYSCALL.match(rest)
            if m:
                calls_seen.append((float(stamp), m.group(1), m.group(2), m.group(3)))
    return r, sorted(calls_seen)


def fd_path(args: str) -> str | None:
    m = FD_PATH.match(args)
    return m.group(1) if m else None


_RENAMEAT = re.compile(r'(?:AT_FDCWD|\d+<([^>]*)>), "([^"]*)", (?:AT_FDCWD|\d+<([^>]*)>), "([^"]*)"')


def renamed_paths(name: str, args: str) -> tuple[str, str] | None:
    """(from, to) of a rename, or of a renameat/renameat2 relative to directory descriptors (fsutil.publish renames
    through its parents' descriptors: the target rule), as full paths; None for other calls."""
    if name == "rename":
        m = re.match(r'"([^"]*)", "([^"]*)"', args)
        return (m.group(1), m.group(2)) if m else None
    if name in ("renameat", "renameat2") and (m := _RENAMEAT.match(args)):
        return os.path.join(m.group(1) or "", m.group(2)), os.path.join(m.group(3) or "", m.group(4))
    return None


def bytes_read(calls) -> dict[str, int]:
    """Bytes returned by read-like calls, by the file behind the descriptor."""
    got: dict[str, int] = {}
    for _, name, args, ret in calls:
        if name in ("read", "pread64", "readv", "preadv", "preadv2") and (path := fd_path(args)) and int(ret) > 0:
            got[path] = got.get(path, 0) + int(ret)
    return got


def bytes_mapped(calls) -> dict[str, int]:
    """Bytes of each file mapped shared (how mm reads a volume's members and hashes a file)."""
    got: dict[str, int] = {}
    for _, name, args, _ in calls:
        if name == "mmap" and "MAP_SHARED" in args and (m := re.match(r"NULL, (\d+), .*?\d+<([^>]*)>", args)):
            got[m.group(2)] = got.get(m.group(2), 0) + int(m.group(1))
    return got


def shared_maps(calls) -> set[str]:
    """Files mapped shared: how mm hashes a file (hashing.mapped_windows). The safetensors reference parser, which
    checks a shard's header, maps it private and reads only the header."""
    return {p for _, name, args, _ in calls if name == "mmap" and "MAP_SHARED" in args
            for p in re.findall(r"\d+<([^>]*)>", args)}


# --- one read per byte -----------------------------------------------------------------------------

def test_unbundle_reads_each_volume_byte_once_and_no_imported_byte_again(model, vols, traced_unbundle):
    dest, calls, doc = traced_unbundle
    read, maps, taken = bytes_read(calls), shared_maps(calls), bytes_mapped(calls)
    for v in sorted(vols.glob("*.tar")):
        members = open_volume(v).data.values()
        data = sum(info.size for info in members)
        headers = v.stat().st_size - data  # tar headers, index, manifest, restore notes: read while judging
        got = read.get(str(v), 0) + taken.get(str(v), 0)  # each member mapped from the page below its start
        assert data <= got <= data + 2 * headers + 4096 * len(members) + 64 * 1024, v.name
    shards = [f for f in files_of(model) if f.path.endswith(".safetensors")]
    for f in shards:  # the final check reads a shard's header (structure), never its data
        assert read.get(str(dest / f.path), 0) < 64 * 1024, f.path
    written = {str(dest / f.path) for f in files_of(model)}
    assert not maps & written
    assert not [p for p in read if "/.mm/unbundle/partial/" in p] and not [p for p in maps if ".part" in p]
    assert doc["verify"]["hashed_as_written"]["files"] == len(files_of(model)) and doc["verify"]["hashed_now"] == {
        "files": 0, "bytes": 0}
    assert "nothing was read back from the disk (--readback does)" in doc["verify"]["proven"]


def test_second_sitting_does_not_read_again_what_the_first_named(model, vols, tmp_path):
    vs = sorted(vols.glob("*.tar"))
    dest = tmp_path / "dest"
    assert run_mm("unbundle", vs[0], "--dest", dest).returncode == 8  # waiting for the rest
    doc = json.loads(run_mm("unbundle", *vs[1:], "--dest", dest, "--json").stdout)
    assert doc["ok"] and doc["verify"]["ok"]
    assert doc["verify"]["named_earlier_unchanged"]["files"] >= 1 and doc["verify"]["hashed_now"]["files"] == 0


def test_file_changed_between_sittings_is_hashed_at_the_end_and_named(model, vols, tmp_path):
    vs = sorted(vols.glob("*.tar"))
    dest = tmp_path / "dest"
    assert run_mm("unbundle", vs[0], "--dest", dest).returncode == 8  # waiting for the rest
    victim = dest / "config.json"
    data = bytearray(victim.read_bytes())
    data[-2] ^= 0x20  # same size: only its content says it changed
    victim.write_bytes(bytes(data))
    r = run_mm("unbundle", *vs[1:], "--dest", dest, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["outcome"] == "verify-failed"
    assert [p for p in doc["verify"]["problems"] if p.startswith("config.json: hash:")]
    assert doc["verify"]["hashed_now"]["files"] == 1


def test_file_found_in_place_with_other_bytes_is_hashed_at_the_end_and_named(model, vols, tmp_path):
    dest = tmp_path / "dest"
    shard = next(f for f in files_of(model) if f.path.endswith(".safetensors"))
    (dest / shard.path).parent.mkdir(parents=True, exist_ok=True)
    data = bytearray((model / shard.path).read_bytes())
    data[-1] ^= 1
    (dest / shard.path).write_bytes(bytes(data))
    r = run_mm("unbundle", vols, "--dest", dest)
    assert r.returncode == 1, r.stderr
    assert f"{shard.path}: hash:" in r.stdout and "1 hashed now" in r.stdout


# --- --readback ----------------------------------------------------------------------------------------

def test_readback_drops_each_synced_file_from_the_page_cache_and_reads_it_whole_before_naming_it(
        model, vols, tmp_path, strace_works):
    dest = tmp_path / "dest"
    r, calls = traced(tmp_path, f"fadvise64,{READS},{DURABILITY}", "unbundle", vols,
                      "--dest", dest, "--readback", "--json")
    assert r.returncode == 0, r.stderr
    for f in files_of(model):
        partial = str(dest / ".mm" / "unbundle" / "partial" / partial_name(f.path))
        synced = [t for t, name, args, _ in calls if name in ("fsync", "fdatasync") and fd_path(args) == partial]
        dropped = [t for t, name, args, _ in calls if name == "fadvise64" and fd_path(args) == partial
                   and args.endswith("0, 0, POSIX_FADV_DONTNEED")]
        reads = [(t, int(ret)) for t, name, args, ret in calls if name.startswith(("read", "pread"))
                 and fd_path(args) == partial and int(ret) > 0]
        renamed = [t for t, name, args, _ in calls if (renamed_paths(name, args) or ("",))[0] == partial]
        assert synced and dropped and renamed, f.path
        assert min(synced) < dropped[0] < min(t for t, _ in reads) and max(t for t, _ in reads) < renamed[0], f.path
        assert sum(n for _, n in reads) == f.size, f.path  # the whole file, once
    doc = json.loads(r.stdout)
    total = sum(f.size for f in files_of(model))
    rb = doc["verify"]["read_back"]
    assert (rb["files"], rb["bytes"]) == (len(files_of(model)), total)
    on_device = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if on_device != "tmpfs" and rb["from_device"] is not None:  # the kernel counted reads from the device
        assert rb["from_device"] >= total
        assert "all of it from the storage device" in doc["verify"]["proven"]


def test_readback_with_no_sync_is_refused_in_one_line(vols, tmp_path):
    r = run_mm("unbundle", vols, "--dest", tmp_path / "dest", "--readback", "--no-sync")
    assert r.returncode == 3 and "not with --no-sync" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "dest").exists()


@pytest.fixture
def loop_ext4(tmp_path):
    """A fresh ext4 on a loop device over a file: yields (mount point, backing image)."""
    tools = [shutil.which(t) for t in ("losetup", "mkfs.ext4", "filefrag", "mount", "umount")]
    if os.geteuid() != 0 or None in tools:
        pytest.skip("needs root with losetup, mkfs.ext4, filefrag (e2fsprogs) to make a loop device")
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(96 * 1024 * 1024)
    mnt.mkdir()
    loop = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if loop.returncode != 0:
        pytest.skip(f"no loop device here: {loop.stderr.strip()}")
    dev = loop.stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True, capture_output=True)
        subprocess.run(["mount", dev, str(mnt)], check=True, capture_output=True)
        try:
            yield mnt, image
        finally:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # detached now, freed when closed
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def _corrupt_on_device(path: str, image: Path) -> None:
    """Change one byte of PATH where the loop device stores it (its backing file), below the page cache."""
    out = subprocess.run(["filefrag", "-v", path], capture_output=True, text=True, check=True).stdout
    block_size = int(re.search(r"blocks? of (\d+) bytes", out).group(1))
    first = int(re.search(r"^\s*0:\s+0\.\.\s*\d+:\s+(\d+)\.\.", out, re.M).group(1))
    fd = os.open(image, os.O_RDWR)
    try:
        at = first * block_size + min(os.stat(path).st_size, block_size) // 2
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)


def test_readback_catches_bytes_changed_on_the_device_after_they_were_synced(model, vols, tmp_path, loop_ext4,
                                                                            strace_works):
    mnt, image = loop_ext4
    dest = mnt / "dest"
    trace = tmp_path / "fadvise.strace"
    # strace holds mm at the first fadvise on one imported file's partial name (the read-back's: after the fsync,
    # before its pages are dropped) for 3 s: the window in which the "disk" goes bad. Only that file's calls are
    # traced (-P): mm also fadvises the volumes it has read.
    chosen = dest / ".mm" / "unbundle" / "partial" / partial_name(max(files_of(model), key=lambda f: f.size).path)
    proc = subprocess.Popen(mm_argv("unbundle", vols, "--dest", dest, "--readback", "--json", prefix=[
        "strace", "-f", "-qq", "-y", "-P", str(chosen), "-e", "signal=none", "-e", "trace=fadvise64",
        "-e", "inject=fadvise64:delay_enter=3000000:when=1", "-o", str(trace)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        victim = None
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"fadvise64\(\d+<([^>]*\.part)>", trace.read_text() if trace.exists() else "")
            victim = m.group(1) if m else None
            time.sleep(0.02)
        assert victim, "mm never dropped a synced file's pages"
        _corrupt_on_device(victim, image)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    doc = json.loads(stdout)
    files = files_of(model)
    bad = next(f for f in files if partial_name(f.path) == Path(victim).name)
    assert proc.returncode == 5 and doc["outcome"] == "refused", stderr
    assert [c for c in doc["corrupt"] if f"{bad.path}: read back from the disk after fsync" in c]
    assert not (dest / bad.path).exists() and not Path(victim).exists()
    good = [f for f in files if f.path != bad.path]
    assert all((dest / f.path).read_bytes() == (model / f.path).read_bytes() for f in good)


# --- durability -------------------------------------------------------------------------------------

def _sync_then_rename_then_dir_sync(calls, partial: str, final: str, file_system: str | None = None) -> bool:
    """PARTIAL's last write, then an fsync of it (or a syncfs of FILE_SYSTEM, when given: a batch of small files),
    then its rename to FINAL, then an fsync of FINAL's directory."""
    last_write = max(t for t, name, args, _ in calls if name.startswith(("write", "pwrite")) and fd_path(args) == partial)
    synced = [t for t, name, args, _ in calls if (name in ("fsync", "fdatasync") and fd_path(args) == partial)
              or (name == "syncfs" and file_system is not None and fd_path(args) == file_system)]
    renamed = [t for t, name, args, _ in calls if renamed_paths(name, args) == (partial, final)]
    directory = os.path.dirname(final)
    dir_synced = [t for t, name, args, _ in calls if name in ("fsync", "fdatasync") and fd_path(args) == directory]
    return bool(renamed) and any(last_write < t < renamed[0] for t in synced) and any(t > renamed[0] for t in dir_synced)


def test_bundle_syncs_each_volume_after_its_last_write_then_names_it_then_syncs_the_directory(traced_bundle):
    out, calls = traced_bundle
    for v in sorted(out.glob("*.tar")):
        assert _sync_then_rename_then_dir_sync(calls, str(v.with_name(f".{v.name}.partial")), str(v)), v.name


def test_unbundle_syncs_each_file_after_its_last_write_then_names_it_then_syncs_the_directory(model, traced_unbundle):
    """A shard by an fsync of its own; the small files (config, tokenizer) a batch at a time, by one syncfs."""
    dest, calls, _ = traced_unbundle
    for f in files_of(model):
        partial = str(dest / ".mm" / "unbundle" / "partial" / partial_name(f.path))
        assert _sync_then_rename_then_dir_sync(calls, partial, str(dest / f.path), str(dest)), f.path
    assert any(name == "syncfs" for _, name, _, _ in calls)


# --- parity ------------------------------------------------------------------------------------------

class _Bytes:
    def __init__(self, data: bytes):
        self.data = data

    def pread(self, offset: int, n: int) -> bytes:
        return self.data[offset:offset + n]


@pytest.mark.parametrize("k, m, stripe, files", [(5, 3, 4096, True), (10, 2, 64 * 1024, True), (1, 1, 640, False),
                                                (4, 2, 8192, False)])
def test_parity_encoded_by_isal_directly_is_byte_identical_to_pyeclibs_and_rebuilds(k, m, stripe, files, tmp_path,
                                                                                   monkeypatch):
    """FILES: the streams are files (mapped, their chunks handed to ISA-L by address), else bytes (read into its
    buffer)."""
    from mm.artifacts.bundle import parity

    rng = random.Random(k * 1000 + m)
    streams = [rng.randbytes(rng.randrange(1, 5 * stripe)) for _ in range(k)]  # unequal, a short last stripe
    for i, data in enumerate(streams):
        (tmp_path / f"v{i}").write_bytes(data)
    layout = parity.Layout(k, m, stripe, tuple(len(s) for s in streams))
    assert parity.DirectEncoder.for_layout(layout) is not None, "ISA-L not found beside pyeclib"

    def run() -> tuple:
        out = [bytearray() for _ in range(m)]
        sources = [parity.FileSource(tmp_path / f"v{i}") if files else _Bytes(s) for i, s in enumerate(streams)]
        result = parity.encode(layout, sources, [o.extend for o in out])
        for src in sources:
            getattr(src, "close", lambda: None)()
        return result, [bytes(o) for o in out]

    direct = run()
    monkeypatch.setattr(parity.DirectEncoder, "for_layout", classmethod(lambda cls, layout: None))
    assert run() == direct
    lost = list(range(min(m, k)))  # rebuild as many data streams as the parity allows, from the direct parity
    inputs = {i: _Bytes(s) for i, s in enumerate(streams) if i not in lost}
    inputs.update({k + p: _Bytes(direct[1][p]) for p in range(m)})
    rebuilt = {i: bytearray() for i in lost}
    parity.rebuild(layout, inputs, lost, {i: rebuilt[i].extend for i in lost})
    assert all(bytes(rebuilt[i]) == streams[i] for i in lost)
