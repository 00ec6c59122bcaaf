"""Int8 weights for drafting on CPUs.

Drafting multiplies a handful of rows by the head's weights and the draft
vocabulary's output rows, so on a CPU its cost is reading those weights from
memory. Stored as int8 with one bf16 scale per output row, they are half the
bytes of bf16, and torch's int8 weight kernel (`_weight_int8pack_mm`, bf16
activations) reads them directly. Only drafting uses them: proposals are
verified by the base model in its own precision, so this rounding can lower
the acceptance rate a little but never changes the output."""

from __future__ import annotations

import copy

import torch
from torch import nn

from models.base import cpu_has_native_bf16


def available(device: torch.device) -> bool:
    """Whether int8 drafting pays on `device`: a CPU with native bf16 and torch's kernel."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm") and cpu_has_native_bf16()


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (int8 (N, K), bf16 scales (N,)), symmetric per row."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
    packed = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return packed.contiguous(), scales.to(torch.bfloat16)


def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (m, K) -> (m, N) in bf16: x @ (packed * scales).T."""
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), packed, scales)


class Int8Linear(nn.Module):
    """A frozen nn.Linear with int8 weights; inputs and outputs keep their dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        packed, scales = quantize_rows(linear.weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = matmul(x.reshape(-1, x.shape[-1]), self.packed, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def with_int8_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` whose nn.Linear layers are Int8Linear; the original is untouched."""
    linears = [child for child in module.modules() if isinstance(child, nn.Linear)]
    shared = {id(tensor): tensor for linear in linears for tensor in linear.parameters()}
    module = copy.deepcopy(module, memo=shared)  # linear weights are not copied, only replaced below
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return module
