"""Int4 weights on CPUs: the bundled GGUF's own 4-bit format, through torch's
int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations).

GGUF's Q4_1 stores each block of 32 weights along a row as a scale d, a
minimum m and 4-bit codes q, meaning d*q + m. Torch's kernel means
(q - 8)*scale + zero per group of 32 along the input dimension, so scale = d
and zero = m + 8d give the same weights (with d and m rounded from fp16 to
bf16). Rather than parse the blocks, the weights transformers dequantized are
quantized again per group from their minimum and maximum: a Q4_1 block
holds codes 0 and 15 at its minimum and maximum, so this finds d and m again.

Reading half the bytes of int8, it is the faster kernel when weights stream
from memory: measured on the 2-core AVX2 machine with 120 distinct 1536x576
layers (more than the caches hold), 71 us per layer for one row against 98
in int8 and 296 in float32, and 183 against 253 for eight rows. Like the int8
kernel it computes every row alone (tests/test_int8.py)."""

from __future__ import annotations

import torch
from torch import nn

from models import int8

GROUP = 32  # weights per scale and zero, along the input dimension (Q4_0/Q4_1's block)
GGUF_4BIT_TYPES = {2, 3, 14, 15}  # general.file_type: MOSTLY_Q4_0, MOSTLY_Q4_1, MOSTLY_Q4_K_S, MOSTLY_Q4_K_M


def kernel_available(device: torch.device) -> bool:
    ops = torch.ops.aten
    return device.type == "cpu" and hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def fits(model: nn.Module) -> bool:
    """Whether the kernel takes every decoder linear: input sizes a whole number
    of groups, output sizes a multiple of 16 (the packer's tile)."""
    linears = [module for module in model.get_decoder().layers.modules() if isinstance(module, nn.Linear)]
    return all(module.in_features % GROUP == 0 and module.out_features % 16 == 0 for module in linears)


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (the kernel's packed codes, bf16 scale_and_zeros (K/32, N, 2)),
    asymmetric per group of 32 along K."""
    rows, columns = weight.shape
    groups = weight.detach().float().reshape(rows, columns // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-30).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    codes = ((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).round().clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(rows, columns).to(torch.int32), 1)
    return packed, torch.stack([scale.T, zero.T], dim=-1).contiguous()


class Int4Linear(int8.QuantizedLinear):
    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        packed, scale_and_zeros = quantize_groups(linear.weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zeros", scale_and_zeros)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_and_zeros)


def quantize_decoder(model: nn.Module) -> int:
    """Int4 weights for every linear layer of a causal LM's decoder layers, in
    place; the embedding and the lm_head keep their precision. -> layers replaced."""
    return int8.replace_linears(model.get_decoder().layers, Int4Linear)


def gguf_is_4bit(path) -> bool:
    """Whether a GGUF file's weights are mostly 4-bit (its general.file_type)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields["general.file_type"]
        return int(field.parts[field.data[0]][0]) in GGUF_4BIT_TYPES
    except Exception:  # an unreadable or unusual header: not known to be 4-bit
        return False
