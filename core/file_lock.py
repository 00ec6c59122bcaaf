"""Non-blocking OS file locks on one byte of an open file: flock where there is
one, msvcrt.locking on Windows. Such a lock ends with its process however that
ends, so a crash leaves none behind. Standard library only: the page's
single-instance check imports this before torch."""

from __future__ import annotations

import contextlib
import errno
import os

# The errors that mean another process holds the lock: flock's EWOULDBLOCK (EAGAIN, or EACCES
# where it is made of fcntl locks) and msvcrt.locking's EACCES (EDEADLK once it gives up). Any
# other means that the file system takes no locks (NFS without its lock service: ENOLCK; some
# shared and FUSE folders: EOPNOTSUPP, EINVAL).
LOCK_HELD = (errno.EACCES, errno.EDEADLK) if os.name == "nt" else (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def lock_now(handle, at: int = 0) -> bool:
    """Lock the open file `handle` without waiting (on Windows its byte at
    offset `at`): True once locked, False where another process holds it.
    OSError where the file system takes no locks."""
    try:
        if os.name == "nt":
            import msvcrt

            handle.seek(at)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in LOCK_HELD:
            return False
        raise
    return True


def unlock(handle, at: int = 0) -> None:
    """Let go of a lock that lock_now took, and close the file. On Windows the
    byte is unlocked first: a closed file's lock ends only when the system gets to it."""
    if os.name == "nt":
        import msvcrt

        with contextlib.suppress(OSError):
            handle.seek(at)
            msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
    handle.close()
