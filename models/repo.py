"""A Hugging Face repo as the user names it: `owner/name` (the default
branch), or `owner/name@REV` pinned to a revision (a branch, tag or commit
hash), the form vLLM and other tools take. Every hub request for the repo
carries the revision; the name as typed, with its @REV, stays the model's or
head's name, so what is keyed by that name (the cached step costs, the API's
model id, a training report's base model) tells revisions apart."""

from __future__ import annotations

import re
from dataclasses import dataclass

from models.errors import ModelNotFoundError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
PINNED = "owner/name@REV (REV a branch, tag or commit hash)"


@dataclass(frozen=True)
class Repo:
    id: str  # owner/name, as the hub's functions take it
    revision: str | None  # a branch, tag or commit hash; None = the repo's default branch


def parse_repo(source: str) -> Repo | None:
    """The repo `source` names; None where it names none (no '@', and not
    owner/name). A source with an '@' is meant as a pinned repo, so a bad one
    is refused naming what is wrong. Callers look for a local file or folder
    first: a path with an '@' in it that exists is that path."""
    if "@" not in source:
        return Repo(source, None) if REPO_ID.match(source) else None
    repo_id, _, revision = source.partition("@")
    if "@" in revision:
        raise ModelNotFoundError(f"{source}: no such file or folder, and not a Hugging Face repo id: it has two '@'; write {PINNED}")
    if not revision:
        raise ModelNotFoundError(f"{source}: no such file or folder, and the revision after '@' is empty; write {PINNED}, "
                                 f"or {repo_id} for the default branch")  # fmt: skip
    if not REPO_ID.match(repo_id):
        raise ModelNotFoundError(f"{source}: no such file or folder, and {repo_id!r} before '@' is not a Hugging Face repo id; write {PINNED}")
    return Repo(repo_id, revision)
