"""Logits -> the base model's token distribution p (temperature, top-k, top-p),
and sampling from it.

The same `probabilities` and the same noise serve vanilla sampling and
speculative acceptance, which is what makes the two produce the same
distribution, and with one seed the same reply."""

from __future__ import annotations

import torch

from core.config import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V) in float32 or wider.

    Temperature first, then top-k, then top-p over what is left."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass strictly before it is below top_p (the first always stays)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


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
        generator = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + position) % (1 << 63))
        uniform = torch.rand(self.vocabulary, generator=generator, dtype=torch.float64)
        return (-torch.log(-torch.log(uniform))).to(self.device)


def sample(probs: torch.Tensor, gumbel: torch.Tensor) -> int:
    """One token id from a (V,) distribution: argmax(log p + g); tokens with p = 0 never win."""
    return int(torch.argmax(torch.log(probs.double()) + gumbel[: probs.shape[-1]]))
