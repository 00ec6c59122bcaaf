"""Row-invariant attention for decoding steps and tree passes.

Greedy EAGLE-2 equals vanilla only if a tree node's features are bit for
bit what a one-token vanilla step at that node's position would compute.
Fused attention kernels (sdpa) do not promise it: their arithmetic depends
on how many query rows share the call and on masked keys. This attention,
registered through transformers' attention interface (the model's code is
unchanged), computes every query row on its own, the same way whatever
else is in the call, over the row's visible keys in cache order (the
prefix, then its ancestors, then itself: the order they have after a
commit). A vanilla step is the one-row case of the same code.

Two implementations, one per process: the C++ kernel of core/rowkernel.py
(one call per layer for all rows) where it builds, else torch operations
per row, split at a multiple of BLOCK positions into an old part (read in
place from the cache) and a recent part (gathered), each multiplied with
fixed shapes, one softmax over both.

Prefill (no mask: causal) goes to sdpa: vanilla and speculative decoding
share it, so it cannot make them differ. Whether the rest of the forward
(linears, norms) is row-invariant too depends on the device and kernels; the
engine checks the whole model bit for bit at load (`core/tree_check.rows_differing`)
and only then uses this attention."""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from core import rowkernel

NAME = "kestrel_rows"
BLOCK = 64  # keys before the last multiple of BLOCK are read in place


class _Plan:
    """Per query row: (old, the old keys' indices or None when they are the
    cache's first `old` keys in order, the recent keys' indices)."""

    def __init__(self, mask: torch.Tensor | None, rows: int, total: int, device: torch.device):
        self.rows = []
        visible = None if mask is None else mask[0, 0].to(torch.bool)
        for row in range(rows):
            if visible is None:  # causal: every key up to this row's own
                count = total - rows + row + 1
                index = torch.arange(count, device=device)
            else:
                index = visible[row].nonzero().squeeze(1)
                count = len(index)
            old = (count - 1) // BLOCK * BLOCK
            in_place = old == 0 or int(index[old - 1]) == old - 1  # sorted and distinct, so index[:old] == 0..old-1
            self.rows.append((old, None if in_place else index[:old], index[old:]))


_local = threading.local()


def _per_forward(kind: str, mask: torch.Tensor | None, rows: int, total: int, build):
    """What build() makes for one forward, reused by all its layers: they see
    the same mask tensor (or none, for a one-token step) and length. The mask
    is held, so an entry is only reused for this very mask."""
    if mask is not None and mask.shape[-1] != total:
        raise ValueError(f"the attention mask covers {mask.shape[-1]} positions, the cache holds {total}")
    slots = _local.__dict__.setdefault("slots", {})
    found = slots.get(kind)
    if found is None or found[0] is not mask or found[1:3] != (rows, total):
        found = slots[kind] = (mask, rows, total, build())
    return found[3]


def unmodelled(module, kwargs: dict) -> list[str]:
    """The attention features asked for in `kwargs` that Kestrel's attention
    paths do not model: a softcap, sinks, a sliding window shorter than the
    context window (a longer one, as Phi-3.5's, never cuts anything)."""
    names = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
    window = kwargs.get("sliding_window")
    context = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    if window is not None and (context is None or window < context):
        names.append("sliding_window")
    return names


def rows_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (1, H, T, D), key/value (1, H_kv, S, D) -> ((1, T, H, D), None)."""
    batch, heads, rows, dim = query.shape
    prefill = attention_mask is None and rows > 1  # causal, shared by every mode
    if batch != 1 or (prefill and not rowkernel.prefills(query.dtype, query.device)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    unsupported = unmodelled(module, kwargs)
    if unsupported:  # the load-time check then keeps sdpa for this model
        raise NotImplementedError(f"row-invariant attention does not model {', '.join(unsupported)}")
    kv_heads, total = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else dim**-0.5
    if rowkernel.covers(query.dtype, query.device):
        visible = None if attention_mask is None else attention_mask[0, 0]
        spec = _per_forward("rows", attention_mask, rows, total, lambda: rowkernel.Rows.of(visible, rows, total))
        out = rowkernel.attend(query, key, value, spec, scale)
        if out is not None:  # the C++ kernel (core/rowkernel.py): one call for every row
            return out, None
    keys, values = key[0], value[0]  # (H_kv, S, D)
    # every row's queries, scaled, in a fresh tensor: (T, H_kv, G, D), each row
    # 64-byte aligned as a lone row would be (checked at load with the rest)
    queries = (query[0].transpose(0, 1) * scale).reshape(rows, kv_heads, heads // kv_heads, dim)
    precision = torch.promote_types(query.dtype, torch.float32)  # softmax in float32 at least
    results = []
    for row, (old, old_index, recent) in enumerate(
        _per_forward("plan", attention_mask, rows, total, lambda: _Plan(attention_mask, rows, total, query.device)).rows
    ):
        q = queries[row]
        recent_keys, recent_values = keys.index_select(1, recent), values.index_select(1, recent)
        if not old:
            weights = torch.softmax((q @ recent_keys.transpose(1, 2)).to(precision), dim=-1).to(q.dtype)
            results.append(weights @ recent_values)
            continue
        if old_index is None:
            old_keys, old_values = keys[:, :old], values[:, :old]
        else:
            old_keys, old_values = keys.index_select(1, old_index), values.index_select(1, old_index)
        scores = torch.cat([q @ old_keys.transpose(1, 2), q @ recent_keys.transpose(1, 2)], dim=-1)
        weights = torch.softmax(scores.to(precision), dim=-1).to(q.dtype)  # (H_kv, G, count)
        results.append(torch.baddbmm(weights[..., old:] @ recent_values, weights[..., :old], old_values))
    return torch.stack(results).reshape(1, rows, heads, dim), None


AttentionInterface.register(NAME, rows_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use(model, exact: bool) -> None:
    """Switch `model` to this attention (exact) or back to sdpa."""
    model.set_attn_implementation(NAME if exact else "sdpa")
