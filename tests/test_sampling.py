import math

import pytest
import torch

from core.config import SamplingParams
from core.sampling import Noise, probabilities, sample, stream_key

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)


def test_temperature_scales_logits():
    probs = probabilities(LOGITS, SamplingParams(temperature=0.5))
    expected = torch.softmax(LOGITS / 0.5, dim=-1)
    assert torch.allclose(probs, expected)


def test_top_k_keeps_the_k_most_likely():
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.softmax(LOGITS[:2], dim=-1)
    assert torch.allclose(probs[:2], expected) and probs[2:].sum() == 0


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = torch.softmax(LOGITS, dim=-1)  # [0.55, 0.20, 0.12, 0.07, 0.03] roughly
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    assert (probs[:2] > 0).all() and probs[2:].sum() == 0  # 0.55 < 0.7 <= 0.55 + 0.20
    assert torch.allclose(probs[:2], full[:2] / full[:2].sum())


def reference(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The documented order written out over a full sort: temperature, then
    top-k, then top-p over what top-k left."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    kept, mass = [], 0.0
    for rank, token in enumerate(order):
        if (top_k and rank >= top_k) or (rank and mass >= top_p):
            break
        kept.append(token)
        mass += float(probs[token]) / float(probs[order[: top_k or len(order)]].sum())
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.5, 0, 0.7), (2.0, 0, 0.7), (0.5, 3, 0.8), (2.0, 4, 0.6), (1.7, 2, 1.0)])
def test_temperature_comes_before_top_k_and_top_p(temperature, top_k, top_p):
    """At T=0.5 the first token holds 0.83 of the mass, so top-p 0.7 keeps it
    alone; choosing the nucleus at T=1 (0.55, then 0.20) would keep two."""
    probs = probabilities(LOGITS, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.allclose(probs, reference(LOGITS, temperature, top_k, top_p), atol=1e-12)
    if (temperature, top_p) == (0.5, 0.7):
        assert probs.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_top_p_always_keeps_the_first_token():
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert probs[0] == 1.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1e-40), SamplingParams(temperature=5e-324, top_k=3), SamplingParams(temperature=1.0, top_p=1e-46),
     SamplingParams(temperature=1e-40, top_p=0.9)],
)  # fmt: skip
def test_a_vanishing_temperature_or_top_p_keeps_the_most_likely_token(params, dtype):
    """Values that underflow (a temperature or top-p below float32's range)
    still give the argmax, not NaN probabilities."""
    logits = torch.tensor([[30.0, 31.5, -2.0, 31.0], [-5.0, -4.0, -9.0, -4.5]]).to(dtype)
    probs = probabilities(logits, params)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]], dtype=probs.dtype))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3, top_p=0.8)],
)
def test_samples_follow_the_distribution(params):
    noise = Noise(seed=0, vocabulary=5)
    draws = 20000
    counts = torch.zeros(5)
    probs = probabilities(LOGITS, params)
    for position in range(draws):
        counts[sample(probs, noise.at(position))] += 1
    expected = probabilities(LOGITS, params).float() * draws
    # every count within 5 standard deviations of its binomial expectation
    for count, mean in zip(counts.tolist(), expected.tolist()):
        spread = math.sqrt(max(mean * (1 - mean / draws), 1e-9))
        assert abs(count - mean) <= 5 * spread + 1e-6


def test_seed_reproduces_samples_position_by_position():
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0))
    runs = [[sample(probs, Noise(7, 5).at(position)) for position in range(50)] for _ in range(2)]
    other = [sample(probs, Noise(8, 5).at(position)) for position in range(50)]
    assert runs[0] == runs[1] and runs[0] != other
    # one position's draw does not depend on which positions were drawn before
    assert sample(probs, Noise(7, 5).at(30)) == runs[0][30]


def test_every_bit_of_the_seed_counts():
    """torch's CPU generator keeps only 32 bits of its seed: seeds 2^32 apart (and
    the extremes of the 64-bit range) still draw unrelated noise, and no seed's
    noise is another's shifted by a position."""
    seeds = [7, 7 + 2**32, 7 + 5 * 2**32, 0, 2**32, -(2**63), 2**63 - 3, -3]
    noises = [Noise(seed, 50).at(10) for seed in seeds]
    for i in range(len(seeds)):
        for j in range(i):
            assert not torch.equal(noises[i], noises[j]), (seeds[i], seeds[j])
    keys = {stream_key(seed, position) for seed in range(64) for position in range(64)}
    assert len(keys) == 64 * 64  # all distinct (among 4,096 random 32-bit keys a collision has a 0.2% chance)


def test_invalid_params_are_named():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=-0.1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


@pytest.mark.parametrize("scale", [8.0, 0.05], ids=["peaked", "flat"])
def test_top_p_over_the_largest_probabilities_equals_the_rule_over_a_full_sort(scale):
    """The nucleus ranks only as many of the largest probabilities as it needs
    (a flat distribution makes it rank more, up to the whole vocabulary); it
    keeps and renormalises the same tokens as a full descending sort."""
    generator = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        logits = (torch.randn(3, 5000, generator=generator) * scale).to(dtype)
        for top_p in (0.3, 0.9, 0.999):
            probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
            full = torch.softmax(logits, dim=-1)
            ranked, order = torch.sort(full, dim=-1, descending=True)
            before = torch.cumsum(ranked, dim=-1) - ranked
            expected = torch.zeros_like(full).scatter(-1, order, ranked.masked_fill(before >= top_p, 0.0))
            expected = expected / expected.sum(dim=-1, keepdim=True)
            assert torch.equal(probs > 0, expected > 0)
            assert torch.allclose(probs, expected, rtol=1e-5, atol=0)
            assert torch.allclose(probabilities(logits[1], SamplingParams(temperature=1.0, top_p=top_p)), probs[1])


def test_a_filter_that_keeps_one_token_is_greedy():
    """top-k 1 and top-p 0 keep the most likely token alone: the exact argmax that greedy
    decoding takes, not a draw among tokens that the lm_head's rounded logits tie."""
    assert SamplingParams(temperature=1.0, top_k=1).greedy and SamplingParams(temperature=0.7, top_p=0).greedy
    assert not SamplingParams(temperature=1.0, top_k=2).greedy and not SamplingParams(temperature=1.0, top_p=1e-9).greedy
