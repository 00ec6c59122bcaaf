"""Paths as the user types them (`~` and `~user` expanded, or refused by
name), tensors written there with the path named when the disk refuses, and
files moved into place while another program holds them for a moment."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from models.errors import ModelNotFoundError


def user_path(text: str | Path) -> Path:
    """`text` with `~` expanded. A `~user` that names no user here (pathlib
    raises a bare RuntimeError for it) is refused, naming the user."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        user = str(text)[1:].split("/", 1)[0].split("\\", 1)[0]
        raise ModelNotFoundError(f"{text}: no user {user!r} on this computer, so ~{user} cannot be expanded") from None


def while_held(move: Callable[[Path, Path], object], source: Path, target: Path, tries: int) -> None:
    """move(source, target), tried again for a moment (up to `tries` times) where
    another program holds a file in it: on Windows a virus scanner or the search
    indexer reading a file just written refuses its replacing or renaming."""
    for attempt in range(tries):
        try:
            move(source, target)
            return
        except PermissionError:
            if attempt == tries - 1:
                raise
            time.sleep(0.05 * 2**attempt)


def save_tensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, whose own error (a full disk) names no file and
    is no OSError: an OSError naming `path` instead."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except (SafetensorError, OSError) as error:  # the file's writing, not the tensors (a ValueError names those)
        raise OSError(f"{path}: cannot be written ({error})") from error
