"""Hostile and broken input, faults and full disks: every path ends in the documented outcome.

Families (each parametrized; the count of cases is what pytest collects here):
  json      malformed JSON of every kind of file mm reads, through the commands that read it (the troubleshooting
            table, docker's answers and a manifest to sign included)
  shape     well-formed JSON of the wrong shape (the cases the issue lists)
  volume    crafted bundle volumes (data and parity)
  hub       a fault-injecting Hub (a file that 404s or 500s, garbage API answers, credentials in HF_ENDPOINT), and
            sources answering Range requests from the wrong byte
  fs        full (ENOSPC) and read-only file systems on small tmpfs mounts (root only), wrong kinds of path,
            names too long
  race      concurrent runs, a file cut while verify hashes it
  values    option values refused as usage errors (exit 2), launch-node and diagnose options included
  messages  what mm prints about hostile names
  oci       hostile registry artifacts, token services and auth files; a model that never had a draft
  guard     an unexpected exception injected into each command family: one line, exit 70
Every run goes through `run`, which records it; the last test asserts that none printed a traceback.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.bundle.format import b3
from mm.artifacts.bundle.pack import BundleOptions, create_bundle
from mm.artifacts.bundle.payloads import CollectOptions
from mm.artifacts.paths import manifest_path
from mm.artifacts.edges.untrusted import At
from tests.support.modelgen import write_model
from tests.support.run import mm_argv, run_mm
from tests.support.slowio import slow_io_env

REPO = "MiniMaxAI/MiniMax-M3.1-Flash"
COMMIT = "ce7f4df87d2e05262f5775f373dac4772f134041"
VOLUME_SIZE = 400_000
RUNS: list[tuple[list[str], subprocess.CompletedProcess]] = []

# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_run_prints_a_traceback():
    """After each test of this module: none of the mm runs it made printed a Python traceback (whatever else the
    test asserts; in any order, on any worker)."""
    RUNS.clear()
    yield
    shown = [(" ".join(argv[1:])[:120], r.stderr[-400:]) for argv, r in RUNS if "Traceback" in r.stderr + r.stdout]
    assert shown == []


def run(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """run_mm, recorded for the check after each test (no traceback in any run of this module)."""
    r = run_mm(*args, extra_env={"COLUMNS": "200", **(env or {})}, timeout=timeout)
    RUNS.append((mm_argv(*args), r))
    return r


def fails_cleanly(r: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit CODE, one `mm: ...` line on stderr naming each needle, and no traceback anywhere."""
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.returncode == code, f"exit {r.returncode}, expected {code}: {r.stderr}"
    lines = [line for line in r.stderr.splitlines() if line.startswith("mm: ")]
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def make_model(root: Path, shards: int = 2, shard_bytes: int = 200 * 1024) -> Path:
    write_model(root, shards=shards, shard_bytes=shard_bytes)
    manifest_for_local_dir(root, REPO, COMMIT, offline=True)
    return root


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("pristine") / "model")


@pytest.fixture
def model(pristine, tmp_path) -> Path:
    root = tmp_path / "model"
    shutil.copytree(pristine, root)
    return root


@pytest.fixture(scope="module")
def pristine_vols(pristine, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vols")
    create_bundle(pristine, BundleOptions((out,), VOLUME_SIZE))
    return out


@pytest.fixture
def vols(pristine_vols, tmp_path) -> list[Path]:
    out = tmp_path / "vols"
    shutil.copytree(pristine_vols, out)
    return sorted(out.glob("*.tar"))


def rewrite_volume(vol: Path, change) -> None:
    """Rewrite VOL member by member; CHANGE(name, data, index) returns the new bytes of a member (index: the
    volume's parsed index, for reference). Member order and names are kept."""
    with tarfile.open(vol, "r:") as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    index = json.loads(members[0][1])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as out:
        for m, data in members:
            data = change(m.name, data, index)
            info = tarfile.TarInfo(m.name)
            info.size, info.mtime, info.mode = len(data), m.mtime, m.mode
            out.addfile(info, io.BytesIO(data))
    vol.write_bytes(buf.getvalue())


def set_index(vol: Path, edit, prefix: str = "MMBUNDLE/index-vol") -> None:
    """Replace VOL's index (or, with PREFIX MMBUNDLE/index-par, a parity volume's) with EDIT(index dict) -> dict or bytes."""
    def change(name, data, index):
        if name.startswith(prefix):
            new = edit(json.loads(data))
            return new if isinstance(new, bytes) else json.dumps(new).encode()
        return data
    rewrite_volume(vol, change)


def set_embedded_manifest(vol: Path, new: bytes) -> None:
    """Replace the manifest inside VOL and update the index's manifest_blake3 so that the hash matches."""
    def change(name, data, index):
        if name == "MMBUNDLE/manifest.json":
            return new
        if name.startswith("MMBUNDLE/index-vol"):
            return json.dumps({**json.loads(data), "manifest_blake3": b3(new)}).encode()
        return data
    rewrite_volume(vol, change)


DEEP = b"[" * 100_000 + b"]" * 100_000
MALFORMED = {
    "deep-nesting": DEEP,
    "deep-object": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "huge-float": b'{"schema": 1e400}',
    "huge-int": b'{"schema": 1' + b"0" * 400 + b"}",
    "nan": b'{"schema": NaN}',
    "lone-surrogate": b'{"schema": "\\ud800"}',
    "not-utf8": b'{"schema": "\xff\xfe"}',
    "truncated": b'{"schema": "mm-',
    "empty": b"",
    "wrong-shape": b"[1, 2, 3]",
}


# A few of every kind through each command (every kind through the loader itself, in process, below).
SOME = ["deep-nesting", "huge-float", "lone-surrogate", "wrong-shape"]


# --- json: malformed JSON of every kind of file mm reads ------------------------------------------

@pytest.mark.parametrize("bad", sorted(MALFORMED))
def test_json_the_loader_refuses_each_kind_in_one_line(bad):
    from mm.artifacts.edges.untrusted import Malformed, load_json
    with pytest.raises(Malformed) as caught:
        doc = load_json(MALFORMED[bad], "f.json")
        assert bad == "wrong-shape" and doc == [1, 2, 3]
        raise Malformed("f.json", "wrong shape: the typed readers refuse it")
    assert caught.value.message.startswith("f.json: ") and "\n" not in caught.value.message


@pytest.mark.parametrize("doc, says", [
    (b'{"sha": "1234567890123456789012345", "n": 1}', None),  # 25 digits in a string: no integer
    (b'{"a": "' + b"[" * 100 + b'", "n": [1]}', None),  # brackets in a string: no nesting
    (b'{"a": "x\\"[[[", "n": 1234567890123456789012}', "more than 20 digits"),  # an escaped quote, brackets after
    (b'{"a": "\\"", "b": ' + b"[" * 70 + b"]" * 70 + b"}", "nested deeper than 64"),
    (b'{"a": "' + b"]" * 70 + b'", "b": ' + b"[" * 70 + b"]" * 70 + b"}", "nested deeper than 64"),
])
def test_json_the_loader_judges_numbers_and_brackets_outside_strings(doc, says):
    from mm.artifacts.edges.untrusted import Malformed, load_json
    if says is None:
        assert load_json(doc, "f.json") == json.loads(doc)
        return
    with pytest.raises(Malformed, match=says):
        load_json(doc, "f.json")


@pytest.mark.parametrize("command, bad", [("verify", bad) for bad in sorted(MALFORMED)]
                         + [(command, "deep-nesting") for command in ("verify --quick", "repair", "bundle", "launch",
                                                                     "manifest export")]
                         + [(command, "wrong-shape") for command in ("repair", "bundle", "launch")])
def test_json_model_manifest(model, tmp_path, command, bad):
    manifest_path(model).write_bytes(MALFORMED[bad])
    args = {"verify": ["verify", model], "verify --quick": ["verify", "--quick", model], "repair": ["repair", model],
            "bundle": ["bundle", model, "--out", tmp_path / "out", "--volume-size", "1G"],
            "launch": ["launch", model, "--hardware", "b300"], "manifest export": ["manifest", "export", model]}[command]
    fails_cleanly(run(*args), 3, str(manifest_path(model)))


@pytest.mark.parametrize("bad", SOME)
@pytest.mark.parametrize("kind", ["safetensors header", "index", "config.json"])
def test_json_structure_files_are_named_by_verify(model, kind, bad):
    raw = MALFORMED[bad]
    if kind == "safetensors header":
        rel = "model-00001-of-00002.safetensors"
        data = (model / rel).read_bytes()
        n = int.from_bytes(data[:8], "little")
        (model / rel).write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    else:
        rel = {"index": "model.safetensors.index.json", "config.json": "config.json"}[kind]
        (model / rel).write_bytes(raw)
    manifest_for_local_dir(model, REPO, COMMIT, offline=True)  # the bytes are what the manifest says: structure only
    r = run("verify", model)
    fails_cleanly(r, 1, "problem")
    problems = [line for line in r.stdout.splitlines() if f" {rel}:" in line]
    assert problems and problems[0].split()[0] in ("STRUCTURE", "INDEX"), r.stdout


@pytest.mark.parametrize("bad", SOME)
def test_json_bundle_index(vols, tmp_path, bad):
    set_index(vols[0], lambda index: MALFORMED[bad])
    r = run("bundle", "verify", *vols)
    fails_cleanly(r, 1, vols[0].name)
    assert r.stdout.split()[0] in ("CORRUPT", "FOREIGN"), r.stdout
    r = run("unbundle", vols[0], "--dest", tmp_path / "dest")
    assert r.returncode in (3, 5) and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("bad", SOME)
def test_json_embedded_manifest_whose_hash_matches(vols, tmp_path, bad):
    for v in vols:
        set_embedded_manifest(v, MALFORMED[bad])
    fails_cleanly(run("unbundle", *vols, "--dest", tmp_path / "dest"), 3, "MMBUNDLE/manifest.json")
    assert not (tmp_path / "dest" / "model-00001-of-00002.safetensors").exists()


@pytest.mark.parametrize("bad", ["deep-nesting", "truncated", "wrong-shape"])
def test_json_destination_manifest(vols, tmp_path, bad):
    dest = tmp_path / "dest"
    manifest_path(dest).parent.mkdir(parents=True)
    manifest_path(dest).write_bytes(MALFORMED[bad])
    fails_cleanly(run("unbundle", *vols, "--dest", dest), 3, str(manifest_path(dest)))


@pytest.mark.parametrize("bad", SOME)
def test_json_unbundle_state(vols, tmp_path, bad):
    dest = tmp_path / "dest"
    assert run("unbundle", vols[0], "--dest", dest).returncode == 8  # waiting for volume 2
    state = dest / ".mm" / "unbundle" / "state.json"
    assert state.is_file()
    state.write_bytes(MALFORMED[bad])
    fails_cleanly(run("unbundle", *vols[1:], "--dest", dest), 3, str(state))


@pytest.mark.parametrize("bad", SOME)
def test_json_kernel_cache_key(model, tmp_path, bad):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernel.bin").write_bytes(b"k")
    (cache / "mm-cache-key.json").write_bytes(MALFORMED[bad])
    r = run("bundle", model, "--out", tmp_path / "out", "--volume-size", "1G", "--kernel-cache", cache)
    fails_cleanly(r, 3, "mm-cache-key.json")


@pytest.mark.parametrize("member", ["manifest.json", "index.json"])
@pytest.mark.parametrize("bad", ["deep-nesting", "wrong-shape"])
def test_json_image_archive(model, tmp_path, member, bad):
    image = tmp_path / "image.tar"
    with tarfile.open(image, "w") as tf:
        info = tarfile.TarInfo(member)
        info.size = len(MALFORMED[bad])
        tf.addfile(info, io.BytesIO(MALFORMED[bad]))
    r = run("bundle", model, "--out", tmp_path / "out", "--volume-size", "1G", "--image", image)
    fails_cleanly(r, 3, str(image))


@pytest.mark.parametrize("bad", SOME + ["nan"])
def test_json_image_record_beside_an_archive(model, tmp_path, bad):
    """`mm image save`'s record crosses the air gap with the archive: launch reads it hostile."""
    archive = tmp_path / "engine.tar"
    archive.write_bytes(b"\0" * 1024)
    (tmp_path / "engine.tar.mm-image.json").write_bytes(MALFORMED[bad])
    r = run("launch", model, "--hardware", "b300", "--image-archive", archive)
    fails_cleanly(r, 3, str(tmp_path / "engine.tar.mm-image.json"))


@pytest.mark.parametrize("bad", sorted(MALFORMED))
def test_json_wheelhouse_index(tmp_path, bad):
    from mm.artifacts.errors import BadInput
    from mm.artifacts.bundle.wheelhouse import INDEX_NAME, read_index
    (tmp_path / INDEX_NAME).write_bytes(MALFORMED[bad])
    with pytest.raises(BadInput) as caught:
        read_index(tmp_path)
    assert caught.value.message.startswith(str(tmp_path / INDEX_NAME)) and "\n" not in caught.value.message


# --- shape: well-formed JSON of the wrong shape ---------------------------------------------------

def _edit_manifest(model: Path, edit) -> None:
    doc = json.loads(manifest_path(model).read_text())
    edit(doc)
    manifest_path(model).write_text(json.dumps(doc))


MANIFEST_SHAPES = {
    "entry is a list": lambda d: d["files"].__setitem__(0, ["a", 1]),
    "size 1e400": lambda d: d["files"][0].__setitem__("size", "@1e400"),
    "size is true": lambda d: d["files"][0].__setitem__("size", True),
    "size is negative": lambda d: d["files"][0].__setitem__("size", -1),
    "size is a float": lambda d: d["files"][0].__setitem__("size", 1.5),
    "files is an object": lambda d: d.__setitem__("files", {"a": 1}),
    "path is a number": lambda d: d["files"][0].__setitem__("path", 7),
    "path has a newline": lambda d: d["files"][0].__setitem__("path", "a\nb"),
    "path escapes": lambda d: d["files"][0].__setitem__("path", "../../etc/passwd"),
    "upstream is a string": lambda d: d["files"][0].__setitem__("upstream", "lfs"),
    "revision is a list": lambda d: d.__setitem__("revision", ["x"]),
    "repo_id is null": lambda d: d.__setitem__("repo_id", None),
}


@pytest.mark.parametrize("shape", sorted(MANIFEST_SHAPES))
def test_shape_manifest(model, shape):
    _edit_manifest(model, MANIFEST_SHAPES[shape])
    text = manifest_path(model).read_text().replace('"@1e400"', "1e400")
    manifest_path(model).write_text(text)
    fails_cleanly(run("verify", model), 3, str(manifest_path(model)))


INDEX_SHAPES = {
    "payloads is a list": lambda i: {**i, "payloads": []},
    "volume 1e400": lambda i: json.dumps(i).replace('"volume": 1,', '"volume": 1e400,').encode(),
    "volume is a string": lambda i: {**i, "volume": "1"},
    "volume 0": lambda i: {**i, "volume": 0},
    "volumes below volume": lambda i: {**i, "volumes": 0},
    "members is an object": lambda i: {**i, "members": {}},
    "member is a list": lambda i: {**i, "members": [[1, 2]]},
    "member offset is true": lambda i: {**i, "members": [{**i["members"][0], "offset": True}]},
    "member length past its file": lambda i: {**i, "members": [{**i["members"][0], "length": 10**15}]},
    "meta is a list": lambda i: {**i, "meta": ["MMBUNDLE/x"]},
    "kernel cache files not pairs": lambda i: {**i, "payloads": {"image": None, "kernel_caches": [
        {"label": "c", "key": None, "files": [["a"]]}]}},
    "image size is a string": lambda i: {**i, "payloads": {"image": {"file": "x.tar", "size": "9", "refs": []},
                                                             "kernel_caches": []}},
    "kernel cache key nested": lambda i: {**i, "payloads": {"image": None, "kernel_caches": [
        {"label": "c", "key": {"schema": "mm-cache-key/1", "gpu": {"a": [1]}}, "files": []}]}},
    "volume_size 0": lambda i: {**i, "volume_size": 0},
    "bundle_id of a megabyte": lambda i: {**i, "bundle_id": "x" * 2**20},
    "whole file stored short": lambda i: {**i, "members": [
        {**e, "size": e["size"] + 1} if e["segments"] == 1 else e for e in i["members"]]},
    "piece larger than a volume": lambda i: {**i, "volume_size": 1000},
    "segments beyond the volumes": lambda i: {**i, "members": [
        {**e, "segments": 10**6} if e["segments"] > 1 else e for e in i["members"]] if any(
        e["segments"] > 1 for e in i["members"]) else [{**i["members"][0], "segments": 10**6}]},
}


@pytest.mark.parametrize("shape", sorted(INDEX_SHAPES))
def test_shape_bundle_index(vols, tmp_path, shape):
    set_index(vols[0], INDEX_SHAPES[shape])
    r = run("bundle", "verify", vols[0])
    fails_cleanly(r, 1, vols[0].name)
    assert r.stdout.split()[0] != "OK", r.stdout
    if shape in ("payloads is a list", "volume 1e400", "member is a list"):
        r = run("unbundle", vols[0], "--dest", tmp_path / "dest")
        assert r.returncode in (3, 5) and "Traceback" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def pristine_parity_vols(pristine, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parity")
    create_bundle(pristine, BundleOptions((out,), VOLUME_SIZE, parity=1))
    return out


PARITY_SHAPES = {
    **{bad: (lambda raw: lambda i: raw)(MALFORMED[bad]) for bad in SOME},
    "data is an object": lambda i: {**i, "data": {}},
    "a data size of 10^13": lambda i: {**i, "data": [{**d, "size": 10**13} for d in i["data"]]},
    "parities 10^6": lambda i: {**i, "parities": 10**6},
    "a name of a megabyte": lambda i: {**i, "name": "n" * 2**20},
}


@pytest.mark.parametrize("shape", sorted(PARITY_SHAPES))
def test_volume_a_hostile_parity_index(pristine_parity_vols, tmp_path, shape):
    shutil.copytree(pristine_parity_vols, tmp_path / "vols")
    all_vols = sorted((tmp_path / "vols").glob("*.tar"))
    par = next(v for v in all_vols if ".par" in v.name)
    set_index(par, PARITY_SHAPES[shape], prefix="MMBUNDLE/index-par")
    r = run("bundle", "verify", *all_vols)
    fails_cleanly(r, 1, par.name)
    data = [v for v in all_vols if v != par]
    data[0].unlink()  # a volume lost: the hostile parity volume is all there is to rebuild it from
    r = run("unbundle", *data[1:], par, "--dest", tmp_path / "dest")
    assert r.returncode in (3, 5) and "Traceback" not in r.stderr, r.stderr
    r = run("bundle", "repair-volume", *data[1:], par)
    assert r.returncode in (1, 3, 5) and "Traceback" not in r.stderr, r.stderr
    big = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 10**8]
    assert big == []


@pytest.mark.parametrize("bad", SOME)
def test_json_a_manifest_to_sign(model, keys, bad):
    manifest_path(model).write_bytes(MALFORMED[bad])
    fails_cleanly(run("sign", model, "--key", keys["alice"]), 3, str(manifest_path(model)))
    assert not (manifest_path(model).parent / "manifest.json.sig").exists()


# --- volume: crafted volumes whose hashes all match ----------------------------------------------

@pytest.fixture(scope="module")
def pristine_image_vols(pristine, tmp_path_factory) -> Path:
    """A bundle of the model plus a 1,000-byte image archive (docker save layout)."""
    work = tmp_path_factory.mktemp("image")
    image = work / "image.tar"
    with tarfile.open(image, "w") as tf:
        for name, data in (("manifest.json", b'[{"RepoTags": ["engine:1"], "Config": "blobs/sha256/ab.json"}]'),
                           ("blobs/sha256/ab.json", b'{"architecture": "amd64", "os": "linux"}'),
                           ("blob", os.urandom(1000))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    create_bundle(pristine, BundleOptions((work / "vols",), VOLUME_SIZE, payloads={"image": (image,)},
                                          collect=CollectOptions(allow_other_image=True)))  # not the pinned image
    return work / "vols"


def _image_volume(vols_dir: Path) -> Path:
    return next(v for v in sorted(vols_dir.glob("*.tar")) if any(
        m.name.startswith("payload/image/") or m.name.startswith("segments/payload/image/")
        for m in tarfile.open(v).getmembers()))


@pytest.mark.parametrize("declared", [10**13, 10**15])
def test_volume_an_entry_declaring_a_huge_size_is_never_ok(pristine_image_vols, tmp_path, declared):
    shutil.copytree(pristine_image_vols, tmp_path / "vols")
    vol = _image_volume(tmp_path / "vols")

    def huge(index):
        for e in index["members"]:
            if e["kind"] == "image":
                e["size"] = declared
        index["payloads"]["image"]["size"] = declared
        return index
    set_index(vol, huge)
    r = run("bundle", "verify", vol)
    fails_cleanly(r, 1, vol.name)
    assert r.stdout.split()[0] == "CORRUPT"
    dest = tmp_path / "dest"
    r = run("unbundle", *sorted((tmp_path / "vols").glob("*.tar")), "--dest", dest)
    assert r.returncode in (3, 5) and "Traceback" not in r.stderr, r.stderr
    big = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 10**9]
    assert big == []  # no sparse giant anywhere


def test_volume_a_model_entry_that_disagrees_with_the_manifest(vols, tmp_path):
    def shrink(index):
        e = next(e for e in index["members"] if e["kind"] == "model" and e["segments"] == 1)
        e["size"] = e["length"] = e["size"] - 1
        return index
    vol = next(v for v in vols if any(e["kind"] == "model" and e["segments"] == 1
                                      for e in json.loads(tarfile.open(v).extractfile(tarfile.open(v).getmembers()[0]).read())["members"]))
    set_index(vol, shrink)
    r = run("bundle", "verify", vol)
    fails_cleanly(r, 1, vol.name)


def test_volume_whose_payload_records_differ_from_the_rest_of_its_bundle(pristine_image_vols, tmp_path):
    """Every hash matches, every entry agrees with its own index: but its bundle-wide records are not the
    bundle's (another image reference), so neither bundle verify nor unbundle takes it."""
    shutil.copytree(pristine_image_vols, tmp_path / "vols")
    all_vols = sorted((tmp_path / "vols").glob("*.tar"))
    assert len(all_vols) > 1
    odd = all_vols[-1]

    def other_refs(index):
        index["payloads"]["image"]["refs"] = ["evil:1"]
        return index
    set_index(odd, other_refs)
    r = run("bundle", "verify", *all_vols)
    fails_cleanly(r, 1, odd.name)
    assert "payloads differs" in r.stdout and r.stdout.count("CORRUPT") == 1, r.stdout
    r = run("unbundle", *all_vols, "--dest", tmp_path / "dest")
    assert r.returncode == 5 and "payloads differs" in r.stdout + r.stderr and "Traceback" not in r.stderr, r.stderr


def test_volume_an_embedded_manifest_with_a_parent_path(vols, tmp_path):
    doc = json.loads(tarfile.open(vols[0]).extractfile("MMBUNDLE/manifest.json").read())
    doc["files"][0]["path"] = "../escaped.safetensors"
    for v in vols:
        set_embedded_manifest(v, json.dumps(doc).encode())
    r = run("bundle", "verify", *vols)
    fails_cleanly(r, 1)
    assert "OK" not in r.stdout.split() and "../escaped" in r.stdout
    fails_cleanly(run("unbundle", *vols, "--dest", tmp_path / "dest"), 3, "escaped")
    assert not (tmp_path / "escaped.safetensors").exists()


# --- values: refused as usage errors, exit 2, one line --------------------------------------------

VALUES = {
    "empty revision": ["fetch", "o/r", "--revision", ""],
    "blank revision": ["fetch", "o/r", "--revision", "  "],
    "repo a/b/c": ["fetch", "a/b/c"],
    "repo with a space": ["fetch", "bad repo!/x"],
    "repo ../..": ["fetch", "../.."],
    "repo of 300 characters": ["fetch", "o/" + "r" * 300],
    "manifest --repo a/b/c": ["manifest", "/tmp", "--repo", "a/b/c", "--revision", COMMIT, "--offline"],
    "verify --repo ../..": ["verify", "/tmp", "--upstream", "--repo", "../..", "--revision", COMMIT],
    "--gpus -1": ["launch", "/tmp", "--hardware", "b300", "--gpus", "-1,0,1,2"],
    "--gpus twice": ["launch", "/tmp", "--hardware", "b300", "--gpus", "0,0,1,2"],
    "--gpus empty": ["launch", "/tmp", "--hardware", "b300", "--gpus", ""],
    "--tp 0": ["launch", "/tmp", "--hardware", "b300", "--tp", "0"],
    "--tp -4": ["launch", "/tmp", "--hardware", "b300", "--tp", "-4"],
    "--context-length -5": ["launch", "/tmp", "--hardware", "b300", "--context-length", "-5"],
    "--context-length 0": ["launch", "/tmp", "--hardware", "b300", "--context-length", "0"],
    "--port 0": ["launch", "/tmp", "--hardware", "b300", "--port", "0"],
    "--port 70000": ["launch", "/tmp", "--hardware", "b300", "--port", "70000"],
    "--volume-size 1 and 400 zeros": ["bundle", "/tmp", "--out", "/tmp/x", "--volume-size", "1" + "0" * 400],
    "--volume-size 0": ["bundle", "/tmp", "--out", "/tmp/x", "--volume-size", "0"],
    "--volume-size 4Q": ["bundle", "/tmp", "--out", "/tmp/x", "--volume-size", "4Q"],
    "--workers 0": ["fetch", "o/r", "--workers", "0"],
    "unknown option": ["verify", "--no-such-option", "/tmp"],
    "missing argument": ["verify"],
    "unknown command": ["no-such-command"],
    "--format xml": ["launch", "/tmp", "--hardware", "b300", "--format", "xml"],
    "--replicas 0": ["launch", "/tmp", "--hardware", "b300", "--replicas", "0"],
    "--replicas -2": ["launch", "/tmp", "--hardware", "b300", "--replicas", "-2"],
    "--replica-ports 0,70000": ["launch", "/tmp", "--hardware", "b300", "--replica-ports", "0,70000"],
    "--replica-ports a,b": ["launch", "/tmp", "--hardware", "b300", "--replica-ports", "a,b"],
    "--metrics-port 0": ["launch", "/tmp", "--hardware", "b300", "--metrics-port", "0"],
    "warmup --replicas 0": ["warmup", "/tmp", "--hardware", "b300", "--replicas", "0"],
    "warmup --timeout nan": ["warmup", "/tmp", "--hardware", "b300", "--timeout", "nan"],
    "warmup --timeout -5": ["warmup", "/tmp", "--hardware", "b300", "--timeout", "-5"],
    "diagnose --gpus -1": ["diagnose", "/tmp/x.log", "--gpus", "-1"],
    "diagnose --port 0": ["diagnose", "/tmp/x.log", "--port", "0"],
    "--cache-key without =": ["bundle", "/tmp", "--out", "/tmp/x", "--volume-size", "1G", "--cache-key", "gpu"],
}


@pytest.mark.parametrize("case", sorted(VALUES))
def test_values_refused_as_usage_errors(case):
    fails_cleanly(run(*VALUES[case]), 2)


@pytest.mark.parametrize("case", ["empty revision", "repo a/b/c", "--tp 0", "--volume-size 1 and 400 zeros", "unknown option"])
def test_values_refused_with_json_give_one_document(case):
    r = run(*VALUES[case], "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2 and "Traceback" not in r.stderr


# --- messages: hostile names, printed safely -------------------------------------------------------

def test_messages_ansi_escape_in_a_file_name_is_printed_escaped(model):
    (model / "\x1b[31mred\x1b[0m.bin").write_bytes(b"x")
    r = run("verify", model, "--strict")  # an extra file fails only with --strict
    assert r.returncode == 1 and "\x1b" not in r.stdout + r.stderr and "\\x1b[31mred" in r.stdout


def test_messages_a_wrong_field_is_named_by_its_json_path(model):
    _edit_manifest(model, lambda d: d["files"][1].__setitem__("size", "9"))
    fails_cleanly(run("verify", model), 3, str(manifest_path(model)), "$.files[1].size: expected an integer")


def test_messages_a_key_that_is_no_name_is_quoted_in_the_json_path():
    at = At("index.json").key("weight_map").key("model.layers.0 w").index(2)
    assert str(at.fail("bad")) == 'index.json: $.weight_map["model.layers.0 w"][2]: bad'


def test_messages_newline_in_a_manifest_path_is_named_as_a_newline(model):
    _edit_manifest(model, lambda d: d["files"][0].__setitem__("path", "a\nb.safetensors"))
    fails_cleanly(run("verify", model), 3, "holds a newline")


def test_fs_a_directory_of_300_character_names_is_bad_input(tmp_path):
    fails_cleanly(run("verify", tmp_path / ("x" * 300)), 3)
    fails_cleanly(run("manifest", "export", tmp_path / ("x" * 300)), 3)


def test_messages_bundle_leaves_nothing_of_mm_on_the_output_media(model, tmp_path):
    out = tmp_path / "media"
    assert run("bundle", model, "--out", out, "--volume-size", "1G").returncode == 0
    assert [p.name for p in out.iterdir()] == [p.name for p in out.glob("*.tar")] and not (out / ".mm").exists()


def test_messages_unbundle_counts_files_not_members_as_already_present(vols, tmp_path):
    dest = tmp_path / "dest"
    assert run("unbundle", *vols, "--dest", dest).returncode == 0
    r = run("unbundle", *vols, "--dest", dest, "--json")
    doc = json.loads(r.stdout)
    files = json.loads(manifest_path(dest).read_text())["files"]
    assert doc["skipped"] == len(files)


# --- race: concurrent runs, a file cut while verify hashes it --------------------------------------

def _big_sparse_model(root: Path, size: int = 3 * 2**30) -> Path:
    """A model of one sparse file whose manifest digest is wrong: verify must hash all of it (a few seconds)."""
    root.mkdir(parents=True)
    with open(root / "big.bin", "wb") as f:
        f.truncate(size)
    manifest_path(root).parent.mkdir()
    manifest_path(root).write_text(json.dumps({
        "schema": "mm-manifest/1", "repo_id": REPO, "revision": COMMIT, "files": [
            {"path": "big.bin", "size": size, "blake3": "0" * 64, "sha256": "0" * 64}]}))
    (root / ".mm" / "lock").write_text("")  # as fetch leaves it: verify shares it while it reads
    return root


def _wait_for(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _holds_lock(pid: int, on: Path | None = None) -> bool:
    """PID holds a flock or lease (on ON, when given: the kernel's lock table names its device and inode)."""
    try:
        st = on.stat() if on is not None else None
    except FileNotFoundError:
        return False
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[1] in ("FLOCK", "LEASE") and parts[4] == str(pid):
            major, minor, ino = parts[5].split(":")
            if st is None or (int(major, 16), int(minor, 16), int(ino)) == (os.major(st.st_dev), os.minor(st.st_dev),
                                                                             st.st_ino):
                return True
    return False


def test_race_fetch_refused_while_verify_reads_names_the_verify(tmp_path):
    model = _big_sparse_model(tmp_path / "m")
    verifier = subprocess.Popen(mm_argv("verify", str(model)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _holds_lock(verifier.pid))
        r = run("manifest", model, "--repo", REPO, "--revision", COMMIT, "--offline")
    finally:
        verifier.kill()
        verifier.wait()
    fails_cleanly(r, 6, f"`mm verify {model}` (pid {verifier.pid}) is reading it")


def test_race_a_file_cut_while_verify_hashes_it_is_named_as_changed(tmp_path):
    model = _big_sparse_model(tmp_path / "m")
    verifier = subprocess.Popen(mm_argv("verify", str(model), "--jobs", "1"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: "LEASE" in Path("/proc/locks").read_text() and _holds_lock(verifier.pid))
    os.truncate(model / "big.bin", 4096)  # waits until verify lets go of the window it is hashing
    out, err = verifier.communicate(timeout=60)
    assert verifier.returncode == 1, err
    assert "CHANGED" in out and "big.bin" in out and "Traceback" not in err


def test_race_a_file_cut_by_a_writer_that_had_it_open_is_named_as_changed(tmp_path):
    model = _big_sparse_model(tmp_path / "m")
    fd = os.open(model / "big.bin", os.O_RDWR)  # open for writing: no lease can be granted, verify reads instead
    try:
        verifier = subprocess.Popen(mm_argv("verify", str(model), "--jobs", "1"), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        _wait_for(lambda: _holds_lock(verifier.pid))
        time.sleep(0.3)
        os.ftruncate(fd, 4096)
        out, err = verifier.communicate(timeout=60)
    finally:
        os.close(fd)
    assert verifier.returncode == 1, err
    assert "CHANGED" in out and "Traceback" not in err


def test_race_two_bundles_into_one_output_directory(model, tmp_path):
    out = tmp_path / "out"
    env = slow_io_env(tmp_path, chunk=65536, delay=0.05)
    first = subprocess.Popen(mm_argv("bundle", str(model), "--out", str(out), "--volume-size", "1G", "--no-sync"),
                             env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the output directory's own lock: the first lock it takes is a read lock on the model (quick verify),
        # and a second bundle started then may take the output directory first
        _wait_for(lambda: _holds_lock(first.pid, on=out))
        r = run("bundle", model, "--out", out, "--volume-size", "1G")
    finally:
        first.kill()
        first.wait()
    fails_cleanly(r, 6, f"`mm bundle {model}")


# --- fs: wrong kinds of path -----------------------------------------------------------------------

def test_fs_bundle_out_is_a_file(model, tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    fails_cleanly(run("bundle", model, "--out", tmp_path / "file", "--volume-size", "1G"), 3, str(tmp_path / "file"))


def test_fs_unbundle_dest_is_a_file(vols, tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    fails_cleanly(run("unbundle", *vols, "--dest", tmp_path / "file"), 3, str(tmp_path / "file"))


def test_fs_launch_out_is_a_directory(model, tmp_path):
    fails_cleanly(run("launch", model, "--hardware", "b300", "--out", tmp_path), 3, str(tmp_path))


def test_fs_fetch_local_dir_is_a_file(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    fails_cleanly(run("fetch", REPO, "--revision", COMMIT, "--local-dir", tmp_path / "file",
                      env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}), 3, str(tmp_path / "file"))


def test_fs_a_directory_where_the_manifest_wants_a_file(model):
    rel = "model-00001-of-00002.safetensors"
    (model / rel).unlink()
    (model / rel).mkdir()
    (model / rel / "x").write_bytes(b"x")
    r = run("verify", model)
    assert r.returncode == 1 and "Traceback" not in r.stderr and f"MISSING    {rel}" in r.stdout


def test_fs_names_too_long(model, tmp_path):
    long = tmp_path / ("n" * 300)
    fails_cleanly(run("bundle", model, "--out", long, "--volume-size", "1G"), 3, "too long")
    fails_cleanly(run("launch", model, "--hardware", "b300", "--out", long), 3, "too long")


# --- fs: full and read-only file systems (tmpfs mounted here; root only) ---------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """mount(name, size=..., inodes=None) -> a fresh tmpfs mount point under tmp_path; unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def mount(name: str, size: str = "4m", inodes: int | None = None) -> Path:
        point = tmp_path / name
        point.mkdir()
        opts = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _read_only(point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True, capture_output=True)


def test_fs_bundle_out_of_space_names_the_full_disk(model, tmpfs):
    out = tmpfs("media", size="16m", inodes=1)  # the free-space check passes; creating the volume fails (ENOSPC)
    r = run("bundle", model, "--out", out, "--volume-size", "1G")
    fails_cleanly(r, 7, str(out), "no space left")
    assert "mm verify" not in r.stderr and list(out.iterdir()) == []


def test_fs_bundle_without_room_is_refused_before_writing(model, tmpfs):
    out = tmpfs("media", size="256k")
    r = run("bundle", model, "--out", out, "--volume-size", "1G")
    fails_cleanly(r, 7, str(out), "not enough free disk", "nothing written")
    assert list(out.iterdir()) == []


def test_fs_unbundle_out_of_inodes_mid_import(vols, tmpfs):
    dest = tmpfs("dest", size="16m", inodes=6)  # the free-space check passes; creating files fails (ENOSPC)
    fails_cleanly(run("unbundle", *vols, "--dest", dest / "m"), 7, "no space left")


def test_fs_unbundle_without_room_is_refused_before_writing(vols, tmpfs):
    dest = tmpfs("dest", size="256k")
    fails_cleanly(run("unbundle", *vols, "--dest", dest / "m"), 7)


def test_fs_manifest_export_on_full_disk(model, tmpfs):
    disk = tmpfs("disk", size="2m")
    shutil.copytree(model, disk / "m")
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    fails_cleanly(run("manifest", "export", disk / "m"), 7, "no space left")


@pytest.mark.parametrize("command", ["manifest create", "manifest export", "bundle --out", "unbundle --dest",
                                     "launch --out", "repair", "verify"])
def test_fs_read_only(model, vols, tmpfs, command):
    ro = tmpfs("ro", size="8m")
    shutil.copytree(model, ro / "model")
    if command == "repair":
        (ro / "model" / "config.json").write_bytes(b"{}")
    _read_only(ro)
    args = {
        "manifest create": ["manifest", ro / "model", "--repo", REPO, "--revision", COMMIT, "--offline"],
        "manifest export": ["manifest", "export", ro / "model"],
        "bundle --out": ["bundle", model, "--out", ro / "out", "--volume-size", "1G"],
        "unbundle --dest": ["unbundle", *vols, "--dest", ro / "dest"],
        "launch --out": ["launch", model, "--hardware", "b300", "--out", ro / "start.sh"],
        "repair": ["repair", ro / "model"],
        "verify": ["verify", ro / "model"],
    }[command]
    r = run(*args, env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    if command == "verify":  # reading a read-only model works and changes nothing
        assert r.returncode == 0, r.stderr
        return
    if command == "repair":  # verify finds the damage; re-fetching cannot reach the Hub or cannot write
        assert r.returncode in (3, 4) and "Traceback" not in r.stderr, r.stderr
        return
    fails_cleanly(r, 3, str(ro), "read-only file system")


# --- hub: a fault-injecting Hub ---------------------------------------------------------------------

def test_hub_credentials_in_the_endpoint_are_never_printed(tmp_path, unused_port):
    endpoint = f"http://user:s3cret-password@127.0.0.1:{unused_port}"
    for extra in ([], ["--json"]):
        r = run("fetch", REPO, "--revision", COMMIT, "--local-dir", tmp_path / "m", *extra,
                env={"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf")})
        assert r.returncode == 4 and "Traceback" not in r.stderr
        assert "s3cret" not in r.stdout + r.stderr and "user:" not in r.stdout + r.stderr
        assert f"127.0.0.1:{unused_port}" in r.stdout + r.stderr


GARBAGE = {
    "deep nesting": DEEP,
    "a list": b"[1, 2, 3]",
    "not JSON": b"<html>maintenance</html>",
    "huge number": b'{"sha": 1e400, "siblings": []}',
}


@pytest.mark.parametrize("answer", sorted(GARBAGE))
def test_hub_garbage_api_answers(hub_server, hub_env, model_repo, tmp_path, answer):
    hub_server.api_body = GARBAGE[answer]
    r = run("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", tmp_path / "m", env=hub_env)
    fails_cleanly(r, 4, model_repo.repo_id)


SHARD = "model-00002-of-00004.safetensors"


@pytest.mark.parametrize("status", [404, 403])  # 5xx takes the same path after ~25 s of client retries
def test_hub_a_file_that_fails_leaves_a_model_that_never_verifies(hub_server, hub_env, model_repo, tmp_path, status,
                                                                  registry):
    hub_server.fail_file[SHARD] = status
    dest = tmp_path / "m"
    r = run("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=hub_env)
    assert r.returncode == 4 and "Traceback" not in r.stderr and SHARD in r.stderr, r.stderr
    manifest = json.loads(manifest_path(dest).read_text())
    assert len(manifest["files"]) == len(model_repo.files)  # the revision, not what arrived
    entry = next(f for f in manifest["files"] if f["path"] == SHARD)
    assert entry["blake3"] is None and entry["upstream"]["kind"] == "lfs-sha256"
    r = run("verify", dest)
    assert r.returncode == 1 and f"MISSING    {SHARD}" in r.stdout
    fails_cleanly(run("bundle", dest, "--out", tmp_path / "out", "--volume-size", "1G"), 1, SHARD)
    fails_cleanly(run("launch", dest, "--hardware", "b300"), 1)
    fails_cleanly(run("launch", dest, "--hardware", "b300", "--replicas", "2"), 1)
    fails_cleanly(run("push", dest, f"{registry.host}/hostile/incomplete:t", env=_oci_env(tmp_path)), 1)
    fails_cleanly(run("manifest", "export", dest), 3, "never fetched")
    hub_server.fail_file.clear()
    r = run("repair", dest, env=hub_env)  # the Hub serves it again: repair completes the model
    assert r.returncode == 0, r.stderr
    assert run("verify", dest).returncode == 0


def test_hub_repair_never_shrinks_the_manifest(hub_server, hub_env, model_repo, tmp_path):
    dest = tmp_path / "m"
    assert run("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=hub_env).returncode == 0
    r = run("manifest", dest, "--repo", model_repo.repo_id, "--revision", model_repo.head, "--offline")
    assert r.returncode == 0, r.stderr
    before = json.loads(manifest_path(dest).read_text())["files"]
    with open(dest / SHARD, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 16)
    r = run("repair", dest, env=hub_env)
    assert r.returncode == 0, r.stderr
    after = json.loads(manifest_path(dest).read_text())["files"]
    assert [f["path"] for f in after] == [f["path"] for f in before]
    assert run("verify", dest).returncode == 0


def test_hub_repair_of_a_file_the_hub_no_longer_lists_says_so(hub_server, hub_env, model_repo, tmp_path):
    dest = tmp_path / "m"
    assert run("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=hub_env).returncode == 0
    doc = json.loads(manifest_path(dest).read_text())
    doc["files"].append({"path": "gone.bin", "size": 3, "blake3": "0" * 64, "sha256": "0" * 64, "upstream": None})
    manifest_path(dest).write_text(json.dumps(doc))
    r = run("repair", dest, env=hub_env)
    fails_cleanly(r, 4, "gone.bin", "no longer lists")
    assert "include/exclude" not in r.stderr
    assert "gone.bin" in [f["path"] for f in json.loads(manifest_path(dest).read_text())["files"]]


def test_hub_a_fetch_that_fails_early_leaves_nothing(hub_server, hub_env, tmp_path):
    dest = tmp_path / "m"
    fails_cleanly(run("fetch", "no-such/repo", "--revision", "main", "--local-dir", dest, env=hub_env), 4)
    assert not dest.exists()
    dest.mkdir()
    fails_cleanly(run("fetch", "no-such/repo", "--revision", "main", "--local-dir", dest, env=hub_env), 4)
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize("disk", ["too small", "out of inodes mid-run", "read-only"])
def test_hub_fetch_onto_a_full_or_read_only_disk(hub_server, hub_env, model_repo, tmpfs, disk):
    point = tmpfs("disk", size="256k" if disk == "too small" else "16m", inodes=8 if "inodes" in disk else None)
    if disk == "read-only":
        _read_only(point)
    r = run("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", point / "m", env=hub_env)
    code, needle = {"read-only": (3, "read-only file system"), "too small": (7, "not enough free disk"),
                    "out of inodes mid-run": (7, "no space left")}[disk]
    fails_cleanly(r, code, str(point), needle)


@pytest.mark.parametrize("shift", [1000, -1000])
def test_hub_a_range_answered_from_another_byte_ends_in_a_correct_file_or_a_bounded_failure(
        hub_server, hub_env, model_repo, tmp_path, shift):
    """A resumed download whose Range is answered by a 206 starting SHIFT bytes before (after,
    when negative) the offset asked. Before: the bytes at their true offset, the file right. After: refused,
    then the whole file without Range. Never an endless loop (the requests are counted), never a misplaced byte."""
    import hashlib
    dest = tmp_path / "m"
    data = model_repo.read(SHARD)
    partial = dest / ".mm" / "partial" / f"{hashlib.sha256(data).hexdigest()}.part"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:40_000])  # an earlier run kept a prefix: this one asks with Range
    hub_server.shift_range[SHARD] = shift
    hub_server.served.clear()
    r = run("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, "--connections", "1",
            env=hub_env)
    hub_server.shift_range.clear()
    asked = [row for row in hub_server.served if SHARD in row[1]]
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (dest / SHARD).read_bytes() == data and 1 <= len(asked) <= 4, asked
    assert str(asked[0][2]).startswith("bytes=40000-") and asked[0][3] == 206, asked  # the shifted answer was met
    assert run("verify", dest).returncode == 0


def test_race_two_unbundles_into_one_destination(vols, tmp_path):
    dest = tmp_path / "dest"
    env = slow_io_env(tmp_path, chunk=65536, delay=0.05)
    first = subprocess.Popen(mm_argv("unbundle", *map(str, vols), "--dest", str(dest), "--no-sync"),
                             env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _holds_lock(first.pid))
        r = run("unbundle", *vols, "--dest", dest)
    finally:
        first.kill()
        first.wait()
    fails_cleanly(r, 6, "`mm unbundle", "is writing it")
    r = run("unbundle", *vols, "--dest", dest)  # the killed run resumes
    assert r.returncode == 0, r.stderr


def test_hub_a_torn_or_hostile_journal_is_not_trusted(hub_server, hub_env, model_repo, tmp_path):
    dest = tmp_path / "m"
    (dest / ".mm").mkdir(parents=True)
    (dest / ".mm" / "journal.jsonl").write_bytes(b'{"path": "../x", "size": 1e400}\n' + DEEP + b"\n\xff\xfe\n[1]\n")
    r = run("fetch", model_repo.repo_id, "--revision", model_repo.head, "--local-dir", dest, env=hub_env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


ANSWERS = {
    "deep nesting": DEEP,
    "message is a string": b'{"choices": [{"message": "hello"}]}',
    "NaN": b'{"choices": [{"message": {"content": NaN}}]}',
    "reasoning is a number": b'{"choices": [{"message": {"content": "x", "reasoning_content": 5}}]}',
}


@pytest.mark.parametrize("answer", sorted(ANSWERS))
def test_json_warmup_server_answers(tmp_path, answer):
    from tests.support import fake_docker
    from tests.test_launch import make_model_dir
    state = tmp_path / "docker-state"
    fake_docker.install(tmp_path / "bin", state)
    (tmp_path / "answer").write_bytes(ANSWERS[answer])
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model_dir = make_model_dir(tmp_path / "models")
    r = run("warmup", model_dir, "--hardware", "b300", "--port", port, "--cache-root", tmp_path / "cache",
            "--timeout", "60", env={"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
                                    "MM_API_KEY": "k", "NO_PROXY": "127.0.0.1",
                                    "FAKE_SGLANG_ANSWER_FILE": str(tmp_path / "answer")})
    fails_cleanly(r, 1)
    assert "FAILED" in r.stdout


TABLE_SHAPES = {
    "rows is an object": lambda t: {**t, "rows": {}},
    "a row is a list": lambda t: {**t, "rows": [[1]]},
    "guide row is a string": lambda t: {**t, "rows": [{**t["rows"][0], "guide": {**t["rows"][0]["guide"],
                                                                                 "value": {"row": "1"}}}]},
    "a pattern that does not compile": lambda t: {**t, "rows": [{**t["rows"][0], "detect": [
        {"source": "log", "pattern": "(", "pattern_source": "x"}]}]},
    "a cleared_by pattern that does not compile": lambda t: {**t, "rows": [{**t["rows"][0], "detect": [
        {"source": "log", "pattern": "x", "cleared_by": "[", "pattern_source": "x"}]}]},
    "a pattern of a megabyte": lambda t: {**t, "rows": [{**t["rows"][0], "detect": [
        {"source": "log", "pattern": "a" * 2**20, "pattern_source": "x"}]}]},
    "a fix naming an unknown placeholder": lambda t: {**t, "rows": [{**t["rows"][0], "fix_here": "run {nope}"}]},
    "a fix naming an attribute": lambda t: {**t, "rows": [{**t["rows"][0], "fix_here": "{port.__class__}"}]},
    "change is a list": lambda t: {**t, "rows": [{**t["rows"][0], "change": []}]},
    "a near without its within": lambda t: {**t, "rows": [{**t["rows"][0], "detect": [
        {"source": "log", "pattern": "x", "near": "y", "pattern_source": "x"}]}]},
    "a within past its bound": lambda t: {**t, "rows": [{**t["rows"][0], "detect": [
        {"source": "log", "pattern": "x", "near": "y", "within": 10**6, "pattern_source": "x"}]}]},
}


@pytest.mark.parametrize("bad", sorted(set(MALFORMED) - {"empty"}) + sorted(TABLE_SHAPES))
def test_json_troubleshooting_table(tmp_path, bad):
    """The table `mm diagnose` and warm-up read: malformed or of the wrong shape, one line naming the file."""
    from mm.artifacts.serving.diagnose import load_table, table_path
    from mm.artifacts.errors import BadInput
    table = tmp_path / "table.json"
    if bad in TABLE_SHAPES:
        table.write_text(json.dumps(TABLE_SHAPES[bad](json.loads(table_path().read_text()))))
    else:
        table.write_bytes(MALFORMED[bad])
    with pytest.raises(BadInput) as caught:
        load_table(table)
    assert caught.value.message.startswith(str(table)) and "\n" not in caught.value.message
    assert len(caught.value.message) < 1000


def test_json_the_table_placeholders_are_the_plans_fields(tmp_path):
    """What load_table lets a fix name is exactly what a plan supplies (so no shown fix can fail)."""
    from mm.artifacts.serving.diagnose import FIX_FIELDS, load_table, plan_context
    from mm.artifacts.serving.launch import LaunchOptions, plan_launch
    from tests.test_launch import make_model_dir
    assert load_table().rows
    plan = plan_launch(make_model_dir(tmp_path), LaunchOptions(hardware="b300"))
    assert set(plan_context(plan)) == FIX_FIELDS


@pytest.mark.parametrize("inspect", ["deep nesting", "a list of strings", "not JSON", "log not UTF-8"])
def test_json_docker_answers_for_diagnose(tmp_path, inspect):
    """`mm diagnose --container`: whatever `docker inspect` (or the log) holds, the log is still diagnosed."""
    answer = {"deep nesting": DEEP, "a list of strings": b'["x", 1]', "not JSON": b"\xff{", "log not UTF-8": b"[]"}[inspect]
    bad_byte = "\\377 " if inspect == "log not UTF-8" else ""
    (tmp_path / "inspect.out").write_bytes(answer)
    docker = tmp_path / "bin" / "docker"
    docker.parent.mkdir()
    docker.write_text("#!/bin/sh\n"
                      "case \"$1\" in\n"
                      f"  logs) printf '{bad_byte}torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\\n' ;;\n"
                      f"  inspect) cat {tmp_path / 'inspect.out'} ;;\n"
                      "esac\n")
    docker.chmod(0o755)
    r = run("diagnose", "--container", "c", env={"PATH": f"{docker.parent}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "out of memory" in r.stdout.lower(), r.stdout


# --- oci: what a registry, a token service and an auth file hold ----------------------------------

def _oci_env(tmp_path: Path, **extra) -> dict[str, str]:
    env = {"DOCKER_CONFIG": str(tmp_path / "docker-config"), "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost", "REGISTRY_AUTH_FILE": "", **extra}
    return env


def _put(registry, repo: str, kind: str, tag: str, data: bytes | None = None, doc: dict | None = None) -> str:
    import hashlib
    import urllib.request
    if kind == "blob":
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with urllib.request.urlopen(urllib.request.Request(f"{registry.url}/v2/{repo}/blobs/uploads/",
                                                           method="POST")) as resp:
            location = resp.headers["Location"]
        urllib.request.urlopen(urllib.request.Request(f"{location}&digest={digest}", data=data, method="PUT",
                                                      headers={"Content-Type": "application/octet-stream"})).close()
        return digest
    urllib.request.urlopen(urllib.request.Request(
        f"{registry.url}/v2/{repo}/manifests/{tag}", data=json.dumps(doc).encode(), method="PUT",
        headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})).close()
    return tag


OCI_BLOBS = {"config blob deep": ("config", DEEP), "config blob 1e400": ("config", MALFORMED["huge-float"]),
             "mm manifest layer deep": ("mm", DEEP), "mm manifest layer of the wrong shape": ("mm", b'{"files": 7}')}


@pytest.mark.parametrize("case", sorted(OCI_BLOBS))
def test_oci_a_hostile_artifact_is_refused_in_one_line(registry, tmp_path, case):
    from mm.artifacts.oci import modelpack
    which, bad = OCI_BLOBS[case]
    repo = "hostile/" + case.replace(" ", "-").replace(".", "")
    good_config = b'{"descriptor":{"name":"x"},"config":{},"modelfs":{"type":"layers","diffIds":[]}}'
    config = bad if which == "config" else good_config
    layers = []
    if which == "mm":
        layers.append({"mediaType": modelpack.MM_MANIFEST, "digest": _put(registry, repo, "blob", "", bad),
                       "size": len(bad)})
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
           "artifactType": modelpack.ARTIFACT_TYPE,
           "config": {"mediaType": modelpack.CONFIG, "digest": _put(registry, repo, "blob", "", config),
                      "size": len(config)}, "layers": layers}
    _put(registry, repo, "manifest", "v1", doc=doc)
    for args in (("pull", f"{registry.host}/{repo}:v1", "--local-dir", tmp_path / "d"),
                 ("inspect", f"{registry.host}/{repo}:v1")):
        fails_cleanly(run(*args, env=_oci_env(tmp_path)), 3, f"{registry.host}/{repo}")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("bad", SOME)
def test_oci_registry_auth_file(registry, tmp_path, bad):
    auth = tmp_path / "auth.json"
    auth.write_bytes(MALFORMED[bad])
    r = run("inspect", f"{registry.host}/any/thing:v1", env=_oci_env(tmp_path, REGISTRY_AUTH_FILE=str(auth)))
    if bad == "wrong-shape":  # a list holds no entry for this registry: anonymous, and the registry has no such tag
        assert r.returncode == 4 and "Traceback" not in r.stderr, r.stderr
    else:
        fails_cleanly(r, 3, str(auth))


TOKEN_ANSWERS = {"deep": DEEP, "not JSON": b"\xff", "token with a newline": b'{"token": "abc\\r\\nX-Evil: 1"}',
                 "token is a list": b'{"token": ["a"]}', "token of 2 MB": b'{"token": "' + b"a" * 2_000_000 + b'"}'}


@pytest.mark.parametrize("answer", sorted(TOKEN_ANSWERS))
def test_oci_a_hostile_token_service_is_a_remote_error(tmp_path, answer):
    """A registry that asks for a bearer token from a service answering garbage: exit 4, one line."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path.startswith("/token"):
                body = TOKEN_ANSWERS[answer]
                self.send_response(200)
            else:
                body = b'{"errors": [{"code": "UNAUTHORIZED", "message": "x"}]}'
                self.send_response(401)
                self.send_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{self.server.server_port}/token",'
                                                     f'service="fake"')
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        r = run("inspect", f"127.0.0.1:{server.server_port}/a/b:v1", env=_oci_env(tmp_path))
    finally:
        server.shutdown()
        server.server_close()
    fails_cleanly(r, 4, "token")
    assert "X-Evil" not in r.stderr


def test_oci_pulling_a_model_that_never_had_a_draft_prints_no_draft_line(registry, tmp_path):
    other = tmp_path / "other"
    write_model(other, shards=1, shard_bytes=64 * 1024, draft=False)
    manifest_for_local_dir(other, "someone/plain-model", COMMIT, offline=True)
    ref = f"{registry.host}/hostile/plain-model:v1"
    assert run("push", other, ref, env=_oci_env(tmp_path)).returncode == 0
    r = run("pull", ref, "--local-dir", tmp_path / "pulled", env=_oci_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "DSpark" not in r.stdout and "MISSING" not in r.stdout, r.stdout


# --- guard: an unexpected exception anywhere is one line, exit 70 ----------------------------------

FAULT = '''\
"""sitecustomize installed by tests: {module}.{attr} raises an exception mm does not expect."""
import importlib

module = importlib.import_module("{module}")


def _fault(*args, **kwargs):
    raise ZeroDivisionError("injected by the test")


setattr(module, "{attr}", _fault)
'''


def fault_env(directory: Path, module: str, attr: str) -> dict[str, str]:
    """Environment for an mm subprocess in which MODULE.ATTR raises (a sitecustomize on PYTHONPATH)."""
    directory = directory / "fault"
    directory.mkdir(exist_ok=True)
    (directory / "sitecustomize.py").write_text(FAULT.format(module=module, attr=attr))
    return {"PYTHONPATH": str(directory)}


GUARDED = {
    "verify": ("mm.artifacts.integrity.verify", "verify_dir", lambda m, t: ["verify", m], "mm verify"),
    "bundle": ("mm.artifacts.bundle.pack", "create_bundle",
               lambda m, t: ["bundle", m, "--out", t / "out", "--volume-size", "1G"], "mm bundle create"),
    "bundle verify": ("mm.artifacts.bundle.check", "verify_volumes", lambda m, t: ["bundle", "verify", m],
                      "mm bundle verify"),
    "unbundle": ("mm.artifacts.bundle.unpack", "unbundle", lambda m, t: ["unbundle", m, "--dest", t / "d"],
                 "mm unbundle"),
    "launch --replicas": ("mm.artifacts.serving.router", "plan_node",
                          lambda m, t: ["launch", m, "--hardware", "b300", "--replicas", "2"], "mm launch"),
    "warmup": ("mm.artifacts.serving.router", "plan_node", lambda m, t: ["warmup", m, "--hardware", "b300"], "mm warmup"),
    "diagnose": ("mm.artifacts.serving.diagnose", "run_diagnosis", lambda m, t: ["diagnose", t / "x.log"], "mm diagnose"),
    "manifest export": ("mm.artifacts.integrity.manifest", "export_sums_files", lambda m, t: ["manifest", "export", m],
                        "mm manifest export"),
    "bundle repair-volume": ("mm.artifacts.bundle.repair", "repair_volumes",
                             lambda m, t: ["bundle", "repair-volume", m], "mm bundle repair-volume"),
    "pull": ("mm.artifacts.oci.pull", "pull", lambda m, t: ["pull", "127.0.0.1:1/a/b:v1", "--local-dir", t / "p"],
             "mm pull"),
    "sign": ("mm.artifacts.integrity.signing", "sign_manifest", lambda m, t: ["sign", m, "--key", t / "k"], "mm sign"),
}


@pytest.mark.parametrize("command", sorted(GUARDED))
def test_guard_an_unexpected_exception_is_one_line_exit_70(model, tmp_path, command):
    module, attr, argv, operation = GUARDED[command]
    (tmp_path / "x.log").write_text("nothing\n")
    r = run(*argv(model, tmp_path), env=fault_env(tmp_path, module, attr))
    fails_cleanly(r, 70, f"internal error in `{operation}`", "ZeroDivisionError: injected by the test",
                  "this is a bug in mm")


def test_guard_with_json_gives_one_document_exit_70(model, tmp_path):
    r = run("diagnose", tmp_path / "x.log", "--json",
            env=fault_env(tmp_path, "mm.artifacts.serving.diagnose", "run_diagnosis"))
    doc = json.loads(r.stdout)
    assert r.returncode == 70 and doc["exit_code"] == 70 and doc["kind"] == "ZeroDivisionError"
    assert "Traceback" not in r.stderr


def test_guard_mm_debug_shows_the_traceback(model, tmp_path):
    env = {**fault_env(tmp_path, "mm.artifacts.integrity.verify", "verify_dir"), "MM_DEBUG": "1"}
    r = run_mm("verify", model, extra_env=env)  # not recorded: this one is meant to show a traceback
    assert r.returncode == 70 and "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr
