"""Files the page's handlers read: Gradio's copies of what the user uploaded,
kept in a folder of the user's own."""

from __future__ import annotations

import os
from pathlib import Path

from models.bundled import cache_root

FOLDER = "page-files"  # under Kestrel's cache


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
    os.environ["GRADIO_TEMP_DIR"] = str(folder)


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
