"""The base model's KV cache: a transformers DynamicCache, committed in place
after each verification."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


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
