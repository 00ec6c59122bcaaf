"""Draft trees: nodes in parent-first order, node 0 the root (the token the base
model sampled last), each other node a drafted token with one parent."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # (N,) int64, tokens[0] is the root
    parents: tuple[int, ...]  # parents[i] < i for i > 0; parents[0] == -1
    depths: torch.Tensor  # (N,) int64, root depth 0: the position offset of each node

    @property
    def size(self) -> int:
        return len(self.parents)

    def children(self) -> list[list[int]]:
        """children()[i]: the nodes whose parent is i, in rank order (best first)."""
        result = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents[1:], start=1):
            result[parent].append(node)
        return result

    def internal(self) -> list[int]:
        """The nodes with children, in order (the ones acceptance can pass through)."""
        return sorted({parent for parent in self.parents if parent >= 0})


def ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """(N, N) bool: row i is True at i and at every ancestor of i."""
    size = len(parents)
    mask = torch.eye(size, dtype=torch.bool)
    for node in range(1, size):
        mask[node] |= mask[parents[node]]
    return mask


def node_depths(parents: tuple[int, ...]) -> torch.Tensor:
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return torch.tensor(depths, dtype=torch.long)


def make_tree(root: int, tokens: list[int], parents: list[int]) -> DraftTree:
    """A tree from the root token plus drafted nodes whose parents index the
    drafted list (-1 = the root); drafted nodes must come parent-first."""
    assert len(tokens) == len(parents), "one parent per drafted token"
    tree_parents = (-1,) + tuple(parent + 1 for parent in parents)
    assert all(tree_parents[i] < i for i in range(1, len(tree_parents))), "parents must precede children"
    return DraftTree(
        tokens=torch.tensor([root] + list(tokens), dtype=torch.long),
        parents=tree_parents,
        depths=node_depths(tree_parents),
    )


def shallower(tree: DraftTree, depth: int) -> DraftTree:
    """The nodes of `tree` less than `depth` deep (the root at least): a
    subtree, since a node's ancestors are shallower than it."""
    depths, tokens = tree.depths.tolist(), tree.tokens.tolist()
    kept = [node for node in range(1, tree.size) if depths[node] < depth]
    index = {node: position for position, node in enumerate(kept)}
    parents = [index[tree.parents[node]] if tree.parents[node] > 0 else -1 for node in kept]
    return make_tree(tokens[0], [tokens[node] for node in kept], parents)


def rerank(scores: torch.Tensor, parents: list[int], keep: int) -> list[int]:
    """EAGLE-2 reranking: the `keep` candidates of highest cumulative score, in
    creation order. `parents[i]` is candidate i's parent (-1 = root) and was
    created before i. A child's score never exceeds its parent's, and ties break
    towards the earlier candidate, so every kept node's parent is kept too."""
    count = scores.shape[0]
    keep = min(keep, count)
    # a stable sort on -score puts the earlier candidate first among equals
    order = torch.sort(-scores.double(), stable=True).indices[:keep]
    chosen = sorted(order.tolist())
    kept = set(chosen)
    assert all(parents[i] == -1 or parents[i] in kept for i in chosen), "reranking broke the tree"
    return chosen


def subtree(tokens: list[int], parents: list[int], chosen: list[int]) -> tuple[list[int], list[int]]:
    """Restrict candidates to `chosen` (sorted, closed under parents), re-indexing parents."""
    index = {old: new for new, old in enumerate(chosen)}
    return [tokens[i] for i in chosen], [index[parents[i]] if parents[i] >= 0 else -1 for i in chosen]


def graft(tokens: list[int], parents: list[int], chain: list[int]) -> tuple[list[int], list[int]]:
    """Add `chain` as a path from the root, sharing the nodes it already
    matches; new nodes go at the end, so parents still precede children."""
    tokens, parents = list(tokens), list(parents)
    node = -1
    for token in chain:
        match = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == token), None)
        if match is None:
            tokens.append(token)
            parents.append(node)
            match = len(tokens) - 1
        node = match
    return tokens, parents


def lookup_continuation(context: list[int], count: int, longest: int = 4, shortest: int = 2) -> list[int]:
    """Prompt lookup: the `count` tokens that followed the latest earlier
    occurrence of the context's final n-gram (longest n first)."""
    for size in range(min(longest, len(context) - 1), shortest - 1, -1):
        pattern = context[-size:]
        for start in range(len(context) - size - 1, -1, -1):
            if context[start : start + size] == pattern:
                return context[start + size : start + size + count]
    return []
