"""load_json_stream: a manifest or a volume index read a record at a time, as hostile as load_json reads it.

The documents here are tiny; the chunk size is cut to a few characters so that every boundary (inside a string,
a number, a multi-byte character, between records) is crossed.
"""
from __future__ import annotations

import io
import json

import pytest

from mm.artifacts.edges import untrusted
from mm.artifacts.edges.untrusted import Malformed, load_json, load_json_stream
from mm.artifacts.integrity.manifest import FileEntry, from_json, to_json
from tests.test_manifest import manifest_with


@pytest.fixture(autouse=True)
def tiny_chunks(monkeypatch):
    monkeypatch.setattr(untrusted, "_CHUNK", 5)


def stream(data: bytes, item=lambda raw, i: raw, key: str = "files", max_items: int = 100):
    return load_json_stream(io.BytesIO(data), "doc.json", key=key, item=item, max_items=max_items,
                            max_bytes=10_000, what="manifest")


def test_a_document_streamed_is_the_document_json_reads():
    doc = {"schema": "x", "files": [{"path": "é/ü.json", "size": 12345678901234}, {"path": "b", "n": [1, 2.5]}],
           "tail": {"k": None}, "big": 98765}
    assert stream(json.dumps(doc, indent=2).encode()) == doc


def test_each_record_is_turned_into_its_typed_form_before_the_next_is_read():
    data = json.dumps({"files": [{"path": f"f{i}"} for i in range(50)]}).encode()
    f = io.BytesIO(data)
    read_when_first_record_kept = []

    def item(raw, i):
        if i == 0:
            read_when_first_record_kept.append(f.tell())
        return raw["path"]

    doc = load_json_stream(f, "doc.json", key="files", item=item, max_items=100, max_bytes=10_000)
    assert doc["files"] == [f"f{i}" for i in range(50)]
    assert read_when_first_record_kept[0] < len(data) // 4


def test_a_manifest_read_holds_slots_entries_not_dicts():
    manifest = manifest_with("a", "b/c")
    entries = from_json(to_json(manifest).encode(), "m.json").files
    assert entries == manifest.files
    assert all(type(e) is FileEntry and not hasattr(e, "__dict__") for e in entries)


@pytest.mark.parametrize("data, says", [
    (b'{"files": [{"a": 1}, {"a": 2}', "not valid JSON (line 1 column 30"),
    (b'{"files": [{"a": 1},, {"a": 2}]}', "not valid JSON"),
    (b'{"files": [], "files": []}', "key 'files' appears twice"),
    (b'{"files": [{"p": "ok"}, {"p": "\xff"}]}', "not UTF-8 text (byte 31)"),
    (b'{"files": [' + b"[" * 70 + b"]" * 70 + b"]}", "nested deeper than"),
    (b'{"files": [{"n": ' + b"9" * 30 + b"}]}", "more than 20 digits"),
    (b'{"files": [{"p": "\\ud800"}]}', "lone UTF-16 surrogate"),
    (b'{"files": [{"n": NaN}]}', "NaN is not a JSON number"),
    (b'{"files": [1, 2, 3, 4]}', "files lists more than 3 entries"),
    (b'{"files": []} {}', "Extra data"),
    (b"", "not valid JSON"),
])
def test_a_damaged_document_is_one_line_naming_it(data, says):
    with pytest.raises(Malformed, match="^doc.json: ") as e:
        stream(data, max_items=3)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_document_that_is_not_an_object_is_returned_as_json_reads_it():
    assert stream(b'[1, {"a": 2}]') == load_json(b'[1, {"a": 2}]', "x")


def test_a_list_under_another_key_or_not_a_list_is_left_to_the_caller():
    assert stream(b'{"files": 3, "other": [1]}', item=lambda raw, i: pytest.fail("no records")) == \
        {"files": 3, "other": [1]}


def test_a_document_larger_than_its_cap_is_refused_as_it_is_read():
    with pytest.raises(Malformed, match="larger than the 10000 bytes allowed"):
        stream(b'{"files": ["' + b"x" * 20_000 + b'"]}')
