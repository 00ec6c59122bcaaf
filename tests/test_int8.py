"""Int8 weights on CPUs: close to the originals, row-invariant, and the
decoding they run (with row-invariant attention) bit for bit identical
between vanilla and EAGLE-2."""

import pytest
import torch

from app.session import default_head
from core import attention
from core.config import SamplingParams, TreeParams
from core.drafter import DraftVocabulary
from core.engine import Engine
from core.tree_check import rows_differing
from models import int8
from models.base import load_base, resolve_quantization
from models.errors import QuantizationUnavailableError
from models.head import load_head
from tests.factory import random_head

needs_kernel = pytest.mark.skipif(not int8.available(torch.device("cpu")), reason="no int8 kernel, or slower than float32 here")


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


def test_quantized_rows_never_clip_and_stay_within_half_a_scale():
    weight = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 2, 300)[:, None]
    packed, scales = int8.quantize_rows(weight)
    assert scales.dtype == torch.bfloat16 and packed.dtype == torch.int8
    assert (scales.float() * 127 >= weight.abs().amax(dim=1)).all()
    assert ((int8.dequantize(packed, scales) - weight).abs() <= scales.float()[:, None] / 2 * (1 + 1e-6)).all()


@needs_kernel
def test_the_int8_kernel_is_row_invariant():
    """A row's result must not depend on how many rows share the call: tree
    passes and vanilla steps rely on it. Fails if a torch upgrade changes it."""
    generator = torch.Generator().manual_seed(2)
    for shape in ((1536, 576), (576, 1536), (192, 576), (2000, 64)):
        packed, scales = int8.quantize_rows(torch.randn(shape, generator=generator))
        x = torch.randn(40, shape[1], generator=generator)
        full = int8.matmul(x, packed, scales)
        for rows in (1, 2, 3, 5, 8, 16, 33):
            for start in (0, 7):
                assert torch.equal(int8.matmul(x[start : start + rows], packed, scales), full[start : start + rows])


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
    assert resolve_quantization("auto", torch.device("cpu"), torch.float64) == "none"
    with pytest.raises(QuantizationUnavailableError, match="float64"):
        resolve_quantization("int8", torch.device("cpu"), torch.float64)
    with pytest.raises(QuantizationUnavailableError, match="bitsandbytes"):
        resolve_quantization("int8", torch.device("meta"), torch.float32)


@needs_kernel
def test_int8_base_loads_with_every_decoder_linear_quantized(tiny_dir):
    base = load_base(str(tiny_dir), quantization="int8", dtype="float32")
    assert base.quantization == "int8"
    layers = base.model.get_decoder().layers
    assert not any(isinstance(module, torch.nn.Linear) for module in layers.modules())
    assert isinstance(base.model.get_output_embeddings(), torch.nn.Linear)  # the lm_head stays exact
    assert load_base(str(tiny_dir), quantization="auto", dtype="float32").quantization == "int8"  # it pays here


@pytest.fixture(scope="module")
def bundled_int8():
    """The bundled pair as `auto` loads it on this CPU: int8 decoder, exact attention."""
    base = load_base(None, quantization="int8", dtype="float32")
    head = default_head(None)
    config = base.model.config
    vocab = base.model.get_output_embeddings().weight.shape[0]
    draft = load_head(head, config.hidden_size, vocab, base.device, base.dtype, config.num_hidden_layers)
    return Engine(base, draft, "bundled")


@needs_kernel
def test_the_int8_forward_is_row_invariant_with_row_attention(bundled_int8):
    """Every tree node's features equal a one-token step's bit for bit on the
    real model; with sdpa they do not (so the check has teeth)."""
    model = bundled_int8.model
    assert bundled_int8.exact and model.config._attn_implementation == attention.NAME
    assert rows_differing(model) == 0
    attention.use(model, False)
    try:
        assert rows_differing(model) > 0
    finally:
        attention.use(model, True)


@needs_kernel
@pytest.mark.parametrize(
    "prompt",
    [
        "Write a Python function that checks whether a number is prime.",
        "Summarise the plot of Hamlet in three sentences.",
        "List five uses of a paperclip, one per line.",
    ],
)
def test_greedy_eagle2_equals_vanilla_bit_for_bit_in_int8(bundled_int8, prompt):
    messages = [{"role": "user", "content": prompt}]
    sampling = SamplingParams(max_new_tokens=64)
    replies = {}
    for mode, tree in (("vanilla", TreeParams()), ("eagle2", TreeParams()), ("eagle2", TreeParams(24, depth=6))):
        replies[(mode, tree.total_tokens)] = [t for step in bundled_int8.chat(messages, mode, sampling, tree) for t in step.token_ids]
    first = replies[("vanilla", 0)]
    assert len(first) > 20
    assert all(reply == first for reply in replies.values())
