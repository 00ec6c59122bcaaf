"""Drafting with an EAGLE head: the EAGLE-2 context-aware dynamic tree, the
static EAGLE-1 tree, and the head's own KV cache of committed positions.

Alignment (EAGLE): the head's input at position t is [embed(token_{t+1}),
feature_t]; its output predicts feature_{t+1}, and lm_head of that gives the
distribution of token_{t+2}. With n committed pairs, a node at depth d (the
root has depth 0) enters the head at position n + d - 1."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from core import planner
from core.calibration import Calibration, Continuation, DraftTiming
from core.config import TreeParams
from core.lookup import ContextIndex
from core.tree import DraftTree, graft, make_tree, rerank, subtree
from models import int4, int8
from models.base import cpu_has_native_bf16
from models.head import DraftHead, HeadCache

if TYPE_CHECKING:
    from core.costs import Costs

MAX_REST = 8  # most consecutive steps a planned drafter skips drafting before it looks again, where drafts are cheap
EXPLORING = 0.1  # where they are dear: the share of a plain step's time that looking again may cost, at most
LONGEST_REST = 256  # and the most steps it then skips

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
    """The drafter's lm_head over its draft tokens, kept in a fast form (4-bit
    groups in the tile layout where the CPU has AVX512-BF16: on the reference Xeon's dev
    set eagle2 ran 116.8 against 114.2 tokens/s with int8, tau 2.68 against
    2.71 for the fixed 16-node tree; else int8 through Kestrel's kernel, or
    torch's where `int8.available`, else bf16 on CPUs with native bf16). It only
    ranks proposals, which the base model then verifies in its own precision,
    so its rounding never changes the output."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor | None, norm: torch.nn.Module | None = None):
        """weight (V', H): one row per draft token; token_ids (V',): their
        target ids (None: the whole vocabulary, in order); norm: applied to
        the head's output first (EAGLE-3's own final norm)."""
        weight = weight.detach()
        self.size = weight.shape[0]  # draft tokens: the widest choice a node can have
        self.norm = norm
        self.packed = self.weight = None
        own = int8.own_kernel_takes(weight)
        if weight.device.type == "cpu" and weight.shape[1] % int4.GROUP == 0 and int4.tiles_available():
            self.packed = int4.TileRows(weight)  # 4-bit groups in the tile layout: a quarter of bf16's bytes per call
        elif own or int8.torch_kernel_takes(weight):
            self.packed = int8.PackedRows(weight, own, tiles=own and int8.tiles_available())  # half of bf16's bytes
        else:
            if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.float64) and cpu_has_native_bf16():
                weight = weight.to(torch.bfloat16)  # such CPUs run bf16 products several times faster
            self.weight = weight.contiguous()  # (V', H)
        self.token_ids = None if token_ids is None else token_ids.to(weight.device)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (m, H) -> (m, V') log-probabilities over the draft vocabulary, float32."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.packed is not None:
            logits = self.packed(hidden)
        else:
            logits = hidden.to(self.weight.dtype) @ self.weight.T
        return torch.log_softmax(logits.float(), dim=-1)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.token_ids is None else self.token_ids[draft_ids]


def draft_vocabulary(head, base_model) -> DraftVocabulary:
    """EAGLE-1/2: the base model's output rows for the head's draft tokens;
    EAGLE-3: the head's own final norm and lm_head."""
    if getattr(head, "lm_head", None) is not None:
        return DraftVocabulary(head.lm_head.weight, head.draft_token_ids, head.norm)
    weight, token_ids = base_model.get_output_embeddings().weight, head.draft_token_ids
    if token_ids is not None:
        weight = weight[token_ids.to(weight.device)]
    return DraftVocabulary(weight, token_ids)


@dataclass(frozen=True)
class Planning:
    """What sizes trees when TreeParams.total_tokens is 0 (core/planner.py)."""

    costs: Costs  # this device's measured step costs
    head: Calibration  # acceptance of the head's nodes by draft confidence, for this sampling setting
    context: Calibration  # acceptance of the context branch's copied nodes by prior confidence
    continuation: Continuation  # how often an accepted draft path goes one level deeper
    timing: DraftTiming  # measured drafting time against the table's expansion times


@dataclass(frozen=True)
class Drafted:
    """Per drafted node of the last tree (the root excluded), what calibration learns from."""

    head_confidence: list[float]  # (N-1,) draft path probability; NaN for nodes only the context branch proposed
    context_confidence: list[float]  # (N-1,) the context branch's prior; NaN for nodes it did not propose
    depths: list[int]  # (N-1,) depth in the tree, from 1


CATCH_UP_CHUNK = 512  # committed pairs the head reads in one forward, at most


class Drafter:
    def __init__(
        self,
        head: DraftHead,
        base_model,
        params: TreeParams,
        static_paths=None,
        vocabulary=None,
        planning: Planning | None = None,
    ):
        self.head = head
        self.embed = head.embed_tokens if head.embed_tokens is not None else base_model.get_input_embeddings()
        self.vocabulary = vocabulary or draft_vocabulary(head, base_model)
        size = self.vocabulary.size  # a node has at most this many children: wider settings are cut to it
        self.params = replace(params, top_k=min(params.top_k, size))
        static_paths = [path for path in static_paths or () if max(path) < size]
        self.static_paths = sorted(static_paths, key=lambda path: (len(path), path)) if static_paths else None
        self.cache = HeadCache()
        self.last_hidden: torch.Tensor | None = None  # (H,) predicted feature at the root's position
        self.index = ContextIndex()  # the committed tokens, ending with the root: for the context branch
        self.planning = planning
        self.drafted: Drafted | None = None  # the last tree's nodes, for calibration
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # committed pairs the head has not read yet
        self.resting = 0  # planned steps left that skip drafting
        self.unprofitable = 0  # planned drafts in a row that did not pay
        self.dtype = head.dtype

    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Committed pairs (feature_t, token_{t+1}) from the base model's true
        features; features (T, F), next_tokens (T,). The head encodes them
        when it next drafts, so steps that draft nothing cost it nothing."""
        self.pending.append((features, next_tokens))
        self.index.extend(next_tokens.tolist())

    def joined_pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pending committed pairs as one (features (T, F), next tokens (T,)), or None."""
        if not self.pending:
            return None
        if len(self.pending) > 1:
            self.pending = [(torch.cat([f for f, _ in self.pending]), torch.cat([t for _, t in self.pending]))]
        return self.pending[0]

    def catch_up(self) -> None:
        """Run the head over the pending committed pairs: one forward, or one
        per CATCH_UP_CHUNK of them after a long prompt, so that no mask or
        attention grows with the square of a long conversation."""
        pending = self.joined_pending()
        if pending is None:
            return
        features, next_tokens = pending
        self.pending = []
        for first in range(0, len(next_tokens), CATCH_UP_CHUNK):
            self._read(features[first : first + CATCH_UP_CHUNK], next_tokens[first : first + CATCH_UP_CHUNK])

    def _read(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        start, count = self.cache.length, len(next_tokens)
        device = features.device
        positions = torch.arange(start, start + count, device=device)
        mask = None  # an empty cache: plain causal attention, no (T, T) mask to build
        if start:
            causal = torch.ones(count, count, dtype=torch.bool, device=device).tril()
            mask = torch.cat([torch.ones(count, start, dtype=torch.bool, device=device), causal], dim=1)[None, None]
        hidden = self.head(self.embed(next_tokens)[None], features.to(self.dtype)[None], positions[None], mask, self.cache)
        self.last_hidden = hidden[0, -1]

    def draft(self, root: int) -> DraftTree:
        """A tree of drafted continuations of `root`; the head cache is left as
        it was. A planned tree may be the root alone, drafted or not: while
        drafting does not pay (see `_rest_after`), steps skip the head."""
        self.drafted = None
        if self.params.planned and self.resting > 0:
            self.resting -= 1
            return make_tree(root, [], [])
        started = time.perf_counter()  # a planned draft's time, its catch-up included as the table counts it
        self.catch_up()
        looking = time.perf_counter()  # the catch-up is owed whenever the head next drafts: not a cost of looking
        committed = self.cache.length
        try:
            if self.static_paths is not None:
                tokens, parents = self._draft_static()
            elif self.params.planned:
                return make_tree(root, *self._draft_planned(started, looking))
            else:
                tokens, parents = self._draft_dynamic()
        finally:
            self.cache.crop(committed)
        if self.params.lookup_tokens:
            tokens, parents = graft(tokens, parents, self.index.continuation(self.params.lookup_tokens))
        return make_tree(root, tokens, parents)

    def _rest_after(self, drafted_rate: float, curve: list[float], draft_seconds: float) -> None:
        """After a planned draft that took `draft_seconds` (after its catch-up): if its expected
        rate, its drafting included, is below a plain step's (no head work at
        all), the context is one where drafting does not pay, so skip the head
        for the next steps: 1, then 2, 4, up to MAX_REST steps while that
        stays so, and further where a draft costs more than MAX_REST *
        EXPLORING of a plain step (a GPU whose passes replay as graphs while
        the head's work is dispatched op by op: one H100 there drafted for
        about 27 ms against 4 ms a step), so that the drafts that look again
        cost at most about EXPLORING of the time."""
        plain_seconds = float(curve[0])  # a step that drafts nothing does no head work (commits wait, see `commit`)
        if drafted_rate >= 1 / plain_seconds:
            self.unprofitable = 0
            return
        longest = min(max(MAX_REST, math.ceil(draft_seconds / (EXPLORING * plain_seconds))), LONGEST_REST)
        self.resting = min(2**self.unprofitable, longest)
        self.unprofitable += 1

    def discard(self) -> None:
        """The last tree was not verified (it would not fit in the context window): it teaches calibration nothing."""
        self.drafted = None

    def observe(self, path: list[int]) -> None:
        """Teach calibration which nodes of the last planned tree were accepted (path: tree nodes, root first)."""
        if self.drafted is None or self.planning is None:
            return
        drafted = self.drafted
        accepted = [False] * len(drafted.depths)
        for node in path[1:]:
            accepted[node - 1] = True
        self.planning.continuation.observe(len(path) - 1, max(drafted.depths, default=0))
        for confidences, table in ((drafted.head_confidence, self.planning.head), (drafted.context_confidence, self.planning.context)):
            known = [index for index, confidence in enumerate(confidences) if not math.isnan(confidence)]
            table.add([confidences[i] for i in known], [drafted.depths[i] for i in known], [accepted[i] for i in known])

    def top(self, hidden: torch.Tensor, k: int):
        """hidden (m, H) -> the k best next tokens of each row: (log-probs (m, k), target ids (m, k))."""
        values, indices = int8.top_k(self.vocabulary.log_probs(hidden), k)
        return values, self.vocabulary.target_ids(indices)

    def _draft_dynamic(self) -> tuple[list[int], list[int]]:
        """EAGLE-2: expand the top_k frontier nodes by cumulative log-probability
        at every depth, then keep the best total_tokens - 1 of all candidates."""
        k = self.params.top_k
        expander = Expander(self)
        values, ids = self.top(self.last_hidden[None], k)
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
            values, ids = self.top(expander.expand(frontier, tokens, parents), k)  # (m, k) each
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

    def _draft_planned(self, started: float, looking: float) -> tuple[list[int], list[int]]:
        """EAGLE-2's expansion, sized by the planner: deepen while the next level
        could raise the expected tokens per second, then keep the best n nodes
        of head and context-branch candidates by calibrated acceptance. The
        bookkeeping is in Python lists: a draft handles a few dozen candidates,
        where each torch call on so small a tensor costs more than its
        arithmetic (together they cost about 1 ms a draft on the reference Xeon)."""
        planning, k = self.planning, self.params.top_k
        costs = planning.costs
        scale, extra = planning.timing.fit
        curve = costs.verify_list(self.cache.length)
        # the table's time for this draft so far (the head's catch-up on committed
        # tokens, its first step), and that corrected by measured drafts: spent = extra + scale * predicted
        predicted = costs.overhead + costs.expand_seconds(1)
        spent = extra + scale * predicted
        expander = Expander(self)
        values, ids = self.top(self.last_hidden[None], k)
        tokens, parents = ids[0].tolist(), [-1] * k
        scores, depths = values[0].tolist(), [1] * k  # per candidate: its path's draft log-probability, its depth
        # calibrated acceptance of the head's candidates, each capped at its parent's (planner.closed)
        estimates = planning.head.estimates([math.exp(score) for score in scores], 1)
        frontier, frontier_scores = list(range(k)), values[0]
        branches = self.index.branches(self.params.context_branches, self.params.lookup_tokens)
        copied = self._copied_estimates(branches)
        floor = math.log(self.params.min_path_prob) if self.params.min_path_prob > 0 else -math.inf
        for depth in range(2, self.params.depth + 1):
            if max(scores[node] for node in frontier) < floor:
                break
            known = sorted(estimates + copied, reverse=True)
            going_on = planning.continuation.rate(depth - 1)
            children = [estimates[node] * going_on for node in frontier]  # one likely child per frontier node
            level = costs.expand_seconds(len(frontier))  # the table's time for this level
            if not planner.worth_deepening(known, children, curve, spent, scale * level):
                break
            predicted += level
            spent += scale * level
            values, ids = self.top(expander.expand(frontier, tokens, parents), k)  # (m, k) each
            child_scores = (frontier_scores[:, None] + values).flatten()  # (m * k,): the paths' sums, in the head's float32
            first = len(tokens)
            tokens += ids.flatten().tolist()
            parents += [parent for parent in frontier for _ in range(k)]
            level_scores = child_scores.tolist()
            scores += level_scores
            depths += [depth] * len(level_scores)
            calibrated = planning.head.estimates([math.exp(score) for score in level_scores], depth)
            estimates += [min(estimate, estimates[parent]) for estimate, parent in zip(calibrated, parents[first:])]
            best = planner.order(level_scores)[:k]  # earlier first among equals
            frontier = [index + first for index in best]
            frontier_scores = child_scores[best]
        head_confidence = [math.exp(score) for score in scores]
        context_confidence = [math.nan] * len(tokens)
        child = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
        copied_estimates = iter(copied)  # in the order of the branches' tokens
        for branch in branches:
            node = -1
            for offset, token in enumerate(branch.tokens, start=1):
                match = child.get((node, token))
                if match is None:
                    match = child[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    depths.append(offset)
                    estimates.append(0.0)
                    context_confidence.append(math.nan)
                    head_confidence.append(math.nan)
                prior = branch.confidence(offset)
                if math.isnan(context_confidence[match]) or prior > context_confidence[match]:
                    context_confidence[match] = prior
                estimates[match] = max(estimates[match], next(copied_estimates))
                node = match
        closed = planner.closed(estimates, parents)
        order = planner.order(closed)
        size, rate = planner.best_size([closed[node] for node in order], curve, spent)
        self._rest_after(rate, curve, time.perf_counter() - looking)
        chosen = sorted(order[: size - 1])
        self.drafted = Drafted(
            head_confidence=[head_confidence[node] for node in chosen],
            context_confidence=[context_confidence[node] for node in chosen],
            depths=[depths[node] for node in chosen],
        )
        planning.timing.observe(predicted, time.perf_counter() - started)
        return subtree(tokens, parents, chosen)

    def _copied_estimates(self, branches) -> list[float]:
        """Calibrated acceptance of every copied node, branch by branch, token by token."""
        priors = [branch.confidence(offset) for branch in branches for offset in range(1, len(branch.tokens) + 1)]
        offsets = [offset for branch in branches for offset in range(1, len(branch.tokens) + 1)]
        return self.planning.context.estimates(priors, offsets)

    def _draft_static(self) -> tuple[list[int], list[int]]:
        """EAGLE-1: the fixed tree of STATIC_PATHS, filled with the head's ranked choices."""
        expander = Expander(self)
        index_of: dict[tuple[int, ...], int] = {}
        tokens, parents = [], []
        widest = 1 + max(path[0] for path in self.static_paths if len(path) == 1)
        first_choices = self.top(self.last_hidden[None], widest)[1][0].tolist()
        deepest = max(len(path) for path in self.static_paths)
        for depth in range(1, deepest + 1):
            level = [path for path in self.static_paths if len(path) == depth]
            if depth == 1:
                choices = {(): first_choices}
            else:
                expanded = sorted({path[:-1] for path in level})
                hidden = expander.expand([index_of[path] for path in expanded], tokens, parents)
                widths = 1 + max(path[-1] for path in level)
                ranked = self.top(hidden, widths)[1].tolist()
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


class Expander:
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
