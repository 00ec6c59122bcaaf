"""The base model's KV cache: a transformers DynamicCache whose layers append
into preallocated buffers, committed in place after each verification."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROWTH = 256  # positions added at a time when a buffer is full (at least; doubling beyond)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are the first `length` positions of
    buffers with room to spare: a step writes its rows in place instead of
    copying the whole cache (transformers' layer concatenates, an O(context)
    copy per layer and step), and a commit or crop only moves `length`.
    `keys` and `values` are views made when read; a tensor assigned to them
    that is not such a view becomes the buffer."""

    key_buffer: torch.Tensor | None = None  # (1, H_kv, capacity, D)
    value_buffer: torch.Tensor | None = None
    key_length = value_length = 0  # positions held (apart only between two assignments, as in a crop)
    # the positions a conversation needs (the context window, and room for a tree pass's rows past it): growth
    # stops there, so that doubling does not hold up to twice the memory the window can use (a tree bigger than
    # that room, at the window's end, grows it once more); None: no bound known
    limit: int | None = None

    @property
    def length(self) -> int:
        return self.key_length

    @length.setter
    def length(self, length: int) -> None:
        self.key_length = self.value_length = length

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.key_buffer is None else self.key_buffer[..., : self.key_length, :]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self.key_buffer, self.key_length = _adopt(tensor, self.key_buffer)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_buffer is None else self.value_buffer[..., : self.value_length, :]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self.value_buffer, self.value_length = _adopt(tensor, self.value_buffer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            self.is_initialized = True
        start = self.length
        end = start + key_states.shape[-2]
        self.reserve(end)
        self.key_buffer[..., start:end, :] = key_states
        self.value_buffer[..., start:end, :] = value_states
        self.length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reserve(self, end: int, capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, with room for positions up to `end` (they move when
        they grow, to `capacity` positions where given)."""
        if end > self.key_buffer.shape[-2] or end > self.value_buffer.shape[-2]:
            if capacity is not None:  # asked for (core/graphs.py: sizes its graphs are recorded for)
                capacity = max(end, capacity)
            elif self.limit is None or end <= self.limit:  # doubling, up to the limit
                capacity = max(end + GROWTH, 2 * self.key_buffer.shape[-2])
                capacity = capacity if self.limit is None else max(end, min(capacity, self.limit))
            else:  # past it (a big tree at the window's end): room for the next steps' too
                capacity = end + GROWTH
            keys, values = self.keys, self.values
            self.key_buffer, self.value_buffer = _larger(keys, capacity), _larger(values, capacity)
        return self.key_buffer, self.value_buffer


def _adopt(tensor: torch.Tensor | None, buffer: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """-> (buffer, length) holding `tensor`: the same buffer where `tensor` is its start."""
    if tensor is None:
        return None, 0
    start_of_buffer = (
        buffer is not None
        and tensor.data_ptr() == buffer.data_ptr()
        and tensor.stride() == buffer.stride()
        and tensor.shape[:-2] == buffer.shape[:-2]
        and tensor.shape[-1] == buffer.shape[-1]
        and tensor.shape[-2] <= buffer.shape[-2]
    )
    return (buffer if start_of_buffer else tensor), tensor.shape[-2]


def _larger(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    """A buffer of `capacity` positions starting with `tensor`'s, zeros after
    them: attention under a mask over the whole buffer (core/graphs.py) weighs
    the positions it hides by zero, and zero times a NaN of uninitialized
    memory would still be NaN."""
    buffer = tensor.new_zeros((*tensor.shape[:-2], capacity, tensor.shape[-1]))
    buffer[..., : tensor.shape[-2], :] = tensor
    return buffer


def new_cache(model) -> DynamicCache:
    """A cache of GrowingLayers where no layer really slides. transformers gives
    a config with any sliding window sliding-window layers, even one as long as
    the context window (Phi-3.5's), which never cut anything but whose count of
    positions seen commits cannot set back: a long chat's count then passed the
    window, and the masks made from it no longer fitted the keys."""
    cache = DynamicCache(config=model.config)
    if all(type(layer) is DynamicLayer for layer in cache.layers) or not has_sliding_window(model.config):
        window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        limit = window + GROWTH if isinstance(window, int) and window > 0 else None  # GROWTH: room for a tree pass at the window's end
        cache.layers = [GrowingLayer() for _ in cache.layers]
        for layer in cache.layers:
            layer.limit = limit
    return cache


def copy_prefix(cache: DynamicCache, model, length: int) -> DynamicCache | None:
    """A new cache holding the first `length` positions of `cache` (copied:
    `cache` is left as it is); None where its layers are not GrowingLayers."""
    copy = new_cache(model)
    layers = list(zip(cache.layers, copy.layers))
    if not all(type(source) is GrowingLayer and source.is_initialized and type(target) is GrowingLayer for source, target in layers):
        return None
    for source, target in layers:
        target.update(source.keys[..., :length, :], source.values[..., :length, :])  # into buffers of its own
    return copy


def nbytes(cache: DynamicCache) -> int:
    """The memory the cache's layers hold, a GrowingLayer's room to grow included."""
    tensors = []
    for layer in cache.layers:
        tensors += [layer.key_buffer, layer.value_buffer] if isinstance(layer, GrowingLayer) else [layer.keys, layer.values]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)


def buffers(cache: DynamicCache, rows: int) -> tuple[int, list[torch.Tensor], list[torch.Tensor]] | None:
    """For code that appends `rows` positions to every layer in place (the row
    kernel's pass ops, core/rowkernel.py), then calls `advance`: the positions
    held, and each layer's key and value buffers (1, H_kv, capacity, D) with
    room for the rows; None where the cache's layers are not GrowingLayers
    holding the same number of positions."""
    layers = cache.layers
    if not all(type(layer) is GrowingLayer and layer.is_initialized for layer in layers):
        return None
    length = layers[0].length
    if any(layer.key_length != length or layer.value_length != length for layer in layers):
        return None
    keys, values = zip(*(layer.reserve(length + rows) for layer in layers))
    return length, list(keys), list(values)


def advance(cache: DynamicCache, length: int) -> None:
    """After such appends: every layer holds `length` positions."""
    for layer in cache.layers:
        layer.length = length


def has_sliding_window(config) -> bool:
    """Whether some layer attends through a sliding window, which tree masks
    and cache commits do not model."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    # configs without layer types (Mistral's) slide every layer wherever a window is set;
    # a window as long as the context window never cuts anything
    window, context = getattr(config, "sliding_window", None), getattr(config, "max_position_embeddings", None)
    return window is not None and (context is None or window < context)


def commit(cache: DynamicCache, prefix: int, path: list[int]) -> None:
    """Keep the prefix and the tree nodes on `path` (tree indices, root first),
    moved to consecutive positions after the prefix; drop the rest of the tree."""
    end = prefix + len(path)
    chain = path == list(range(len(path)))  # a chain along node order: just crop
    rows = None if chain else torch.tensor(path, device=cache.layers[0].keys.device) + prefix
    for layer in cache.layers:
        growing = type(layer) is GrowingLayer
        keys, values = (layer.key_buffer, layer.value_buffer) if growing else (layer.keys, layer.values)
        if rows is not None:  # gather (a copy) then write in place: only the accepted rows move
            keys[..., prefix:end, :] = keys[..., rows, :]
            values[..., prefix:end, :] = values[..., rows, :]
        if growing:
            layer.length = end
        else:
            layer.keys, layer.values = keys[..., :end, :], values[..., :end, :]
            if isinstance(getattr(layer, "cumulative_length", None), int):  # positions seen, which masks are sized from
                layer.cumulative_length = end
