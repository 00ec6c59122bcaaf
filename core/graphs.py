"""Whole base-model passes replayed as CUDA graphs.

On a GPU a one-token step of a small model is host work: about 1,200 kernel
launches, each dispatched from Python through transformers' modules, while the
GPU itself is busy a few milliseconds (profiled on one H200: 55.6 ms a step,
2.2 ms of it on the GPU). A CUDA graph records the launches of one pass once
and replays them with one call. A graph replays fixed shapes at fixed
addresses, so a pass is made static:

- rows: a one-token step or a tree pass of n nodes runs ROWS[k] >= n rows;
  the padding rows each see only their own position and are dropped after;
- the cache: each layer's keys and values are written in place, into the
  buffers of core/kv_cache.GrowingLayer at positions length .. length + rows,
  and attention reads the whole buffer under a mask (rows, capacity) that
  shows each row the positions it may see; the rows beyond the real ones are
  never committed (kv_cache.advance keeps `length + n`);
- inputs (tokens, positions, the slots written, the mask) are copied into
  tensors the graph owns before each replay, and its output is copied out.

A graph is kept per row count and set of cache buffers (their addresses), so a
conversation's steps replay the graphs captured in its first steps; a cache
that moves (it grew, or a new conversation's) gets new ones, up to MAX_GRAPHS
in all, the least recently used dropped. Growing buffers by CAPACITY_STEP
positions at least keeps such moves rare.

The transformers modules are unchanged: the loop over them is the decoder's
(embedding, rotary embedding, layers, final norm, as core/compiled.py runs it),
and attention is registered through transformers' attention interface; outside
a static pass it is sdpa, so prefill (a causal pass of any length) and
transformers' own generate run eagerly as before. Forward pre-hooks (the
layer captures of EAGLE-3 heads, core/capture.py) run at capture; after each
replay they are handed the same layers' inputs again, from the graph's memory.

Where a graph cannot be captured (a kernel that does not support capture, say)
the model decodes eagerly from then on, with a log line saying why. On CPUs
the same static passes run without capture (`Graphed(model, capture=False)`):
the tests check there that they compute what eager passes do."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from core import attention, kv_cache
from core.compiled import decoder_problem, loop_difference  # the compiled layers run the same loop
from models.base import out_of_memory

NAME = "kestrel_graphs"
ATTRIBUTE = "_kestrel_graphs"  # on the model: its Graphed form
ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # row counts a pass is padded to; larger passes run eagerly
MAX_GRAPHS = 32
CAPACITY_STEP = 1024  # positions a cache's buffers grow by, at least, under graphs
log = logging.getLogger("kestrel")
_local = threading.local()


class _Static:
    """One pass of `rows` rows over caches whose buffers hold `capacity`
    positions: its input tensors, and once captured its graph and output."""

    @torch.inference_mode(False)  # normal tensors: a later pass outside inference mode may reuse the entry
    def __init__(self, rows: int, capacity: int, device: torch.device):
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.arange(rows, device=device)  # cache positions the rows' keys and values go to
        self.mask = torch.zeros(1, 1, rows, capacity, dtype=torch.bool, device=device)  # what each row sees
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # (1, rows, H) after the final norm
        self.inputs: dict[int, torch.Tensor] = {}  # hooked module index -> its input (1, rows, H)

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, length: int) -> None:
        """This pass's n rows at cache positions length .. length + n; the
        padding rows after them see their own slot only."""
        n, rows = len(tokens), len(self.tokens)
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        if rows > n:  # the padding rows at a position the pass already has (a rotary embedding may scale by the largest)
            self.positions[n:] = length
        torch.arange(length, length + rows, out=self.slots)
        visible = self.mask[0, 0]
        visible.zero_()
        if mask is None:  # one token: the prefix and itself
            visible[0, : length + 1] = True
        else:
            visible[:n, : length + n] = mask
        if rows > n:
            visible[n:, length + n : length + rows].fill_diagonal_(True)


class _State:
    """What the attention entry of a static pass reads: the slots, the mask,
    and every layer's key and value buffers."""

    def __init__(self, static: _Static, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.static, self.keys, self.values = static, keys, values
        self.packed: torch.Tensor | None = None


def graphs_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (1, H, T, D), this pass's key/value (1, H_kv, T, D) -> ((1, T, H, D), None):
    inside a static pass, the keys and values written into the layer's buffers
    and attention over all of them under the pass's mask; outside one, sdpa."""
    state: _State | None = getattr(_local, "state", None)
    if state is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    unsupported = attention.unmodelled(module, kwargs)
    if unsupported:
        raise NotImplementedError(f"graphed decoding does not model {', '.join(unsupported)}")
    keys, values = state.keys[module.layer_idx], state.values[module.layer_idx]
    keys.index_copy_(2, state.static.slots, key)
    values.index_copy_(2, state.static.slots, value)
    _, heads, rows, dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if state.packed is None:  # the mask once a pass, a row for each query head of a group (below)
        state.packed = state.static.mask.repeat(1, 1, groups, 1)  # (1, 1, G * T, capacity)
    # the G query heads that share a key head become G * T rows over it, rather than the keys and
    # values (the whole buffer) repeated G times
    packed = query.reshape(1, kv_heads, groups * rows, dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, keys, values, attn_mask=state.packed, scale=scaling)
    return out.reshape(1, heads, rows, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, graphs_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def rows_for(count: int) -> int | None:
    """The padded row count of a pass of `count` rows, None past the largest."""
    return next((rows for rows in ROWS if rows >= count), None)


class Graphed:
    """A base model whose one-token steps and tree passes run as static passes,
    captured as CUDA graphs where `capture`; `forward` is what
    core/verify.base_forward runs for it."""

    def __init__(self, model, capture: bool):
        self.model, self.capture = model, capture
        # CUDA calls act on the current device, which each thread keeps apart and nothing sets to the
        # model's: capture and replay run with this one current, or a model on cuda:1 records nothing
        self.device = model.get_input_embeddings().weight.device
        self.decoder = model.get_decoder()
        self.layers = tuple(self.decoder.layers)
        self.hookable = (*self.layers, self.decoder.norm)  # the modules whose inputs core/capture.py may keep
        self.previous = model.config._attn_implementation
        self.entries: OrderedDict[tuple, _Static] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # warm-up and capture: torch.cuda.graph's own stream is made once, on the device current then
        self.stream = torch.cuda.Stream(self.device) if capture else None
        self.warmed: set[int] = set()  # row counts run once before their first capture
        self.problem: str | None = None  # why graphs were given up, once they were
        self.captures, self.capture_seconds = 0, 0.0  # graphs captured, and the time it took

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor | None:
        """-> features (T, H) after the final norm, or None for a pass left to
        the transformers decoder (core/verify.base_forward runs it): prefill,
        more than ROWS[-1] rows, a cache of other layers, graphs given up."""
        count = len(tokens)
        rows = rows_for(count)
        if self.problem is not None or rows is None or (mask is None and count > 1):
            return None
        held = self._buffers(cache, rows)
        if held is None:
            return None
        length, keys, values = held
        hooked = tuple(index for index, module in enumerate(self.hookable) if module._forward_pre_hooks)
        key = (rows, hooked, keys[0].shape[-2], tuple(buffer.data_ptr() for buffer in (*keys, *values)))
        static = self.entries.get(key)
        if static is not None and self.capture and static.graph is None:  # run before capture was turned on: none to replay
            static = None
        fresh = static is None
        if fresh:
            static = _Static(rows, keys[0].shape[-2], tokens.device)
        static.fill(tokens, positions, mask, length)
        if fresh and self.capture:
            try:
                self._capture(static, keys, values, hooked)
            except Exception as error:  # a kernel that cannot be captured, or no memory for the graph: eager from now on
                failed = "ran out of memory" if out_of_memory(error) else "failed"
                self.give_up(f"capturing a CUDA graph {failed} ({type(error).__name__}: {str(error)[:200]})")
                return None
        if self.capture:
            with torch.cuda.device(self.device):
                static.graph.replay()
            out = static.out
        else:
            out = self._static_forward(static, keys, values, hooked)
        if fresh:
            self._keep(key, static)
        else:
            self.entries.move_to_end(key)
        kv_cache.advance(cache, length + count)
        for index in hooked:  # what the hooks would have seen, from the graph's memory
            _run_pre_hooks(self.hookable[index], static.inputs[index][:, :count].clone())
        return out[0, :count].clone()

    def give_up(self, problem: str) -> None:
        self.problem = problem
        self.entries.clear()
        log.warning(f"Decoding eagerly: {problem}")

    def _buffers(self, cache, rows: int):
        """kv_cache.buffers with room for `rows` more positions, in buffers of
        a multiple of CAPACITY_STEP positions: each move means new graphs, and
        where the allocator gives a next conversation buffers of the same
        sizes at the same addresses, its steps replay this one's graphs."""
        layers = cache.layers
        if layers and all(type(layer) is kv_cache.GrowingLayer and layer.is_initialized for layer in layers):
            end, capacity = layers[0].length + rows, layers[0].key_buffer.shape[-2]
            if end > capacity or (capacity % CAPACITY_STEP and capacity < (layers[0].limit or capacity + 1)):  # at the limit: no more moves
                wanted = max(end, 2 * capacity) if end > capacity else capacity
                aligned = -(-wanted // CAPACITY_STEP) * CAPACITY_STEP
                for layer in layers:
                    layer.reserve(aligned, aligned)
        return kv_cache.buffers(cache, rows)

    def _capture(self, static: _Static, keys, values, hooked) -> None:
        start = time.perf_counter()
        rows = len(static.tokens)
        with torch.cuda.device(self.device):
            if rows not in self.warmed:  # libraries set themselves up on a first call, which a capture must not see
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    self._static_forward(static, keys, values, hooked)
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
                self.warmed.add(rows)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call meanwhile (the page freeing cached memory, say) does not break it
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                static.out = self._static_forward(static, keys, values, hooked)
        static.graph = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start

    def _static_forward(self, static: _Static, keys, values, hooked) -> torch.Tensor:
        """The decoder's forward over the static inputs -> (1, rows, H); keeps
        the hooked modules' inputs in static.inputs."""
        outer = getattr(_local, "state", None)
        _local.state = _State(static, keys, values)
        try:
            decoder = self.decoder
            position_ids = static.positions[None]
            hidden = decoder.embed_tokens(static.tokens[None])
            cos, sin = decoder.rotary_emb(hidden, position_ids)
            for index, layer in enumerate(self.layers):
                if index in hooked:
                    static.inputs[index] = hidden
                hidden = layer.forward(hidden, attention_mask=None, position_embeddings=(cos, sin), position_ids=position_ids, past_key_values=None, use_cache=False)
            if len(self.layers) in hooked:
                static.inputs[len(self.layers)] = hidden
            return decoder.norm(hidden)
        finally:
            _local.state = outer

    def _keep(self, key: tuple, static: _Static) -> None:
        self.entries[key] = static
        while len(self.entries) > MAX_GRAPHS:
            self.entries.popitem(last=False)


def _run_pre_hooks(module, hidden: torch.Tensor) -> None:
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, (hidden,), {})
        else:
            hook(module, (hidden,))


def of(model) -> Graphed | None:
    """The graphed form of `model`, if it has one."""
    return getattr(model, ATTRIBUTE, None)


def worth_trying(device: torch.device) -> bool:
    """Whether compile="auto" replays graphs: on CUDA GPUs."""
    return device.type == "cuda"


def graph_model(model, capture: bool = True) -> Graphed | None:
    """Run `model`'s steps and tree passes as static passes (captured as CUDA
    graphs where `capture`) from now on. -> the Graphed model, or None (left
    eager, with a logged reason) where its decoder is not the loop this
    module runs, or where the check ran out of memory (graphs' buffers are
    memory eager passes do without)."""
    problem = _layout_problem(model)
    graphed = None
    if problem is None:
        graphed = Graphed(model, capture)
        model.set_attn_implementation(NAME)
        setattr(model, ATTRIBUTE, graphed)
        try:
            problem = _loop_problem(graphed)
        except Exception as error:  # a decoder the check cannot even run: eager, as for any other problem
            failed = "ran out of memory" if out_of_memory(error) else "failed"
            problem = f"the static pass's check {failed} ({type(error).__name__}: {str(error)[:200]})"
    if problem is not None:
        if graphed is not None:
            ungraph(graphed)
        log.info(f"Decoding eagerly: {problem}")
        return None
    return graphed


def _layout_problem(model) -> str | None:
    """Why the static pass's loop cannot stand in for this model's decoder, or None."""
    problem = decoder_problem(model)
    if problem is not None:
        return problem
    decoder = model.get_decoder()
    if not all(isinstance(getattr(getattr(layer, "self_attn", None), "layer_idx", None), int) for layer in decoder.layers):
        return f"{type(decoder).__name__}'s layers have no attention module with a layer index"
    return None


@torch.inference_mode()
def _loop_problem(graphed: Graphed) -> str | None:
    """Whether a static pass computes what the model's decoder does (one
    that, say, scales its embedding would not): None, or why not. Checked
    uncaptured, on a one-token step after a 3-token prompt."""
    model = graphed.model
    device = model.get_input_embeddings().weight.device
    ids = torch.arange(1, 5, device=device)
    reference = graphed.decoder(input_ids=ids[None], use_cache=False).last_hidden_state[0, -1]
    cache = kv_cache.new_cache(model)
    capture, graphed.capture = graphed.capture, False
    try:
        graphed.decoder(input_ids=ids[None, :3], past_key_values=cache, use_cache=True)  # the prompt, eagerly
        hidden = graphed.forward(ids[3:], torch.tensor([3], device=device), None, cache)
        if hidden is None:  # a cache of other layers (sliding windows): every pass would be the decoder's own
            return f"{type(graphed.decoder).__name__}'s cache layers are not ones a static pass reads (sliding-window attention)"
        hidden = hidden[0]
    finally:
        graphed.capture = capture
        graphed.entries.clear()  # made uncaptured: none may be replayed as a graph
    return loop_difference(hidden, reference, f"a static pass differs from {type(graphed.decoder).__name__}'s forward")


def ungraph(graphed: Graphed) -> None:
    graphed.entries.clear()
    graphed.model.__dict__.pop(ATTRIBUTE, None)
    graphed.model.set_attn_implementation(graphed.previous)
