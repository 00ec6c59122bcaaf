import math

import pytest
import torch

from core.config import SamplingParams
from core.sampling import next_token, probabilities

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


def test_top_p_always_keeps_the_first_token():
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert probs[0] == 1.0


def test_greedy_is_argmax():
    assert next_token(LOGITS, SamplingParams(), None) == 0


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3, top_p=0.8)],
)
def test_samples_follow_the_distribution(params):
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    counts = torch.zeros(5)
    for _ in range(draws):
        counts[next_token(LOGITS, params, generator)] += 1
    expected = probabilities(LOGITS, params).float() * draws
    # every count within 5 standard deviations of its binomial expectation
    for count, mean in zip(counts.tolist(), expected.tolist()):
        spread = math.sqrt(max(mean * (1 - mean / draws), 1e-9))
        assert abs(count - mean) <= 5 * spread + 1e-6


def test_seed_reproduces_samples():
    params = SamplingParams(temperature=1.0)
    first = [next_token(LOGITS, params, torch.Generator().manual_seed(3)) for _ in range(1)]
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(7)
        runs.append([next_token(LOGITS, params, generator) for _ in range(50)])
    assert runs[0] == runs[1] and first


def test_invalid_params_are_named():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
