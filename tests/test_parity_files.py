"""Parity over volume files, as `mm bundle --parity` computes it (parity.DirectEncoder: the chunks that lie whole inside
a volume are mapped and handed to ISA-L by address, the others read into a buffer and padded with zeros): the result
must be the bytes and digests of the in-memory path over the same bytes, exactly."""
from __future__ import annotations

import random

import blake3

from mm.artifacts.bundle.parity import FileSource, Layout, encode

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
