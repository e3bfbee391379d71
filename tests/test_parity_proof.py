"""A data volume's proof (bundle/proof.py): the one the writer takes from what it writes equals the one a reader takes
from the bytes as they stream by, whatever the names (pax headers) and sizes; real tar headers from format.py."""
from __future__ import annotations

import io
import os
import random
import tarfile

import blake3

from mm.artifacts.bundle.format import END_OF_ARCHIVE, tar_header
from mm.artifacts.bundle.proof import TarProof, VolumeProof

MEMBERS = [  # (name, size): two metadata members, then data members of every awkward shape
    ("MMBUNDLE/index-vol001.json", 700), ("MMBUNDLE/manifest.json", 1024),
    ("model/" + "é" * 80 + "/weights.safetensors", 3000),  # non-ASCII and over 100 bytes: a pax path record
    ("model/empty.txt", 0), ("model/exact.bin", 4096), ("model/" + "d/" * 120 + "x.bin", 77),
]


def volume() -> tuple[bytes, str]:
    """A volume's bytes and the proof the writer takes of them (as pack._write_volume does)."""
    out, proof = bytearray(), VolumeProof()
    for n, (name, size) in enumerate(MEMBERS):
        part = proof.head if n < 2 else proof.body
        header, data = tar_header(name, size, 1_700_000_000), os.urandom(size)
        out += header + data + bytes(-size % 512)
        part.raw(header)
        part.member(size, blake3.blake3(data).hexdigest())
        part.raw(bytes(-size % 512))
    out += bytes(END_OF_ARCHIVE)
    proof.body.raw(bytes(END_OF_ARCHIVE))
    return bytes(out), proof.hexdigest()


def streamed(data: bytes, head: int = 2, seed: int = 0) -> str:
    rng, proof, i = random.Random(seed), TarProof(head), 0
    while i < len(data):
        n = rng.choice([1, 100, 511, 512, 513, 4096, 1 << 20])
        proof.update(data[i: i + n])
        i += n
    return proof.hexdigest()


def test_the_stream_proof_is_the_writers_in_any_chunking():
    data, want = volume()
    assert [(m.name, m.size) for m in tarfile.open(fileobj=io.BytesIO(data))] == MEMBERS
    assert all(streamed(data, seed=s) == want for s in range(5))


def test_another_head_count_or_any_changed_byte_gives_another_proof():
    data, want = volume()
    assert streamed(data, head=1) != want and streamed(data, head=3) != want
    for at in random.Random(1).sample(range(len(data)), 30):
        changed = bytearray(data)
        changed[at] ^= 0x80
        assert streamed(bytes(changed)) != want


def test_a_pax_size_record_sets_the_next_members_size():
    header = tar_header("model/huge.bin", 10**10, 0)  # past the ustar size field: tarfile writes a pax size record
    assert b" size=10000000000\n" in header
    proof = TarProof(0)
    proof.update(header + bytes(100))
    assert proof._state == "member" and proof._left == 10**10 - 100
