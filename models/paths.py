"""Paths as the user types them (`~` and `~user` expanded, or refused by
name), and tensors written there with the path named when the disk refuses."""

from __future__ import annotations

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


def save_tensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, whose own error (a full disk) names no file and
    is no OSError: an OSError naming `path` instead."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except (SafetensorError, OSError) as error:  # the file's writing, not the tensors (a ValueError names those)
        raise OSError(f"{path}: cannot be written ({error})") from error
