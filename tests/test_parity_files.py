"""Parity over volume files, as `mm bundle --parity` computes it (parity.DirectEncoder: the chunks that lie whole inside
a volume are mapped and handed to ISA-L by address, the others read into a buffer and padded with zeros): the result
must be the bytes and digests of the in-memory path over the same bytes, exactly. The same holds where a volume's
member bytes are read from the files they were copied from (parity.SplicedSource, as a bundle's own parity pass
does, so that it can drop its volumes' pages once written), and only while those files are unchanged."""
from __future__ import annotations

import os
import random
from pathlib import Path

import blake3
import pytest

from mm.artifacts.bundle import pack
from mm.artifacts.bundle.pack import BundleOptions, create_bundle, write_parity_volumes
from mm.artifacts.errors import IntegrityError
from mm.artifacts.bundle.parity import FileSource, Layout, Span, SplicedSource, encode, file_identity
from mm.artifacts.bundle.volume import open_volume
from tests.test_bundle_parity import VOLUME_SIZE, data_volumes, make_model, parity_volumes

K, M, S = 5, 2, 4096
# volumes ending inside a stripe, on a stripe's edge, one byte short of it, and the longest setting the last stripe
LENGTHS = [9 * S + 100, 12 * S + 17, 10 * S, 11 * S + 4095, 9 * S]


class BytesSource:
    def __init__(self, data: bytes):
        self.data = data

    def pread(self, offset: int, n: int) -> bytes:
        return self.data[offset:offset + n]


def _encode(layout, sources):
    outs = [bytearray() for _ in range(M)]
    result = encode(layout, sources, [o.extend for o in outs])
    return [bytes(o) for o in outs], result


def test_volume_files_encode_to_the_bytes_and_digests_of_the_in_memory_path(tmp_path):
    rng = random.Random(7)
    data = [rng.randbytes(n) for n in LENGTHS]
    paths = []
    for i, d in enumerate(data):
        paths.append(tmp_path / f"vol{i}")
        paths[-1].write_bytes(d)
    layout = Layout(K, M, S, tuple(LENGTHS))
    sources = [FileSource(p) for p in paths]
    try:
        parity, result = _encode(layout, sources)
    finally:
        for s in sources:
            s.close()
    want_parity, want = _encode(layout, [BytesSource(d) for d in data])
    assert parity == want_parity and len(parity[0]) == layout.parity_length
    assert result.data_blake3 == want.data_blake3 == [blake3.blake3(d).hexdigest() for d in data]
    assert result.parity_blake3 == want.parity_blake3


def _spliced_volume(tmp_path: Path, i: int, data: bytes, rng: random.Random) -> SplicedSource:
    """A volume file whose member bytes are zeros on the disk, their real bytes in files of their own (after a
    prefix: a piece of a split file): it encodes right only if the spans are read from those files."""
    # a member over many stripes, one inside a stripe, one across a stripe's edge, one running to the volume's end
    regions = [(S // 2, 5 * S), (6 * S + 10, 100), (7 * S - 50, 2 * S), (len(data) - S - 7, S + 7)]
    on_disk = bytearray(data)
    spans = []
    for r, (at, length) in enumerate(regions):
        src = tmp_path / f"src{i}-{r}"
        prefix = rng.randbytes(rng.randrange(1, 3 * S))
        src.write_bytes(prefix + data[at: at + length])
        spans.append(Span(at, src, len(prefix), length, file_identity(src)))
        on_disk[at: at + length] = bytes(length)
    (tmp_path / f"vol{i}").write_bytes(on_disk)
    return SplicedSource(tmp_path / f"vol{i}", spans)


def test_volumes_read_from_the_files_their_members_came_from_encode_like_the_volumes(tmp_path):
    rng = random.Random(11)
    data = [rng.randbytes(n) for n in LENGTHS]
    layout = Layout(K, M, S, tuple(LENGTHS))
    sources = [_spliced_volume(tmp_path, i, d, rng) for i, d in enumerate(data)]
    try:
        assert all(s.unchanged() for s in sources)
        assert [s.pread(0, len(d)) for s, d in zip(sources, data)] == data
        parity, result = _encode(layout, sources)
    finally:
        for s in sources:
            s.close()
    want_parity, want = _encode(layout, [BytesSource(d) for d in data])
    assert parity == want_parity
    assert result.data_blake3 == want.data_blake3 and result.parity_blake3 == want.parity_blake3


def test_a_file_written_after_its_bytes_were_copied_is_seen_as_changed(tmp_path):
    rng = random.Random(5)
    source = _spliced_volume(tmp_path, 0, rng.randbytes(LENGTHS[0]), rng)
    try:
        path = tmp_path / "src0-1"
        os.utime(path, ns=(0, 0))  # the same bytes, another mtime: taken as another file
        assert not source.unchanged()
    finally:
        source.close()


def _member_spans(vol: Path, model: Path) -> list[Span]:
    """Where each model file's bytes lie in data volume VOL (from its index), as the bundle that wrote it saw them."""
    opened = open_volume(vol)
    return [Span(opened.data[e.member].offset_data, model / e.path, e.offset, e.length, file_identity(model / e.path))
            for e in opened.entries() if (model / e.path).is_file()]


def _parity_again(model: Path, vols: Path, out: Path, spans) -> list[bytes]:
    first = open_volume(parity_volumes(vols)[0])
    out.mkdir()
    data = data_volumes(vols)
    written = write_parity_volumes(out, name=first.parity.name, bundle_id=first.bundle_id,
                                   manifest_bytes=(model / ".mm" / "manifest.json").read_bytes(), meta=[], mtime=0,
                                   data_paths=data, parities=2, stripe=4096, spans=spans)
    return [[st.blake3 for st in open_volume(path).parity.streams] for _, path in written]


def test_a_bundle_parity_pass_reads_unchanged_model_files_or_else_the_volumes(tmp_path):
    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    create_bundle(model, BundleOptions((vols,), VOLUME_SIZE, parity=2, stripe=4096, sync=False))
    recorded = [st.blake3 for st in open_volume(parity_volumes(vols)[0]).parity.streams]
    spans = [_member_spans(v, model) for v in data_volumes(vols)]
    assert sum(len(s) for s in spans) >= 3
    assert _parity_again(model, vols, tmp_path / "spliced", spans) == [recorded] * 2
    for span in spans[0]:  # the model changes after the bundle: its bytes are no longer the volume's
        span.path.write_bytes(bytes(span.path.stat().st_size))
    assert _parity_again(model, vols, tmp_path / "volumes", spans) == [recorded] * 2


def test_a_model_file_written_during_the_parity_pass_fails_it(tmp_path, monkeypatch):
    model = make_model(tmp_path / "model")
    vols = tmp_path / "vols"
    create_bundle(model, BundleOptions((vols,), VOLUME_SIZE, parity=2, stripe=4096, sync=False))
    spans = [_member_spans(v, model) for v in data_volumes(vols)]
    encode_then_write = pack.encode

    def written_meanwhile(*args, **kwargs):
        result = encode_then_write(*args, **kwargs)
        os.utime(spans[0][0].path, ns=(0, 0))  # as a writer leaves it: another mtime
        return result

    monkeypatch.setattr(pack, "encode", written_meanwhile)
    with pytest.raises(IntegrityError, match="was changed while parity was computed"):
        _parity_again(model, vols, tmp_path / "again", spans)
    assert not list((tmp_path / "again").iterdir())  # nothing published, no partial left
