"""Capturing the base model's intermediate hidden states for EAGLE-3 heads.

An EAGLE-3 head reads three hidden states of the residual stream: the inputs
of chosen decoder layers (for i < L, transformers' `output_hidden_states[i]`
is the input of layer i; i = L, past the last layer, is the input of the final
norm, where transformers' `output_hidden_states[L]` is its output).
Forward pre-hooks on the unmodified transformers model keep a reference to
those three inputs during one forward, so nothing else is stored and no layer
runs twice; the hooks are removed when the forward ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from models import int8


class LayerCapture:
    def __init__(self, model, layer_ids: tuple[int, ...]):
        decoder = model.get_decoder()
        if int8.decoder_layers(model) is None or not hasattr(decoder, "norm"):
            raise ValueError(f"{type(model).__name__} keeps its decoder layers otherwise than as model.layers and "
                             "model.norm, where an EAGLE-3 head's features are captured; use an EAGLE-1/2 head")  # fmt: skip
        layers = len(decoder.layers)
        bad = [i for i in layer_ids if not 0 <= i <= layers]
        if bad:
            raise ValueError(f"feature layers {bad} do not exist in a {layers}-layer model")
        # the module whose input is hidden state i
        self.modules = [decoder.layers[i] if i < layers else decoder.norm for i in layer_ids]
        self.states: list[torch.Tensor | None] = [None] * len(layer_ids)

    @contextmanager
    def during(self) -> Iterator[LayerCapture]:
        """Capture within the block (one base-model forward)."""
        handles = [
            module.register_forward_pre_hook(self._keeper(index), with_kwargs=True)
            for index, module in enumerate(self.modules)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _keeper(self, index: int):
        def keep(module, args, kwargs):
            self.states[index] = args[0] if args else kwargs["hidden_states"]

        return keep

    def features(self) -> torch.Tensor:
        """(T, 3H): the captured states of the last forward (batch 1), low to high, concatenated."""
        return self.batched()[0]

    def batched(self) -> torch.Tensor:
        """(B, T, 3H): the same for a batched forward."""
        if any(state is None for state in self.states):
            raise RuntimeError("no forward ran while capturing")
        fused = torch.cat(self.states, dim=-1)
        self.states = [None] * len(self.states)
        return fused
