"""Files the page's handlers read: Gradio's copies of what the user uploaded,
kept in a folder of the user's own."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from models.bundled import cache_root

FOLDER = "page-files"  # under Kestrel's cache
STALE_S = 86400  # what is older at a start goes


def keep_private() -> None:
    """Gradio's copies of uploads and exports go to a folder only this user may
    open (under Kestrel's cache) rather than /tmp/gradio, where any user of the
    machine could read them, or have made the folder first and own them. Called
    before the page is built (its components take the folder then). A
    GRADIO_TEMP_DIR set by the user stands; where the folder cannot be made, Gradio's own."""
    if os.environ.get("GRADIO_TEMP_DIR"):
        return
    folder = cache_root() / FOLDER
    try:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
    except OSError:
        return
    remove_stale(folder)
    os.environ["GRADIO_TEMP_DIR"] = str(folder)


def remove_stale(folder: Path) -> None:
    """Remove what a day old lies in `folder`: Gradio removes its copies as a
    day passes and at a clean stop, not those of a process that was killed."""
    oldest = time.time() - STALE_S
    for entry in folder.iterdir():
        try:
            if entry.lstat().st_mtime < oldest:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError:  # held by another program (Windows), or gone meanwhile
            pass


def uploaded(path: str | os.PathLike) -> bool:
    """Whether `path` is a file the page uploaded (in Gradio's upload folder).
    Gradio checks the paths a client names only for an app it launched itself,
    and Kestrel mounts it: a client could name any file on this computer."""
    from gradio.utils import get_upload_folder

    try:
        Path(path).resolve().relative_to(Path(get_upload_folder()).resolve())
    except (ValueError, OSError):
        return False
    return True
