"""What a training command's work folder holds, told without loading torch
(an error handler asks, possibly while torch is still being imported)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

BASE_FILE = "base-model.json"  # which base model (and quantization) made the work folder's answers and features
LOCK_FILE = "running.lock"  # held by the command working in the folder: a second one is refused
RUN_FILE = "run.json"  # the run's id, also recorded in the report of each head it writes
RECORDS = (BASE_FILE, LOCK_FILE, RUN_FILE)  # written before any work: no run to continue on their own
CACHES = ("answers", "documents", "requests")  # train-head's answers, long-prompts' and self-prompts' caches
# the settings each cache's records are made with: written before the first batch, they are no work of their own
SETTINGS_FILES = {f"{cache}-settings.json" for cache in CACHES}
# what the training commands write into a work folder besides the records: train-head's answers, phase
# times, features and checkpoints; long-prompts' and self-prompts' caches and their settings
WORK_ENTRIES = {
    *(f"{cache}.jsonl" for cache in CACHES), *SETTINGS_FILES,
    "phases.json", "phases.json.partial", "features", "features-eagle3", "train", "train-eagle3",
}  # fmt: skip
# a head's files (models.head, core.training.report), named here without importing torch
HEAD_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "training_report.json", "TRAINING.md")


def holds_a_run(work: Path) -> bool:
    """Whether `work` holds an earlier run's work for --resume to continue:
    what a run writes there, more than the records of its model and id (a run
    refused once it had loaded its model leaves those alone), the settings of
    its caches and the lock a run takes."""
    try:
        return work.is_dir() and any(entry.name in WORK_ENTRIES - SETTINGS_FILES for entry in work.iterdir())
    except OSError:
        return False


def not_a_work_folder(work: Path) -> str | None:
    """Why `work` is no work folder of a training command, where it holds
    what none writes (a head's or a model's files, say); None where it holds
    only what they write, or nothing. Hidden files (a desktop's own, a
    check's temporary file) are no sign either way."""
    try:
        names = sorted(entry.name for entry in work.iterdir() if not entry.name.startswith("."))
    except OSError:  # no folder yet (or not one to read): said where it is written
        return None
    # a file a run writes whole goes by NAME.partial first (models.paths.write_whole): a kill can leave one
    names = [name for name in names if name.removesuffix(".partial") not in (*RECORDS, *WORK_ENTRIES)]
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    looks = "a draft head's or a model's folder" if any(name in HEAD_FILES for name in names) else "a folder of other files"
    return f"{work}: holds {shown}, which no training run writes: it looks like {looks}, not a run's work folder"


def run_id(work: Path) -> str | None:
    """The id of the run whose work `work` holds, where one is recorded."""
    try:
        recorded = json.loads((work / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded.get("run") if isinstance(recorded, dict) and isinstance(recorded.get("run"), str) else None


def start_run(work: Path) -> str:
    """The run's id: the one `work` records, else a new one recorded there
    (a work folder from before the record gets one now, so that a head its
    earlier runs wrote, which records none, is not taken for its own)."""
    known = run_id(work)
    if known:
        return known
    new = uuid.uuid4().hex
    work.mkdir(parents=True, exist_ok=True)
    (work / RUN_FILE).write_text(json.dumps({"run": new}) + "\n", encoding="utf-8")
    return new
