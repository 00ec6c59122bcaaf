"""Int8 and int4 weights on CPUs: close to the originals, row-invariant, and
the decoding they run (with row-invariant attention) bit for bit identical
between vanilla and EAGLE-2."""

import contextlib

import pytest
import torch

from app.session import default_head
from core import attention
from core.config import SamplingParams, TreeParams
from core.drafter import DraftVocabulary
from core.engine import Engine
from core.tree_check import rows_differing
from models import int4, int8
from models.base import load_base, resolve_quantization
from models.errors import QuantizationUnavailableError
from models.head import load_head
from tests.factory import random_head, save_tiny_model

# The kernel's own tests need only the kernel: whether it pays here (a speed
# probe, which a busy moment can sway) decides the engine's use of it, not them.
needs_kernel = pytest.mark.skipif(not int8.kernel_available(torch.device("cpu")), reason="no int8 kernel")


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


@contextlib.contextmanager
def thread_count(threads: int):
    """torch's thread count set to `threads` for the block, then restored."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


needs_torch_int4 = pytest.mark.skipif(not int4.torch_kernel(torch.device("cpu")), reason="no torch int4 kernel")
needs_own_int4 = pytest.mark.skipif(not int4.own_kernel(), reason="Kestrel's int4 kernel could not be built here")
needs_int4 = pytest.mark.skipif(not int4.kernel_available(torch.device("cpu")), reason="no int4 kernel")
SHAPES = ((1536, 576), (192, 576), (576, 1536), (40, 64))  # the last: a column count no thread split divides evenly


def q4_1_blocks(rows: int, columns: int, seed: int) -> torch.Tensor:
    """Weights made as Q4_1 blocks: d*q + m, codes 0 and 15 present in each block."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, columns // 32, 32), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    d = 2.0 ** torch.randint(-8, -3, (rows, columns // 32, 1), generator=generator)
    m = torch.randint(-64, 0, (rows, columns // 32, 1), generator=generator) * d
    return (codes * d + m).reshape(rows, columns)


@needs_torch_int4
def test_the_torch_int4_kernel_is_row_invariant():
    generator = torch.Generator().manual_seed(3)
    for shape in SHAPES[:3]:
        packed, scale_and_zeros = int4.quantize_groups(torch.randn(shape, generator=generator))
        x = torch.randn(40, shape[1], generator=generator).bfloat16()
        full = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, int4.GROUP, scale_and_zeros)
        for rows in (1, 2, 3, 5, 8, 16, 33):
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(x[5 : 5 + rows].contiguous(), packed, int4.GROUP, scale_and_zeros)
            assert torch.equal(part, full[5 : 5 + rows])


def int8_cases(seed: int):
    """(shape, int8 rows, float32 scales, 40 input rows) for Kestrel's int8 kernels, at three shapes."""
    generator = torch.Generator().manual_seed(seed)
    for shape in ((48, 64), (1000, 576), (37, 32)):
        packed, scales = int8.quantize_rows(torch.randn(shape, generator=generator))
        yield shape, packed, scales.float(), torch.randn(40, shape[1], generator=generator) * 10


@pytest.mark.skipif(not int8.own_kernel(), reason="Kestrel's int8 kernel is not built here")
@pytest.mark.parametrize("threads", [1, 2])
def test_kestrels_int8_kernel_is_row_invariant_and_within_its_stated_bound(threads):
    """A row's result is the same bits in every block of rows, on 1 or 2
    threads, and within the rounding bound core/argmax.py relies on:
    |rough - w'.h| <= (K + 2) 2^-24 ||w'|| ||h||."""
    with thread_count(threads):
        for shape, packed, scales, x in int8_cases(seed=4):
            full = int8.own_matmul(x, packed, scales)
            for rows in (1, 2, 3, 4, 5, 7, 8, 16, 33):
                part = int8.own_matmul(x[5 : 5 + rows].contiguous(), packed, scales)
                assert torch.equal(part, full[5 : 5 + rows]), (shape, rows)
            weights = int8.dequantize(packed, scales).double()
            bound = (shape[1] + 2) * 2.0**-24 * weights.norm(dim=1)[None, :] * x.double().norm(dim=1)[:, None]
            assert ((full.double() - x.double() @ weights.T).abs() <= bound).all()


@pytest.mark.skipif(not int8.integer_screen(), reason="the integer screen is built for AVX2 CPUs without AVX-512")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_integer_screen_is_row_invariant_and_within_the_bound_the_screen_adds(threads):
    """The lm_head screen's integer product: a row's result is the same bits
    in every block of rows; the rounding it reports is ||h - a p|| for h
    rounded per group of 32 to int8 (checked against the same rounding done
    here in float64); and the products are within ||w'|| r plus float32
    accumulation over ||h|| + r of the exact w'.h."""
    with thread_count(threads):
        for shape, packed, scales, x in int8_cases(seed=5):
            x[0, :32] = 0.0  # a group of zeros: nothing to round
            x[1] *= 1e-3
            full, rounding = int8.screen(x, packed, scales)
            for rows in (1, 2, 3, 4, 5, 7, 8, 16, 33):
                part, part_rounding = int8.screen(x[5 : 5 + rows].contiguous(), packed, scales)
                assert torch.equal(part, full[5 : 5 + rows]) and torch.equal(part_rounding, rounding[5 : 5 + rows]), (shape, rows)
            groups = x.double().reshape(len(x), -1, 32)
            largest = groups.abs().amax(dim=2, keepdim=True)
            step = (largest.float() / 127).double()
            codes = torch.where(largest > 0, groups * (127 / largest.float()).double(), 0.0).float().round().clamp(-127, 127).double()
            expected = (groups - codes * step).reshape(len(x), -1).norm(dim=1)
            assert torch.allclose(rounding, expected, rtol=1e-6, atol=1e-12)
            assert float(rounding[0]) < float(rounding[2]) and 0 < float(rounding[1]) < float(rounding[2]) * 1e-2
            weights = int8.dequantize(packed, scales).double()
            norms = weights.norm(dim=1)[None, :]
            accumulation = (shape[1] + 2) * 2.0**-24 * norms * (x.double().norm(dim=1) + rounding)[:, None]
            assert ((full.double() - x.double() @ weights.T).abs() <= norms * rounding[:, None] + accumulation).all()
            assert (full.double() - x.double() @ weights.T).abs().max() > accumulation.max()  # the activations were rounded


@needs_own_int4
@pytest.mark.parametrize("threads", [1, 2])
def test_kestrels_int4_kernel_is_row_invariant_and_exact_to_float32_rounding(threads):
    """A row's result is the same bits in every block of rows, on 1 or 2
    threads, and within float32 rounding of the weights times the input."""
    with thread_count(threads):
        generator = torch.Generator().manual_seed(3)
        for shape in SHAPES:
            codes, d, m = int4.quantize_blocks(torch.randn(shape, generator=generator))
            x = torch.randn(40, shape[1], generator=generator)
            full = torch.ops.kestrel_q4.linear(x, codes, d, m)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 33):
                part = torch.ops.kestrel_q4.linear(x[5 : 5 + rows].contiguous(), codes, d, m)
                assert torch.equal(part, full[5 : 5 + rows]), (shape, rows)
            expected = x.double() @ int4.dequantize_blocks(codes, d, m).double().T
            assert (full.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@needs_own_int4
def test_kestrels_int4_layer_matches_its_linear_and_compiles():
    generator = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(96, 48)
    with torch.no_grad():
        linear.weight.copy_(q4_1_blocks(48, 96, 4))
    layer = int4.Q4Linear(linear)
    assert torch.equal(layer.weight(), linear.weight)  # Q4_1 blocks come back exactly
    x = torch.randn(2, 3, 96, generator=generator)
    out = layer(x)
    assert out.shape == (2, 3, 48) and out.dtype == torch.float32
    assert torch.allclose(out, linear(x), rtol=1e-5, atol=1e-5)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    compiled = torch.compile(lambda x: layer(x) * 2, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(x), out * 2)


@needs_torch_int4
def test_int4_groups_find_q4_1_blocks_again():
    """Q4_1 blocks come back exactly through torch's kernel: the identity matrix returns them."""
    rows, columns = 48, 96
    weight = q4_1_blocks(rows, columns, 4)
    packed, scale_and_zeros = int4.quantize_groups(weight)
    identity = torch.eye(columns, dtype=torch.bfloat16)
    recovered = torch.ops.aten._weight_int4pack_mm_for_cpu(identity, packed, int4.GROUP, scale_and_zeros)
    assert torch.equal(recovered.float().T, weight)


@needs_int4
def test_int4_base_loads_and_odd_sizes_are_refused(tiny_dir, tmp_path):
    base = load_base(str(tiny_dir), quantization="int4", dtype="float32")
    assert base.quantization == "int4"
    kind = int4.Q4Linear if int4.own_kernel() else int4.Int4Linear
    assert sum(isinstance(m, kind) for m in base.model.get_decoder().layers.modules()) == 14  # 2 layers x 7
    odd = save_tiny_model(tmp_path / "odd", hidden_size=48, intermediate_size=80, num_attention_heads=4)
    with pytest.raises(QuantizationUnavailableError, match="multiples of 32"):
        load_base(str(odd), quantization="int4", dtype="float32")
    narrow = load_base(str(save_tiny_model(tmp_path / "narrow", intermediate_size=72)), dtype="float32")
    assert not int4.fits(narrow.model)  # 72 outputs: not a whole number of the packer's 16-row tiles


@needs_kernel
def test_with_int8_linears_replaces_every_linear_of_a_copy(tiny_base):
    head = random_head(tiny_base.model)
    packed = int8.with_int8_linears(head)
    assert not any(isinstance(module, torch.nn.Linear) for module in packed.modules())
    kind = int8.DraftLinear if int8.own_kernel() else int8.Int8Linear  # Kestrel's kernels where they are built
    assert sum(isinstance(module, kind) for module in packed.modules()) == 8  # fc, q, k, v, o, 3 MLP
    assert isinstance(head.fc, torch.nn.Linear)  # the original is untouched
    x = torch.randn(9, head.fc.in_features, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for rows in (1, 9):  # one row: the vector kernel; more: tiles where the CPU has them
        torch.testing.assert_close(packed.fc(x[:rows]), head.fc(x[:rows]), rtol=0.05, atol=0.05)
    assert packed.dtype == head.dtype == torch.float64


@needs_kernel
def test_engine_drafts_with_int8_and_the_vocabulary_ranks_alike(tiny_base, monkeypatch):
    monkeypatch.setattr(int8, "pays", lambda dtype: True)  # as where the probe finds it faster
    engine = Engine(tiny_base, random_head(tiny_base.model))
    assert isinstance(engine.draft_head.fc, int8.QuantizedLinear)
    assert engine.vocabulary.packed is not None
    lm_head = tiny_base.model.get_output_embeddings()
    hidden = torch.randn(64, lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = torch.log_softmax(lm_head(hidden), dim=-1)
    rough = DraftVocabulary(lm_head.weight, None).log_probs(hidden)
    assert (rough.argmax(dim=-1) == exact.argmax(dim=-1)).float().mean() >= 0.9
    four_bit = isinstance(engine.vocabulary.packed, int4.TileRows)  # where the CPU has AVX512-BF16
    assert (rough - exact).abs().max() < (0.08 if four_bit else 0.02) * exact.abs().max()  # int8: about 1% of the scale, as above


def test_int8_is_off_where_it_does_not_pay():
    assert not int8.available(torch.device("meta"))
    assert resolve_quantization("auto", torch.device("cpu"), torch.float64) == "none"
    with pytest.raises(QuantizationUnavailableError, match="float64"):
        resolve_quantization("int8", torch.device("cpu"), torch.float64)
    with pytest.raises(QuantizationUnavailableError, match="bitsandbytes"):
        resolve_quantization("int8", torch.device("meta"), torch.float32)


def test_auto_takes_int4_for_a_4_bit_gguf_only_through_kestrel_s_own_kernel(monkeypatch):
    """torch's int4 kernel rounds each group's scale and minimum to bf16 (a
    greedy reply of the bundled model changed with it): without Kestrel's own
    kernel (no compiler) auto takes the rule of other models, and int4 by name
    still runs through torch's."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(int4, "own_kernel", lambda: True)
    assert resolve_quantization("auto", cpu, torch.bfloat16, q4_1_source=True) == "int4"
    monkeypatch.setattr(int4, "own_kernel", lambda: False)
    other = resolve_quantization("auto", cpu, torch.bfloat16, q4_1_source=False)
    assert resolve_quantization("auto", cpu, torch.bfloat16, q4_1_source=True) == other != "int4"
    if int4.torch_kernel(cpu):
        assert resolve_quantization("int4", cpu, torch.bfloat16) == "int4"


@needs_kernel
def test_int8_base_loads_with_every_decoder_linear_quantized(tiny_dir):
    base = load_base(str(tiny_dir), quantization="int8", dtype="float32")
    assert base.quantization == "int8"
    layers = base.model.get_decoder().layers
    assert not any(isinstance(module, torch.nn.Linear) for module in layers.modules())
    assert isinstance(base.model.get_output_embeddings(), torch.nn.Linear)  # the lm_head stays exact
    expected = "int8" if int8.pays(torch.float32) else "none"  # auto takes int8 where the probe finds it faster
    assert load_base(str(tiny_dir), quantization="auto", dtype="float32").quantization == expected


@pytest.fixture(scope="module")
def bundled_auto():
    """The bundled pair as `auto` loads it on this CPU (int4: the GGUF is
    Q4_1, else int8), with exact attention."""
    base = load_base(None, quantization="auto", dtype="float32")
    assert base.quantization == ("int4" if int4.kernel_available(base.device) else "int8")
    head = default_head(None)
    config = base.model.config
    vocab = base.model.get_output_embeddings().weight.shape[0]
    draft = load_head(head, config.hidden_size, vocab, base.device, base.dtype, config.num_hidden_layers)
    return Engine(base, draft, "bundled")


@needs_kernel
def test_the_int8_forward_is_row_invariant_with_row_attention(bundled_auto):
    """Every tree node's features equal a one-token step's bit for bit on the
    real model; with sdpa they do not (so the check has teeth)."""
    model = bundled_auto.model
    assert bundled_auto.exact and model.config._attn_implementation == attention.NAME
    assert bundled_auto.argmax.row_by_row
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
def test_greedy_eagle2_equals_vanilla_bit_for_bit_in_the_default_setting(bundled_auto, prompt):
    messages = [{"role": "user", "content": prompt}]
    sampling = SamplingParams(max_new_tokens=64)
    replies = {}
    for mode, tree in (("vanilla", TreeParams()), ("eagle2", TreeParams()), ("eagle2", TreeParams(24, depth=6))):
        replies[(mode, tree.total_tokens)] = [t for step in bundled_auto.chat(messages, mode, sampling, tree) for t in step.token_ids]
    first = replies[("vanilla", 0)]
    assert len(first) > 20
    assert all(reply == first for reply in replies.values())


@needs_kernel
def test_the_model_s_own_reply_does_not_depend_on_whether_a_head_is_loaded(bundled_auto):
    """An engine without a head (a model with none, or `chat --mode vanilla`)
    runs the same row-invariant attention as one with a head, so vanilla
    replies are the same bits either way (with sdpa they part ways here)."""
    messages = [{"role": "user", "content": "Write a short poem about the sea and explain its meaning."}]
    sampling = SamplingParams(max_new_tokens=160)
    with_head = [t for step in bundled_auto.chat(messages, "vanilla", sampling) for t in step.token_ids]
    alone = Engine(bundled_auto.base)
    try:
        assert alone.head is None and alone.exact
        assert [t for step in alone.chat(messages, "vanilla", sampling) for t in step.token_ids] == with_head
    finally:
        Engine(bundled_auto.base, bundled_auto.head, "bundled")  # the fixture's model as it was (exact attention)


def test_row_attention_refuses_what_it_does_not_model():
    query, key = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="softcap"):
        attention.rows_attention(None, query, key, key, mask, softcap=30.0)


@needs_torch_int4
def test_int4_falls_back_to_torchs_kernel_where_kestrels_cannot_be_built(tiny_dir, monkeypatch):
    monkeypatch.setattr(int4, "own_kernel", lambda: False)
    base = load_base(str(tiny_dir), quantization="int4", dtype="float32")
    layers = list(base.model.get_decoder().layers.modules())
    assert sum(isinstance(m, int4.Int4Linear) for m in layers) == 14 and not any(isinstance(m, int4.Q4Linear) for m in layers)


needs_tiles = pytest.mark.skipif(not int4.tiles_available(), reason="no AVX512-BF16 on this CPU (nor AMX tiles)")


@needs_tiles
@pytest.mark.parametrize("threads", [1, 2])
def test_kestrels_int4_tiles_are_row_invariant_and_exact_to_float32_rounding(threads):
    """The tile layout's product (AMX or vdpbf16ps): a row's result is the
    same bits in every block of rows (1 to 16 rows a tile, more in several),
    on 1 or 2 threads, and within
    float32 rounding of the exact weights times the bf16 input."""
    with thread_count(threads):
        generator = torch.Generator().manual_seed(13)
        for shape in SHAPES:
            if shape[0] % 16 or shape[1] % int4.GROUP:
                continue
            codes, d, m = int4.quantize_blocks(torch.randn(shape, generator=generator))
            tiles = int4.pack_tiles(codes, d, m)
            assert all(torch.equal(a, b) for a, b in zip(int4.unpack_tiles(*tiles), (codes, d, m)))
            x = torch.randn(40, shape[1], generator=generator).bfloat16()
            full = torch.ops.kestrel_q4.tiles(x, *tiles)
            for rows in (1, 2, 3, 5, 8, 15, 16, 17, 33):
                part = torch.ops.kestrel_q4.tiles(x[5 : 5 + rows].contiguous(), *tiles)
                assert torch.equal(part, full[5 : 5 + rows]), (shape, rows)
            expected = x.double() @ int4.dequantize_blocks(codes, d, m).double().T
            assert (full.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@needs_tiles
def test_a_bf16_int4_layer_runs_on_tiles_and_a_float32_one_does_not():
    weight = q4_1_blocks(48, 96, 6)
    linear = torch.nn.Linear(96, 48, bias=True).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(weight)
    layer = int4.Q4Linear(linear)
    assert layer.tiles and torch.equal(layer.weight(), weight.bfloat16().float())
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(6)).bfloat16()
    expected = (x.double() @ weight.bfloat16().double().T + linear.bias.double()).bfloat16()
    assert torch.allclose(layer(x).float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert not int4.Q4Linear(torch.nn.Linear(96, 48)).tiles  # float32 layers keep the vector kernel



@pytest.mark.skipif(not int8.tiles_available(), reason="no AVX512-BF16 on this CPU (nor AMX tiles)")
def test_int8_rows_on_tiles_match_the_vector_kernel_within_float32_rounding():
    """The int8 product in the tile layout (AMX or vdpbf16ps; two rows or more): the same exact
    products summed in float32, each row alone, output rows padded to 16."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(1000, 96, generator=generator).bfloat16()
    rows = int8.PackedRows(weight, own=True, tiles=True)
    assert rows.tiles
    x = torch.randn(40, 96, generator=generator).bfloat16()
    full = rows(x)
    assert full.shape == (40, 1000)
    for count in (2, 3, 16, 17, 33):
        assert torch.equal(rows(x[4 : 4 + count]), full[4 : 4 + count]), count
    expected = x.double() @ rows.dequantized().double().T
    bound = (96 + 2) * 2.0**-24 * rows.dequantized().double().norm(dim=1)[None, :] * x.double().norm(dim=1)[:, None]
    assert ((full.double() - expected).abs() <= bound).all()
    assert not rows.one_row_tiles
    assert ((rows(x[:1]).double() - expected[:1]).abs() <= bound[:1]).all()  # one row: the vector kernel
    assert rows.choose_one_row() == rows.one_row_tiles  # measured: whichever kernel was faster here
    rows.one_row_tiles = True
    assert all(torch.equal(rows(x[row : row + 1]), full[row : row + 1]) for row in range(40))  # one row on tiles: as in company


@needs_tiles
def test_the_draft_vocabulary_on_tiles_ranks_like_its_float_weights():
    """Where the CPU has AVX512-BF16 the draft vocabulary is 4-bit groups in the tile layout
    (rows padded to 16); its logits stay close to the float ones."""
    from core.drafter import DraftVocabulary

    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(1000, 64, generator=generator)  # 1000 rows: not a multiple of 16
    vocabulary = DraftVocabulary(weight, None)
    assert isinstance(vocabulary.packed, int4.TileRows)
    hidden = torch.randn(3, 64, generator=generator)
    logits = vocabulary.packed(hidden)
    exact = hidden @ weight.T
    assert logits.shape == (3, 1000)
    assert (logits - exact).abs().max() < 0.1 * exact.abs().max()
    assert torch.equal(vocabulary.log_probs(hidden).argmax(-1), logits.argmax(-1))


@needs_kernel
def test_kestrels_top_k_equals_torch_topk_with_ties_to_the_first_index():
    generator = torch.Generator().manual_seed(10)
    for rows, width, k in ((1, 49152, 17), (5, 8192, 8), (2, 5000, 64)):
        x = torch.randn(rows, width, generator=generator)
        x[0, 7] = x[0, 3] = x[0].max() + 1  # a tie at the top
        if rows > 1:
            x[-1, 100:200] = x[-1].max() + 2  # a hundred equal maxima
        values, indices = int8.top_k(x, k)
        expected = x.topk(k, dim=-1)
        assert torch.equal(values, expected.values) and torch.equal(x.gather(1, indices), values)
        assert indices[0, :2].tolist() == [3, 7]
        if rows > 1:
            assert indices[-1, : min(k, 100)].tolist() == list(range(100, 100 + min(k, 100)))


@needs_kernel
def test_sampled_eagle2_equals_vanilla_for_one_seed_through_the_screened_lm_head(bundled_auto):
    """Sampling over the whole vocabulary takes the screened lm_head (no full
    product per node); with one seed every mode writes the same reply, and
    another seed another reply."""
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    replies = {}
    for seed in (3, 4):
        sampling = SamplingParams(temperature=0.8, max_new_tokens=48, seed=seed)
        for mode in ("vanilla", "eagle2"):
            replies[(mode, seed)] = [t for step in bundled_auto.chat(messages, mode, sampling) for t in step.token_ids]
    assert replies[("vanilla", 3)] == replies[("eagle2", 3)] and len(replies[("vanilla", 3)]) > 20
    assert replies[("vanilla", 4)] == replies[("eagle2", 4)]
    assert replies[("vanilla", 3)] != replies[("vanilla", 4)]


@needs_kernel
def test_layers_the_int8_kernels_cannot_take_keep_plain_products(tmp_path):
    """torch's int8 kernel reads past its weights where a layer's input size is
    not a multiple of 16 (products of 1e23 and more, or a crash): such layers
    keep plain products, so greedy vanilla equals transformers' generate and
    eagle2 equals vanilla, and int8 by name is refused."""
    from core.argmax import ScreenedArgmax

    assert int8.takes(torch.zeros(3, 48)) and not int8.takes(torch.zeros(3, 40))
    folder = save_tiny_model(tmp_path / "k40", hidden_size=40, intermediate_size=120, num_attention_heads=4, num_key_value_heads=2)
    base = load_base(str(folder), dtype="float32", quantization="auto")
    assert base.quantization == "none"
    assert not ScreenedArgmax(base.model.get_output_embeddings()).enabled
    head = random_head(base.model)
    assert int8.drafting_head(head) is head
    assert DraftVocabulary(base.model.get_output_embeddings().weight, None).packed is None or int8.takes(base.model.get_output_embeddings().weight)
    engine = Engine(base, head)
    prompt = [5, 9, 13, 21, 8]
    reference = base.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=sorted(engine.stop_ids), pad_token_id=0)
    expected = reference[0, len(prompt) :].tolist()
    for mode in ("vanilla", "eagle2"):
        steps = list(engine.stream(prompt, mode=mode, sampling=SamplingParams(max_new_tokens=20)))
        assert [token for step in steps for token in step.token_ids] == expected, mode
    with pytest.raises(QuantizationUnavailableError, match="int8 needs layer input sizes that are multiples of 16"):
        load_base(str(folder), dtype="float32", quantization="int8")


@pytest.mark.parametrize("file_type, taken", [(3, True), (2, False), (15, False)])  # MOSTLY_Q4_1, MOSTLY_Q4_0, MOSTLY_Q4_K_M
def test_auto_reads_only_a_q4_1_gguf_as_int4(tmp_path, file_type, taken):
    """int4 finds each block's d and m again from its minimum and maximum: exact
    for Q4_1's blocks, not for Q4_0's (d * (q - 8) seldom spans codes 0 to 15),
    so auto takes int4 only for a GGUF whose file type says Q4_1."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_file_type(file_type)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((16, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert int4.gguf_is_q4_1(path) is taken

    weights = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    kind = GGMLQuantizationType.Q4_1 if taken else GGMLQuantizationType.Q4_0
    stored = torch.from_numpy(quants.dequantize(quants.quantize(weights, kind), kind).copy())
    again = int4.dequantize_blocks(*int4.quantize_blocks(stored))
    assert torch.equal(again, stored) is (kind == GGMLQuantizationType.Q4_1)
