"""Drafting with an EAGLE head: the EAGLE-2 context-aware dynamic tree, the
static EAGLE-1 tree, and the head's own KV cache of committed positions.

Alignment (EAGLE): the head's input at position t is [embed(token_{t+1}),
feature_t]; its output predicts feature_{t+1}, and lm_head of that gives the
distribution of token_{t+2}. With n committed pairs, a node at depth d (the
root has depth 0) enters the head at position n + d - 1."""

from __future__ import annotations

import math

import torch

from core import int8
from core.config import TreeParams
from core.tree import DraftTree, graft, lookup_continuation, make_tree, rerank, subtree
from models.head import DraftHead, HeadCache

# EAGLE-1's static tree, sized for a CPU: each path lists child ranks from the
# root, e.g. (0, 1) is the head's second choice after its first choice.
STATIC_PATHS = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
    (0, 0, 0, 0, 0),
)  # fmt: skip


class DraftVocabulary:
    """The drafter's lm_head: the base model's output rows for the tokens the
    head drafts from, kept in a fast form (int8 where `int8.available`, else
    bf16 on CPUs). It only ranks proposals, which the base model then verifies
    in its own precision, so its rounding never changes the output."""

    def __init__(self, lm_head: torch.nn.Module, token_ids: torch.Tensor | None):
        weight = lm_head.weight.detach()
        if token_ids is not None:
            weight = weight[token_ids.to(weight.device)]
        self.packed = self.scales = self.weight = None
        if int8.available(weight.device):
            self.packed, self.scales = int8.quantize_rows(weight)  # half the bytes of bf16 to read per call
        else:
            if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.float64):
                weight = weight.to(torch.bfloat16)  # CPUs run bf16 products several times faster
            self.weight = weight.contiguous()  # (V', H)
        self.token_ids = None if token_ids is None else token_ids.to(weight.device)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (m, H) -> (m, V') log-probabilities over the draft vocabulary, float32."""
        if self.packed is not None:
            logits = int8.matmul(hidden, self.packed, self.scales)
        else:
            logits = hidden.to(self.weight.dtype) @ self.weight.T
        return torch.log_softmax(logits.float(), dim=-1)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.token_ids is None else self.token_ids[draft_ids]


class Drafter:
    def __init__(self, head: DraftHead, base_model, params: TreeParams, static_paths=None, vocabulary=None):
        self.head = head
        self.embed = head.embed_tokens if head.embed_tokens is not None else base_model.get_input_embeddings()
        self.vocabulary = vocabulary or DraftVocabulary(base_model.get_output_embeddings(), head.draft_token_ids)
        self.params = params
        self.static_paths = sorted(static_paths, key=lambda path: (len(path), path)) if static_paths else None
        self.cache = HeadCache()
        self.last_hidden: torch.Tensor | None = None  # (H,) predicted feature at the root's position
        self.context: list[int] = []  # committed tokens after the first, ending with the root: for prompt lookup
        self.dtype = head.dtype

    @property
    def committed(self) -> int:
        return self.cache.length

    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Encode committed pairs (feature_t, token_{t+1}) from the base model's
        true features; features (T, H), next_tokens (T,)."""
        start, count = self.cache.length, len(next_tokens)
        device = features.device
        positions = torch.arange(start, start + count, device=device)
        mask = None  # an empty cache: plain causal attention, no (T, T) mask to build
        if start:
            causal = torch.ones(count, count, dtype=torch.bool, device=device).tril()
            mask = torch.cat([torch.ones(count, start, dtype=torch.bool, device=device), causal], dim=1)[None, None]
        hidden = self.head(self.embed(next_tokens)[None], features.to(self.dtype)[None], positions[None], mask, self.cache)
        self.last_hidden = hidden[0, -1]
        self.context.extend(next_tokens.tolist())

    def draft(self, root: int) -> DraftTree:
        """A tree of drafted continuations of `root`; the head cache is left as it was."""
        committed = self.cache.length
        try:
            if self.static_paths is not None:
                tokens, parents = self._draft_static()
            else:
                tokens, parents = self._draft_dynamic()
        finally:
            self.cache.crop(committed)
        if self.params.lookup_tokens:
            tokens, parents = graft(tokens, parents, lookup_continuation(self.context, self.params.lookup_tokens))
        return make_tree(root, tokens, parents)

    def _top(self, hidden: torch.Tensor, k: int):
        """hidden (m, H) -> the k best next tokens of each row: (log-probs (m, k), target ids (m, k))."""
        top = self.vocabulary.log_probs(hidden).topk(k, dim=-1)
        return top.values, self.vocabulary.target_ids(top.indices)

    def _draft_dynamic(self) -> tuple[list[int], list[int]]:
        """EAGLE-2: expand the top_k frontier nodes by cumulative log-probability
        at every depth, then keep the best total_tokens - 1 of all candidates."""
        k = self.params.top_k
        expander = _Expander(self)
        values, ids = self._top(self.last_hidden[None], k)
        tokens, parents = ids[0].tolist(), [-1] * k
        scores = [values[0]]
        frontier = list(range(k))
        frontier_scores = values[0]  # (k,)
        floor = math.log(self.params.min_path_prob) if self.params.min_path_prob > 0 else -math.inf
        keep = self.params.total_tokens - 1
        for _ in range(1, self.params.depth):
            if float(frontier_scores.max()) < floor:  # dynamic depth: deeper nodes would hardly be accepted
                break
            if _settled(torch.cat(scores), frontier_scores, keep):  # deeper nodes cannot be kept: same tree, less work
                break
            values, ids = self._top(expander.expand(frontier, tokens, parents), k)  # (m, k) each
            child_scores = (frontier_scores[:, None] + values).flatten()  # (m * k,)
            first = len(tokens)
            tokens += ids.flatten().tolist()
            parents += [parent for parent in frontier for _ in range(k)]
            scores.append(child_scores)
            best = torch.sort(-child_scores, stable=True).indices[:k]
            frontier = (best + first).tolist()
            frontier_scores = child_scores[best]
        chosen = rerank(torch.cat(scores), parents, self.params.total_tokens - 1)
        return subtree(tokens, parents, chosen)

    def _draft_static(self) -> tuple[list[int], list[int]]:
        """EAGLE-1: the fixed tree of STATIC_PATHS, filled with the head's ranked choices."""
        expander = _Expander(self)
        index_of: dict[tuple[int, ...], int] = {}
        tokens, parents = [], []
        widest = 1 + max(path[0] for path in self.static_paths if len(path) == 1)
        first_choices = self._top(self.last_hidden[None], widest)[1][0].tolist()
        deepest = max(len(path) for path in self.static_paths)
        for depth in range(1, deepest + 1):
            level = [path for path in self.static_paths if len(path) == depth]
            if depth == 1:
                choices = {(): first_choices}
            else:
                expanded = sorted({path[:-1] for path in level})
                hidden = expander.expand([index_of[path] for path in expanded], tokens, parents)
                widths = 1 + max(path[-1] for path in level)
                ranked = self._top(hidden, widths)[1].tolist()
                choices = dict(zip(expanded, ranked))
            for path in level:
                index_of[path] = len(tokens)
                tokens.append(choices[path[:-1]][path[-1]])
                parents.append(index_of.get(path[:-1], -1))
        return tokens, parents


def _settled(scores: torch.Tensor, frontier_scores: torch.Tensor, keep: int) -> bool:
    """Whether reranking's best `keep` of `scores` is final. Every later
    candidate descends from the frontier, so its score is at most its
    frontier ancestor's (log-probabilities are <= 0), and it loses ties to the
    earlier candidates; none can enter once no frontier score beats the
    keep-th best score so far."""
    if len(scores) < keep:
        return False
    return float(frontier_scores.max()) <= float(scores.topk(keep).values[-1])


class _Expander:
    """Feeds drafted nodes through the head, one depth at a time. Each node
    attends to the committed positions, its drafted ancestors and itself."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.committed = drafter.cache.length
        self.hidden: dict[int, torch.Tensor] = {}  # candidate -> head output (H,)
        self.slots: dict[int, list[int]] = {}  # candidate -> drafted cache slots it sees

    def expand(self, nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        """nodes: candidates of one depth -> (m, H) head outputs, whose lm_head gives their children."""
        drafter, device = self.drafter, self.drafter.last_hidden.device
        first_slot = drafter.cache.length - self.committed
        width = first_slot + len(nodes)
        mask = torch.zeros(len(nodes), self.committed + width, dtype=torch.bool)
        mask[:, : self.committed] = True
        features = []
        for row, node in enumerate(nodes):
            parent = parents[node]
            self.slots[node] = (self.slots[parent] if parent >= 0 else []) + [first_slot + row]
            mask[row, [self.committed + slot for slot in self.slots[node]]] = True
            features.append(self.hidden[parent] if parent >= 0 else drafter.last_hidden)
        depth = len(self.slots[nodes[0]])
        positions = torch.full((1, len(nodes)), self.committed + depth - 1, device=device)
        node_tokens = torch.tensor([tokens[node] for node in nodes], device=device)
        hidden = drafter.head(
            drafter.embed(node_tokens)[None],
            torch.stack(features)[None],
            positions,
            mask.to(device)[None, None],
            drafter.cache,
        )[0]  # (m, H)
        for row, node in enumerate(nodes):
            self.hidden[node] = hidden[row]
        return hidden
