"""The per-file path of the local commands, made cheap for revisions of a million files, writes the same bytes as
the general one: a document's records, a tar member's length, a small file's digests, a report of many files."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import blake3
import pytest

from mm.artifacts.bundle.format import member_bytes, padded, render_json, tar_header
from mm.artifacts.edges.fsutil import json_line_chunks, json_record, json_text_chunks
from mm.artifacts.integrity.hashing import SMALL_READ, hash_file

HOSTILE = "d/\udcff\u00e9\"\\\n\t\x00\u2028 f.json"  # an undecodable byte, non-ASCII, quotes, controls


@pytest.mark.parametrize("record", [
    {"member": f"model/{HOSTILE}", "kind": "model", "path": HOSTILE, "offset": 0, "length": 10**15, "size": -1,
     "blake3": "0" * 64, "file_blake3": None, "file_sha256": None},
    {"flag": True}, {"ratio": 1.5}, {}, {"list": [1, 2]}, {"upstream": {"kind": "lfs-sha256", "value": "a"}},
], ids=["member", "bool", "float", "empty", "list", "nested"])
@pytest.mark.parametrize("indent,lead", [(1, "  "), (2, "    ")])
def test_a_record_is_written_as_json_dumps_writes_it(record, indent, lead):
    assert json_record(record, indent, lead) == json.dumps(record, indent=indent).replace("\n", "\n" + lead)


def test_an_index_listing_many_members_is_json_dumps_of_the_document():
    members = [{"member": f"model/{HOSTILE}{i}", "kind": "model", "path": f"{HOSTILE}{i}", "offset": i,
                "length": i * 7, "size": i * 7, "blake3": f"{i:064x}", "file_blake3": None, "file_sha256": "x"}
               for i in range(20000)]  # more than a megabyte: rendered in several chunks
    head = {"schema": "s", "members": None, "after": [1, {"a": None}]}
    assert render_json(head, members=iter(members)) == (json.dumps({**head, "members": members}, indent=1)
                                                        + "\n").encode()


@pytest.mark.parametrize("name", ["a" * 100, "a" * 101, "é", "model/d/f.json", "a" * 99 + "é"])
@pytest.mark.parametrize("size", [0, 1, 8**11 - 1, 8**11])
@pytest.mark.parametrize("mtime", [0, 8**11 - 1, 8**11])
def test_a_members_length_is_what_tarfile_writes(name, size, mtime):
    assert member_bytes(name, size, mtime) == len(tar_header(name, size, mtime)) + padded(size)


@pytest.mark.parametrize("size", [0, 1, 4096, SMALL_READ, SMALL_READ + 1])
def test_a_file_small_or_large_has_the_digests_of_its_bytes(tmp_path, size):
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    (tmp_path / "f").write_bytes(data)
    d = hash_file(tmp_path / "f", sha256=True, git_sha1=True)
    assert (d.size, d.blake3, d.sha256) == (size, blake3.blake3(data).hexdigest(), hashlib.sha256(data).hexdigest())
    assert d.git_sha1 == hashlib.sha1(b"blob %d\x00" % size + data).hexdigest()


def test_a_document_written_a_megabyte_at_a_time_is_json_dumps_of_it():
    doc = {"ok": True, "imported": [f"model/{HOSTILE}{i}" for i in range(60000)], "n": None}
    chunks = list(json_text_chunks(doc, 2))
    assert len(chunks) > 1 and "".join(chunks) == json.dumps(doc, indent=2) + "\n"


def test_a_one_line_document_written_a_slice_at_a_time_is_json_dumps_of_it():
    """unbundle's state (a stamp a file): its large object and list are rendered in slices, the same bytes."""
    from mm.artifacts.bundle.unpack import Stamp

    doc = {"bundle_id": HOSTILE, "proven": {f"model:{HOSTILE}{i}": Stamp.of(i, 2, 3, 4) for i in range(25001)},
           "done_volumes": list(range(30001)), "pieces": {}, "whole": [], "read_from": {"1": "/v"}}
    chunks = list(json_line_chunks(doc, Stamp.as_list))
    assert max(map(len, chunks)) < 1 << 20
    assert "".join(chunks) == json.dumps(doc, default=Stamp.as_list) + "\n"


def test_a_json_report_is_one_document_on_stdout():
    code = ("from mm.commands.shared import emit_json; "
            "emit_json({'imported': ['model/f%d' % i for i in range(60000)], 'path': __import__('pathlib').Path('/x')})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"imported": [f"model/f{i}" for i in range(60000)], "path": "/x"}


def test_small_files_are_named_durably_a_batch_at_a_time_not_with_two_flushes_each(tmp_path, monkeypatch):
    """unbundle's small files: their bytes reach the disk together (syncfs), then the names, then each directory
    once; every file still arrives whole, under its final name, and is recorded as proven."""
    import os

    from mm.artifacts.bundle.unpack import unbundle
    from tests.support.run import run_mm

    model = tmp_path / "model"
    for i in range(300):
        (model / f"d{i // 100}").mkdir(parents=True, exist_ok=True)
        (model / f"d{i // 100}" / f"f{i:03d}.json").write_text(f'{{"i": {i}}}\n')
    assert run_mm("manifest", model, "--repo", "a/b", "--revision", "c" * 40, "--offline").returncode == 0
    assert run_mm("bundle", model, "--out", tmp_path / "vols", "--volume-size", "1G", "--no-mm").returncode == 0
    flushes = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushes.append(fd), real_fsync(fd))[1])
    report = unbundle([tmp_path / "vols"], tmp_path / "dest")
    assert report.ok and len(report.imported) == 300
    assert all((tmp_path / "dest" / f"d{i // 100}" / f"f{i:03d}.json").read_text() == f'{{"i": {i}}}\n'
               for i in range(300))
    assert len(flushes) < 30, f"{len(flushes)} fsyncs for 300 files"
    assert not list((tmp_path / "dest" / ".mm").glob("**/*.part"))
