"""Int8 drafting weights: close to the originals, and only where they pay."""

import pytest
import torch

from core import int8
from core.drafter import DraftVocabulary
from core.engine import Engine
from tests.factory import random_head

needs_kernel = pytest.mark.skipif(not int8.available(torch.device("cpu")), reason="no int8 kernel / native bf16 here")


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_close_and_keeps_shape_and_dtype(bias):
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias).double()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=generator, dtype=torch.float64))
        if bias:
            linear.bias.copy_(torch.randn(40, generator=generator, dtype=torch.float64))
    x = torch.randn(2, 3, 96, generator=generator, dtype=torch.float64)
    out = int8.Int8Linear(linear)(x)
    expected = linear(x)
    assert out.shape == expected.shape and out.dtype == torch.float64
    # int8 rows (1/254 of each row's largest weight) and bf16 activations: about 1% of the output scale
    assert (out - expected).abs().max() < 0.03 * expected.abs().max()


@needs_kernel
def test_with_int8_linears_replaces_every_linear_of_a_copy(tiny_base):
    head = random_head(tiny_base.model)
    packed = int8.with_int8_linears(head)
    assert not any(isinstance(module, torch.nn.Linear) for module in packed.modules())
    assert sum(isinstance(module, int8.Int8Linear) for module in packed.modules()) == 8  # fc, q, k, v, o, 3 MLP
    assert isinstance(head.fc, torch.nn.Linear)  # the original is untouched
    assert packed.dtype == head.dtype == torch.float64


@needs_kernel
def test_engine_drafts_with_int8_and_the_vocabulary_ranks_alike(tiny_base):
    engine = Engine(tiny_base, random_head(tiny_base.model))
    assert isinstance(engine.draft_head.fc, int8.Int8Linear)
    assert engine.vocabulary.packed is not None
    lm_head = tiny_base.model.get_output_embeddings()
    hidden = torch.randn(64, lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = torch.log_softmax(lm_head(hidden), dim=-1)
    rough = DraftVocabulary(lm_head.weight, None).log_probs(hidden)
    assert (rough.argmax(dim=-1) == exact.argmax(dim=-1)).float().mean() >= 0.9
    assert (rough - exact).abs().max() < 0.02 * exact.abs().max()  # about 1% of the scale, as above


def test_int8_is_off_where_it_does_not_pay():
    assert not int8.available(torch.device("meta"))
