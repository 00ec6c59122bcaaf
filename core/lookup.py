"""The context branch: continuations copied from earlier in the conversation.

Where a reply copies (summaries, answers quoting a passage, code edits,
follow-up turns), the tokens after an earlier occurrence of the reply's last
few tokens are likely next. Several earlier occurrences can continue
differently, and a longer match is a better bet than a short one, so every
earlier occurrence of the final bigram is a candidate, ranked by how far the
match extends backwards, and copied for longer where the match is long. Each
copied node gets a prior confidence from its match length and offset, which
calibration (core/calibration.py) turns into an acceptance estimate that
competes with the head's nodes for the tree's node budget."""

from __future__ import annotations

from dataclasses import dataclass

LONGEST_MATCH = 32  # how far back a match is extended when ranking candidates
RECENT = 64  # earlier occurrences of the final bigram considered, latest first


@dataclass(frozen=True)
class Branch:
    tokens: tuple[int, ...]  # the copied continuation
    match: int  # tokens matched before it (>= 2)
    rank: int  # 0 for the best-matching candidate, then 1, 2, ...

    def confidence(self, offset: int) -> float:
        """Prior chance that the first `offset` copied tokens are all right:
        a match of m tokens continues with probability about m / (m + 1)
        per token, shared among the candidates that compete with it."""
        per_token = self.match / (self.match + 1)
        return per_token**offset / (self.rank + 1)


class ContextIndex:
    """The committed tokens with the end positions of every bigram, kept as
    tokens are committed, so finding all earlier matches is a dictionary look-up."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, int], list[int]] = {}  # bigram -> positions just after its occurrences

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            if len(self.tokens) >= 2:
                self.ends.setdefault((self.tokens[-2], self.tokens[-1]), []).append(len(self.tokens))

    def continuation(self, count: int, longest: int = 4, shortest: int = 2) -> list[int]:
        """core.tree.lookup_continuation of the tokens, from the final bigram's
        earlier ends instead of a scan of the whole conversation at every step."""
        context = self.tokens
        end = len(context)
        ends = self.ends.get(tuple(context[-2:]), []) if end >= 2 else []
        for size in range(min(longest, end - 1), shortest - 1, -1):
            pattern = context[-size:]
            for position in reversed(ends):
                if position < end and position >= size and context[position - size : position] == pattern:
                    return context[position : position + count]
        return []

    def branches(self, count: int, longest: int) -> list[Branch]:
        """Up to `count` distinct continuations of the latest earlier matches
        of the final bigram, longest match first (the latest among equals),
        each copied for up to min(longest, 2 * match + 2) tokens."""
        context = self.tokens
        if len(context) < 3 or count < 1 or longest < 1:
            return []
        end = len(context)
        found = []
        for position in reversed(self.ends.get((context[-2], context[-1]), [])[-RECENT - 1 :]):
            if position >= end:
                continue  # the final bigram itself
            match = 2
            while match < LONGEST_MATCH and position - match - 1 >= 0 and context[position - match - 1] == context[end - match - 1]:
                match += 1
            length = min(longest, 2 * match + 2)
            continuation = tuple(context[position : position + length])
            if continuation:
                found.append((match, -len(found), continuation))
        found.sort(reverse=True)
        branches, seen = [], set()
        for match, _, continuation in found:
            if continuation in seen:
                continue
            seen.add(continuation)
            branches.append(Branch(continuation, match, len(branches)))
            if len(branches) == count:
                break
        return branches
