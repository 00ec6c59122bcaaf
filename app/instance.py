"""One running Kestrel per data folder: where the folder is, the lock that
keeps a second start from serving it too, and that start opening the running
one's page. Light to import (no torch, gradio or pandas), so that a second
start (a double-click twice) answers at once instead of after the imports."""

from __future__ import annotations

import os
import sys
import webbrowser
from pathlib import Path

import platformdirs

from core.file_lock import lock_now, unlock
from models.errors import KestrelError


def data_dir() -> Path:
    """Kestrel's user data folder; KESTREL_DATA_DIR overrides it (tests)."""
    override = os.environ.get("KESTREL_DATA_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir("kestrel"))  # "~/..." as a shell would


ROOT = Path(__file__).resolve().parent.parent
CODE_FOLDERS = ("app", "core", "models")  # what an update changes, with launch.py


def code_stamp(root: Path = ROOT) -> str:
    """This Kestrel's folder and the time of its code's latest change: a
    running Kestrel with another stamp is another copy, or this one before an
    update (a new copy, or files pulled over these)."""
    files = [root / "launch.py", *(path for folder in CODE_FOLDERS for path in (root / folder).rglob("*.py"))]
    newest = max((path.stat().st_mtime_ns for path in files if path.is_file()), default=0)
    return f"{newest} {root}"


LOCK_FILE = "kestrel.lock"
LOCKED_BYTE = 1 << 16  # where Windows locks the file: past the address it holds


class FolderLockError(KestrelError):
    """A folder whose file system takes no file locks, so that a second run could not be kept out."""


class DataLock:
    """One running page per data folder: two would each save their own view of
    a chat over the other's. Held as an OS file lock, which ends with the
    process however it ends (no stale lock after a crash); the file names the
    holder's address, for a second start to open instead."""

    def __init__(self, folder: Path, name: str = LOCK_FILE):
        self.path = folder / name
        self._file = None

    def acquire(self) -> bool:
        """True when this process now holds the folder, or when nothing can be
        written there at all (no lock can be taken; the page names the problem
        at load and no chat is saved); False when another process holds it.
        FolderLockError where files there can be written but not locked."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held open while the lock is held)
        except OSError:  # a read-only folder, or a file where the folder belongs
            return True
        try:
            locked = lock_now(file, LOCKED_BYTE)  # on Windows a byte past the address, so that a second start can read that
        except OSError as error:  # no process holds the folder, nor can one
            file.close()
            # the data folder is chosen by KESTREL_DATA_DIR; a command's work folder by its options
            choose = "set KESTREL_DATA_DIR to" if self.path.name == LOCK_FILE else "use"
            raise FolderLockError(
                f"{self.path.parent}: files there cannot be locked ({error.strerror or error}), and without a lock a second "
                f"Kestrel could write over this one's files there; {choose} a folder on a local disk"
            ) from error
        if not locked:
            file.close()
            return False
        self._file = file
        file.truncate(0)  # a previous holder's address is no longer served
        file.flush()
        return True

    def announce(self, url: str) -> None:
        """Name this process's address in the lock file, and its code's stamp, for a second start."""
        if self._file is None:  # no lock could be taken (nothing can be written there)
            return
        self._file.truncate(0)
        self._file.seek(0)
        self._file.write(f"{url}\n{code_stamp()}")
        self._file.flush()

    def holder(self) -> str:
        """The address the holding process announced ("" while it starts)."""
        return self._announced()[0]

    def holder_stamp(self) -> str:
        """The holding process's code_stamp ("" while it starts)."""
        return self._announced()[1]

    def _announced(self) -> tuple[str, str]:
        try:
            url, _, stamp = self.path.read_text(encoding="utf-8").partition("\n")
        except (OSError, UnicodeDecodeError):
            return "", ""
        return url.strip(), stamp.strip()

    def release(self) -> None:
        if self._file is not None:
            unlock(self._file, LOCKED_BYTE)
            self._file = None


def open_browser(url: str) -> None:
    """The page in the desktop's browser. Without a graphical session (Linux
    over ssh, a server), none: Python's fallback is a text browser such as
    lynx, which would take over the terminal that shows Kestrel's own lines."""
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return
    webbrowser.open(url)


def tell_running(lock: DataLock, store_dir: Path, no_browser: bool) -> int:
    """A second start on a held data folder: name the running Kestrel and
    open its page (it keeps the chats; a second would save over them)."""
    url, stamp = lock.holder(), lock.holder_stamp()
    where = f"at {url}" if url else "(still starting)"
    mine = code_stamp()
    if url and stamp != mine:  # opening its page would pass the older Kestrel off as this one
        # no stamp beside its address: a Kestrel from before stamps were written, so before an update
        folder = stamp.partition(" ")[2]
        which = f"from {folder}" if folder and folder != mine.partition(" ")[2] else "started before this one's files were updated"
        print(f"Another Kestrel, {which}, is running {where} with the chats in {store_dir}. "
              "Close it (Ctrl+C in its window) and start this one again to use it.", flush=True)  # fmt: skip
        return 1
    print(f"Kestrel is already running {where} with the chats in {store_dir}; "
          "a second one would save over its chats. Set KESTREL_DATA_DIR to run another with chats of its own.", flush=True)  # fmt: skip
    if url and not no_browser:
        open_browser(url)
    return 0
