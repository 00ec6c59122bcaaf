"""The base model's KV cache: a transformers DynamicCache whose layers append
into preallocated buffers, committed in place after each verification."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROWTH = 256  # positions added at a time when a buffer is full (at least; doubling beyond)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with room to
    spare: a step writes its rows in place instead of copying the whole cache
    (transformers' layer concatenates, an O(context) copy per layer and step)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            self.key_buffer = self.value_buffer = None
            self.is_initialized = True
        length = self.keys.shape[-2]
        end = length + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self._grow(end)
        self.key_buffer[..., length:end, :] = key_states
        self.value_buffer[..., length:end, :] = value_states
        self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        old = 0 if self.key_buffer is None else self.key_buffer.shape[-2]
        capacity = max(needed + GROWTH, 2 * old)
        for name, current in (("key_buffer", self.keys), ("value_buffer", self.values)):
            shape = (*current.shape[:-2], capacity, current.shape[-1])
            buffer = current.new_empty(shape)
            buffer[..., : current.shape[-2], :] = current
            setattr(self, name, buffer)


def new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def has_sliding_window(config) -> bool:
    """Whether some layer attends through a sliding window, which tree masks
    and cache commits do not model."""
    return "sliding_attention" in (getattr(config, "layer_types", None) or ())


def commit(cache: DynamicCache, prefix: int, path: list[int]) -> None:
    """Keep the prefix and the tree nodes on `path` (tree indices, root first),
    moved to consecutive positions after the prefix; drop the rest of the tree."""
    if path == list(range(len(path))):  # a chain along node order: just crop
        for layer in cache.layers:
            layer.keys = layer.keys[..., : prefix + len(path), :]
            layer.values = layer.values[..., : prefix + len(path), :]
        return
    rows = torch.tensor(path, device=cache.layers[0].keys.device) + prefix
    end = prefix + len(path)
    for layer in cache.layers:
        # gather (a copy) then write in place: only the accepted rows move
        layer.keys[..., prefix:end, :] = layer.keys[..., rows, :]
        layer.values[..., prefix:end, :] = layer.values[..., rows, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
