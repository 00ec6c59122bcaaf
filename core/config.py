"""Decoding settings: frozen dataclasses built once at the edge and passed down."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace

MODES = ("vanilla", "eagle", "eagle2")

SEED_LIMIT = 2**32  # seeds drawn for sampling settings without one are below this
TOP_K_LIMIT = 1_000_000  # the largest top-k the page, the API and the commands take (past any vocabulary: off)
SEEDS = (-(2**63), 2**63 - 1)  # the seeds the API and the commands take (any 64-bit integer, as OpenAI's; there -1 draws a fresh one)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much mass (0: the most likely alone)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    max_new_tokens: int = 256  # hard limit on generated tokens
    seed: int | None = None  # seeds the sampling generator; None draws a fresh seed

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or a filter that keeps the most likely token alone (top-k 1, top-p 0):
        the exact argmax, which the lm_head's rounded logits could tie with another token."""
        return self.temperature == 0 or self.top_k == 1 or self.top_p == 0

    def seeded(self) -> SamplingParams:
        """These settings with a seed drawn (below 2**32) where they sample
        without one, so that what was made with them can name its seed."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbelow(SEED_LIMIT))


# the tree settings the API, chat and bench accept (the page's sliders span less): field -> (lowest, highest)
TREE_LIMITS = {"total_tokens": (0, 256), "depth": (1, 16), "top_k": (1, 32), "lookup_tokens": (0, 64), "context_branches": (1, 16)}


@dataclass(frozen=True)
class TreeParams:
    """By default (total_tokens 0) every tree is sized by the planner from
    this device's measured costs and calibrated acceptance (core/planner.py):
    a 2-core CPU, where a 16-node pass costs twice a one-node pass, gets small
    trees or none; a GPU, where 60 nodes cost about one, gets big ones. A
    fixed total_tokens is EAGLE-2's own rule (the official GPU setting is 60
    total, depth 5-6, top_k 10)."""

    total_tokens: int = 0  # nodes verified per step, the root included (EAGLE-2 reranking budget); 0 = sized by the planner
    depth: int = 8  # most draft expansions of the head per step (branches copied from the context may go deeper)
    top_k: int = 6  # children per expanded node, and nodes expanded per depth
    min_path_prob: float = 0.0  # stop deepening once the best frontier path's draft probability is below this; 0 = never
    lookup_tokens: int = 16  # longest branch copied from the context after a repeated n-gram; 0 = off
    context_branches: int = 4  # copied branches from different earlier matches, when the planner sizes the tree

    def __post_init__(self):
        if self.total_tokens != 0 and self.total_tokens < 2:
            raise ValueError(f"total_tokens must be 0 (sized by the planner) or >= 2, got {self.total_tokens}")
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0 <= self.min_path_prob < 1:
            raise ValueError(f"min_path_prob must be in [0, 1), got {self.min_path_prob}")
        if self.lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0, got {self.lookup_tokens}")
        if self.context_branches < 1:
            raise ValueError(f"context_branches must be >= 1, got {self.context_branches}")

    @property
    def planned(self) -> bool:
        """Whether the planner sizes each tree (total_tokens 0)."""
        return self.total_tokens == 0

    @property
    def head_capacity(self) -> int:
        """Most nodes the head can draft into a fixed tree, the root included:
        top_k at the first depth and top_k children of top_k nodes at each
        deeper one (EAGLE-2's expansion, core/drafter.py)."""
        return 1 + self.top_k + (self.depth - 1) * self.top_k**2

    def shortfall(self, labels: tuple[str, str, str] = ("total tokens", "depth", "top-k")) -> str | None:
        """A note where a fixed total_tokens is more than depth and top_k can
        draft (the trees then hold fewer nodes than asked), else None.
        labels: how the user names total_tokens, depth and top_k."""
        if self.planned or self.total_tokens <= self.head_capacity:
            return None
        total, depth, top_k = labels
        return (
            f"{total} {self.total_tokens} is more than {depth} {self.depth} and {top_k} {self.top_k} can draft: "
            f"trees hold at most {self.head_capacity} tokens (the root included, before any copied from the "
            f"context). Raise {depth} or {top_k} for bigger trees."
        )
