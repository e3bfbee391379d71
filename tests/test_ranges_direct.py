"""artifacts/fetching/ranges.py's disk side: received bytes go to disk direct (O_DIRECT) where the file system allows it,
their unaligned edges buffered, and are read back direct for hashing; wire.Alarms, the one thread behind every
request's header deadline."""
from __future__ import annotations

import os
import threading
import time

import pytest

from mm.artifacts.fetching.ranges import ALIGN, Connections, Disk, MiB, download
from mm.artifacts.edges.wire import Alarms
from tests.test_ranges import MemorySource, check_digests, job, payload


def open_disk(path, size: int = 0) -> Disk:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if size:
        os.ftruncate(fd, size)
    return Disk(fd)


def aligned_buffer(data: bytes, place: int) -> memoryview:
    """DATA in a page-aligned buffer, starting PLACE bytes in (so it lines up with a file offset of that remainder)."""
    import mmap
    view = memoryview(mmap.mmap(-1, -(-(place + len(data)) // ALIGN) * ALIGN))
    view[place:place + len(data)] = data
    return view[place:place + len(data)]


@pytest.fixture
def direct_disk(tmp_path):
    disk = open_disk(tmp_path / "p.part", 4 * MiB)
    if disk.direct is None:
        disk.close()
        pytest.skip("this file system refuses O_DIRECT")
    yield disk
    disk.close()


def test_a_write_at_unaligned_offsets_lands_whole_with_its_middle_direct(direct_disk, tmp_path):
    data = payload(3 * ALIGN + 1234, seed=3)
    offset = 5 * ALIGN + 777  # head and tail both partial blocks
    direct_disk.write([aligned_buffer(data, offset % ALIGN)], offset, len(data))
    assert direct_disk.direct is not None  # the aligned middle went direct: no fallback was needed
    assert (tmp_path / "p.part").read_bytes()[offset:offset + len(data)] == data


def test_a_piece_not_aligned_in_memory_falls_back_to_buffered_writes_for_the_file(direct_disk, tmp_path):
    data = payload(4 * ALIGN, seed=4)
    odd = memoryview(bytearray(len(data) + 1))[1:]  # an address O_DIRECT refuses
    odd[:] = data
    direct_disk.write([odd], 0, len(data))
    assert direct_disk.direct is None
    assert (tmp_path / "p.part").read_bytes()[:len(data)] == data


def test_a_read_back_at_any_offset_sees_bytes_written_direct_and_buffered(direct_disk):
    data = payload(2 * MiB, seed=5)
    direct_disk.write([aligned_buffer(data, 100)], 100, len(data))
    buf = aligned_buffer(bytes(2 * MiB + 2 * ALIGN), 0)
    for start, end in [(100, 100 + len(data)), (ALIGN, 3 * ALIGN), (100, 101), (MiB + 5, 2 * MiB + 99)]:
        at = start - start % ALIGN
        view = buf[:-((at - end) // ALIGN) * ALIGN]
        direct_disk.read(view, at, end - at)
        assert bytes(view[start - at:end - at]) == data[start - 100:end - 100]


def test_a_read_back_past_the_end_of_the_file_is_an_error(tmp_path):
    disk = open_disk(tmp_path / "short.part")
    os.pwrite(disk.fd, b"x" * 100, 0)
    buf = aligned_buffer(bytes(ALIGN), 0)
    with pytest.raises(OSError):
        disk.read(buf, 0, 200)
    disk.close()


def test_bytes_cut_at_unaligned_offsets_on_many_connections_land_and_hash_right(tmp_path):
    data = payload(9 * MiB + 4099, seed=6)  # not a whole number of blocks
    src = MemorySource(data, chunk=4099, answer=lambda start, end, n, bs, be: (bs, be, 123_457 if n % 3 == 0 else None))
    result = download(job(tmp_path, data), src, Connections(6))
    check_digests(result, data)
    assert (tmp_path / "w.part").read_bytes() == data


def test_alarms_fire_in_deadline_order_and_a_cancelled_one_never_fires():
    alarms, fired, done = Alarms(), [], threading.Event()
    alarms.after(0.3, lambda: (fired.append("late"), done.set()))
    cancel = alarms.after(0.1, lambda: fired.append("cancelled"))
    alarms.after(0.05, lambda: fired.append("early"))  # earlier than all: wakes the thread's longer sleep
    cancel()
    began = time.monotonic()
    assert done.wait(5)
    assert fired == ["early", "late"] and time.monotonic() - began < 2


def serve_once(body_head: bytes, length: int, then_close: threading.Event):
    """A plain HTTP server on 127.0.0.1 that answers one request with LENGTH announced, sends BODY_HEAD, then says
    nothing until THEN_CLOSE is set; returns its URL."""
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % length + body_head)
        then_close.wait(10)
        conn.close()
        srv.close()
    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}/f"


def test_a_body_that_goes_silent_ends_the_read_after_mm_net_timeout(monkeypatch):
    from mm.artifacts.edges import wire
    monkeypatch.setenv("MM_NET_TIMEOUT", "0.5")
    done = threading.Event()
    raw = wire.open_raw(serve_once(b"x" * 1000, 5000, done), {}, "test server")
    try:
        view = memoryview(bytearray(8192))
        assert raw.readinto(view) == 1000
        began = time.monotonic()
        with pytest.raises(OSError):  # (the kernel's SO_RCVTIMEO on a plain socket; Python's poll on TLS)
            raw.readinto(view)
        assert 0.4 < time.monotonic() - began < 3
    finally:
        raw.close()
        done.set()
