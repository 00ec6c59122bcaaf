"""The row-invariant attention's C++ kernel (core/rowkernel.py)."""

import pytest
import torch

from core import attention, rowkernel
from core.tree import ancestor_mask

needs_kernel = pytest.mark.skipif(rowkernel.library() is None, reason="no C++ compiler to build the kernel")
PARENTS = (-1, 0, 1, 0, 3, -1, 5, 2)  # a tree of 8 nodes, three deep


def tree_case(dtype, prefix=70, heads=6, kv_heads=2, dim=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = len(PARENTS)
    keys = torch.randn(1, kv_heads, prefix + rows, dim, generator=generator, dtype=dtype)
    values = torch.randn(1, kv_heads, prefix + rows, dim, generator=generator, dtype=dtype)
    query = torch.randn(1, rows, heads, dim, generator=generator, dtype=dtype).transpose(1, 2)  # as transformers passes it
    mask = torch.ones(rows, prefix + rows, dtype=torch.bool)
    mask[:, prefix:] = ancestor_mask(PARENTS)
    return query, keys, values, mask


TOLERANCES = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-5)}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_kernel_computes_masked_attention(dtype):
    """bf16 in, bf16 out, float32 inside: the result is float32 attention of
    the bf16 inputs, rounded once."""
    query, keys, values, mask = tree_case(dtype)
    out, _ = attention.rows_attention(None, query, keys, values, mask[None, None], scaling=0.3)
    assert out.dtype == dtype
    group = query.shape[1] // keys.shape[1]
    inside = torch.float64 if dtype == torch.float64 else torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.to(inside), keys.repeat_interleave(group, 1).to(inside), values.repeat_interleave(group, 1).to(inside),
        attn_mask=mask[None, None], scale=0.3,
    ).transpose(1, 2)  # fmt: skip
    assert out.shape == expected.shape
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.to(inside), expected, rtol=rtol, atol=atol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_row_is_bit_for_bit_a_lone_row_over_its_keys(dtype):
    """What makes greedy EAGLE-2 equal vanilla: each node's result is what a
    one-token step over the same key sequence (after the commit) computes."""
    query, keys, values, mask = tree_case(dtype, seed=3)
    out, _ = attention.rows_attention(None, query, keys, values, mask[None, None], scaling=0.25)
    for row in range(len(PARENTS)):
        visible = mask[row].nonzero().squeeze(1)
        lone, _ = attention.rows_attention(
            None, query[:, :, row : row + 1], keys[:, :, visible], values[:, :, visible], None, scaling=0.25
        )
        assert torch.equal(lone[0, 0], out[0, row]), row


def test_rows_lists_each_rows_keys_in_cache_order():
    mask = torch.tensor([[1, 1, 1, 0, 0, 1], [1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    rows = rowkernel.Rows.of(mask, 3, 6)
    assert rows.prefix.tolist() == [3, 2, 6]
    assert rows.offsets.tolist() == [0, 1, 3, 3]
    assert rows.extra.tolist() == [5, 3, 4]
    causal = rowkernel.Rows.of(None, 2, 9)  # the last two of nine positions, causal
    assert causal.prefix.tolist() == [8, 9] and causal.offsets.tolist() == [0, 0, 0]


def test_without_the_kernel_the_torch_code_computes_the_same_attention(monkeypatch):
    query, keys, values, mask = tree_case(torch.float64, seed=5)
    with_kernel, _ = attention.rows_attention(None, query, keys, values, mask[None, None], scaling=0.3)
    monkeypatch.setattr(rowkernel, "library", lambda: None)
    assert rowkernel.attend(query, keys, values, rowkernel.Rows.of(mask, len(PARENTS), mask.shape[1]), 0.3) is None
    attention._local.plan = None
    without, _ = attention.rows_attention(None, query, keys, values, mask[None, None], scaling=0.3)
    torch.testing.assert_close(without, with_kernel, rtol=1e-12, atol=1e-13)


@needs_kernel
def test_the_kernel_leaves_dtypes_it_does_not_cover_to_torch():
    query, keys, values, mask = tree_case(torch.float32)
    rows = rowkernel.Rows.of(mask, len(PARENTS), mask.shape[1])
    assert rowkernel.attend(query.half(), keys.half(), values.half(), rows, 0.3) is None
    assert rowkernel.attend(query.bfloat16(), keys.bfloat16(), values.bfloat16(), rows, 0.3) is not None
    assert rowkernel.attend(query, keys, values, rows, 0.3) is not None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the tile path where the CPU has one
def test_the_result_does_not_depend_on_the_thread_count(dtype):
    query, keys, values, mask = tree_case(dtype, prefix=300, heads=9, kv_heads=3, dim=64, seed=7)
    rows = rowkernel.Rows.of(mask, len(PARENTS), mask.shape[1])
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(rowkernel.attend(query, keys, values, rows, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


needs_tiles = pytest.mark.skipif(rowkernel.library() is None or not rowkernel.tiles(), reason="no AVX512-BF16 on this CPU (nor AMX tiles)")


@needs_tiles
@pytest.mark.parametrize("dim, heads, kv_heads, prefix", [(64, 9, 3, 300), (128, 8, 2, 37), (64, 16, 1, 5)])
def test_the_tile_path_keeps_tree_rows_bit_for_bit(dim, heads, kv_heads, prefix):
    """bf16 with head size 64 or 128 runs as tile products (AMX or vdpbf16ps),
    16 query vectors at a time: a tree node still gets what a lone row over its keys gets, a causal
    row what it gets alone, and the result is as close to float32 attention
    as torch's own bf16 attention is (both weigh the values with bf16 weights)."""
    query, keys, values, mask = tree_case(torch.bfloat16, prefix=prefix, heads=heads, kv_heads=kv_heads, dim=dim, seed=11)
    out, _ = attention.rows_attention(None, query, keys, values, mask[None, None], scaling=0.2)
    group = heads // kv_heads
    every_head = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # sdpa's layout
    sdpa = torch.nn.functional.scaled_dot_product_attention
    expected = sdpa(query.float(), *(t.float() for t in every_head), attn_mask=mask[None, None], scale=0.2).transpose(1, 2)
    torch_bf16 = sdpa(query, *every_head, attn_mask=mask[None, None], scale=0.2).transpose(1, 2)
    torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=2e-3)
    assert (out.float() - expected).abs().max() <= 1.25 * (torch_bf16.float() - expected).abs().max()
    for row in range(len(PARENTS)):
        visible = mask[row].nonzero().squeeze(1)
        lone, _ = attention.rows_attention(None, query[:, :, row : row + 1], keys[:, :, visible], values[:, :, visible], None, scaling=0.2)
        assert torch.equal(lone[0, 0], out[0, row]), row
    # causal rows (a prefill), more than one item's worth: each row as it is alone
    total = keys.shape[2]
    count = min(21, total)
    generator = torch.Generator().manual_seed(12)
    rows_query = torch.randn(1, count, heads, dim, generator=generator).bfloat16().transpose(1, 2)
    causal = rowkernel.attend(rows_query, keys, values, rowkernel.Rows.of(None, count, total), 0.2)
    for row in (0, 7, count - 1):
        lone = rowkernel.attend(rows_query[:, :, row : row + 1], keys, values, rowkernel.Rows.of(None, 1, total - count + 1 + row), 0.2)
        assert torch.equal(lone[0, 0], causal[0, row]), row


DOTS_CHECK = r"""
import torch
from core import rowkernel
from models import int4, int8
assert not int4.tile_unit() and not int8.tile_unit(), "KESTREL_AMX=0 leaves the tile unit alone"
assert int4.tiles_available() and int8.tiles_available() and rowkernel.tiles()
generator = torch.Generator().manual_seed(3)
x = torch.randn(20, 96, generator=generator).bfloat16()
tiles = int4.pack_tiles(*int4.quantize_blocks(torch.randn(48, 96, generator=generator)))
full = torch.ops.kestrel_q4.tiles(x, *tiles)
rows = int8.PackedRows(torch.randn(40, 96, generator=generator).bfloat16(), own=True, tiles=True)
whole = rows(x)
for count in (2, 3, 7, 17):
    assert torch.equal(torch.ops.kestrel_q4.tiles(x[1 : 1 + count].contiguous(), *tiles), full[1 : 1 + count]), count
    assert torch.equal(rows(x[1 : 1 + count].contiguous()), whole[1 : 1 + count]), count
keys = torch.randn(1, 2, 45, 64, generator=generator).bfloat16()
values = torch.randn(1, 2, 45, 64, generator=generator).bfloat16()
query = torch.randn(1, 6, 5, 64, generator=generator).bfloat16()
causal = rowkernel.attend(query, keys, values, rowkernel.Rows.of(None, 5, 45), 0.125)
for row in range(5):
    lone = rowkernel.attend(query[:, :, row : row + 1], keys, values, rowkernel.Rows.of(None, 1, 41 + row), 0.125)
    assert torch.equal(lone[0, 0], causal[0, row]), row
print("dots ok")
"""


@pytest.mark.skipif(rowkernel.library() is None or not rowkernel.tiles(), reason="no AVX512-BF16 on this CPU (nor AMX tiles)")
def test_the_vdpbf16ps_paths_run_where_the_tile_unit_is_declined():
    """With KESTREL_AMX=0 (or on AVX512-BF16 CPUs without AMX) the int4, int8
    and attention tile paths run as vdpbf16ps chains, each row alone: a row
    gets the same bits in any block of rows (on AMX machines this is the
    only test of that path)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    environment = {**os.environ, "KESTREL_AMX": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", DOTS_CHECK], cwd=root, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "dots ok" in done.stdout, done.stderr[-2000:]


@needs_kernel
def test_a_bf16_prefill_runs_on_the_kernel_where_it_is_the_faster():
    """Causal rows (a prefill) go to the row kernel where rowkernel.prefills
    (bf16 tile products as vdpbf16ps), else to sdpa; either way every mode
    shares the prefill, and on the kernel each row is what it is alone."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(21)
    keys = torch.randn(1, 2, 40, 64, generator=generator).bfloat16()
    values = torch.randn(1, 2, 40, 64, generator=generator).bfloat16()
    query = torch.randn(1, 6, 40, 64, generator=generator).bfloat16()
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 3, True, False
    out, _ = attention.rows_attention(module, query, keys, values, None, scaling=0.125)
    kernel = rowkernel.attend(query, keys, values, rowkernel.Rows.of(None, 40, 40), 0.125)
    sdpa, _ = sdpa_attention_forward(module, query, keys, values, None, scaling=0.125)
    assert torch.equal(out, kernel.to(out.dtype) if rowkernel.prefills(torch.bfloat16, torch.device("cpu")) else sdpa)
    assert not rowkernel.prefills(torch.float32, torch.device("cpu"))  # float32 prefills stay on sdpa
    for row in (0, 17, 39):
        lone = rowkernel.attend(query[:, :, row : row + 1], keys[:, :, : row + 1], values[:, :, : row + 1], rowkernel.Rows.of(None, 1, row + 1), 0.125)
        assert torch.equal(lone[0, 0], kernel[0, row]), row
