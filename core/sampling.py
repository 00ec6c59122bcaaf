"""Logits -> the base model's token distribution p (temperature, top-k, top-p),
and sampling from it.

The same `probabilities` and the same noise serve vanilla sampling and
speculative acceptance, which is what makes the two produce the same
distribution, and with one seed the same reply."""

from __future__ import annotations

import numpy
import torch

from core.config import SamplingParams
from models import int8


FLOAT32_TEMPERATURE = 1e-30  # below it, logits / temperature leave float32's range: float64 then


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V) in float32 or wider.

    Temperature first, then top-k, then top-p over what is left."""
    # float64 where the temperature is below float32's range; the largest logit
    # is subtracted first, so a tiny temperature sends the others to -inf, not to inf - inf
    wide = logits.dtype == torch.float64 or params.temperature < FLOAT32_TEMPERATURE
    logits = logits.to(torch.float64 if wide else torch.float32)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = nucleus(probs, params.top_p)
    return probs


NUCLEUS_FIRST = 64  # tokens ranked first for top-p; four times more each time they fall short


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p: keep a token if the mass strictly before it, in descending
    order, is below top_p (the first always stays), and renormalise. Only the
    largest probabilities are ranked, as many as it takes: the first token
    that is dropped is among them once their mass before the last reaches
    top_p, and every token after it is dropped too (sorting a whole 49k
    vocabulary took 3.1 ms on the AVX512-BF16 EPYC; the whole rule, ranking
    only the largest, about 0.1 ms a row on the bundled model's logits)."""
    vocabulary = probs.shape[-1]
    count = min(NUCLEUS_FIRST, vocabulary)
    while True:
        if count == vocabulary:
            ranked, order = torch.sort(probs, dim=-1, descending=True)
        else:
            ranked, order = _largest(probs, count)
        before = torch.cumsum(ranked, dim=-1) - ranked
        if count == vocabulary or bool((before[..., -1] >= top_p).all()):
            break
        count = min(count * 4, vocabulary)
    dropped = before >= top_p
    dropped[..., 0] = False  # the first stays, however small top_p is (it may round to 0 here)
    kept = ranked.masked_fill(dropped, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, kept)
    return probs / probs.sum(dim=-1, keepdim=True)


def _largest(probs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest along the last dimension, largest first, and their indices."""
    if probs.dim() <= 2:  # Kestrel's one-pass kernel takes rows
        values, indices = int8.top_k(probs.reshape(-1, probs.shape[-1]), count)
        return values.reshape(*probs.shape[:-1], count), indices.reshape(*probs.shape[:-1], count)
    top = probs.topk(count, dim=-1)
    return top.values, top.indices


class Noise:
    """Gumbel noise for every position of a reply, drawn from the request's seed.

    The token at position t is argmax(log p_t + g_t) with g_t i.i.d.
    Gumbel(0, 1) per token: an exact sample of p_t (the Gumbel-max trick).
    g_t depends only on the seed and t, never on which tree or mode produced
    the prefix, so the sampled reply is a function of the seed alone: vanilla
    and speculative decoding with one seed give the same reply whatever
    trees the planner chose, and each token is still distributed as p_t given
    its prefix, since g_t is independent of the earlier noise that chose the prefix."""

    def __init__(self, seed: int, vocabulary: int, device: torch.device | str = "cpu"):
        self.seed, self.vocabulary, self.device = seed, vocabulary, torch.device(device)

    def at(self, position: int) -> torch.Tensor:
        """(V,) float64 Gumbel noise for the token at `position` (0 = the prompt's first)."""
        uniform = numpy.random.Generator(numpy.random.Philox(key=noise_key(self.seed, position))).random(self.vocabulary)
        return (-torch.log(-torch.log(torch.from_numpy(uniform)))).to(self.device)


def noise_key(seed: int, position: int) -> int:
    """The key of position `position`'s noise: all 64 bits of the seed and the
    position, as the low and high words of a 128-bit Philox key (an integer:
    numpy reads a list of large integers through float64). Philox is counter-based, a
    different stream for every key, so no two positions of a reply share
    noise (a 32-bit seed, as torch's CPU generator keeps, made two positions
    of a long reply share it: about once in eight replies of 32k tokens), and
    no seed's noise is another's shifted by some positions."""
    return position << 64 | seed % (1 << 64)


def sample(probs: torch.Tensor, gumbel: torch.Tensor) -> int:
    """One token id from a (V,) distribution: argmax(log p + g); tokens with p = 0 never win."""
    return int(torch.argmax(torch.log(probs.double()) + gumbel[: probs.shape[-1]]))
