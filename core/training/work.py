"""What a training command's work folder holds, told without loading torch
(an error handler asks, possibly while torch is still being imported)."""

from __future__ import annotations

from pathlib import Path

BASE_FILE = "base-model.json"  # which base model (and quantization) made the work folder's answers and features
LOCK_FILE = "running.lock"  # held by the command working in the folder: a second one is refused


def holds_a_run(work: Path) -> bool:
    """Whether `work` holds an earlier run's work for --resume to continue:
    more than the record of its base model (a run refused once it had loaded
    one leaves that alone) and the lock a run takes."""
    try:
        return work.is_dir() and any(entry.name not in (BASE_FILE, LOCK_FILE) for entry in work.iterdir())
    except OSError:
        return False
