"""Reed-Solomon parity over byte streams (the bundle's data volume files): the code, the stripe layout, encoding,
and rebuilding lost streams. Nothing here knows about tar or the index (pack, unpack and check do).

The code: pyeclib's `isa_l_rs_cauchy` (ISA-L's Cauchy Reed-Solomon; the pyeclib wheel bundles liberasurecode
and ISA-L), systematic, any M of the K+M volumes can be lost. Chosen over zfec because it is faster at both
ends on these machines (k=10, m=2, 1 MiB stripes, one thread: encode ~4 GB/s, rebuild of one volume several
GB/s once glibc stops returning every 1 MiB buffer to the kernel; zfec ~0.9 GB/s encode, ~1.3 GB/s decode of
one) and because the wheel needs nothing else installed. The parity bytes depend on the code, so the parity
index records it and a volume made with another code is refused, not misread.

Layout: K data volumes are byte strings of different lengths L1..LK (whole volume files, tar headers and all,
so a lost volume is rebuilt byte-identical). Stripe j is bytes [j*S, (j+1)*S) of every data volume, zeros
past a volume's end (virtual padding: nothing is written). Each of the M parity streams holds one S-byte
chunk per stripe: NSTRIPES*S bytes, NSTRIPES = ceil(max(Li) / S).

pyeclib works on fragments with an 80-byte header that depends only on (fragment index, sizes, code): the
headers are taken once from an encoding of zeros and put in front of chunks read from the volumes. pyeclib
aborts the process on a malformed fragment, so it is only ever given fragments built here.
"""
from __future__ import annotations

import bisect
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import blake3

from ..errors import BadInput, ProblemsFound
from .copyio import drop_cached

CODEC = "isa_l_rs_cauchy"
FRAGMENT_HEADER = 80
STRIPE = 1024 * 1024
MAX_STRIPE = 4 * 1024 * 1024  # a stripe of each of up to MAX_TOTAL streams is held at once: memory stays bounded
MAX_TOTAL = 32  # k + m: ISA-L's Cauchy matrix and pyeclib allow more, but a bundle needs no more
_malloc_tuned = False


class NotRecoverable(ProblemsFound):
    """More volumes lost than the parity present can rebuild (exit 1); the message names what would be enough."""


def _tune_malloc() -> None:
    """Keep glibc from mmap/munmap-ing every 1 MiB fragment pyeclib allocates: the page faults of fresh
    mappings cost 5-10x the coding itself (measured: encode 0.5 GB/s -> 4 GB/s)."""
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    import ctypes  # here: only a parity run pays for it
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 4194304)   # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 * 1024 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: slower, still correct
        pass


class Code:
    """Systematic RS(k, m) over S-byte chunks: encode k data chunks to m parity chunks, rebuild any m."""

    def __init__(self, k: int, m: int, stripe: int = STRIPE):
        if k < 1 or m < 1 or k + m > MAX_TOTAL:
            raise BadInput(f"parity: {k} data and {m} parity volumes; at most {MAX_TOTAL} volumes in all")
        if stripe <= 0 or stripe % 64:
            raise BadInput(f"parity: stripe size {stripe} is not a positive multiple of 64")
        try:
            from pyeclib.ec_iface import ECDriver, ECDriverError
        except ImportError as e:  # pragma: no cover - an install_requires dependency
            raise BadInput(f"parity needs pyeclib (pip install pyeclib): {e}") from None
        _tune_malloc()
        self.k, self.m, self.stripe = k, m, stripe
        try:
            self._driver = ECDriver(k=k, m=m, ec_type=CODEC)
        except ECDriverError as e:
            raise BadInput(f"parity: the {CODEC} code is not available in this pyeclib ({e})") from None
        zero = self._driver.encode(bytes(k * stripe))
        if any(len(f) != stripe + FRAGMENT_HEADER for f in zero):  # pragma: no cover - pyeclib changed its framing
            raise BadInput(f"parity: pyeclib frames a {stripe}-byte chunk unexpectedly; this version is not supported")
        self._headers = [bytes(f[:FRAGMENT_HEADER]) for f in zero]

    def encode(self, data: bytes) -> list[memoryview]:
        """DATA is the k chunks of one stripe back to back (k*S bytes); returns the m parity chunks."""
        frags = self._driver.encode(data)
        return [memoryview(f)[FRAGMENT_HEADER:] for f in frags[self.k:]]

    def rebuild(self, chunks: dict[int, bytes], missing: list[int]) -> dict[int, memoryview]:
        """CHUNKS: k chunks by index (0..k-1 data, k..k+m-1 parity); returns the chunks of MISSING."""
        if len(chunks) < self.k:
            raise NotRecoverable(f"parity: {len(chunks)} chunks of a stripe, {self.k} needed")
        frags = [self._headers[i] + bytes(chunks[i]) for i in sorted(chunks)[: self.k]]
        out = self._driver.reconstruct(frags, list(missing))
        return {i: memoryview(f)[FRAGMENT_HEADER:] for i, f in zip(missing, out)}


@dataclass(frozen=True)
class Layout:
    """K data volumes of LENGTHS, M parity streams, stripes of STRIPE bytes; the last stripe is only as long as
    the longest volume needs (rounded up to 64 bytes), so a parity volume is never more than 63 bytes longer
    than the longest data volume's bytes."""

    k: int
    m: int
    stripe: int
    lengths: tuple[int, ...]

    def __post_init__(self):
        if len(self.lengths) != self.k or any(n < 0 for n in self.lengths):
            raise BadInput(f"parity: {len(self.lengths)} data volume lengths for {self.k} data volumes")

    @property
    def nstripes(self) -> int:
        return max(1, -(-max(self.lengths) // self.stripe))

    @property
    def tail(self) -> int:
        """Size of the last stripe's chunks."""
        left = max(self.lengths) - (self.nstripes - 1) * self.stripe
        return max(64, -(-left // 64) * 64)

    def chunk(self, j: int) -> int:
        return self.stripe if j < self.nstripes - 1 else self.tail

    @property
    def parity_length(self) -> int:
        return (self.nstripes - 1) * self.stripe + self.tail

    def length(self, index: int) -> int:
        """Real bytes of stream INDEX (0..k-1 data volumes, k..k+m-1 parity)."""
        return self.lengths[index] if index < self.k else self.parity_length


class Codes:
    """The Code for each chunk size a layout uses (the stripe, and the shorter last stripe)."""

    def __init__(self, layout: Layout):
        self._layout = layout
        self._codes: dict[int, Code] = {}

    def __call__(self, j: int) -> Code:
        size = self._layout.chunk(j)
        if size not in self._codes:
            self._codes[size] = Code(self._layout.k, self._layout.m, size)
        return self._codes[size]


class ByteSource(Protocol):
    """Bytes of one stream: pread(offset, n) returns up to n bytes (fewer at its end)."""

    def pread(self, offset: int, n: int) -> bytes: ...


class FileSource:
    """A stream stored in a file from OFFSET on (a whole volume, or a parity member inside a tar).

    READ_ONCE (the inputs of unbundle's rebuild, read from start to end for the last time): the pages read leave
    the page cache behind the reader, DROP_BEHIND at a time, so the cache stays small. Growing it by every byte of
    ten volumes is what a rebuild from uncached volumes cost on a VM that reports free memory to its host: 3.3-4.8
    CPU-s and 3.5-4.9 s for one 228 MB volume from 2.3 GB, against 0.75-1.3 CPU-s and 1.1-1.6 s this way
    (docs/bundle.md, "Parity"). repair-volume keeps its inputs: its check pass has just cached them, and a later
    unbundle may read them from there (dropping measured no faster for it)."""

    DROP_BEHIND = 8 * 1024 * 1024  # 4, 16 and 32 MiB measured no better (same runs)

    def __init__(self, path: Path, offset: int = 0, size: int | None = None, *, read_once: bool = False):
        self.path, self.offset = Path(path), offset
        self._fd = os.open(self.path, os.O_RDONLY)
        self.size = size if size is not None else os.fstat(self._fd).st_size - offset
        self._dropped = offset if read_once else None  # the file offset up to which pages were dropped

    def pread(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        data = os.pread(self._fd, n, self.offset + offset) if n else b""
        self._read_to(self.offset + offset + len(data))
        return data

    def readinto(self, offset: int, view: memoryview) -> int:
        """pread into VIEW (no bytes object in between); returns the bytes read, fewer at the end."""
        n = max(0, min(len(view), self.size - offset))
        got = os.preadv(self._fd, [view[:n]], self.offset + offset) if n else 0
        self._read_to(self.offset + offset + got)
        return got

    def _read_to(self, end: int) -> None:
        """The reader got the file's bytes up to END: with READ_ONCE, the pages before it go in DROP_BEHIND steps,
        each starting a step back (only whole folios leave: one that reached past the last step's end goes now), and
        all of the stream's at its end (so a second pass, a rebuild run again to find a damaged input, leaves
        nothing either)."""
        at_end = end >= self.offset + self.size
        if self._dropped is not None and (at_end or end - self._dropped >= self.DROP_BEHIND):
            low = self.offset if at_end else max(self.offset, self._dropped - self.DROP_BEHIND)
            drop_cached(self._fd, low, end - low)
            self._dropped = end

    def map(self) -> tuple[mmap.mmap, int] | None:
        """The stream mapped (copy-on-write, never written: so that its address can be taken) under a read lease (a
        writer or a truncation waits for us: the mapping cannot lose its pages), and where it starts in the
        mapping; None where no lease is granted or the file is shorter than the stream. The lease goes with close()."""
        from ..integrity.hashing import lease  # here: hashing is no import of this module's otherwise

        if self.size <= 0 or not lease(self._fd):
            return None
        self._leased = True
        if os.fstat(self._fd).st_size < self.offset + self.size:
            return None
        head = self.offset % mmap.ALLOCATIONGRANULARITY
        return mmap.mmap(self._fd, head + self.size, offset=self.offset - head, access=mmap.ACCESS_COPY), head

    def advise(self, advice: int) -> None:
        """posix_fadvise over the whole file (best effort: a hint)."""
        try:
            os.posix_fadvise(self._fd, 0, 0, advice)
        except OSError:
            pass

    def close(self) -> None:
        if getattr(self, "_leased", False):  # explicitly: a mapping still held would keep the lease with the file
            from ..integrity.hashing import unlease

            unlease(self._fd)
        os.close(self._fd)


@dataclass(frozen=True)
class Span:
    """Bytes of a data volume copied from a file: LENGTH bytes at AT in the volume, from OFFSET of PATH, whose
    IDENTITY (inode, size, mtime_ns) was taken before they were read."""

    at: int
    path: Path
    offset: int
    length: int
    identity: tuple[int, int, int]


def file_identity(path: Path) -> tuple[int, int, int]:
    """(inode, size, mtime_ns): a write or a replacement of the file changes it (a rename does not)."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class SplicedSource:
    """A data volume read back from where its bytes came from: its member bytes from the files they were copied from
    (SPANS; a bundle's model files, in the page cache still) and the rest (tar headers, metadata, padding: a few KB a
    member) from the volume file. So a bundle with parity can drop its volumes' pages once written, as a plain
    bundle does, where keeping them cached for the parity pass is dear (pack._write_all): on a VM that hands free
    memory back to its host, growing the page cache by the data volumes cost the run 3-4 s of sys time for 2.3 GB
    (docs/bundle.md, "How the parity pass reads"). Use it only where unchanged() holds before the pass (else read the
    volume: FileSource); the caller checks it again after the pass."""

    def __init__(self, volume: Path, spans: list[Span]):
        self._volume = FileSource(volume)
        self._volume.advise(os.POSIX_FADV_RANDOM)  # a few KB here and there: no readahead fills the cache around them
        self.size = self._volume.size
        self._spans = sorted(spans, key=lambda s: s.at)
        self._starts = [s.at for s in self._spans]
        self._files: dict[int, FileSource] = {}  # span index -> its file, opened when first read
        self._maps: dict[int, _Mapped | None] = {}  # span index -> its file mapped (None: it could not be)

    def unchanged(self) -> bool:
        """Every file a span reads is the one its bytes were copied from (same inode, size and mtime)."""
        try:
            return all(file_identity(s.path) == s.identity for s in self._spans)
        except OSError:
            return False

    def _span_at(self, at: int) -> tuple[int, Span | None, int]:
        """(index, the span holding byte AT or None, where that stretch ends: the span's end, or else where the next
        span starts or the volume ends)."""
        k = bisect.bisect_right(self._starts, at) - 1
        if k >= 0 and at < self._spans[k].at + self._spans[k].length:
            return k, self._spans[k], self._spans[k].at + self._spans[k].length
        following = self._starts[k + 1] if k + 1 < len(self._spans) else self.size
        return k, None, following

    def _file(self, k: int) -> FileSource:
        if k not in self._files:
            span = self._spans[k]
            self._files[k] = FileSource(span.path, span.offset, span.length)
        return self._files[k]

    def readinto(self, offset: int, view: memoryview) -> int:
        n, done = max(0, min(len(view), self.size - offset)), 0
        while done < n:
            at = offset + done
            k, span, end = self._span_at(at)
            take = min(n - done, end - at)
            part = view[done: done + take]
            got = self._file(k).readinto(at - span.at, part) if span else self._volume.readinto(at, part)
            done += got
            if got < take:  # a cut file: the rest reads as zeros, and the pass's digests say so
                break
        return done

    def pread(self, offset: int, n: int) -> bytes:
        buf = bytearray(max(0, min(n, self.size - offset)))
        got = self.readinto(offset, memoryview(buf))
        return bytes(buf[:got])

    def mapped(self, offset: int, size: int) -> tuple[memoryview, int] | None:
        """(a view, its address) of bytes [OFFSET, OFFSET+SIZE) where they lie in one span whose file is mapped."""
        k, span, end = self._span_at(offset)
        if span is None or offset + size > end:
            return None
        if k not in self._maps:
            self._maps[k] = _Mapped.of(self._file(k))
        m = self._maps[k]
        return m.chunk(offset - span.at, size) if m is not None else None

    def release(self, offset: int, size: int) -> None:
        """Encoded: the pages of [OFFSET, OFFSET+SIZE) leave our page tables (the page cache keeps them)."""
        for k, m in self._maps.items():
            span = self._spans[k]
            low, high = max(offset, span.at), min(offset + size, span.at + span.length)
            if m is not None and high > low:
                m.release(low - span.at, high - low)

    def close(self) -> None:
        for m in self._maps.values():
            if m is not None:
                m.close()
        self._maps.clear()
        for f in self._files.values():
            f.close()
        self._volume.advise(os.POSIX_FADV_DONTNEED)  # what was read of the volume leaves the page cache too
        self._volume.close()


def _chunk(src: ByteSource, offset: int, stripe: int, length: int) -> bytes:
    """STRIPE bytes of a stream at OFFSET, zeros past its LENGTH (a short read of a cut file reads as zeros too:
    the whole-stream blake3 catches it)."""
    want = max(0, min(stripe, length - offset))
    data = src.pread(offset, want) if want else b""
    return data if len(data) == stripe else data + bytes(stripe - len(data))


def _stripes(produce: Callable[[int], object], count: int):
    """Yield (j, produce(j)) for every stripe, in this thread. A read-ahead thread, and two decoding threads,
    were tried and measured slower: pyeclib holds the GIL while it codes, so every pread, write and blake3 call
    of the other thread (each releasing and taking back the GIL) waited out the interpreter's switch interval
    (the convoy effect): encode ~0.3 GB/s against ~0.7-1.2 GB/s in one thread; rebuild ~80 against ~150 MB/s
    of volume under the same load."""
    for j in range(count):
        yield j, produce(j)


class Hasher(Protocol):
    """What digests a stream: blake3, or a data volume's proof (proof.TarProof)."""

    def update(self, data) -> None: ...

    def hexdigest(self) -> str: ...


def whole_blake3(_i: int) -> Hasher:
    """The default digest of a stream: blake3 of its real bytes, on blake3's own threads."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


@dataclass(frozen=True)
class EncodeResult:
    data_digest: list[str]    # each data volume's digest (as HASHER takes it, or as the caller knew it)
    parity_blake3: list[str]  # whole parity stream, NSTRIPES*S bytes


def encode(layout: Layout, sources: list[ByteSource], sinks: list[Callable[[memoryview], None]],
           on_bytes: Callable[[int], None] | None = None, known: list[str | None] | None = None,
           hasher: Callable[[int], Hasher] = whole_blake3) -> EncodeResult:
    """Read the K data streams stripe by stripe (once), write the M parity streams to SINKS in order. KNOWN: a data
    stream's digest where the caller already has it (its bytes are not hashed), else None: HASHER(i) digests data
    stream I's real bytes as they are read."""
    if len(sources) != layout.k or len(sinks) != layout.m:
        raise BadInput(f"parity: {len(sources)} sources and {len(sinks)} sinks for k={layout.k}, m={layout.m}")
    known = known or [None] * layout.k
    direct = DirectEncoder.for_layout(layout)
    if direct is not None:
        return direct.encode(layout, sources, sinks, on_bytes, known, hasher)
    codes = Codes(layout)
    S = layout.stripe
    data_h = [hasher(i) if known[i] is None else None for i in range(layout.k)]
    par_h = [blake3.blake3() for _ in range(layout.m)]

    def read_stripe(j: int) -> tuple[bytes, int]:
        parts, read = [], 0
        size = layout.chunk(j)
        for i, src in enumerate(sources):
            c = _chunk(src, j * S, size, layout.lengths[i])
            real = max(0, min(size, layout.lengths[i] - j * S))
            if real and data_h[i] is not None:
                data_h[i].update(memoryview(c)[:real])
            parts.append(c)
            read += real
        return b"".join(parts), read

    for j, (data, read) in _stripes(read_stripe, layout.nstripes):
        for p, chunk in enumerate(codes(j).encode(data)):
            sinks[p](chunk)
            par_h[p].update(chunk)
        if on_bytes:
            on_bytes(read)  # bytes of the data volumes read (padding is virtual): adds up to their sizes
    return EncodeResult([known[i] if h is None else h.hexdigest() for i, h in enumerate(data_h)],
                        [h.hexdigest() for h in par_h])


class DirectEncoder:
    """The same encoding as Code.encode, with ISA-L's encoder called directly (ctypes) on buffers read once.

    pyeclib's encode copies every data byte twice (into liberasurecode's fragments, then into Python bytes) and
    wants the stripe as one bytes object (another copy, after the read's): measured, 0.46 CPU-s per GB of data
    in pyeclib against 0.05 in ISA-L itself, and the parity pass of a bundle was CPU-bound (its time grew with
    the load while it read nothing from the disk). liberasurecode's isa_l_rs_cauchy builds its tables from ISA-L
    (gf_gen_cauchy1_matrix(k+m, k), ec_init_tables over the last m rows) and encodes with ec_encode_data; this
    does the same with the ISA-L that pyeclib's wheel bundles, and checks once per layout that its parity is
    byte-identical to pyeclib's before it is used (else, or without that library, pyeclib encodes)."""

    _lib = None
    _loaded = False

    def __init__(self, lib, k: int, m: int, stripe: int):
        import ctypes  # here: only a parity run pays for it

        self.k, self.m, self.stripe = k, m, stripe
        self._lib = lib
        matrix = (ctypes.c_ubyte * ((k + m) * k))()
        lib.gf_gen_cauchy1_matrix(matrix, k + m, k)
        self._tables = (ctypes.c_ubyte * (k * m * 32))()
        lib.ec_init_tables(k, m, ctypes.byref(matrix, k * k), self._tables)
        self._data = bytearray(k * stripe)
        # two parity buffers: one is written out and hashed (a helper thread) while the next stripe is encoded
        self._parity = [bytearray(m * stripe), bytearray(m * stripe)]
        base = self._base = ctypes.addressof((ctypes.c_char * len(self._data)).from_buffer(self._data))
        self._data_ptrs = (ctypes.c_void_p * k)(*[base + i * stripe for i in range(k)])
        self._parity_ptrs = []
        for buf in self._parity:
            pbase = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
            self._parity_ptrs.append((ctypes.c_void_p * m)(*[pbase + i * stripe for i in range(m)]))

    @classmethod
    def library(cls):
        """ISA-L as pyeclib's wheel bundles it, or None."""
        if not cls._loaded:
            cls._loaded = True
            import ctypes

            try:
                import pyeclib_c

                found = sorted((Path(pyeclib_c.__file__).parent / "pyeclib.libs").glob("libisal*.so*"))
                lib = ctypes.CDLL(str(found[0])) if found else None
                if lib is not None:
                    lib.ec_encode_data.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                   ctypes.c_void_p, ctypes.c_void_p]
                    lib.gf_gen_cauchy1_matrix, lib.ec_init_tables  # noqa: B018 - present, or AttributeError
                cls._lib = lib
            except (ImportError, OSError, AttributeError):
                cls._lib = None
        return cls._lib

    @classmethod
    def for_layout(cls, layout: Layout) -> DirectEncoder | None:
        lib = cls.library()
        if lib is None:
            return None
        enc = cls(lib, layout.k, layout.m, layout.stripe)
        probe = os.urandom(layout.k * 64)  # a 64-byte stripe in the first bytes of each chunk
        for i in range(layout.k):
            enc._data[i * layout.stripe: i * layout.stripe + 64] = probe[i * 64: (i + 1) * 64]
        enc._encode(64)
        want = Code(layout.k, layout.m, 64).encode(probe)
        if any(bytes(enc._parity[0][p * layout.stripe: p * layout.stripe + 64]) != bytes(want[p])
               for p in range(layout.m)):
            return None
        return enc

    def _encode(self, size: int, into: int = 0) -> None:
        """Encode SIZE bytes of each data chunk into parity buffer INTO."""
        self._lib.ec_encode_data(size, self.k, self.m, self._tables, self._data_ptrs, self._parity_ptrs[into])

    def encode(self, layout: Layout, sources: list[ByteSource], sinks: list[Callable[[memoryview], None]],
               on_bytes: Callable[[int], None] | None, known: list[str | None],
               hasher: Callable[[int], Hasher] = whole_blake3) -> EncodeResult:
        S = layout.stripe
        # a volume whose digest is KNOWN is not hashed here (a bundle's volumes are proven as they are written)
        data_h = [hasher(i) if known[i] is None else None for i in range(layout.k)]
        par_h = [blake3.blake3(max_threads=blake3.blake3.AUTO) for _ in range(layout.m)]
        data = memoryview(self._data)
        out = _ParityOut(self._parity, S, sinks, par_h)
        mapped = _Mappings(sources, layout.lengths)
        try:
            for j in range(layout.nstripes):
                size, read = layout.chunk(j), 0
                for i, src in enumerate(sources):
                    want = max(0, min(size, layout.lengths[i] - j * S))
                    if want == size and (in_place := mapped.chunk(i, j * S, size)) is not None:
                        view, self._data_ptrs[i] = in_place  # ISA-L reads the page cache itself
                    else:
                        view = data[i * S: i * S + size]
                        self._data_ptrs[i] = self._slot(i)
                        got = _read_into(src, j * S, view[:want]) if want else 0
                        if got < size:  # past the volume's end (or a cut file): zeros, as the layout says
                            view[got:] = bytes(size - got)
                    if want:
                        if data_h[i] is not None:
                            data_h[i].update(view[:want])
                        read += want
                into = out.free()
                self._encode(size, into)
                mapped.done(j * S, size)
                out.put(into, size)
                if on_bytes:
                    on_bytes(read)  # bytes of the data volumes read (padding is virtual): adds up to their sizes
            out.finish()
        finally:
            view = None  # the last chunk: a view of a mapping would keep it open
            out.close()
            mapped.close()
            data.release()
        return EncodeResult([known[i] if h is None else h.hexdigest() for i, h in enumerate(data_h)],
                            [h.hexdigest() for h in par_h])

    def _slot(self, i: int) -> int:
        return self._base + i * self.stripe


class DirectDecoder:
    """Code.rebuild for lost data streams with ISA-L called directly (DirectEncoder's library), on chunks read into
    one buffer: pyeclib's reconstruct wants each input chunk as bytes behind its fragment header (a copy of every
    input byte) and copies the fragments again inside. The lost data is the inverse of the code matrix's rows of the
    inputs used (gf_gen_cauchy1_matrix, as liberasurecode's isa_l_rs_cauchy) times those inputs; checked once per
    rebuild on a probe whose data is known (else, or without the library, or for a lost parity stream, pyeclib).

    The code works byte by byte, so several stripes in a row decode as one span (BATCH stripes, at most SPAN_BYTES
    of each input): the K inputs' spans are read side by side in threads (os.preadv, the copy out of the page cache,
    is most of a rebuild's work and releases the GIL), and each decoded span is written and hashed in a side thread
    while the next is read (measured on the 16-core GPU host, one 913 MB volume from nine: 263 MB/s reading, decoding,
    writing and hashing one stripe after another in one thread)."""

    SPAN_BYTES = 4 * 1024 * 1024  # of each input at once (mm's margin: 1-4 stripes of the default 1-4 MiB)
    # the inputs' spans together at most (mm's margin: ten inputs of 3 MiB and two spans decoded, 36 MiB, beside the
    # 40 MB repair-volume holds, under the 150 MB bound)
    BUFFER_BYTES = 32 * 1024 * 1024

    def __init__(self, lib, layout: Layout, use: list[int], want: list[int]):
        import ctypes  # here: only a rebuild pays for it

        k, n, S = layout.k, layout.k + layout.m, layout.stripe
        self._lib, self._k, self._want, self.stripe = lib, k, want, S
        self.batch = max(1, min(self.SPAN_BYTES, self.BUFFER_BYTES // k) // S)
        span = self.span = self.batch * S
        code = (ctypes.c_ubyte * (n * k))()
        lib.gf_gen_cauchy1_matrix(code, n, k)
        rows = (ctypes.c_ubyte * (k * k))(*[code[i * k + c] for i in use for c in range(k)])
        inverse = (ctypes.c_ubyte * (k * k))()
        if lib.gf_invert_matrix(rows, inverse, k) != 0:
            raise ValueError("the inputs' rows of the code are singular")
        decode = (ctypes.c_ubyte * (len(want) * k))(*[inverse[w * k + c] for w in want for c in range(k)])
        self._tables = (ctypes.c_ubyte * (k * len(want) * 32))()
        lib.ec_init_tables(k, len(want), decode, self._tables)
        self._in = bytearray(k * span)
        self._outs = [bytearray(len(want) * span) for _ in range(2)]  # one decoded while the other is written
        base = ctypes.addressof((ctypes.c_char * len(self._in)).from_buffer(self._in))
        self._in_ptrs = (ctypes.c_void_p * k)(*[base + r * span for r in range(k)])
        self._out_ptrs = []
        for out in self._outs:
            base = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
            self._out_ptrs.append((ctypes.c_void_p * len(want))(*[base + r * span for r in range(len(want))]))

    @classmethod
    def for_rebuild(cls, layout: Layout, use: list[int], want: list[int]) -> DirectDecoder | None:
        lib = DirectEncoder.library()
        if lib is None or any(w >= layout.k for w in want):
            return None
        try:
            dec = cls(lib, layout, use, want)
        except (ValueError, AttributeError, OSError):
            return None
        k, span = layout.k, dec.span
        data = [os.urandom(64) for _ in range(k)]
        streams = data + [bytes(p) for p in Code(k, layout.m, 64).encode(b"".join(data))]
        for r, i in enumerate(use):
            dec._in[r * span: r * span + 64] = streams[i]
        dec._decode(64, 0)
        if any(bytes(dec._outs[0][r * span: r * span + 64]) != data[w] for r, w in enumerate(want)):
            return None
        return dec

    def _decode(self, size: int, out: int) -> None:
        self._lib.ec_encode_data(size, self._k, len(self._want), self._tables, self._in_ptrs, self._out_ptrs[out])

    def rebuild(self, layout: Layout, inputs: dict[int, ByteSource], use: list[int],
                emit: Callable[[int, dict[int, memoryview]], None], in_h: dict) -> None:
        """Every stripe of the wanted streams to EMIT(j, {stream: chunk}), in order, from one side thread; IN_H:
        hashers of inputs' real bytes."""
        from concurrent.futures import ThreadPoolExecutor

        from ..edges.interrupt import usable_cores
        from ..integrity.hashing import SideThread

        S, span = self.stripe, self.span
        view = memoryview(self._in)
        outs = [memoryview(out) for out in self._outs]

        def read(r: int, i: int, at: int, size: int) -> None:
            slot = view[r * span: r * span + size]
            real = max(0, min(size, layout.length(i) - at))
            got = _read_into(inputs[i], at, slot[:real]) if real else 0
            if got < size:  # past the stream's end (or a cut file): zeros, as the layout says
                slot[got:] = bytes(size - got)
            if real and i in in_h:
                in_h[i].update(slot[:real])

        def emit_span(job: tuple[int, int, int]) -> None:
            first, last, o = job
            for j in range(first, last):
                at, size = (j - first) * S, layout.chunk(j)
                emit(j, {w: outs[o][r * span + at: r * span + at + size] for r, w in enumerate(self._want)})

        side = SideThread("mm-rebuild-write")
        pending = False
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(len(use), usable_cores()))) as pool:
                for n, first in enumerate(range(0, layout.nstripes, self.batch)):
                    last = min(first + self.batch, layout.nstripes)
                    size = (last - 1 - first) * S + layout.chunk(last - 1)  # only the last stripe is short
                    for done in [pool.submit(read, r, i, first * S, size) for r, i in enumerate(use)]:
                        done.result()
                    self._decode(size, n % 2)  # the other buffer's span may still be being written
                    if pending:
                        pending = False
                        side.end()  # the span before is written: its buffer is free for the next decode
                    side.begin(emit_span, (first, last, n % 2))
                    pending = True
            if pending:
                pending = False
                side.end()
        finally:
            if pending:
                try:
                    side.end()
                except BaseException:  # the first error is already on its way up
                    pass
            side.close()
            view.release()
            for out in outs:
                out.release()


class _ParityOut:
    """Writes the parity of one stripe (to the sinks, and into the parity hashers) in a helper thread while the
    caller encodes the next into the other buffer. os.write, blake3 and ISA-L (ctypes) all release the GIL, so the
    two overlap (measured in process, 2.28 GB in ten volumes: the parity pass spent 0.26 s writing and 0.12 s
    hashing parity beside 0.37 s encoding)."""

    def __init__(self, buffers: list[bytearray], stripe: int, sinks: list[Callable[[memoryview], None]], hashers):
        import queue
        import threading

        self._buffers, self._stripe, self._sinks, self._hashers = buffers, stripe, sinks, hashers
        self._free: queue.Queue = queue.Queue()
        self._full: queue.Queue = queue.Queue()
        for i in range(len(buffers)):
            self._free.put(i)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._full.get()) is not None:
            i, size = item
            try:
                if self._error is None:
                    view = memoryview(self._buffers[i])
                    for p, (sink, h) in enumerate(zip(self._sinks, self._hashers)):
                        chunk = view[p * self._stripe: p * self._stripe + size]
                        sink(chunk)
                        h.update(chunk)
                    view.release()
            except BaseException as e:  # handed to the caller at its next call
                self._error = e
            finally:
                self._free.put(i)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def free(self) -> int:
        """A parity buffer to encode into (waits for the helper to have written it out)."""
        self._raise()
        i = self._free.get()
        self._raise()
        return i

    def put(self, i: int, size: int) -> None:
        self._full.put((i, size))

    def finish(self) -> None:
        """Wait until every stripe is written; raise what the writing raised."""
        self.close()
        self._raise()

    def close(self) -> None:
        if self._thread.is_alive():
            self._full.put(None)
            self._thread.join()


class _Mapped:
    """A stream mapped (FileSource.map) with its address taken, so that its chunks go to ISA-L where they lie."""

    def __init__(self, mapping: mmap.mmap, head: int):
        import ctypes  # here: only a parity run pays for it

        self._mapping, self._head = mapping, head
        self._view = memoryview(mapping)
        self._anchor = ctypes.c_char.from_buffer(mapping)  # the address's buffer export
        self._base = ctypes.addressof(self._anchor)

    @classmethod
    def of(cls, src: FileSource) -> _Mapped | None:
        got = src.map()
        return cls(*got) if got is not None else None

    def chunk(self, offset: int, size: int) -> tuple[memoryview, int]:
        """(a view, its address) of the stream's bytes [OFFSET, OFFSET+SIZE)."""
        start = self._head + offset
        return self._view[start: start + size], self._base + start

    def release(self, offset: int, size: int) -> None:
        """Encoded: the pages of [OFFSET, OFFSET+SIZE) leave our page tables (the page cache keeps them)."""
        start = (self._head + offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(self._mapping), self._head + offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self._view.release()
        self._anchor = None  # the export goes before the mapping can close
        try:
            self._mapping.close()
        except BufferError:  # a view a caller still holds: the mapping goes with it
            pass


class _Mappings:
    """The data streams that can be mapped (FileSource.map, or a SplicedSource's files), their whole chunks handed to
    the encoder by address: the read's copy into a buffer goes (measured, 1 GiB of ten volumes: 0.25 s of 0.95 s in
    preadv). A chunk's pages leave our page tables once encoded (the page cache keeps them), so memory stays flat."""

    def __init__(self, sources: list[ByteSource], lengths: tuple[int, ...]):
        self._maps: dict[int, _Mapped] = {}
        self._spliced = {i: src for i, src in enumerate(sources) if isinstance(src, SplicedSource)}
        for i, src in enumerate(sources):
            if isinstance(src, FileSource) and lengths[i] == src.size and (m := _Mapped.of(src)) is not None:
                self._maps[i] = m

    def chunk(self, i: int, offset: int, size: int) -> tuple[memoryview, int] | None:
        """(a view, its address) of stream I's bytes [OFFSET, OFFSET+SIZE), or None where they are not mapped."""
        if i in self._spliced:
            return self._spliced[i].mapped(offset, size)
        return self._maps[i].chunk(offset, size) if i in self._maps else None

    def done(self, offset: int, size: int) -> None:
        for m in self._maps.values():
            m.release(offset, size)
        for src in self._spliced.values():
            src.release(offset, size)

    def close(self) -> None:
        """The mappings taken here (a SplicedSource closes its own)."""
        for m in self._maps.values():
            m.close()
        self._maps.clear()


def _read_into(src: ByteSource, offset: int, view: memoryview) -> int:
    if hasattr(src, "readinto"):
        return src.readinto(offset, view)
    got = src.pread(offset, len(view))
    view[: len(got)] = got
    return len(got)


def choose_inputs(layout: Layout, present: set[int], want: set[int]) -> list[int]:
    """K streams to rebuild WANT from: data volumes first (fewer GF multiplications), then parity."""
    usable = sorted(present - want)
    if len(usable) < layout.k:
        raise NotRecoverable(describe_shortfall(layout, present, want))
    data = [i for i in usable if i < layout.k]
    return (data + [i for i in usable if i >= layout.k])[: layout.k]


def describe_shortfall(layout: Layout, present: set[int], want: set[int]) -> str:
    lost = sorted(set(range(layout.k + layout.m)) - (present - want))
    lost_data = [i + 1 for i in lost if i < layout.k]
    lost_par = [i - layout.k + 1 for i in lost if i >= layout.k]
    short = layout.k - len(present - want)
    names = [f"volume {n}" for n in lost_data] + [f"parity {n}" for n in lost_par]
    return (f"{len(lost)} of {layout.k + layout.m} volumes lost or damaged ({', '.join(names)}); parity rebuilds at "
            f"most {layout.m}: bring back any {short} of them")


@dataclass(frozen=True)
class RebuildResult:
    inputs: list[int]
    input_digest: dict[int, str]   # whole stream of each input used (its real length), as HASHER takes it
    output_digest: dict[int, str]  # whole rebuilt stream (its real length), as HASHER takes it


def _one_thread_blake3(_i: int) -> Hasher:
    return blake3.blake3()


def rebuild(layout: Layout, inputs: dict[int, ByteSource], want: list[int], sinks: dict[int, Callable[[memoryview], None]],
            on_bytes: Callable[[int], None] | None = None, hash_inputs: bool = False,
            hasher: Callable[[int], Hasher] = _one_thread_blake3) -> RebuildResult:
    """Rebuild the streams WANT (indexes as in Layout.length) from K of INPUTS; each sink gets exactly the
    stream's real length. Callers compare the returned output digests (HASHER(i) over stream I: blake3, or a data
    volume's proof) with the ones recorded at encoding; when one differs, an input was damaged: HASH_INPUTS=True
    (a second, slower run) names it by its digest."""
    codes = Codes(layout)
    use = choose_inputs(layout, set(inputs), set(want))
    S = layout.stripe
    in_h = {i: hasher(i) for i in use} if hash_inputs else {}
    out_h = {i: hasher(i) for i in want}

    def read_stripe(j: int) -> dict[int, bytes]:
        chunks = {}
        size = layout.chunk(j)
        for i in use:
            c = _chunk(inputs[i], j * S, size, layout.length(i))
            real = max(0, min(size, layout.length(i) - j * S))
            if real and hash_inputs:
                in_h[i].update(memoryview(c)[:real])
            chunks[i] = c
        return chunks

    def emit(j: int, out: dict[int, memoryview]) -> None:
        for i, chunk in out.items():
            real = max(0, min(layout.chunk(j), layout.length(i) - j * S))
            if real:
                view = chunk[:real]
                sinks[i](view)
                out_h[i].update(view)
                if on_bytes:
                    on_bytes(real)

    direct = DirectDecoder.for_rebuild(layout, use, list(want))
    if direct is not None:
        direct.rebuild(layout, inputs, use, emit, in_h)
    else:
        for j, chunks in _stripes(read_stripe, layout.nstripes):
            emit(j, codes(j).rebuild(chunks, list(want)))
    return RebuildResult(use, {i: h.hexdigest() for i, h in in_h.items()}, {i: h.hexdigest() for i, h in out_h.items()})
