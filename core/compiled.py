"""Compiled decoder layers: the base model's forward with torch.compile.

A decoding step of a small model is mostly framework overhead: about a dozen
small ops per layer, each dispatched from Python. torch.compile (Inductor,
which needs a C++ compiler on CPUs) fuses a layer's norms, rotary embedding
and elementwise MLP work into a few generated kernels around the same linear
kernels. The transformers model itself is unchanged: each decoder layer's
forward is wrapped by torch.compile, and everything that has state or
depends on a tree's shape stays outside the compiled code, in one opaque op
per layer (`kestrel::attend`): appending the step's keys and values to the
KV cache and the attention itself (core/attention.py's row-invariant one, or
sdpa). Layers then compile once for one-token steps and once for any other
row count (dynamic), whatever the cache length or tree shape.

Vanilla steps, tree passes and prefill all run the compiled layers, so the
comparison between them is of one model; whether its tree passes compute
each node bit for bit as a one-token step would is still checked at load
(core/tree_check.rows_differing). Where compiling fails (no compiler, an
operation Inductor cannot handle) the model stays eager."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from core import attention, native
from core.kv_cache import new_cache
from models.bundled import cache_root

NAME = "kestrel_compiled"
log = logging.getLogger("kestrel")
_local = threading.local()


class _Pass:
    """What the opaque attention op of one forward needs: the cache, the tree
    mask (None: causal) and whether attention is the row-invariant one."""

    def __init__(self, cache, mask: torch.Tensor | None, exact: bool, modules: list):
        self.cache, self.mask, self.exact, self.modules = cache, mask, exact, modules
        self.layer = 0  # layers run in order; the op counts them


@torch.library.custom_op("kestrel::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """query (1, H, T, D), this step's key/value (1, H_kv, T, D) -> (1, T, H, D),
    after appending key/value to the current pass's cache."""
    state: _Pass | None = getattr(_local, "state", None)
    if state is None:
        raise RuntimeError("a compiled model decodes through core/verify.base_forward; run other code inside compiled.eager(model)")
    index = state.layer
    state.layer += 1
    module = state.modules[index]
    keys, values = state.cache.update(key, value, index)
    mask, scaling = state.mask, module.scaling
    if state.exact:
        out, _ = attention.rows_attention(module, query, keys, values, mask, scaling=scaling)
    else:
        out, _ = sdpa_attention_forward(module, query, keys, values, mask, scaling=scaling)
    return out.contiguous()


@attend.register_fake
def _(query, key, value):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def compiled_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention interface entry inside a compiled layer: the opaque op."""
    unsupported = [name for name in ("softcap", "s_aux", "sliding_window") if kwargs.get(name) is not None]
    if unsupported:
        raise NotImplementedError(f"compiled decoding does not model {', '.join(unsupported)}")
    return attend(query, key, value), None  # the op reads the module's scaling


def _no_mask(*args, **kwargs):
    return None  # masks reach the op through the pass state, never through the compiled graph


AttentionInterface.register(NAME, compiled_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _no_mask)


class Compiled:
    """A base model whose decoder layers run compiled; `forward` is what
    core/verify.base_forward runs for it."""

    def __init__(self, model):
        self.model = model
        self.decoder = model.get_decoder()
        self.modules = [layer.self_attn for layer in self.decoder.layers]
        self.exact = False  # row-invariant attention (core/attention.py) rather than sdpa
        self.previous = model.config._attn_implementation
        self.suspended = False  # inside eager(): the layers are plain transformers code

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor:
        if self.suspended:
            raise RuntimeError("the model is running as plain transformers code (compiled.eager); decode after it ends")
        outer = getattr(_local, "state", None)
        state = _local.state = _Pass(cache, None if mask is None else mask[None, None], self.exact, self.modules)
        try:
            out = self.decoder(input_ids=tokens[None], position_ids=positions[None], use_cache=False)
        finally:
            _local.state = outer
        if state.layer != len(self.modules):  # every layer's attention must have run through the op, once
            raise RuntimeError(f"the attention op ran {state.layer} times for {len(self.modules)} layers")
        return out.last_hidden_state[0]


ATTRIBUTE = "_kestrel_compiled"  # on the model: its compiled form (no registry that would keep unloaded models alive)


def of(model) -> Compiled | None:
    """The compiled form of `model`, if it was compiled."""
    return getattr(model, ATTRIBUTE, None)


@contextmanager
def eager(model) -> Iterator[None]:
    """Within the block `model` is plain transformers code again (for its own
    generate, e.g. the bench's baselines); compiled afterwards."""
    found = of(model)
    if found is None:
        yield
        return
    saved = {}
    found.suspended = True
    try:
        for index, layer in enumerate(found.decoder.layers):
            if "forward" in layer.__dict__:
                saved[index] = layer.__dict__.pop("forward")
        model.set_attn_implementation("sdpa")
        yield
    finally:
        for index, forward in saved.items():
            found.decoder.layers[index].forward = forward
        model.set_attn_implementation(NAME)
        found.suspended = False


def compiler_available() -> bool:
    """Inductor on CPUs generates C++ and needs a compiler."""
    return native.compiler() is not None


def worth_trying(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether compile="auto" compiles: on CPUs with a C++ compiler, computing
    in float32 or bf16 (float64 is for checking, not speed). GPUs are left
    eager until measured there."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and compiler_available()


def compile_model(model, progress: Callable[[str], None] | None = None) -> Compiled | None:
    """Wrap the decoder layers' forward with torch.compile and compile them
    now (a one-token step and a multi-row pass, each once for every layer).
    -> the Compiled model, or None (model left eager) where that fails."""
    if model.device.type == "cpu" and not compiler_available():
        log.info("Decoding eagerly: torch.compile needs a C++ compiler (g++ or clang++) on CPUs")
        return None
    # Inductor's cache beside Kestrel's other caches rather than in /tmp, which
    # a reboot may clear: later starts then read the compiled code (2-3 s)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    problem = _layout_problem(model)
    if problem is not None:
        log.info(f"Decoding eagerly: {problem}")
        return None
    compiled = Compiled(model)
    try:
        model.set_attn_implementation(NAME)
        for layer in compiled.decoder.layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        setattr(model, ATTRIBUTE, compiled)
        start = time.perf_counter()
        if progress:
            progress("Compiling the model (once; cached afterwards)...")
        _warm(compiled)
        if progress:
            progress(f"Compiled in {time.perf_counter() - start:.0f} s")
    except Exception as error:  # no usable compiler or an unsupported operation: stay eager
        uncompile(compiled)
        log.warning(f"Decoding eagerly: compiling the model failed ({type(error).__name__}: {str(error)[:200]})")
        return None
    return compiled


def _layout_problem(model) -> str | None:
    """Why this model's layers cannot run compiled here, or None: the op
    stands in for attention modules that hold their layer's scaling and are
    called through transformers' attention interface."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None or len(layers) == 0:
        return f"{type(model).__name__} has no decoder layers in the expected place"
    for layer in layers:
        attention_module = getattr(layer, "self_attn", None)
        if not isinstance(getattr(attention_module, "scaling", None), float):
            return f"{type(layer).__name__} has no attention module with a scaling"
    return None


def uncompile(compiled: Compiled) -> None:
    compiled.model.__dict__.pop(ATTRIBUTE, None)
    for layer in compiled.decoder.layers:
        layer.__dict__.pop("forward", None)
    compiled.model.set_attn_implementation(compiled.previous)


@torch.inference_mode()
def _warm(compiled: Compiled) -> None:
    device = compiled.model.get_input_embeddings().weight.device
    cache = new_cache(compiled.model)
    compiled.forward(torch.arange(3, device=device), torch.arange(3, device=device), None, cache)
    compiled.forward(torch.tensor([5], device=device), torch.tensor([3], device=device), None, cache)
