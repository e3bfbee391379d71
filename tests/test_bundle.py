"""mm bundle / mm bundle verify / mm unbundle: real tar volumes of real safetensors, real subprocesses."""
from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.bundle import payloads
from mm.artifacts.bundle.check import verify_volumes
from mm.artifacts.bundle.payloads import PAYLOAD_KINDS
from mm.artifacts.bundle.format import b3
from mm.artifacts.units import parse_size
from mm.artifacts.bundle.pack import BundleOptions, create_bundle
from mm.artifacts.bundle.unpack import Outcome, Places, UnbundleOptions, check_free_space, unbundle
from mm.artifacts.bundle.volume import find_volumes, open_volume
from mm.artifacts.serving.cachekey import CacheKey, write_cache_key
from mm.artifacts.errors import BadInput, BadValue, Refused
from mm.artifacts.paths import manifest_path
from mm.artifacts.integrity.manifest import read_manifest
from tests.support.modelgen import write_model
from tests.support.run import mm_argv, run_mm
from tests.support.slowio import slow_io_env

VOLUME_SIZE = 500_000  # smaller than every shard: shards are split across volumes
REVISION = "ce7f4df87d2e05262f5775f373dac4772f134041"


# --- helpers ------------------------------------------------------------------------------------

def make_model(root: Path, seed: int = 0, shard_bytes: int = 600 * 1024) -> Path:
    write_model(root, shards=3, shard_bytes=shard_bytes, seed=seed)
    manifest_for_local_dir(root, "MiniMaxAI/MiniMax-M3.1-Flash", REVISION, offline=True)
    return root


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ROOT (manifest included; the lock, the verification stamp of `mm ls` and the import record
    excluded) with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("lock", "verified.json", "imported.json")}


def volumes_in(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(".tar"))


def copy_volumes(src: Path, dst: Path) -> list[Path]:
    dst.mkdir(parents=True, exist_ok=True)
    for v in volumes_in(src):
        shutil.copy2(v, dst / v.name)
    return volumes_in(dst)


def rewrite_volume(src: Path, dst: Path, edit_index=None, extra: list[tuple[tarfile.TarInfo, bytes | None]] = (),
                   replace: dict[str, tuple[tarfile.TarInfo, bytes | None]] | None = None) -> None:
    """Rebuild a volume with tarfile: optionally edit its index JSON, replace members, append members."""
    replace = replace or {}
    with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
        for info in tin.getmembers():
            data = tin.extractfile(info).read()
            if info.name.startswith("MMBUNDLE/index-vol") and edit_index:
                doc = json.loads(data)
                edit_index(doc)
                data = json.dumps(doc, indent=1).encode()
                info.size = len(data)
            if info.name in replace:
                info, data = replace[info.name]
            tout.addfile(info, io.BytesIO(data) if data is not None else None)
        for info, data in extra:
            tout.addfile(info, io.BytesIO(data) if data is not None else None)


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = b"x", link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if data is not None and kind == tarfile.REGTYPE else 0
    return info, (data if kind == tarfile.REGTYPE else None)


def docker_save_archive(path: Path) -> None:
    """A small tar shaped like `docker save` output (manifest.json, index.json, blobs)."""
    rnd = random.Random(7)
    layer = bytes(rnd.getrandbits(8) for _ in range(700_000))
    config = b'{"architecture": "amd64"}'
    cfg_hex = "a" * 64
    manifest = [{"Config": f"blobs/sha256/{cfg_hex}", "RepoTags": ["lmsysorg/sglang:dev-minimax-m31-flash"],
                 "Layers": ["blobs/sha256/" + "b" * 64]}]
    index = {"schemaVersion": 2, "manifests": [{"annotations": {
        "io.containerd.image.name": "docker.io/lmsysorg/sglang:dev-minimax-m31-flash"}}]}
    with tarfile.open(path, "w") as tf:
        for name, data in [("manifest.json", json.dumps(manifest).encode()), ("index.json", json.dumps(index).encode()),
                           (f"blobs/sha256/{cfg_hex}", config), ("blobs/sha256/" + "b" * 64, layer)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def kernel_cache(root: Path, keyed: bool) -> Path:
    root.mkdir(parents=True)
    (root / "sm100").mkdir()
    (root / "sm100" / "msa_kernel.cubin").write_bytes(os.urandom(40_000))
    (root / "index.txt").write_text("msa fmha\n")
    if keyed:
        (root / "mm-cache-key.json").write_text(json.dumps({
            "schema": "mm-cache-key/1", "gpu": "NVIDIA B300", "compute_capability": "10.3", "driver": "590.44",
            "image": "lmsysorg/sglang@sha256:" + "6" * 64, "recipe": "balanced"}))
    return root


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("bundle-src") / "model")


@pytest.fixture(scope="module")
def vols(model, tmp_path_factory) -> Path:
    """The model bundled once through the CLI; tests that damage volumes work on copies."""
    out = tmp_path_factory.mktemp("bundle-vols")
    r = run_mm("bundle", model, "--out", out, "--volume-size", VOLUME_SIZE)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def other_vols(tmp_path_factory) -> Path:
    """A different model's bundle (another seed), for foreign-volume cases."""
    src = make_model(tmp_path_factory.mktemp("other-src") / "model", seed=1)
    out = tmp_path_factory.mktemp("other-vols")
    create_bundle(src, BundleOptions((out,), VOLUME_SIZE))
    return out


def model_tree(model: Path) -> dict[str, bytes]:
    return tree(model)


# --- mm bundle ----------------------------------------------------------------------------------

def test_round_trip_is_identical_with_files_larger_than_a_volume(model, vols, tmp_path):
    assert max(p.stat().st_size for p in model.glob("*.safetensors")) > VOLUME_SIZE
    dest = tmp_path / "dest"
    r = run_mm("unbundle", vols, "--dest", dest)
    assert r.returncode == 0, r.stderr
    assert tree(dest) == tree(model)  # every byte, and the manifest byte for byte
    assert "verify" in r.stdout and "OK" in r.stdout


def test_volumes_are_named_sized_and_split_files_across_volumes(vols):
    names = [v.name for v in volumes_in(vols)]
    count = len(names)
    assert count > 2
    assert names == [f"MiniMax-M3.1-Flash-ce7f4df87d2e.vol{n:03d}-of-{count:03d}.tar" for n in range(1, count + 1)]
    assert all(v.stat().st_size <= VOLUME_SIZE for v in volumes_in(vols))
    segments = [m for v in volumes_in(vols) for m in tarfile.open(v).getnames() if m.startswith("segments/")]
    assert any(".seg0002" in m for m in segments)


def test_every_volume_starts_with_its_index_manifest_and_restore(vols, model):
    for n, v in enumerate(volumes_in(vols), 1):
        with tarfile.open(v) as tf:
            names = tf.getnames()
            assert names[:4] == [f"MMBUNDLE/index-vol{n:03d}.json", "MMBUNDLE/manifest.json", "MMBUNDLE/SHA256SUMS",
                                 "MMBUNDLE/RESTORE.txt"]
            index = json.load(tf.extractfile(names[0]))
            assert (index["volume"], index["volumes"]) == (n, len(volumes_in(vols)))
            assert tf.extractfile("MMBUNDLE/manifest.json").read() == manifest_path(model).read_bytes()
            for e in index["members"]:
                assert {"path", "offset", "length", "blake3", "file_blake3", "file_sha256"} <= set(e)
                assert e["blake3"] != "0" * 64


def _syncs(tmp_path: Path, marker: str, *args) -> list[str]:
    """The fsync/fdatasync calls `mm ARGS` makes on files whose path holds MARKER (strace -y names each fd's file)."""
    trace = tmp_path / "syncs.strace"
    r = run_mm(*args, prefix=["strace", "-f", "-y", "-qq", "-e", "trace=fsync,fdatasync", "-o", str(trace)])
    assert r.returncode == 0, r.stderr
    return [line for line in trace.read_text().splitlines() if marker in line]


def _synced_names(lines: list[str]) -> set[str]:
    return {line.split("<", 1)[1].split(">", 1)[0].rsplit("/", 1)[-1] for line in lines}


@pytest.fixture(scope="module")
def strace_works() -> None:
    if shutil.which("strace") is None or subprocess.run(["strace", "-o", os.devnull, "true"]).returncode != 0:
        pytest.skip("strace cannot trace here (missing, or ptrace forbidden); `make tools` installs it")


def test_every_volume_is_fsynced_before_it_gets_its_name(model, vols, tmp_path, strace_works):
    lines = _syncs(tmp_path, ".tar.partial>", "bundle", model, "--out", tmp_path / "v", "--volume-size", VOLUME_SIZE)
    assert _synced_names(lines) == {f".{v.name}.partial" for v in volumes_in(vols)}


def test_bundle_no_sync_writes_the_same_volumes_without_any_fsync(model, vols, tmp_path, strace_works):
    out = tmp_path / "v"
    assert _syncs(tmp_path, ".tar.partial>", "bundle", model, "--out", out, "--volume-size", VOLUME_SIZE, "--no-sync") == []
    assert [v.read_bytes() for v in volumes_in(out)] == [v.read_bytes() for v in volumes_in(vols)]


def test_every_imported_file_is_on_the_disk_before_it_gets_its_name(model, vols, tmp_path, strace_works):
    """Each partial file's last write is followed, before its rename, by an fsync of it or by a syncfs (small files
    are named a batch at a time: one syncfs for their bytes, then the renames)."""
    trace = tmp_path / "names.strace"
    r = run_mm("unbundle", vols, "--dest", tmp_path / "dest", prefix=[
        "strace", "-f", "-y", "-qq", "-e", "trace=write,pwrite64,fsync,fdatasync,syncfs,rename,renameat,renameat2",
        "-o", str(trace)])
    assert r.returncode == 0, r.stderr
    dirty, named = set(), set()
    for line in trace.read_text().splitlines():
        part = re.search(r"([0-9a-f]{32}\.part)[>\"]", line)
        if re.search(r"\bsyncfs\(", line):
            dirty.clear()
        elif part and re.search(r"\b(p?write(64)?)\(", line):
            dirty.add(part[1])
        elif part and re.search(r"\bf(data)?sync\(", line):
            dirty.discard(part[1])
        elif part and re.search(r"\brename(at2?)?\(", line):
            assert part[1] not in dirty, f"{part[1]} named before its bytes were flushed"
            named.add(part[1])
    files = read_manifest(manifest_path(model)).files
    assert named == {b3(f"model:{f.path}".encode())[:32] + ".part" for f in files}  # the partial names


def test_unbundle_no_sync_imports_the_same_files_without_fsyncing_them(model, vols, tmp_path, strace_works):
    dest = tmp_path / "dest"
    assert _syncs(tmp_path, ".part>", "unbundle", vols, "--dest", dest, "--no-sync") == []
    assert tree(dest) == tree(model)


def test_no_sync_says_so_and_what_to_do_before_unplugging(model, tmp_path):
    r = run_mm("bundle", model, "--out", tmp_path / "v", "--volume-size", VOLUME_SIZE, "--no-sync")
    assert r.returncode == 0, r.stderr
    assert "not synced (--no-sync): run `sync` or unmount" in r.stdout
    js = run_mm("bundle", model, "--out", tmp_path / "v", "--volume-size", VOLUME_SIZE, "--no-sync", "--json")
    assert json.loads(js.stdout)["synced"] is False


def test_volume_size_is_decimal_unless_spelled_binary():
    assert parse_size("4G") == 4_000_000_000
    assert parse_size("1.8T") == 1_800_000_000_000
    assert parse_size("750M") == 750_000_000
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("20Gi") == parse_size("20GiB") == 20 * 2**30  # as Kubernetes writes it
    with pytest.raises(BadValue, match="'4Q'"):
        parse_size("4Q")


def test_bundle_refuses_a_model_failing_quick_verify_naming_the_file(tmp_path):
    src = make_model(tmp_path / "model")
    with open(src / "model-00002-of-00003.safetensors", "ab") as f:
        f.write(b"extra")
    r = run_mm("bundle", src, "--out", tmp_path / "out", "--volume-size", "1M")
    assert r.returncode == 1  # the one quick-verify gate, the same exit as `mm launch`
    assert "model-00002-of-00003.safetensors" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not list((tmp_path / "out").glob("*.tar")) if (tmp_path / "out").exists() else True


@pytest.mark.parametrize("given, message", [
    (dict(directory=Path("m"), volume_size=None), "give the model DIRECTORY and --volume-size"),
    (dict(directory=Path("m"), no_mm=True, payloads={"mm": [Path("w")]}), "--no-mm and --wheelhouse: choose one"),
    (dict(directory=Path("m"), no_mm=True, target_platforms=["linux/arm64"]), "not with --no-mm or --wheelhouse"),
    (dict(directory=Path("m"), payloads={"mm": [Path("w")]}, target_pythons=["3.12"]), "not with --no-mm or --wheel"),
    (dict(directory=None, volume_size=None, only_mm=True, parity=1), "--only-mm writes only install-mm.sh"),
    (dict(directory=None, volume_size=None, only_mm=True, outs=[Path("a"), Path("b")]), "into one --out directory"),
    (dict(directory=Path("m"), name="../up"), "bundle name '../up': use letters, digits"),
])
def test_bundle_options_refuse_options_that_do_not_go_together_before_any_work(given, message):
    given = {"outs": [Path("out")], "volume_size": 10**9, "payloads": {}, **given}
    with pytest.raises(BadInput, match=message.replace(".", r"\.")) as e:
        BundleOptions.from_cli(given.pop("directory"), **given)
    assert e.value.exit_code == 3


def test_bundle_options_build_mm_unless_it_is_left_out_or_given():
    def options(**given) -> BundleOptions:
        return BundleOptions.from_cli(Path("m"), outs=[Path("out")], volume_size=10**9, **{"payloads": {}, **given})

    assert options().build_mm and not options(no_mm=True).build_mm
    given = options(payloads={"mm": [Path("w")], "image": []})
    assert not given.build_mm and given.payloads == {"mm": (Path("w"),)}
    assert options().carrying("mm", Path("built")).payloads == {"mm": (Path("built"),)}


def test_bundle_cli_reports_a_broken_rule_in_one_line_exit_3(model, tmp_path):
    r = run_mm("bundle", model, "--out", tmp_path / "v", "--volume-size", "1G", "--no-mm", "--wheelhouse", tmp_path)
    assert r.returncode == 3 and r.stderr.strip() == "mm: --no-mm and --wheelhouse: choose one"


@pytest.mark.parametrize("given, error, message", [
    (dict(link=True), BadValue, "--link hard-links files of the base: it needs --from BASE_DIR"),
    (dict(readback=True, sync=False), BadInput, "--readback reads back what was fsynced to the disk: not with"),
])
def test_unbundle_options_refuse_options_that_do_not_go_together(given, error, message):
    with pytest.raises(error, match=re.escape(message)):
        UnbundleOptions.from_cli(**given)
    assert UnbundleOptions.from_cli(link=True, base_dir=Path("base")).link


def test_unbundle_link_without_from_is_a_usage_error_in_one_line(vols, tmp_path):
    r = run_mm("unbundle", vols, "--dest", tmp_path / "dest", "--link")
    assert r.returncode == 2 and r.stderr.strip() == "mm: --link hard-links files of the base: it needs --from BASE_DIR"
    assert not (tmp_path / "dest").exists()


def test_bundle_without_manifest_is_bad_input(tmp_path):
    write_model(tmp_path / "model", shards=1)
    with pytest.raises(BadInput, match="no manifest"):
        create_bundle(tmp_path / "model", BundleOptions((tmp_path / "out",), 1_000_000))


def test_rerun_keeps_finished_volumes_that_verify_and_rewrites_damaged_ones(model, vols, tmp_path):
    out = tmp_path / "vols"
    copy_volumes(vols, out)
    victim = volumes_in(out)[1]
    data = bytearray(victim.read_bytes())
    data[-5000] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = run_mm("bundle", model, "--out", out, "--volume-size", VOLUME_SIZE)
    assert r.returncode == 0, r.stderr
    wrote = [line for line in r.stdout.splitlines() if line.startswith("wrote")]
    assert len(wrote) == 1 and victim.name in wrote[0]
    assert [v.read_bytes() for v in volumes_in(out)] == [v.read_bytes() for v in volumes_in(vols)]


def test_rebundling_with_another_size_counts_the_stale_volumes_in_one_note(model, vols, tmp_path):
    out = tmp_path / "vols"
    old = copy_volumes(vols, out)
    result = create_bundle(model, BundleOptions((out,), 2 * VOLUME_SIZE))
    assert len(result.volumes) < len(old)
    stale = [note for note in result.notes if "earlier, different run" in note]
    assert len(stale) == 1 and stale[0].startswith(f"{len(old)} volume file(s) ") and str(out) in stale[0]


# --- mm bundle verify ---------------------------------------------------------------------------

def test_bundle_verify_reports_each_volume_ok(vols):
    r = run_mm("bundle", "verify", vols)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("OK ") == len(volumes_in(vols))
    assert "missing: none" in r.stdout


def test_bundle_verify_names_missing_volumes_without_failing(vols):
    given = volumes_in(vols)
    report = verify_volumes([given[2], given[0]])
    assert report.ok
    assert report.missing == [n for n in range(1, len(given) + 1) if n not in (1, 3)]


def test_flipped_byte_is_named_by_verify_and_refused_by_unbundle_while_the_rest_imports(model, vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    victim = vs[-1]  # holds whole small files after the last shard piece
    vol = open_volume(victim)
    target = next(e for e in vol.entries() if e.segments == 1)
    info = vol.data[target.member]
    data = bytearray(victim.read_bytes())
    data[info.offset_data + info.size // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    r = run_mm("bundle", "verify", out)
    assert r.returncode == 1
    assert f"CORRUPT  {victim}" in r.stdout and target.member in r.stdout
    assert r.stdout.count("OK ") == len(vs) - 1

    dest = tmp_path / "dest"
    r = run_mm("unbundle", out, "--dest", dest)
    assert r.returncode == 5
    assert victim.name in r.stderr and target.member in r.stderr
    assert not (dest / target.path).exists()
    good = tree(model)
    imported = {k: v for k, v in tree(dest).items() if k != ".mm/manifest.json" and not k.startswith(".mm/unbundle")}
    assert imported and all(good[k] == v for k, v in imported.items())
    assert len(imported) == len(good) - 2  # all but the damaged file (and the manifest, counted apart)


def test_volume_of_another_bundle_is_foreign(vols, other_vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    stranger = volumes_in(other_vols)[0]
    shutil.copy(stranger, out / ("x-" + stranger.name))
    r = run_mm("bundle", "verify", out)
    assert r.returncode == 1
    assert f"FOREIGN  {out / ('x-' + stranger.name)}" in r.stdout
    r = run_mm("unbundle", *vs, out / ("x-" + stranger.name), "--dest", tmp_path / "dest")
    assert r.returncode == 5
    assert "x-" + stranger.name in r.stderr and "belongs to bundle" in r.stderr


def test_truncated_volume_is_corrupt_and_names_the_cut_member(vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    with open(vs[0], "r+b") as f:
        f.truncate(vs[0].stat().st_size // 2)
    report = verify_volumes([vs[0]])
    assert [v.status for v in report.verdicts] == ["CORRUPT"]
    assert any("truncated" in p or "missing" in p for p in report.verdicts[0].problems)


def test_truncated_volume_is_refused_by_unbundle_while_the_rest_imports(model, vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    with open(vs[-1], "r+b") as f:
        f.truncate(vs[-1].stat().st_size - 3000)
    report = unbundle([out], tmp_path / "dest")
    assert report.outcome is Outcome.REFUSED and not report.complete
    assert report.corrupt and all(vs[-1].name in line for line in report.corrupt)
    good = tree(model)
    assert all(good[k] == v for k, v in tree(tmp_path / "dest").items() if not k.startswith(".mm/unbundle"))


# --- mm unbundle --------------------------------------------------------------------------------

def test_unbundle_in_reverse_and_shuffled_order(model, vols, tmp_path):
    vs = volumes_in(vols)
    shuffled = vs[:]
    random.Random(3).shuffle(shuffled)
    r = run_mm("unbundle", *reversed(vs), "--dest", tmp_path / "reversed")
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "reversed") == tree(model)
    report = unbundle(shuffled, tmp_path / "shuffled")
    assert report.ok and report.complete
    assert tree(tmp_path / "shuffled") == tree(model)


def test_unbundle_from_several_directories(model, vols, tmp_path):
    vs = volumes_in(vols)
    disk_a, disk_b = tmp_path / "a", tmp_path / "b"
    disk_a.mkdir(), disk_b.mkdir()
    for i, v in enumerate(vs):
        shutil.copy(v, (disk_a if i % 2 else disk_b) / v.name)
    assert unbundle([disk_a, disk_b], tmp_path / "dest").ok
    assert tree(tmp_path / "dest") == tree(model)


def test_import_in_two_sittings_names_what_is_missing_and_does_not_rewrite(model, vols, tmp_path):
    vs = volumes_in(vols)
    dest = tmp_path / "dest"
    first, second = vs[::2], vs[1::2]
    r = run_mm("unbundle", *first, "--dest", dest)
    assert r.returncode == 8, r.stderr  # waiting for the rest
    missing = ", ".join(str(n) for n in range(2, len(vs) + 1, 2))
    assert f"still missing: volume(s) {missing}" in r.stdout
    done = {p: (dest / p).stat().st_mtime_ns for p in ("config.json", "README.md") if (dest / p).exists()}
    assert done
    r = run_mm("unbundle", *second, "--dest", dest)
    assert r.returncode == 0, r.stderr
    assert tree(dest) == tree(model)
    assert {p: (dest / p).stat().st_mtime_ns for p in done} == done


def test_unbundle_refuses_when_free_space_is_short(tmp_path):
    with pytest.raises(Refused, match="not enough free disk"):
        check_free_space(Places(tmp_path / "dest"), {"model": 10**18})


def test_a_refused_unbundle_leaves_no_empty_dest_behind(vols, model, tmp_path):
    dest = tmp_path / "new-dest"
    r = run_mm("unbundle", vols, "--dest", dest, "--from", model)  # not a delta: refused once the index is read
    assert r.returncode == 2 and "is not a delta" in r.stderr, r.stderr
    assert not dest.exists()  # `mm unbundle ... && ...` retried later finds no half-made directory
    kept = tmp_path / "kept"
    (kept / "mine").mkdir(parents=True)
    assert run_mm("unbundle", vols, "--dest", kept, "--from", model).returncode == 2
    assert (kept / "mine").is_dir()  # a directory the user had stays, with what it held


def test_unbundle_refuses_a_dest_holding_another_model(vols, other_vols, tmp_path):
    dest = tmp_path / "dest"
    assert unbundle([other_vols], dest).ok
    shutil.rmtree(dest / ".mm" / "unbundle", ignore_errors=True)
    with pytest.raises(Refused, match="different model"):
        unbundle([vols], dest)


# --- hostile volumes ------------------------------------------------------------------------------

HOSTILE = {
    "dotdot": member("../sentinel.txt", data=b"pwned"),
    "absolute": member("/tmp/mm-bundle-test-absolute-sentinel", data=b"pwned"),
    "symlink": member("model/config.json", tarfile.SYMTYPE, link="/etc/passwd"),
    "hardlink": member("model/README.md", tarfile.LNKTYPE, link="../sentinel.txt"),
    "device": member("model/tokenizer.json", tarfile.CHRTYPE),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_member_is_refused_and_nothing_outside_dest_changes(case, vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    crafted = vs[-1]
    info, data = HOSTILE[case]
    rewrite_volume(vols / crafted.name, crafted, extra=[(info, data)])
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("original")
    before = sorted(p.name for p in tmp_path.iterdir())
    report = unbundle([out], tmp_path / "dest")
    assert report.outcome is Outcome.REFUSED
    assert any(crafted.name in line and repr(info.name) in line for line in report.refused)
    assert sentinel.read_text() == "original"
    assert not Path("/tmp/mm-bundle-test-absolute-sentinel").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["dest"])
    assert not any(p.is_symlink() for p in (tmp_path / "dest").rglob("*"))


def test_hostile_volume_refused_through_the_cli_with_one_line_naming_it(vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    rewrite_volume(vols / vs[-1].name, vs[-1], extra=[HOSTILE["symlink"]])
    r = run_mm("unbundle", out, "--dest", tmp_path / "dest")
    assert r.returncode == 5
    refused = [line for line in r.stderr.splitlines() if line.startswith("refused:")]
    assert refused == [f"refused: {vs[-1].name}: member 'model/config.json' is a symlink to '/etc/passwd'; refused"]
    assert r.stderr.splitlines()[-1].startswith("mm: unbundle")


def test_index_path_escaping_dest_is_refused(vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)

    def escape(doc):
        e = doc["members"][-1]
        e["path"] = "../sentinel.txt"
        e["member"] = "model/../sentinel.txt"
    rewrite_volume(vols / vs[-1].name, vs[-1], edit_index=escape)
    (tmp_path / "sentinel.txt").write_text("original")
    report = unbundle([out], tmp_path / "dest")
    assert report.outcome is Outcome.REFUSED
    assert any(vs[-1].name in line and "unsafe path" in line for line in report.refused)
    assert (tmp_path / "sentinel.txt").read_text() == "original"


def test_index_payload_name_escaping_dest_is_refused(vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    forged = {"file": "../evil.tar", "size": 1, "refs": [], "image_id": None}
    rewrite_volume(vols / vs[0].name, vs[0], edit_index=lambda doc: doc["payloads"].update(image=forged))
    report = verify_volumes([vs[0]])
    assert report.verdicts[0].status == "CORRUPT"
    assert "unsafe path" in report.verdicts[0].problems[0] and vs[0].name in report.verdicts[0].problems[0]


MALFORMED = {
    "offset as a string": lambda doc: doc["members"][-1].update(offset="0"),
    "negative length": lambda doc: doc["members"][-1].update(length=-1),
    "segment zero": lambda doc: doc["members"][-1].update(segment=0),
    "blake3 not hex": lambda doc: doc["members"][-1].update(blake3="zz" * 32),
    "members not a list": lambda doc: doc.update(members={"a": 1}),
    "member not an object": lambda doc: doc["members"].append(["model/x", 1]),
    "volume as a bool": lambda doc: doc.update(volume=True),
    "kernel caches not a list": lambda doc: doc["payloads"].update(kernel_caches="x"),
    "cache key not an object": lambda doc: doc["payloads"].update(
        kernel_caches=[{"label": "c", "key": "gpu=B300", "files": []}]),
    "image size negative": lambda doc: doc["payloads"].update(image={"file": "i.tar", "size": -5, "refs": []}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_index_is_refused_naming_the_volume_without_a_traceback(case, vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    rewrite_volume(vols / vs[-1].name, vs[-1], edit_index=MALFORMED[case])
    report = verify_volumes([vs[-1]])
    assert report.verdicts[0].status == "CORRUPT"
    assert report.verdicts[0].problems[0].startswith(f"{vs[-1].name}: MMBUNDLE/index-vol")
    assert "malformed index" in report.verdicts[0].problems[0] or "unsafe path" in report.verdicts[0].problems[0]
    r = run_mm("unbundle", out, "--dest", tmp_path / "dest")
    assert r.returncode == 5 and "Traceback" not in r.stderr
    assert any(line.startswith(f"refused: {vs[-1].name}: ") for line in r.stderr.splitlines())


def test_unbundle_json_names_the_outcome_and_its_exit_code(vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    rewrite_volume(vols / vs[-1].name, vs[-1], extra=[HOSTILE["device"]])
    r = run_mm("unbundle", out, "--dest", tmp_path / "dest", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 5 and (doc["outcome"], doc["exit_code"], doc["ok"]) == ("refused", 5, False)
    r = run_mm("unbundle", vols, "--dest", tmp_path / "clean", "--json")
    assert r.returncode == 0 and (json.loads(r.stdout)["outcome"], json.loads(r.stdout)["exit_code"]) == ("imported", 0)


def test_index_size_disagreeing_with_tar_header_is_refused(vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    name = json.loads(tarfile.open(vs[-1]).extractfile(f"MMBUNDLE/index-vol{len(vs):03d}.json").read())["members"][-1]["member"]
    info, _ = member(name, data=b"y" * 10)
    rewrite_volume(vols / vs[-1].name, vs[-1], replace={name: (info, b"y" * 10)})
    report = verify_volumes([vs[-1]])
    assert not report.ok
    assert any("bytes in the tar but" in p and name in p for p in report.verdicts[0].problems)


def test_two_different_volumes_claiming_the_same_number_are_both_refused(vols, tmp_path):
    out = tmp_path / "vols"
    vs = copy_volumes(vols, out)
    twin = out / ("twin-" + vs[1].name)
    rewrite_volume(vols / vs[1].name, twin, edit_index=lambda doc: doc.update(note="forged"))
    report = unbundle([out], tmp_path / "dest")
    assert report.outcome is Outcome.REFUSED
    claims = [line for line in report.refused if "claims volume 2" in line]
    assert len(claims) == 2 and {twin.name, vs[1].name} <= set(" ".join(claims).replace(",", " ").split())


# --- kill -9 ----------------------------------------------------------------------------------------

def _kill_when(proc: subprocess.Popen, ready) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, "finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_kill_9_during_bundle_then_rerun_gives_the_same_volumes(model, vols, tmp_path):
    out = tmp_path / "vols"
    out.mkdir()
    proc = subprocess.Popen(mm_argv("bundle", model, "--out", out, "--volume-size", VOLUME_SIZE),
                            env={**os.environ, **slow_io_env(tmp_path)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_when(proc, lambda: any(".vol002-" in p.name and p.name.endswith(".partial") for p in out.iterdir())
               and len(volumes_in(out)) == 1)  # volume 1 published (its fsync runs beside volume 2's writing)
    assert len(volumes_in(out)) == 1  # only the finished volume has a final name
    r = run_mm("bundle", model, "--out", out, "--volume-size", VOLUME_SIZE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("kept ")
    assert [v.read_bytes() for v in volumes_in(out)] == [v.read_bytes() for v in volumes_in(vols)]
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]


def test_kill_9_during_unbundle_then_rerun_completes(model, vols, tmp_path):
    dest = tmp_path / "dest"
    partials = dest / ".mm" / "unbundle" / "partial"
    proc = subprocess.Popen(mm_argv("unbundle", vols, "--dest", dest), env={**os.environ, **slow_io_env(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_when(proc, lambda: (dest / "config.json").exists() and partials.is_dir() and any(partials.iterdir()))
    good = tree(model)
    for rel, data in tree(dest).items():  # whatever has a final name is already right
        if not rel.startswith(".mm/"):
            assert good[rel] == data, rel
    assert unbundle([vols], dest).ok
    assert tree(dest) == good


# --- standard tools and payloads ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def payload_bundle(model, tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    base = tmp_path_factory.mktemp("payload")
    image = base / "sglang.tar"
    docker_save_archive(image)
    keyed = kernel_cache(base / "minfer", keyed=True)
    unkeyed = kernel_cache(base / "flashinfer", keyed=False)
    out = base / "vols"
    r = run_mm("bundle", model, "--out", out, "--volume-size", VOLUME_SIZE, "--image", image, "--allow-other-image",
           "--kernel-cache", keyed, "--kernel-cache", unkeyed, "--cache-key", "gpu=NVIDIA B300", "--cache-key", "compute_capability=10.3",
           "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["image"]["refs"] == ["lmsysorg/sglang:dev-minimax-m31-flash",
                                    "docker.io/lmsysorg/sglang:dev-minimax-m31-flash"]
    keys = {c["label"]: c["key"] for c in doc["kernel_caches"]}
    assert keys["minfer"]["gpu"] == "NVIDIA B300" and keys["minfer"]["recipe"] == "balanced"
    assert keys["flashinfer"] == {"schema": "mm-cache-key/1", "gpu": "NVIDIA B300", "compute_capability": "10.3"}
    return out, image, keyed, unkeyed


def test_image_and_kernel_cache_payloads_round_trip(model, payload_bundle, tmp_path):
    out, image, keyed, unkeyed = payload_bundle
    dest = tmp_path / "model"
    r = run_mm("unbundle", out, "--dest", dest, "--image-dest", tmp_path / "images", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert tree(dest) == tree(model)
    assert (tmp_path / "images" / "sglang.tar").read_bytes() == image.read_bytes()
    caches = tmp_path / "model.payload" / "kernel-cache"  # beside the model by default
    assert tree(caches / "minfer") == tree(keyed) and tree(caches / "flashinfer") == tree(unkeyed)
    assert any(c.startswith(f"docker load -i {tmp_path / 'images' / 'sglang.tar'}   # NOT proven")  # --allow-other-image
               for c in doc["next_commands"])
    assert any(f"{caches / 'minfer'}:/root/.cache/minfer" in c for c in doc["next_commands"])
    assert doc["verify"]["ok"] is True


def test_the_cache_key_warmup_writes_is_the_key_bundle_carries(model, tmp_path):
    cache = kernel_cache(tmp_path / "minfer", keyed=False)
    key = CacheKey(gpu="NVIDIA B300", compute_capability="10.3", driver="590.44",
                   image="lmsysorg/sglang@sha256:" + "6" * 64, recipe="balanced", gpu_count=4)
    write_cache_key(cache, key)  # what `mm warmup` does once the caches are compiled
    result = create_bundle(model, BundleOptions((tmp_path / "vols",), 2_000_000, payloads={"kernel-cache": (cache,)}))
    assert result.payloads["kernel_caches"] == [{"label": "minfer", "key": key.document(), "files": 3}]
    assert not result.notes


def test_a_new_payload_kind_is_one_table_entry(model, tmp_path, monkeypatch):
    wheels = payloads.PayloadKind("wheelhouse", "wheelhouses", True, payloads.KernelCachePayload,
                                  "--wheelhouse", "wheels to carry", "--wheel-dest", "wheelhouse", "where wheels go")
    monkeypatch.setattr(payloads, "PAYLOAD_KINDS", (*payloads.PAYLOAD_KINDS, wheels))
    monkeypatch.setattr(payloads, "BY_KIND", {**payloads.BY_KIND, wheels.kind: wheels})
    monkeypatch.setitem(payloads.PREFIXES, wheels.kind, wheels.prefix)
    house = tmp_path / "wheels"
    house.mkdir()
    (house / "mm-0.1.0-py3-none-any.whl").write_bytes(os.urandom(30_000))
    result = create_bundle(model, BundleOptions((tmp_path / "vols",), 2_000_000, payloads={"wheelhouse": (house,)}))
    assert result.payloads["wheelhouses"] == [{"label": "wheels", "key": None, "files": 1}]
    vol = volumes_in(tmp_path / "vols")[-1]
    assert "payload/wheelhouse/wheels/mm-0.1.0-py3-none-any.whl" in tarfile.open(vol).getnames()
    report = unbundle([tmp_path / "vols"], tmp_path / "dest")
    assert report.ok and report.complete
    placed = tmp_path / "dest.payload" / "wheelhouse" / "wheels"
    assert tree(placed) == tree(house) and report.payloads["wheelhouses"][0]["path"] == str(placed)
    assert not (tmp_path / "dest.payload" / "wheelhouse" / ".mm-partial").exists()


def test_every_payload_kind_has_its_options_and_its_own_place(model):
    bundle_help, unbundle_help = run_mm("bundle", "create", "--help").stdout, run_mm("unbundle", "--help").stdout
    for k in PAYLOAD_KINDS:
        assert k.source_option in bundle_help and k.dest_option in unbundle_help
    prefixes = [k.prefix for k in PAYLOAD_KINDS]
    assert len(set(prefixes)) == len(prefixes) and all(p.startswith("payload/") for p in prefixes)


def test_standard_tools_restore_following_restore_txt(model, payload_bundle, tmp_path):
    out, image, keyed, _ = payload_bundle
    work = tmp_path / "work"
    copy_volumes(out, work)
    text = tarfile.open(volumes_in(work)[0]).extractfile("MMBUNDLE/RESTORE.txt").read().decode()
    script = text.split("--- begin restore script ---\n", 1)[1].split("--- end restore script ---", 1)[0]
    (work / "restore.sh").write_text(script)
    r = subprocess.run(["sh", "restore.sh"], cwd=work, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "FAILED" not in r.stdout and r.stdout.count(": OK") == len(tree(model)) - 1 + 1 + 5
    restored = work / "restore"
    assert tree(restored / "model") == tree(model)  # the manifest too, where mm looks for it
    assert (restored / "payload" / "image" / "sglang.tar").read_bytes() == image.read_bytes()
    assert tree(restored / "payload" / "kernel-cache" / "minfer") == tree(keyed)


def test_find_volumes_in_a_directory_ignores_other_files(vols, tmp_path):
    copy_volumes(vols, tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    assert len(find_volumes([tmp_path])) == len(volumes_in(vols))


def test_a_volume_whose_index_is_over_the_bound_is_refused_on_one_line_naming_it(vols, tmp_path, monkeypatch):
    from mm.artifacts.bundle import volume
    monkeypatch.setattr(volume, "MAX_INDEX_BYTES", 1024)  # the real bound is 1 GiB: a million files' index is 442 MB
    first = volumes_in(vols)[0]
    opened = open_volume(first)
    assert opened.index is None and len(opened.refused) == 1
    assert re.fullmatch(rf"{re.escape(first.name)}: MMBUNDLE/index-vol001\.json is \d+ bytes, more than the 1024 "
                        rf"allowed", opened.refused[0]), opened.refused


def test_a_volume_cut_inside_its_index_is_refused_as_no_readable_volume(vols, tmp_path):
    first = volumes_in(vols)[0]
    cut = tmp_path / first.name
    cut.write_bytes(first.read_bytes()[:512 + 100])  # the index's header and 100 bytes of it
    opened = open_volume(cut)
    assert opened.index is None and opened.refused == [f"{cut.name}: not a readable tar volume (unexpected end of data)"]


def test_a_volumes_manifest_changed_on_disk_since_it_was_opened_is_not_read_as_its_manifest(model, vols, tmp_path):
    """The manifest's bytes are not held (read again when needed): what is read again must be what was checked."""
    path = copy_volumes(vols, tmp_path)[0]
    opened = open_volume(path)
    assert opened.has_manifest and opened.manifest_bytes == manifest_path(model).read_bytes()
    with open(path, "r+b") as f:
        f.seek(opened.manifest_at.offset_data + 20)
        f.write(b"#")
    assert opened.manifest_bytes == b""


def test_a_manifest_changed_in_its_volume_while_unbundle_runs_is_refused_with_nothing_written(vols, tmp_path,
                                                                                                monkeypatch):
    """unbundle reads the manifest again from its volume as it parses it: bytes other than those checked when the
    volume was opened are refused, on one line naming the volume."""
    from mm.artifacts.bundle import unpack
    copies = copy_volumes(vols, tmp_path / "vols")

    def open_then_change(path):
        opened = open_volume(path)
        if opened.manifest_at is not None:
            with open(path, "r+b") as f:
                f.seek(opened.manifest_at.offset_data + 20)
                f.write(b"#")
        return opened

    monkeypatch.setattr(unpack, "open_volume", open_then_change)
    with pytest.raises(BadInput, match=rf"^{re.escape(copies[0].name)}: MMBUNDLE/manifest\.json: changed since the "
                                       rf"volume was opened; refused, nothing written$"):
        unbundle(copies, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_a_volume_whose_index_mm_unbundle_could_not_read_is_refused_before_anything_is_written(model, tmp_path,
                                                                                                  monkeypatch):
    from mm.artifacts.bundle import pack
    monkeypatch.setattr(pack, "MAX_INDEX_BYTES", 1024)  # the real bound is 1 GiB: a million files' index is 442 MB
    with pytest.raises(BadValue, match=r"index of .*more than the 1\.0 kB mm unbundle reads; choose a smaller "
                                       r"--volume-size, e\.g\. "):
        create_bundle(model, BundleOptions((tmp_path / "out",), VOLUME_SIZE))
    assert not any((tmp_path / "out").glob("*.tar"))
