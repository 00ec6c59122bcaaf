"""The base model's KV cache: a transformers DynamicCache, committed in place
after each verification."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def commit(cache: DynamicCache, prefix: int, path: list[int]) -> None:
    """Keep the prefix and the tree nodes on `path` (tree indices, root first),
    moved to consecutive positions after the prefix; drop the rest of the tree."""
    if path == list(range(len(path))):  # a chain along node order: just crop
        for layer in cache.layers:
            layer.keys = layer.keys[..., : prefix + len(path), :]
            layer.values = layer.values[..., : prefix + len(path), :]
        return
    rows = torch.tensor(path, device=cache.layers[0].keys.device) + prefix
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., :prefix, :], layer.keys[..., rows, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., :prefix, :], layer.values[..., rows, :]], dim=-2)


def length(cache: DynamicCache) -> int:
    return cache.get_seq_length()
