"""Bytes shared between files of one file system: how a file is made from another without copying its bytes
(a reflink, or a hard link when the user asks), and where a file's bytes lie on disk, so that bytes shared between
revisions can be counted.

- reflink (`ioctl(FICLONE)`, XFS with reflink=1, btrfs, bcachefs, OCFS2): the new file shares the old one's blocks
  copy-on-write. A later write to either copies the block first, so damage to one never reaches the other.
- hard link: the same inode under a second name. Costs nothing anywhere, but the two names ARE one file: damage,
  a chmod or an editor writing in place shows under both. mm makes one only when the user asks (`--link`).
- copy: the bytes read and written again; what is left where neither of the others is possible.

Disk use is measured with FIEMAP (`ioctl(FS_IOC_FIEMAP)`): a file's extents with their physical addresses, so
that bytes two files share (a reflink, a hard link) are counted once. Where the file system has no FIEMAP
(tmpfs), a file is one unit of its allocated blocks, shared only with its own hard links.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap)
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNKNOWN = 0x2
FIEMAP_EXTENT_DELALLOC = 0x4
FIEMAP_EXTENT_INLINE = 0x200  # data inside the inode (no extent of its own)
FIEMAP_EXTENT_SHARED = 0x2000
_HEAD = struct.Struct("=QQIIII")  # struct fiemap: fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count
_EXTENT = struct.Struct("=QQQQQIIII")  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 reserved
_BATCH = 256  # extents per ioctl
# errnos that mean "this file system (or this pair of files) cannot do it", as opposed to a real failure
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EBADF}

REFLINK, LINK, COPY = "reflink", "link", "copy"


def reflink(src_fd: int, dst_fd: int) -> bool:
    """Make DST_FD's file share SRC_FD's bytes (copy-on-write). False where the file system or the pair cannot."""
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return False
        raise


def clone_file(src: Path, dst: Path, *, root: Path) -> bool:
    """DST (under ROOT, created or truncated; reached by fsutil's target rule, never through a link) made a reflink
    of SRC (never following a symlink at SRC, never blocking on a FIFO there); False, with DST left empty, where
    the file system or the pair cannot clone, or SRC is not a regular file."""
    from .fsutil import open_file

    fd_src = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd_src).st_mode):
            return False
        fd_dst = open_file(root, dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            return reflink(fd_src, fd_dst)
        finally:
            os.close(fd_dst)
    finally:
        os.close(fd_src)


def how_to_share(src_dir: Path, dst_dir: Path, allow_link: bool, *, root: Path) -> str:
    """How files of SRC_DIR can become files of DST_DIR (under ROOT) here: REFLINK when the file system clones
    (probed with a real clone of a scratch file in DST_DIR), else LINK when ALLOW_LINK and both are on one file
    system, else COPY. DST_DIR and the scratch files are reached by fsutil's target rule."""
    from .fsutil import make_dirs, open_file, unlink_file

    make_dirs(root, dst_dir)
    probe_src, probe_dst = dst_dir / f".mm-reflink-probe-{os.getpid()}", dst_dir / f".mm-reflink-probe-{os.getpid()}.2"
    try:
        same_fs = os.stat(src_dir).st_dev == os.stat(dst_dir).st_dev
        if same_fs:
            s = open_file(root, probe_src, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(s, b"\0" * 4096)
                d = open_file(root, probe_dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                try:
                    if reflink(s, d):
                        return REFLINK
                finally:
                    os.close(d)
            finally:
                os.close(s)
        return LINK if allow_link and same_fs else COPY
    finally:
        unlink_file(root, probe_src)
        unlink_file(root, probe_dst)


@dataclass(frozen=True)
class Layout:
    """Where one file's bytes lie: its inode (device, number), its hard links, allocated bytes, and its extents on
    disk ((physical start, length), sorted) when the file system tells (None: it does not, count the inode whole)."""

    dev: int
    ino: int
    links: int
    allocated: int
    extents: tuple[tuple[int, int], ...] | None


def layout(path: Path | str) -> Layout:
    """PATH's layout (never following a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        return Layout(st.st_dev, st.st_ino, st.st_nlink, st.st_blocks * 512, _extents(fd, st.st_size))
    finally:
        os.close(fd)


def _extents(fd: int, size: int) -> tuple[tuple[int, int], ...] | None:
    out: list[tuple[int, int]] = []
    start = 0
    while start < max(size, 1):
        buf = bytearray(_HEAD.size + _BATCH * _EXTENT.size)
        _HEAD.pack_into(buf, 0, start, 2**64 - 1 - start, 0, 0, _BATCH, 0)  # no FIEMAP_FLAG_SYNC: never writes
        try:
            fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                return None
            raise
        mapped = _HEAD.unpack_from(buf, 0)[3]
        if mapped == 0:
            break
        last = False
        for i in range(mapped):
            logical, physical, length, _, _, flags, *_ = _EXTENT.unpack_from(buf, _HEAD.size + i * _EXTENT.size)
            if flags & (FIEMAP_EXTENT_UNKNOWN | FIEMAP_EXTENT_DELALLOC | FIEMAP_EXTENT_INLINE):
                return None  # no physical address yet (not written back) or none at all: count the inode whole
            out.append((physical, length))
            start = logical + length
            last = bool(flags & FIEMAP_EXTENT_LAST)
        if last:
            break
    return tuple(sorted(out))


class DiskUse:
    """Bytes on disk of a set of files, each shared byte counted once (hard links by inode, reflinks by extent)."""

    def __init__(self, layouts: Iterable[Layout] = ()):
        self.inodes: dict[tuple[int, int], Layout] = {}
        for item in layouts:
            self.add(item)

    def add(self, item: Layout) -> None:
        self.inodes[(item.dev, item.ino)] = item

    @property
    def bytes(self) -> int:
        whole = sum(i.allocated for i in self.inodes.values() if i.extents is None)
        by_dev: dict[int, list[tuple[int, int]]] = {}
        for i in self.inodes.values():
            if i.extents is not None:
                by_dev.setdefault(i.dev, []).extend(i.extents)
        return whole + sum(_union(spans) for spans in by_dev.values())


def _union(spans: list[tuple[int, int]]) -> int:
    """Bytes covered by (start, length) spans, overlaps counted once."""
    total, end = 0, -1
    for start, length in sorted(spans):
        if start + length <= end:
            continue
        total += start + length - max(start, end)
        end = start + length
    return total


def shared_bytes(mine: Iterable[Layout], others: Iterable[Layout]) -> int:
    """Bytes on disk that MINE's files use and OTHERS' files use too (by inode, or by overlapping extents)."""
    mine = DiskUse(mine)
    others = DiskUse(others)
    alone = DiskUse(list(mine.inodes.values()) + list(others.inodes.values())).bytes - others.bytes
    return mine.bytes - alone
