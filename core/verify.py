"""Verification: one base-model pass over every tree node, then acceptance.

Names (EAGLE/SpecInfer): p is the base model's distribution at a node after
temperature / top-k / top-p; the draft proposes each child as a point mass."""

from __future__ import annotations

from collections.abc import Callable

import torch

from core import compiled, graphs
from core.argmax import ScreenedArgmax
from core.config import SamplingParams
from core.kv_cache import new_cache
from core.sampling import Noise, probabilities, sample
from core.tree import DraftTree, ancestor_mask
from models import int8


def base_forward(model, tokens, positions, mask, cache):
    """-> features (T, H): the last hidden state after the final norm.
    tokens, positions: (T,) int64; mask: (T, past + T) bool or None for causal."""
    fast = compiled.of(model) or graphs.of(model)
    features = None if fast is None else fast.forward(tokens, positions, mask, cache)
    if features is not None:  # graphs leave prefill and the largest passes to the decoder below
        return features
    attention_mask = None if mask is None else mask[None, None]
    out = model.get_decoder()(
        input_ids=tokens[None],
        position_ids=positions[None],
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=True,
    )
    return out.last_hidden_state[0]


def next_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """(V,) logits for the token after `tokens` (T,), from one plain causal
    forward with a fresh cache: the reference a tree pass is held to."""
    features = base_forward(model, tokens, torch.arange(len(tokens), device=tokens.device), None, new_cache(model))
    return logits_of(model, features[-1:])[0]


def logits_of(model, features: torch.Tensor) -> torch.Tensor:
    """features (T, H) -> logits (T, V): the base model's lm_head, then what
    its CausalLM class does to that output (logit_form)."""
    logits = model.get_output_embeddings()(features)
    scale, softcap = logit_form(model.config)
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def logit_form(config) -> tuple[float, float | None]:
    """(scale, softcap): the logits a CausalLM returns are softcap *
    tanh(scale * lm_head(h) / softcap), or scale * lm_head(h) without a
    softcap, as transformers' classes make them: Granite divides by
    `logits_scaling`, Cohere multiplies by `logit_scale`, Falcon-H1 by
    `lm_head_multiplier`, Gemma 2 and 3 cap with `final_logit_softcapping`.
    Sampling draws from these logits; the greedy token is the raw product's
    (both are monotone), so the greedy screen reads the lm_head alone."""
    scale = 1.0
    for name, power in (("logits_scaling", -1), ("logit_scale", 1), ("lm_head_multiplier", 1)):
        value = getattr(config, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            scale *= float(value) ** power
    softcap = getattr(config, "final_logit_softcapping", None)
    return scale, float(softcap) if isinstance(softcap, int | float) and not isinstance(softcap, bool) and softcap > 0 else None


class NodeLogits:
    """Base-model logits of tree nodes, computed only where acceptance looks:
    all nodes with children in one product, a leaf when it is reached. Most
    drafted nodes are leaves that are never accepted, so this saves most of
    the lm_head work of a step."""

    def __init__(self, model, features: torch.Tensor, tree: DraftTree, row_by_row: bool = False):
        """row_by_row: each node's own product, as a one-token step takes it (an
        exact engine whose lm_head is not row-invariant: ScreenedArgmax.row_by_row)."""
        self.model, self.features = model, features
        internal = [] if row_by_row else tree.internal()
        self.rows = dict(zip(internal, logits_of(model, features[internal]))) if internal else {}

    def __getitem__(self, node: int) -> torch.Tensor:
        """(V,) logits at `node`."""
        if node not in self.rows:
            self.rows[node] = logits_of(self.model, self.features[node : node + 1])[0]
        return self.rows[node]


class NodeArgmax:
    """The base model's greedy token at the tree nodes acceptance visits: all
    nodes with children in one product, a leaf when the walk reaches it (the
    lm_head rows cost about as much as a decoder layer each here, and most
    leaves are never visited). Where Kestrel's int8 kernel screens, the
    screen's rows come from one product and only the visited nodes are
    resolved: every node's row where the tree is small enough that its rows
    cost what the internal nodes' do (up to SCREEN_ALL rows read the weights
    once, as one row does; on the AMX tile unit, a block of SCREEN_TILES rows
    costs what one row does, while as vdpbf16ps 16 rows cost about twice one),
    so a reached leaf costs no second product; else the internal nodes' rows."""

    SCREEN_ALL = 7
    SCREEN_TILES = 16

    def __init__(self, argmax: ScreenedArgmax, features: torch.Tensor, tree: DraftTree):
        self.argmax, self.features = argmax, features
        self.tokens: dict[int, int] = {}
        self.rough = screened_rows(argmax, features, tree)
        if not self.rough:
            internal = tree.internal() or [0]  # the root alone: acceptance still asks it
            self.tokens = dict(zip(internal, argmax(features[internal])))

    def __call__(self, node: int) -> int:
        if node not in self.tokens:
            if node in self.rough:
                self.tokens[node] = self.argmax.resolve(self.features[node], self.rough[node])
            else:
                self.tokens[node] = self.argmax(self.features[node : node + 1])[0]
        return self.tokens[node]


def screened_rows(argmax: ScreenedArgmax, features: torch.Tensor, tree: DraftTree) -> dict:
    """node -> its screen (NodeArgmax's rule), or {} where Kestrel's kernel
    does not screen (torch's pays per row: each visited node then gets its own)."""
    if not (argmax.enabled and argmax.own):
        return {}
    limit = NodeArgmax.SCREEN_TILES if argmax.rows.tiles and int8.tile_unit() else NodeArgmax.SCREEN_ALL
    if tree.size <= limit:
        return dict(zip(range(tree.size), argmax.screen(features)))
    internal = tree.internal() or [0]
    return dict(zip(internal, argmax.screen(features[internal])))


class NodeGumbel:
    """The base model's sampled token at the nodes acceptance visits, where
    sampling keeps the whole vocabulary (no top-k, no top-p) and the lm_head
    is screened. The token after a node at depth d is argmax(logits / T + g),
    g the noise of position prefix + d + 1: NodeSample's rule (Gumbel-max)
    without the softmax, which leaves the argmax where it is. The screen
    resolves it exactly as it resolves the greedy argmax, so no node needs
    the lm_head's full product (1.9 ms a row in bf16 on the AVX512-BF16
    EPYC, against 0.7 ms for the screen). Vanilla steps and prefill use the same
    rule, so one seed still gives one reply in every mode."""

    def __init__(self, argmax: ScreenedArgmax, features: torch.Tensor, tree: DraftTree, temperature: float, noise: Noise, prefix: int):
        self.argmax, self.features, self.temperature, self.noise, self.prefix = argmax, features, temperature, noise, prefix
        self.depths = tree.depths.tolist()
        self.rough = screened_rows(argmax, features, tree)
        self.tokens: dict[int, int] = {}

    def __call__(self, node: int) -> int:
        if node not in self.tokens:
            rough = self.rough[node] if node in self.rough else self.argmax.screen(self.features[node : node + 1])[0]
            gumbel = self.noise.at(self.prefix + self.depths[node] + 1)
            self.tokens[node] = self.argmax.resolve(self.features[node], rough, gumbel, self.temperature)
        return self.tokens[node]


def verify_tree(model, tree: DraftTree, prefix: int, cache) -> torch.Tensor:
    """One forward over the tree. Each node sees the prefix, its ancestors and
    itself, at position prefix + depth. -> features (N, H)."""
    device = cache_device(model)
    tokens = tree.tokens.to(device)
    positions = (tree.depths + prefix).to(device)
    mask = None
    if tree.size > 1:
        mask = torch.ones(tree.size, prefix + tree.size, dtype=torch.bool, device=device)  # (N, prefix + N)
        mask[:, prefix:] = ancestor_mask(tree.parents).to(device)
    return base_forward(model, tokens, positions, mask, cache)


def cache_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def accept(tree: DraftTree, choice_at: Callable[[int], int]) -> tuple[list[int], int]:
    """Longest path whose every token is the base model's own choice at its
    parent; choice_at(node) is that choice (the argmax when greedy, the
    Gumbel-max sample when sampling). -> (accepted nodes, root first; the
    bonus token: the choice after the last)."""
    tokens = tree.tokens.tolist()
    children = tree.children()
    path = [0]
    while True:
        node = path[-1]
        chosen = choice_at(node)
        match = next((child for child in children[node] if tokens[child] == chosen), None)
        if match is None:
            return path, chosen
        path.append(match)


class NodeSample:
    """The base model's sampled token after each tree node the walk visits.

    With Gumbel-max coupling (core/sampling.Noise) the token after a node at
    depth d is argmax(log p_node + g) with g the noise of position
    prefix + d + 1, so it is the token vanilla sampling with the same seed
    draws after the same prefix. A drafted child is accepted when it equals
    that token: with probability p(x) for a child x, and p(x) + p(y) for two
    siblings x and y, as in multi-candidate speculative sampling (SpecInfer),
    and the emitted token is exactly distributed as p, whatever the tree."""

    def __init__(self, logits: NodeLogits, tree: DraftTree, params: SamplingParams, noise: Noise, prefix: int):
        self.logits, self.depths, self.params, self.noise, self.prefix = logits, tree.depths.tolist(), params, noise, prefix

    def __call__(self, node: int) -> int:
        probs = probabilities(self.logits[node], self.params)
        return sample(probs, self.noise.at(self.prefix + self.depths[node] + 1))
