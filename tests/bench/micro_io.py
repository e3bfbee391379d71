"""The measurements behind the bundle copy path's choices, each interleaved in rounds, printing medians
and the load average. Not part of `make bench`: run one with `python -m tests.bench.micro_io write|copy|parity|writesize`.

  write   2 GiB written then fsynced: left to the kernel (what tar + sync does), fdatasync every 128 MiB in a
          thread (mm before), sync_file_range(WRITE) every 32 MiB, posix_fadvise(DONTNEED) every 32 MiB (mm now)
  copy    1 GiB copied from a warm file: read into a buffer + write (tar), or mapped + write (mm now); sys time
  parity  parity of ten ~100 MiB volumes: pyeclib's encode against ISA-L called directly, and blake3 on one
          thread against blake3's own threads; wall and CPU
  writesize  2 GiB copied from a warm mapped file in writes of 64 KiB to 8 MiB (source pages populated first;
          `writesize faulting`: also without), + fsync, each right after deleting a file of that size: copy and total
          wall, sys time, /proc/vmstat deltas (compaction, direct reclaim) and the KiB the guest handed back to the
          host (free page reporting) meanwhile (copyio.write_size)
"""
from __future__ import annotations

import ctypes
import mmap
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

from tests.bench.common import bench_dir, load_average

ROUNDS = int(os.environ.get("MM_BENCH_ROUNDS", "3"))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sys() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _rounds(variants: dict, measure) -> None:
    got = {k: [] for k in variants}
    names = list(variants)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[: r % len(names)]:
            got[name].append(measure(variants[name]))
    print(f"  ({ROUNDS} rounds, {load_average()})")
    for name, runs in got.items():
        print(f"  {name:<26} wall {statistics.median(w for w, _ in runs):6.2f} s   "
              f"cpu/sys {statistics.median(c for _, c in runs):5.2f} s")


def write_strategies(total: int = 2 << 30) -> None:
    work = bench_dir("micro-io")
    buf = memoryview(os.urandom(8 << 20))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]

    def run(mode: str) -> tuple[float, float]:
        os.sync()
        path = work / "out"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t, s = time.perf_counter(), _sys()
        pos, since, helper = 0, 0, None
        step = 128 << 20 if mode == "fdatasync 128 MiB" else 32 << 20
        while pos < total:
            n = os.write(fd, buf)
            pos, since = pos + n, since + n
            if mode == "kernel" or since < step:
                continue
            since = 0
            if mode == "fdatasync 128 MiB" and (helper is None or not helper.is_alive()):
                helper = threading.Thread(target=os.fdatasync, args=(fd,))
                helper.start()
            elif mode == "sync_file_range":
                libc.sync_file_range(fd, pos - step, step, 2)
            elif mode == "fadvise DONTNEED":
                low = max(0, pos - 4 * step)
                os.posix_fadvise(fd, low, pos - low, os.POSIX_FADV_DONTNEED)
        if helper is not None:
            helper.join()
        os.fsync(fd)
        os.close(fd)
        result = time.perf_counter() - t, _sys() - s
        path.unlink()
        return result

    print(f"write {total >> 20} MiB then fsync (cpu/sys: sys time)")
    _rounds({m: m for m in ("kernel", "fdatasync 128 MiB", "sync_file_range", "fadvise DONTNEED")}, run)


def _warm_source(size: int) -> tuple[Path, Path]:
    """The work dir and a SIZE-byte file of random bytes in it (kept between runs), read into the page cache."""
    work = bench_dir("micro-io")
    src = work / "src"
    if not src.exists() or src.stat().st_size != size:
        with open(src, "wb") as f:
            for _ in range(size >> 23):
                f.write(os.urandom(8 << 20))
    with open(src, "rb") as f:  # warm
        while f.read(8 << 20):
            pass
    return work, src


def copy_paths(size: int = 1 << 30) -> None:
    work, src = _warm_source(size)
    chunk = 8 << 20

    def run(mapped: bool) -> tuple[float, float]:
        dst = work / "dst"
        fi, fo = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t, s = time.perf_counter(), _sys()
        if mapped:
            m = mmap.mmap(fi, 0, access=mmap.ACCESS_READ)
            v = memoryview(m)
            for start in range(0, size, chunk):
                os.write(fo, v[start:start + chunk])
                m.madvise(mmap.MADV_DONTNEED, start, chunk)
            v.release()
            m.close()
        else:
            buf = mmap.mmap(-1, chunk)
            v = memoryview(buf)
            while n := os.readv(fi, [v]):
                os.write(fo, v[:n])
            v.release()
            buf.close()
        result = time.perf_counter() - t, _sys() - s
        os.close(fi)
        os.close(fo)
        dst.unlink()
        return result

    print(f"copy {size >> 20} MiB, page cache warm, no fsync (cpu/sys: sys time)")
    _rounds({"read + write (tar)": False, "mapped + write (mm)": True}, run)


def parity_encode(k: int = 10, size: int = 100 << 20) -> None:
    import blake3

    from mm.artifacts.bundle import parity

    work = bench_dir("micro-io")
    paths = []
    for i in range(k):
        p = work / f"vol{i}"
        if not p.exists() or p.stat().st_size != size - i * 4096:
            p.write_bytes(os.urandom(size - i * 4096))
        paths.append(p)
    layout = parity.Layout(k, 2, parity.STRIPE, tuple(p.stat().st_size for p in paths))
    real_for_layout, real_blake3 = parity.DirectEncoder.for_layout, blake3.blake3

    class OneThread:  # blake3.blake3 as DirectEncoder calls it, on one thread whatever it asks
        AUTO = real_blake3.AUTO

        def __new__(cls, *args, **kwargs):
            return real_blake3()

    def run(variant: tuple[bool, bool]) -> tuple[float, float]:
        direct, threaded = variant
        parity.DirectEncoder.for_layout = real_for_layout if direct else classmethod(lambda cls, layout: None)
        parity.blake3.blake3 = real_blake3 if threaded else OneThread
        sources = [parity.FileSource(p) for p in paths]
        t, c = time.perf_counter(), _cpu()
        try:
            parity.encode(layout, sources, [lambda view: None] * 2)
        finally:
            for src in sources:
                src.close()
            parity.DirectEncoder.for_layout, parity.blake3.blake3 = real_for_layout, real_blake3
        return time.perf_counter() - t, _cpu() - c

    print(f"parity of {k} volumes of ~{size >> 20} MiB, page cache warm (cpu/sys: CPU time)")
    _rounds({"pyeclib, blake3 1 thread": (False, False), "ISA-L, blake3 1 thread": (True, False),
             "ISA-L, blake3 threads": (True, True)}, run)


_VMSTAT = ("compact_stall", "compact_migrate_scanned", "compact_isolated", "allocstall_normal", "pgscan_direct",
           "pgsteal_kswapd", "pgfault", "pgalloc_normal")


def _counters() -> dict[str, int]:
    got = {}
    with open("/proc/vmstat") as f:
        for line in f:
            name, value = line.split()
            if name in _VMSTAT:
                got[name] = int(value)
    try:
        got["reported_kib"] = int(Path("/sys/module/page_reporting/parameters/reported_kib").read_text())
    except (OSError, ValueError):
        pass
    return got


def write_sizes(size: int = 2 << 30) -> None:
    """A warm file copied (mapped, pwrite of W bytes at a time, sync_file_range every 32 MiB as unbundle does, then
    fsync) right after another file of the same size was deleted (its page cache freed: what a bench round's rm
    does): wall of the copy and of the fsync, sys time, and /proc/vmstat deltas (direct compaction, direct reclaim)
    and the guest's free-page-reporting count (KiB handed back to the host meanwhile)."""
    work, src = _warm_source(size)
    from mm.artifacts.bundle.copyio import WriteBehind

    mapping = mmap.mmap(os.open(src, os.O_RDONLY), size, access=mmap.ACCESS_READ)
    whole = memoryview(mapping)
    rows = {}

    def run(variant: tuple[int, bool]) -> tuple[float, float]:
        w, populate = variant
        dst = work / "dst"
        if dst.exists():
            dst.unlink()  # frees its page cache: the blocks a large folio is cut from next
        os.sync()
        time.sleep(2)
        before, t, s = _counters(), time.perf_counter(), _sys()
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        flush = WriteBehind(fd)
        for pos in range(0, size, w):
            if populate:  # the source pages in our page tables, as mm's hashing leaves them before the write
                mapping.madvise(22, pos - pos % (8 << 20), 8 << 20) if pos % (8 << 20) == 0 else None  # POPULATE_READ
            n = os.pwrite(fd, whole[pos: pos + w], pos)
            flush.wrote(n)
        for pos in range(0, size, 8 << 20):
            mapping.madvise(mmap.MADV_DONTNEED, pos, 8 << 20)
        copied = time.perf_counter() - t
        os.fsync(fd)
        os.close(fd)
        wall, sys_s, after = time.perf_counter() - t, _sys() - s, _counters()
        rows.setdefault(variant, []).append((copied, {k: after[k] - before[k] for k in after}))
        return wall, sys_s

    print(f"copy {size >> 20} MiB (mapped source, pwrite of W bytes) + fsync, after deleting a file of that size")
    faulting = "faulting" in sys.argv[2:]  # also with the source pages not mapped yet
    _rounds({f"W {w >> 10} KiB{' populated' if p else ''}": (w, p)
             for w in (64 << 10, 128 << 10, 256 << 10, 1 << 20, 8 << 20) for p in ((False, True) if faulting else (True,))},
            run)
    for (w, p), runs in rows.items():
        print(f"  W {w >> 10:>5} KiB {'populated' if p else 'faulting'} copy " + " ".join(f"{c:.2f}" for c, _ in runs) + " s; per run: "
              + "; ".join(", ".join(f"{k} {v}" for k, v in d.items() if v) for _, d in runs))


if __name__ == "__main__":
    {"write": write_strategies, "copy": copy_paths, "parity": parity_encode, "writesize": write_sizes}[sys.argv[1]]()
