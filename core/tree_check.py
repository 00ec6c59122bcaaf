"""The load-time self-check that decides whether a base model can verify
draft trees: speculative decoding relies on the model honouring a custom 4D
attention mask and explicit position ids, which an architecture's attention
code may ignore. Rather than trusting a list of architectures, each model is
asked: a few tokens decoded one path at a time must give the same logits as
one tree pass over all the paths, whose siblings a node must not see; and
the same tree pass given other position ids must give other logits."""

from __future__ import annotations

import dataclasses
import math

import torch

from core import kv_cache
from core.attention import BLOCK
from core.tree import make_tree
from core.verify import base_forward, logits_of, next_logits, verify_tree
from models import int8
from models.base import out_of_memory

# Largest allowed root-mean-square difference between tree and sequential
# logits, relative to the spread (standard deviation) of the sequential logits,
# per compute dtype. A tree pass and path-by-path decoding differ only by
# rounding; measured on the bundled SmolLM2-135M: 8e-6 in float32 and 0.46 in
# bfloat16 (its features move by up to 0.5 over 30 layers), against 7.1 for
# the same model with an attention that drops the tree mask. Linears run
# through torch's int8 or int4 kernels compute with bf16 activations, so such
# a model is held to bf16's tolerance (measured with int8: 0.025); Kestrel's
# int4 kernel computes in float32. float16 keeps three more bits than bfloat16:
# 0.045 on the same model, against 1.39 where its attention ignores position ids.
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-3, torch.bfloat16: 2.0, torch.float16: 0.5}
PROMPT = (11, 12, 13, 14, 15)
# root, then drafted tokens with their parents (-1 = the root): a chain of
# depth 3 and two more branches, so that every depth has siblings to ignore
TREE_TOKENS = (16, 17, 18, 19, 20, 21, 22)
TREE_PARENTS = (-1, -1, 0, 2, -1, 1)
# A tree pass whose nodes are given consecutive positions instead of prefix +
# depth must move the logits by more than this (relative to their spread):
# an attention that ignores the position ids it is given (counting positions
# itself) gives the same logits bit for bit. The rounding noise of bfloat16
# (0.46 on the bundled model, above) can hide such an attention from the
# comparison with path-by-path decoding: 1.40 there, within bfloat16's 2.0.
# Measured: 1.33 (bf16) to 1.43 (float32) on the bundled model, 0.010 to 0.57 on tiny random models.
POSITION_EFFECT = 1e-6


def paths(parents: tuple[int, ...]) -> list[list[int]]:
    """Node indices from the root to each node (tree indices, 0 = root)."""
    tree_parents = (-1,) + tuple(parent + 1 for parent in parents)
    result = []
    for node in range(len(tree_parents)):
        path = [node]
        while tree_parents[path[0]] >= 0:
            path.insert(0, tree_parents[path[0]])
        result.append(path)
    return result


def check_tokens(model) -> torch.Tensor:
    """PROMPT then TREE_TOKENS, within the model's vocabulary, on its device."""
    weight = model.get_input_embeddings().weight
    return torch.tensor(PROMPT + TREE_TOKENS, device=weight.device) % weight.shape[0]


def tree_logits(model, consecutive: bool = False) -> tuple[list[int], list[int], torch.Tensor]:
    """One tree pass over the self-check's tree after its prompt -> (the
    prompt's tokens, the tree's tokens, the nodes' logits in float64). With
    `consecutive` the nodes are placed at prefix + node index, as a sequence,
    rather than at prefix + depth."""
    device = model.get_input_embeddings().weight.device
    ids = check_tokens(model).tolist()
    prompt, tokens = ids[: len(PROMPT)], ids[len(PROMPT) :]
    cache = kv_cache.new_cache(model)
    base_forward(model, torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device), None, cache)
    tree = make_tree(tokens[0], tokens[1:], list(TREE_PARENTS))
    if consecutive:
        tree = dataclasses.replace(tree, depths=torch.arange(tree.size))
    return prompt, tokens, logits_of(model, verify_tree(model, tree, len(prompt), cache)).double()


def relative_difference(logits: torch.Tensor, expected: torch.Tensor) -> float:
    """Root-mean-square difference relative to the spread of `expected`."""
    return float((logits - expected).pow(2).mean().sqrt()) / (float(expected.std()) or 1.0)


@torch.inference_mode()
def tree_mismatch(model) -> float:
    """The worst node's root-mean-square difference between tree and
    sequential logits, relative to the spread of the sequential logits;
    NaN where any of them is not a finite number (the model overflows)."""
    device = model.get_input_embeddings().weight.device
    prompt, tokens, logits = tree_logits(model)
    worst = 0.0
    for node, path in enumerate(paths(TREE_PARENTS)):
        expected = next_logits(model, torch.tensor(prompt + [tokens[i] for i in path], device=device)).double()
        if not (torch.isfinite(expected).all() and torch.isfinite(logits[node]).all()):
            return math.nan  # max() would keep the finite worst past a NaN
        worst = max(worst, relative_difference(logits[node], expected))
    return worst


@torch.inference_mode()
def position_effect(model) -> float:
    """How far the tree pass's logits move when its nodes are placed as a
    sequence instead of by depth (the worst node, relative to the spread of
    its logits): exactly 0 where the attention ignores the position ids."""
    _, _, by_depth = tree_logits(model)
    _, _, consecutive = tree_logits(model, consecutive=True)
    return max(relative_difference(consecutive[node], by_depth[node]) for node in range(len(by_depth)))


# Largest allowed difference (as TOLERANCE's) between a prompt read in two chunks and in one forward:
# the same keys in other shapes, far closer than a tree pass to path-by-path decoding (tiny Llama: 2e-7
# in float32, 0.004 in bf16, 0.0006 in fp16), while a mask read wrong moves the logits by 0.16 (GPT-J) to
# 1 (MPT in bf16) of their spread. A large model's bf16 rounding can pass it (the bundled model: 0.74),
# for both ways alike: then the closer is kept (chunk_mask).
CHUNK_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.02}
# How a prompt's later chunks are read after the earlier ones' cache (core/engine.py's _read):
EXPLICIT = "explicit"  # with a boolean mask spelt out, which Kestrel's own attention paths need
MODEL_MASK = "model"  # with none: the model's own code masks them from the cache length (ALiBi models, MPT's inverted masks)
ONE_PASS = "one pass"  # neither reads them right: a prompt is read in one forward, and no cache is continued


@torch.inference_mode()
def chunk_mismatch(model, explicit: bool, reference: torch.Tensor) -> float:
    """The worst relative difference between the logits of the self-check's
    tokens read as two chunks (the second after the first's cache, with or
    without an `explicit` mask) and `reference`, those of one forward; NaN
    where they are not finite numbers, and where the model refuses the read."""
    tokens, device = check_tokens(model), model.get_input_embeddings().weight.device
    split, cache = len(PROMPT), kv_cache.new_cache(model)
    try:
        base_forward(model, tokens[:split], torch.arange(split, device=device), None, cache)
        rows = len(tokens) - split
        mask = torch.ones(rows, len(tokens), dtype=torch.bool, device=device).tril(diagonal=split) if explicit else None
        later = logits_of(model, base_forward(model, tokens[split:], torch.arange(split, len(tokens), device=device), mask, cache))
    except Exception as error:  # a model whose attention takes no 4D mask (Bloom's, Falcon's ALiBi)
        if out_of_memory(error):
            raise
        return math.nan
    later = later.double()
    if not torch.isfinite(later).all():
        return math.nan
    return max(relative_difference(later[row], reference[split + row]) for row in range(len(later)))


def kestrel_attention(model) -> bool:
    """Whether the model's attention runs through Kestrel's own paths (the
    row-invariant attention, compiled layers, CUDA graphs), which take a
    multi-row pass after a cache with no mask as causal from the first key."""
    from core import attention, compiled, graphs

    paths = (attention.NAME, compiled.NAME, graphs.NAME)
    return model.config._attn_implementation in paths or compiled.of(model) is not None or graphs.of(model) is not None


def chunk_mask(model) -> str:
    """How this model reads a prompt's later chunks: EXPLICIT, MODEL_MASK or ONE_PASS
    (above). The first that gives the logits of one forward within CHUNK_TOLERANCE
    (MODEL_MASK never where Kestrel's own attention runs); where neither does
    (rounding beyond it: a large model in bf16), the closer, EXPLICIT on a tie;
    ONE_PASS only where neither reads a later chunk at all (refused, or not finite numbers)."""
    tokens, device = check_tokens(model), model.get_input_embeddings().weight.device
    with torch.inference_mode():
        features = base_forward(model, tokens, torch.arange(len(tokens), device=device), None, kv_cache.new_cache(model))
        reference = logits_of(model, features).double()
    if not torch.isfinite(reference).all():  # nothing to judge by: the prompt's own check names the overflow
        return EXPLICIT
    tolerance = CHUNK_TOLERANCE.get(int8.compute_dtype(model), CHUNK_TOLERANCE[torch.float32])
    spelt = chunk_mismatch(model, True, reference)
    if spelt <= tolerance:  # NaN never is
        return EXPLICIT
    if kestrel_attention(model):  # its chunks need the mask spelt out
        return ONE_PASS if math.isnan(spelt) else EXPLICIT
    own = chunk_mismatch(model, False, reference)
    if own <= tolerance:
        return MODEL_MASK
    if math.isnan(spelt) and math.isnan(own):
        return ONE_PASS
    return MODEL_MASK if math.isnan(spelt) or own < spelt else EXPLICIT


def not_finite(what: str, dtype: torch.dtype) -> str:
    """What `what`, not finite numbers in `dtype`, means, and what to do."""
    if dtype == torch.float16:  # the load's dtype: --dtype, or Compute dtype in the Models tab
        return f"{what} overflow float16's range (not finite numbers); load the model in bfloat16 or float32 (--dtype)"
    return f"{what} are not finite numbers in {str(dtype).removeprefix('torch.')}: the model's weights may be damaged"


def tree_problem(model) -> str | None:
    """Why this model cannot verify draft trees, or None when it passes.
    Memory running out during the check is raised: it says nothing of the
    model's attention."""
    dtype = int8.compute_dtype(model)
    tolerance = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    try:
        mismatch = tree_mismatch(model)
    except Exception as error:  # an attention that refuses 4D masks or position ids
        if out_of_memory(error):
            raise
        return f"the model failed the tree-attention self-check ({type(error).__name__}: {error})"
    if math.isnan(mismatch):
        return not_finite("the model's logits", model.get_input_embeddings().weight.dtype)
    if not mismatch <= tolerance:
        return (
            f"the model does not honour tree attention masks and positions: one tree pass differed from decoding "
            f"path by path by {mismatch:.3g} of the logits' spread (allowed in {str(dtype).removeprefix('torch.')}: {tolerance:g})"
        )
    if not position_effect(model) > POSITION_EFFECT:
        return (
            "the model's attention ignores the position ids it is given: a tree pass with its nodes placed "
            "by depth and one with them placed in a row gave the same logits"
        )
    return None


@torch.inference_mode()
def rows_differing(model) -> int:
    """How many nodes of the self-check's tree get features that differ in
    any bit from one-token decoding steps along their paths. Run after
    prompts of BLOCK - 2 and BLOCK + 6 tokens, so that some paths cross an
    attention block (core/attention.py) and others do not."""
    vocabulary = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    tokens = [token % vocabulary for token in TREE_TOKENS]
    tree = make_tree(tokens[0], tokens[1:], list(TREE_PARENTS))
    differing = 0
    for length in (BLOCK - 2, BLOCK + 6):
        prompt = [(PROMPT[0] + index) % vocabulary for index in range(length)]
        cache = kv_cache.new_cache(model)
        base_forward(model, torch.tensor(prompt, device=device), torch.arange(length, device=device), None, cache)
        tree_features = verify_tree(model, tree, length, cache)
        # depth first (paths in lexicographic order), so the cache already holds each node's
        # parent path, decoded one token at a time: one step per node
        for node, path in sorted(enumerate(paths(TREE_PARENTS)), key=lambda item: item[1]):
            position = length + len(path) - 1
            kv_cache.commit(cache, position, [])  # back to the parent's path
            one = torch.tensor([tokens[path[-1]]], device=device)
            features = base_forward(model, one, torch.tensor([position], device=device), None, cache)
            differing += not torch.equal(features[0], tree_features[node])
    return differing
