"""What an OSError means for the person running mm: which exit code, and one line naming the path.

A full disk is "refused" (7) and names the file system that is full, not the file being read; a path that
cannot be written or is of the wrong kind (read-only file system, permission, a file where a directory is
expected or the reverse, a name too long) is bad input (3) naming the path; a connection failure is a remote
error (4). Other errnos are not the user's situation: the caller treats them as a bug in mm.
"""
from __future__ import annotations

import errno
import os

from .untrusted import printable

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
BAD_PATH = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EISDIR: "is a directory (a file is expected here)",
    errno.ENOTDIR: "a component of this path is not a directory (a directory is expected here)",
    errno.ENAMETOOLONG: "file name too long for this file system",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "already exists",
    errno.ENOTEMPTY: "directory not empty",
    errno.ELOOP: "too many levels of symbolic links",
    errno.EXDEV: "crosses file systems",
    errno.EMLINK: "too many links",
    errno.ETXTBSY: "file busy",
    errno.EINVAL: "invalid argument for this file system (a name it cannot hold?)",
    errno.EIO: "input/output error (the disk or the medium is failing)",
    errno.EILSEQ: "a name this file system cannot hold",
}


def mount_point(path: str) -> str:
    """The mount point of the file system holding PATH (or its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    while not os.path.ismount(p):
        p = os.path.dirname(p)
    return p


def describe_os_error(exc: OSError, target: str | None = None) -> tuple[int, str] | None:
    """(exit code, message) for EXC, or None when it is not the user's situation (a bug in mm)."""
    path = exc.filename if exc.filename is not None else target
    path = os.fsdecode(path) if isinstance(path, bytes) else path
    shown = printable(str(path)) if path is not None else None
    if exc.errno in FULL:
        where = shown or "the output"
        try:
            disk = mount_point(str(path)) if path is not None else None
        except (OSError, ValueError):
            disk = None
        on = f" (the file system mounted at {printable(disk)} is full)" if disk else ""
        return 7, f"{where}: no space left on device{on}; free space there or choose another disk"
    if isinstance(exc, ConnectionError) or exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT,
                                                         errno.EHOSTUNREACH, errno.ENETUNREACH):
        return 4, f"{shown or 'connection'}: {exc.strerror or exc}"
    if exc.errno in BAD_PATH:
        other = f" -> {printable(os.fsdecode(exc.filename2))}" if exc.filename2 is not None else ""
        return 3, f"{shown or 'a path'}{other}: {BAD_PATH[exc.errno]}"
    return None
