"""Every file is accounted for: what a manifest, a delta's index and parity promise is what mm delivers.

Families (each parametrized):
  manifest        an emptied manifest (`"files": []`) beside a model's files is damage for verify (full and
                  quick) and for every command behind the quick-verify gate; a model's manifest lists a file
  delta index     a signed delta whose index is edited (the signature covers the manifest, and every claim of
                  the index is held to it): a dropped take, a duplicated take, a take of a path the manifest
                  lacks, a take of a path the base lacks, a take also carried, a take with other hashes, a carried
                  file dropped (its member and its entry); `mm bundle verify` and `mm unbundle --allowed-signers` both refuse
                  (never exit 0, never "waiting" for a file no volume can bring)
  parity          every data volume lost, only parity volumes given (full and delta bundles, parity 1 and 2, one
                  and two data volumes): `mm bundle verify` says recoverable, and `mm unbundle` does it
Each case: the exit code, one line naming what is wrong, no traceback.
"""
from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from mm.artifacts.fetching.adopt import manifest_for_local_dir
from mm.artifacts.bundle.pack import BundleOptions, create_bundle
from mm.artifacts.paths import manifest_path
from tests.support.modelgen import write_model
from tests.test_hostile import COMMIT, REPO, fails_cleanly, no_run_prints_a_traceback, run, set_index  # noqa: F401

COMMIT_B = "b" * 40
CHANGED = "generation_config.json"


def payload(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".mm" not in p.relative_to(root).parts}


@pytest.fixture(scope="module")
def revisions(tmp_path_factory) -> tuple[Path, Path]:
    """A, and B = A with one small file changed and a shard's bytes changed (a delta of B carries two files)."""
    work = tmp_path_factory.mktemp("revs")
    a, b = work / "A", work / "B"
    write_model(a, shards=2, shard_bytes=200 * 1024, seed=5)
    manifest_for_local_dir(a, REPO, COMMIT, offline=True)
    shutil.copytree(a, b, ignore=shutil.ignore_patterns(".mm"))
    (b / CHANGED).write_text('{"temperature": 0.3}\n')
    manifest_for_local_dir(b, REPO, COMMIT_B, offline=True)
    return a, b


@pytest.fixture
def model(revisions, tmp_path) -> Path:
    root = tmp_path / "model"
    shutil.copytree(revisions[0], root)
    return root


# --- manifest: an emptied manifest is damage ---------------------------------------------------------------------

def _empty_manifest(model: Path) -> None:
    doc = json.loads(manifest_path(model).read_text())
    doc["files"] = []
    manifest_path(model).write_text(json.dumps(doc))


EMPTIED = {  # the command, and what it says on an emptied manifest: exit code
    "verify": (lambda m, t: ("verify", m), 1),
    "verify --quick": (lambda m, t: ("verify", m, "--quick"), 1),
    "bundle": (lambda m, t: ("bundle", m, "--out", t / "vols", "--volume-size", "1G"), 1),
    "launch": (lambda m, t: ("launch", m, "--hardware", "b300", "--out", t / "start.sh"), 1),
}


@pytest.mark.parametrize("command", sorted(EMPTIED))
def test_manifest_emptied_beside_the_model_is_damage(model, tmp_path, command):
    _empty_manifest(model)
    argv, code = EMPTIED[command]
    r = run(*argv(model, tmp_path))
    assert r.returncode == code and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert "lists no file" in r.stdout + r.stderr
    assert not (tmp_path / "vols").exists() and not (tmp_path / "start.sh").exists()


def test_manifest_emptied_in_json_verify_names_the_manifest_as_the_problem(model):
    _empty_manifest(model)
    doc = json.loads(run("verify", model, "--json").stdout)
    assert doc["ok"] is False
    assert {"path": ".mm/manifest.json", "kind": "manifest"}.items() <= doc["problems"][0].items(), doc["problems"]


def test_manifest_of_one_file_with_nothing_else_verifies(tmp_path):
    """The rule is 'at least one file': the smallest legitimate model still verifies."""
    d = tmp_path / "one"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "test"}\n')
    manifest_for_local_dir(d, REPO, COMMIT, offline=True)
    r = run("verify", d)
    assert r.returncode == 0, r.stdout + r.stderr


# --- delta index: every file of the signed manifest carried or taken -------------------------------------------------

@pytest.fixture(scope="module")
def signed_delta(revisions, keys, tmp_path_factory) -> Path:
    a, b = revisions
    signed = tmp_path_factory.mktemp("signed") / "B"
    shutil.copytree(b, signed)
    r = run("sign", signed, "--key", keys["alice"])
    assert r.returncode == 0, r.stderr
    out = tmp_path_factory.mktemp("delta")
    create_bundle(signed, BundleOptions((out,), 10 ** 9, base=a))
    return out


def _first_carried(i: dict) -> dict:
    return next(e for e in i["members"] if e["kind"] == "model")


def _drop_carried(vol: Path) -> None:
    """VOL without its first carried model file: the member gone from the tar, its entry from the index."""
    with tarfile.open(vol, "r:") as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    index = json.loads(members[0][1])
    gone = _first_carried(index)
    index["members"] = [e for e in index["members"] if e is not gone]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as out:
        for m, data in members:
            if m.name == gone["member"]:
                continue
            data = json.dumps(index).encode() if m is members[0][0] else data
            info = tarfile.TarInfo(m.name)
            info.size, info.mtime, info.mode = len(data), m.mtime, m.mode
            out.addfile(info, io.BytesIO(data))
    vol.write_bytes(buf.getvalue())


DELTA_EDITS = {  # edit of every volume's index; (bundle verify's exit, a needle), (unbundle's exit, a needle)
    "dropped take": (lambda i: {**i, "delta": {**i["delta"], "take": i["delta"]["take"][1:]}},
                     (1, "neither carried by a volume nor taken"), (3, "neither carried by a volume nor taken")),
    "duplicated take": (lambda i: {**i, "delta": {**i["delta"], "take": i["delta"]["take"] + i["delta"]["take"][:1]}},
                        (1, "takes one path twice"), (3, "takes one path twice")),
    "take of a path the manifest lacks": (
        lambda i: {**i, "delta": {**i["delta"], "take": [{**i["delta"]["take"][0], "path": "zzz.json"}]
                                  + i["delta"]["take"][1:]}},
        (1, "the manifest has no such file"), (3, "the manifest has no such file")),
    "take of a path the base lacks": (
        lambda i: {**i, "delta": {**i["delta"], "take": [{**i["delta"]["take"][0], "base_path": "not-in-base.bin"}]
                                  + i["delta"]["take"][1:]}},
        None, (3, "which the base")),
    "take also carried": (
        lambda i: {**i, "delta": {**i["delta"], "take": i["delta"]["take"] + [
            {"path": _first_carried(i)["path"], "base_path": i["delta"]["take"][0]["base_path"],
             "size": _first_carried(i)["size"], "sha256": _first_carried(i)["file_sha256"],
             "blake3": _first_carried(i)["file_blake3"]}]}},
        (1, "the volume carries it too"), (5, "the volume carries it too")),
    "take with other hashes": (
        lambda i: {**i, "delta": {**i["delta"], "take": [{**i["delta"]["take"][0], "blake3": "0" * 64}]
                                  + i["delta"]["take"][1:]}},
        (1, "the hashes differ"), (3, "the hashes differ")),
    "dropped carried file (member and entry)": (None, (1, "neither carried by a volume nor taken"),
                                                (3, "neither carried by a volume nor taken")),
}


@pytest.mark.parametrize("edit", sorted(DELTA_EDITS))
def test_delta_index_that_does_not_account_for_the_signed_manifest_is_refused(signed_delta, revisions, keys, tmp_path,
                                                                              edit):
    change, verify_says, unbundle_says = DELTA_EDITS[edit]
    vols = tmp_path / "vols"
    shutil.copytree(signed_delta, vols)
    for vol in sorted(vols.glob("*.tar")):
        set_index(vol, change) if change else _drop_carried(vol)
    if verify_says is not None:
        r = run("bundle", "verify", vols)
        code, needle = verify_says
        assert r.returncode == code and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
        assert needle in r.stdout + r.stderr and not r.stdout.startswith("OK"), r.stdout
    dest = tmp_path / "new"
    r = run("unbundle", vols, "--dest", dest, "--from", revisions[0], "--allowed-signers", keys["allowed"])
    code, needle = unbundle_says
    assert r.returncode == code and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert needle in r.stderr, r.stderr
    assert "waiting. Run again" not in r.stdout


def test_delta_index_untouched_imports_under_its_signature(signed_delta, revisions, keys, tmp_path):
    """The control of the family above: the same bundle, unedited, imports and verifies."""
    dest = tmp_path / "new"
    r = run("unbundle", signed_delta, "--dest", dest, "--from", revisions[0], "--allowed-signers", keys["allowed"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert payload(dest) == payload(revisions[1])


# --- parity: every data volume lost ----------------------------------------------------------------------------------

PARITY_CASES = {  # (delta?, parity volumes, volume size: one data volume, or two)
    "full, parity 1, one data volume": (False, 1, "1G"),
    "full, parity 2, one data volume": (False, 2, "1G"),
    "full, parity 2, two data volumes": (False, 2, "400K"),
    "delta, parity 1, one data volume": (True, 1, "1G"),
    "delta, parity 2, one data volume": (True, 2, "1G"),
}


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_parity_rebuilds_when_every_data_volume_is_lost(revisions, tmp_path, case):
    delta, parities, size = PARITY_CASES[case]
    a, b = revisions
    vols = tmp_path / "vols"
    create_bundle(b, BundleOptions((vols,), size, parity=parities, base=a if delta else None))
    data = sorted(vols.glob("*.vol*.tar"))
    assert len(data) == (2 if "two data" in case else 1) <= parities
    for vol in data:
        vol.unlink()
    r = run("bundle", "verify", vols)
    assert "recoverable with parity" in r.stdout and "NOT recoverable" not in r.stdout, r.stdout + r.stderr
    dest = tmp_path / "new"
    r = run("unbundle", vols, "--dest", dest, *(("--from", a) if delta else ()), "--json")
    doc = json.loads(r.stdout)
    assert (r.returncode, doc["complete"], doc["verify"]["ok"]) == (0, True, True), r.stdout + r.stderr
    assert doc["rebuilt"] == list(range(1, len(data) + 1))
    assert payload(dest) == payload(b)
    assert not (dest / ".mm" / "unbundle").exists()  # the rebuilt volumes went with the import's state


def test_parity_too_little_for_every_data_volume_lost_says_what_would_be_enough(revisions, tmp_path):
    """Two data volumes lost, one parity volume: no import, and the reason is named (never an empty one)."""
    vols = tmp_path / "vols"
    create_bundle(revisions[1], BundleOptions((vols,), 400_000, parity=1))
    for vol in vols.glob("*.vol*.tar"):
        vol.unlink()
    r = run("unbundle", vols, "--dest", tmp_path / "new")
    fails_cleanly(r, 3, "no usable volume", "cannot rebuild from parity")
    assert not r.stderr.rstrip().endswith(":")
