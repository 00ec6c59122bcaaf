import math

import pytest
import torch

from core.config import SamplingParams
from core.sampling import Noise, noise_key, probabilities, sample

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
    """Seeds 2^32 apart (and the extremes of the 64-bit range) draw unrelated
    noise, no seed's noise is another's shifted by a position, and no two
    (seed, position) pairs share a key."""
    seeds = [7, 7 + 2**32, 7 + 5 * 2**32, 0, 2**32, -(2**63), 2**63 - 3, -3]
    noises = [Noise(seed, 50).at(10) for seed in seeds]
    for i in range(len(seeds)):
        for j in range(i):
            assert not torch.equal(noises[i], noises[j]), (seeds[i], seeds[j])
    assert noise_key(-3, 5) == 5 * 2**64 + 2**64 - 3 and noise_key(2**63 - 3, 5) != noise_key(-3, 5)
    # positions 21,017 and 26,259 of seed 0 shared a 32-bit key once; a key holds the whole position now
    assert not torch.equal(Noise(0, 50).at(21_017), Noise(0, 50).at(26_259))


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


@pytest.mark.parametrize(
    "architecture, setting",
    [("granite", {"logits_scaling": 4.0}), ("cohere", {"logit_scale": 0.25}), ("gemma3", {"final_logit_softcapping": 1.5})],
)
def test_sampling_draws_from_the_logits_the_model_returns(tmp_path, architecture, setting):
    """Granite divides its lm_head's output, Cohere multiplies it, Gemma 3
    can cap it: Kestrel's logits are the ones the model returns, and a seeded
    sample (from the lm_head screen, top_p 1, or the full product, top_p 0.9)
    is the Gumbel argmax of the model's own distribution."""
    from transformers import AutoModelForCausalLM, CohereConfig, Gemma3TextConfig, GraniteConfig

    from core.engine import Engine
    from core.kv_cache import new_cache
    from core.verify import base_forward, logits_of
    from models.base import load_base
    from tests.factory import tiny_config, tiny_tokenizer

    shape = {key: getattr(tiny_config(), key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")}  # fmt: skip
    config = {"granite": GraniteConfig, "cohere": CohereConfig, "gemma3": Gemma3TextConfig}[architecture](
        **shape, tie_word_embeddings=False, **setting
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # logits of a few units: the scale and the cap change the draws
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    base = load_base(str(tmp_path), dtype="float64")
    engine, prompt = Engine(base), [5, 6, 7, 8]
    ids = torch.tensor([prompt])
    returned = base.model(ids).logits[0, -1]
    features = base_forward(base.model, ids[0], torch.arange(len(prompt)), None, new_cache(base.model))
    assert torch.allclose(logits_of(base.model, features[-1:])[0], returned, rtol=1e-12, atol=1e-12)
    for top_p in (1.0, 0.9):
        params = SamplingParams(temperature=0.8, top_p=top_p, max_new_tokens=1)
        wanted = probabilities(returned, params)
        for seed in range(30):
            steps = list(engine.stream(prompt, "vanilla", SamplingParams(0.8, top_p, 0, 1, seed)))
            assert steps[0].token_ids[0] == sample(wanted, Noise(seed, len(returned), returned.device).at(len(prompt))), (top_p, seed)
