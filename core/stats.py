"""Live decoding statistics. tau (mean accepted length) is tokens committed per
base-model forward, the bonus token included; vanilla decoding has tau = 1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

SHORT_REPLY = 32  # tokens: a reply shorter than this is timed mostly by its prompt's reading, not its decoding


@dataclass(frozen=True)
class Snapshot:
    tokens: int  # tokens generated so far
    forwards: int  # base-model forwards so far, the prefill included
    seconds: float  # since the request started
    time_to_first_token: float | None  # seconds until the first token
    tokens_per_s: float  # tokens / seconds
    mean_accepted_length: float  # tau = tokens / forwards
    draft_seconds: float  # total time spent drafting (head forwards)
    verify_seconds: float  # total time in base-model forwards and acceptance
    acceptance_by_depth: tuple[float, ...]  # [d-1]: share of steps whose tree reached depth d that accepted a token there
    mean_tree_size: float = 1.0  # nodes verified per step after the prefill, the root included
    mean_tree_depth: float = 0.0  # depth of those trees (0 for a root-only step)
    first_tokens: int = 0  # tokens committed by the step that gave the first token
    reused_tokens: int = 0  # prompt tokens whose keys and values were kept from an earlier request, not read again

    @property
    def decoding_tokens_per_s(self) -> float | None:
        """Tokens after the first / seconds since it: the decoding rate without the time spent
        reading the prompt (None until a step after the first token has committed some)."""
        later = self.tokens - self.first_tokens
        decoding = self.seconds - (self.time_to_first_token or 0.0)
        return later / decoding if later > 0 and decoding > 0 else None

    def without_last(self, count: int) -> Snapshot:
        """The figures as if the last `count` tokens had not been made (tokens a stop
        string cuts from a reply); the time, forwards and trees stay as they were."""
        tokens = self.tokens - count
        return replace(
            self,
            tokens=tokens,
            tokens_per_s=tokens / self.seconds if self.seconds > 0 else 0.0,
            mean_accepted_length=tokens / self.forwards if self.forwards else 0.0,
        )


@dataclass
class Recorder:
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    forwards: int = 0
    first_token_at: float | None = None
    first_tokens: int = 0  # tokens committed by the step that gave the first token
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    depth_offered: list[int] = field(default_factory=list)  # [d-1]: steps whose tree had depth >= d
    depth_accepted: list[int] = field(default_factory=list)  # [d-1]: steps that accepted >= d drafted tokens
    tree_nodes: int = 0  # nodes verified by the steps after the prefill
    tree_depths: int = 0  # and the sum of their trees' depths
    reused: int = 0  # prompt tokens kept in the caches from an earlier request

    def record(
        self, tokens: int, accepted: int, tree_size: int, tree_depth: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        """One forward's step: `tokens` the reply got from it, `accepted` the
        drafted tokens the verifier accepted (for the depth chart: more than
        the reply got where the token budget or a stop token cut the step)."""
        now = time.perf_counter()
        if self.forwards:  # the prefill is not a tree
            self.tree_nodes += tree_size
            self.tree_depths += tree_depth
        if self.first_token_at is None and tokens:
            self.first_token_at, self.first_tokens = now, tokens
        self.tokens += tokens
        self.forwards += 1
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        while len(self.depth_offered) < tree_depth:
            self.depth_offered.append(0)
            self.depth_accepted.append(0)
        for depth in range(tree_depth):
            self.depth_offered[depth] += 1
            self.depth_accepted[depth] += depth < accepted

    def snapshot(self) -> Snapshot:
        seconds = time.perf_counter() - self.started
        return Snapshot(
            tokens=self.tokens,
            forwards=self.forwards,
            seconds=seconds,
            time_to_first_token=None if self.first_token_at is None else self.first_token_at - self.started,
            tokens_per_s=self.tokens / seconds if seconds > 0 else 0.0,
            mean_accepted_length=self.tokens / self.forwards if self.forwards else 0.0,
            draft_seconds=self.draft_seconds,
            verify_seconds=self.verify_seconds,
            acceptance_by_depth=tuple(a / o for a, o in zip(self.depth_accepted, self.depth_offered)),
            mean_tree_size=self.tree_nodes / (self.forwards - 1) if self.forwards > 1 else 1.0,
            mean_tree_depth=self.tree_depths / (self.forwards - 1) if self.forwards > 1 else 0.0,
            first_tokens=self.first_tokens,
            reused_tokens=self.reused,
        )
