"""The erasure code and stripe layout on their own (artifacts/bundle/parity.py): real pyeclib, bytes compared exactly."""
from __future__ import annotations

import itertools
import random

import blake3
import pytest

from mm.artifacts.bundle.check import ranges, recoverability
from mm.artifacts.bundle.parity import Code, DirectDecoder, Layout, NotRecoverable, choose_inputs, encode, rebuild

K, M, S = 5, 2, 4096


class BytesSource:
    def __init__(self, data: bytes):
        self.data = data

    def pread(self, offset: int, n: int) -> bytes:
        return self.data[offset:offset + n]


def volumes(seed: int = 1) -> list[bytes]:
    """Five data volumes of different lengths, none a multiple of the stripe, one empty-ish, one long."""
    rng = random.Random(seed)
    lengths = [3 * S + 100, 5 * S + 17, 1, 4 * S, 5 * S + 4095]
    return [rng.randbytes(n) for n in lengths]


def encoded(data: list[bytes]) -> tuple[Layout, list[bytes], object]:
    layout = Layout(K, M, S, tuple(len(d) for d in data))
    outs = [bytearray() for _ in range(M)]
    result = encode(layout, [BytesSource(d) for d in data], [o.extend for o in outs])
    return layout, [bytes(o) for o in outs], result


def test_parity_streams_are_nstripes_long_and_hashes_are_of_the_real_bytes():
    data = volumes()
    layout, parity, result = encoded(data)
    assert layout.nstripes == 6 and layout.tail == 4096 and all(len(p) == 6 * S for p in parity)
    assert result.data_digest == [blake3.blake3(d).hexdigest() for d in data]
    assert result.parity_blake3 == [blake3.blake3(p).hexdigest() for p in parity]


def test_virtual_padding_matches_explicit_zero_padding():
    data = volumes()
    _, parity, _ = encoded(data)
    padded = [d + bytes(6 * S - len(d)) for d in data]
    _, parity_padded, _ = encoded(padded)
    assert parity == parity_padded


def test_the_last_stripe_is_only_as_long_as_the_longest_volume_needs():
    data = [d[:2 * S + 100] for d in volumes()]
    layout, parity, _ = encoded(data)
    assert layout.nstripes == 3 and layout.tail == 128 and layout.parity_length == 2 * S + 128
    assert all(len(p) == 2 * S + 128 for p in parity)
    inputs = {i: BytesSource(s) for i, s in enumerate(data + parity) if i not in (0, 6)}
    out = bytearray()
    rebuild(layout, inputs, [0], {0: out.extend})
    assert bytes(out) == data[0]


@pytest.mark.parametrize("lost", [c for n in (1, 2) for c in itertools.combinations(range(K + M), n)])
def test_every_single_and_pair_of_lost_streams_is_rebuilt_byte_identical(lost):
    data = volumes()
    layout, parity, _ = encoded(data)
    streams = data + parity
    inputs = {i: BytesSource(s) for i, s in enumerate(streams) if i not in lost}
    outs = {i: bytearray() for i in lost}
    result = rebuild(layout, inputs, list(lost), {i: o.extend for i, o in outs.items()})
    for i in lost:
        assert bytes(outs[i]) == streams[i]
        assert result.output_digest[i] == blake3.blake3(streams[i]).hexdigest()


def test_lost_data_streams_are_rebuilt_by_isal_directly_as_pyeclib_rebuilds_them(monkeypatch):
    data = volumes()
    layout, parity, _ = encoded(data)
    streams = data + parity
    lost = [1, 3]
    use = choose_inputs(layout, set(range(K + M)) - set(lost), set(lost))
    assert DirectDecoder.for_rebuild(layout, use, lost) is not None  # the fast path is taken here
    got = {}
    for path in ("direct", "pyeclib"):
        if path == "pyeclib":
            monkeypatch.setattr(DirectDecoder, "for_rebuild", classmethod(lambda cls, *args: None))
        outs = {i: bytearray() for i in lost}
        rebuild(layout, {i: BytesSource(s) for i, s in enumerate(streams) if i not in lost}, lost,
                {i: o.extend for i, o in outs.items()})
        got[path] = {i: bytes(o) for i, o in outs.items()}
    assert got["direct"] == got["pyeclib"] == {i: streams[i] for i in lost}


@pytest.mark.parametrize("stripes", [1, 2, 4, 64])
def test_a_rebuild_decodes_several_stripes_at_once_as_it_decodes_one(monkeypatch, stripes):
    """Spans of 1, 2 or 4 stripes (the last span shorter: 6 stripes, the last one short) and one span for all."""
    monkeypatch.setattr(DirectDecoder, "SPAN_BYTES", stripes * S)
    data = volumes()
    layout, parity, _ = encoded(data)
    streams = data + parity
    lost = [0, 4]
    use = choose_inputs(layout, set(range(K + M)) - set(lost), set(lost))
    assert DirectDecoder.for_rebuild(layout, use, lost).batch == min(stripes, DirectDecoder.BUFFER_BYTES // K // S)
    outs = {i: bytearray() for i in lost}
    result = rebuild(layout, {i: BytesSource(s) for i, s in enumerate(streams) if i not in lost}, lost,
                     {i: o.extend for i, o in outs.items()})
    assert {i: bytes(o) for i, o in outs.items()} == {i: streams[i] for i in lost}
    assert result.output_digest == {i: blake3.blake3(streams[i]).hexdigest() for i in lost}


def test_a_damaged_input_shows_in_its_digest_and_the_output():
    data = volumes()
    layout, parity, enc = encoded(data)
    bad = bytearray(data[1])
    bad[S + 5] ^= 1
    inputs = {0: BytesSource(data[0]), 1: BytesSource(bytes(bad)), 3: BytesSource(data[3]), 4: BytesSource(data[4]),
              5: BytesSource(parity[0])}
    out = bytearray()
    result = rebuild(layout, inputs, [2], {2: out.extend}, hash_inputs=True)
    assert result.input_digest[1] != enc.data_digest[1] and result.input_digest[0] == enc.data_digest[0]


def test_more_lost_than_parity_is_not_recoverable_and_says_what_is_needed():
    layout = Layout(K, M, S, (S,) * K)
    with pytest.raises(NotRecoverable) as e:
        choose_inputs(layout, {0, 1, 5, 6}, {2})
    assert "3 of 7 volumes lost" in e.value.message and "bring back any 1" in e.value.message
    assert "volume 3" in e.value.message and "volume 4" in e.value.message and "volume 5" in e.value.message


def test_inputs_prefer_data_volumes():
    layout = Layout(K, M, S, (S,) * K)
    assert choose_inputs(layout, set(range(7)) - {3}, {3}) == [0, 1, 2, 4, 5]


def test_code_rejects_silly_shapes():
    with pytest.raises(Exception, match="at most 32"):
        Code(30, 3, S)
    with pytest.raises(Exception, match="multiple of 64"):
        Code(5, 2, 1000)


def test_recoverability_sentences():
    assert recoverability(10, 2, [3, 7], [], []) == (True, "volumes 3 and 7 missing: recoverable with parity 1-2")
    assert recoverability(10, 2, [3], [], [1]) == (True, "volume 3 missing: recoverable with parity 2")
    ok, text = recoverability(5, 2, [1, 2], [4], [])
    assert not ok and "volumes 1 and 2 missing, volume 4 damaged: NOT recoverable" in text
    assert "bring back any 1 of: volume 1, volume 2, volume 4" in text
    assert ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
