"""Paths as the user types them (`~` and `~user` expanded, or refused by
name), tensors and text written there with the path named when the disk
refuses (text whole or not at all), and files moved into place while another
program holds them for a moment."""

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


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a full disk leaves the file
    there as it was (a report cut short would be JSON that no longer reads),
    with an OSError naming `path`."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise OSError(f"{path}: cannot be written ({error.strerror or error})") from error
