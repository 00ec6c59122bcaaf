"""Compiled decoding: the base model's decoder layers run under torch.compile.

A decoding step of a small model is mostly framework overhead: about a dozen
small ops per layer, each dispatched from Python. torch.compile (Inductor,
which needs a C++ compiler on CPUs) fuses the layers' norms, rotary embedding
and elementwise MLP work into a few generated kernels around the same linear
kernels. The transformers modules themselves are unchanged; the decoder's
loop over them is Kestrel's (`Compiled.forward`: embedding, rotary
embedding, the layers, the final norm, as the transformers decoders of the
supported architectures run them), so that one compiled call runs a run of
SEGMENT layers: every compiled call costs its guards and wrappers, and 30
calls a step cost more than the layers' own elementwise work. Everything
that has state or depends on a tree's shape stays outside the compiled code,
in one opaque op per layer: appending the step's keys and values to the KV
cache and the attention itself (core/attention.py's row-invariant one, or
sdpa). Where the row kernel runs a forward, the op is C++ throughout
(`kestrel_rows::pass_attend`, PASS_OPS); otherwise it is a Python op
(`kestrel::attend`). A segment then compiles once for one-token
steps and once for any other row count (dynamic), whatever the cache length
or tree shape, and every segment of the same length shares that code.

Forward pre-hooks on a layer (core/capture.py's, for EAGLE-3 heads) start a
segment of their own and run before it, with the layer's input. At compile
time the loop is checked against the transformers decoder it stands in for
(the same hidden states, up to the compiled kernels' rounding), so a model
whose decoder does something else (a scaled embedding, say) stays eager.

Vanilla steps, tree passes and prefill all run the compiled layers, so the
comparison between them is of one model; whether its tree passes compute
each node bit for bit as a one-token step would is still checked at load
(core/tree_check.rows_differing). Where compiling fails (no compiler, an
operation Inductor cannot handle) the model stays eager.

The draft head runs compiled alongside (`CompiledHead`, at the end of this
file), its attention likewise one opaque op (`kestrel::head_attend`)."""

from __future__ import annotations

import logging
import pickle
import re
import shutil
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from core import attention, kv_cache, native, rowkernel
from core.kv_cache import new_cache
from models.bundled import cache_root, use_compile_cache

NAME = "kestrel_compiled"
log = logging.getLogger("kestrel")
_local = threading.local()


class _Pass:
    """What the opaque attention op of one forward needs: the cache, the tree
    mask (None: causal), whether attention is the row-invariant one, and the
    row kernel's key lists where that kernel computes this pass."""

    def __init__(self, cache, mask: torch.Tensor | None, exact: bool, modules: list, rows: rowkernel.Rows | None):
        self.cache, self.mask, self.exact, self.modules, self.rows = cache, mask, exact, modules, rows
        self.layer = 0  # layers run in order; the op counts them


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
    rows = state.rows
    if rows is not None:  # the C++ kernel: every row in one call, nothing else in between
        return rowkernel.library()(query, keys, values, rows.prefix, rows.offsets, rows.extra, module.scaling)
    if state.exact:
        out, _ = attention.rows_attention(module, query, keys, values, state.mask, scaling=module.scaling)
    else:
        out, _ = sdpa_attention_forward(module, query, keys, values, state.mask, scaling=module.scaling)
    return out.contiguous()


# The op, defined directly on the dispatcher (torch.library.custom_op's wrapper costs ~30 us a call,
# once per layer and step); registering it is like registering the attention interface below
_operators = torch.library.Library("kestrel", "FRAGMENT")
_operators.define("attend(Tensor query, Tensor key, Tensor value) -> Tensor")
_operators.impl("attend", attend, "CompositeExplicitAutograd")


@torch.library.register_fake("kestrel::attend")
def _(query, key, value):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def compiled_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention interface entry inside a compiled layer: the opaque op
    (the C++ one where Compiled runs the row kernel's pass ops, see PASS_OPS)."""
    unsupported = attention.unmodelled(module, kwargs)
    if unsupported:
        raise NotImplementedError(f"compiled decoding does not model {', '.join(unsupported)}")
    if getattr(module, PASS_OPS, False):
        return torch.ops.kestrel_rows.pass_attend(query, key, value), None
    return torch.ops.kestrel.attend(query, key, value), None  # the op reads the module's scaling


# On an attention module: whether its compiled layer calls kestrel_rows::pass_attend, which for a
# forward with the row kernel appends to the cache and attends in C++ (core/rowkernel.py), and
# otherwise calls kestrel::attend. The Python op costs about 60 us a layer here (the cache's
# update, the pass state), a twentieth of a one-token step.
PASS_OPS = "_kestrel_pass_ops"


def _no_mask(*args, **kwargs):
    return None  # masks reach the op through the pass state, never through the compiled graph


AttentionInterface.register(NAME, compiled_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _no_mask)


SEGMENT = 6  # layers per compiled call (at most): 30 one-layer calls cost ~4 ms a step more than 5 six-layer ones here
RECOMPILE_LIMIT = 64  # compiled variants per model: two row counts for each segment length in use


def _run_layers(layers: tuple, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """hidden (1, T, H) through `layers`, as the transformers decoder calls them
    (masks and the cache reach the attention op through the pass state).
    Their forward is called rather than the modules: hooks run outside (see
    Compiled.decoder_forward), never traced into code shared by all segments."""
    for layer in layers:
        hidden = layer.forward(hidden, attention_mask=None, position_embeddings=(cos, sin), position_ids=position_ids, past_key_values=None, use_cache=False)
    return hidden


def _guards_kept(entries) -> list[bool]:
    """Dynamo's guards to keep: not those on the layers' insides (their types,
    attribute dicts and some 130 tensors for six layers, 0.4 ms a call to
    check). A runner serves one model, whose layers all have the same class,
    shapes and dtypes (_layout_problem), so what tells variants apart is kept:
    the number of layers and the activations' shapes."""
    return [not entry.name.startswith(("layers[", "dict(type(layers[")) for entry in entries]


OPTIONS = {"guard_filter_fn": _guards_kept, "cpp_wrapper": True, "emulate_precision_casts": True}


def _compiled_runner() -> Callable:
    """_run_layers compiled, with a code object of its own: Dynamo keeps its
    compiled variants per code object, so each model's are its own, counted
    against its own limit and dropped with it. Inductor writes the call
    sequence of each variant in C++ (cpp_wrapper) rather than Python: about
    fifty operator calls per segment then cost no Python each. In bf16,
    Inductor rounds every intermediate to bf16 where eager code would
    (emulate_precision_casts): without it, how a value is rounded depends on
    what a kernel fuses, which differs between one-token and multi-row
    variants, and tree nodes would not match one-token steps bit for bit."""
    code = _run_layers.__code__.replace()  # a copy: a distinct code object
    runner = types.FunctionType(code, _run_layers.__globals__, "run_layers")
    return torch.compile(runner, dynamic=True, options=OPTIONS)


def segments(layers: int, starts: set[int]) -> list[tuple[int, int]]:
    """[start, end) runs of at most SEGMENT layers covering 0..layers-1,
    where each layer in `starts` begins a run of its own."""
    bounds, start = [], 0
    for cut in sorted({*starts, layers} - {0}):
        bounds += [(begin, min(begin + SEGMENT, cut)) for begin in range(start, cut, SEGMENT)]
        start = cut
    return bounds


class Compiled:
    """A base model whose decoder layers run compiled; `forward` is what
    core/verify.base_forward runs for it."""

    def __init__(self, model):
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = tuple(self.decoder.layers)
        self.modules = [layer.self_attn for layer in self.layers]
        self.exact = False  # row-invariant attention (core/attention.py) rather than sdpa
        self.previous = model.config._attn_implementation
        self.suspended = False  # inside eager(): the model is plain transformers code
        self.runner = _compiled_runner()
        self._segments: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        # the row kernel's pass ops (PASS_OPS), where it is built for this device
        self.pass_ops = model.device.type == "cpu" and rowkernel.library() is not None
        self.scales = [float(module.scaling) for module in self.modules]
        for module in self.modules:
            setattr(module, PASS_OPS, self.pass_ops)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor:
        if self.suspended:
            raise RuntimeError("the model is running as plain transformers code (compiled.eager); decode after it ends")
        rows = self._rows(mask, len(tokens), cache)
        outer = getattr(_local, "state", None)
        state = _local.state = _Pass(cache, None if mask is None else mask[None, None], self.exact, self.modules, rows)
        held = kv_cache.buffers(cache, len(tokens)) if self.pass_ops and rows is not None else None
        if self.pass_ops:
            self._begin_pass(held, rows)
        try:
            hidden = self.decoder_forward(tokens[None], positions[None])
        finally:
            _local.state = outer
            length = torch.ops.kestrel_rows.end_pass() if self.pass_ops else None
        if held is not None:  # the C++ op appended to the cache's buffers
            if length != held[0] + len(tokens):
                raise RuntimeError(f"the attention op did not run once for each of the {len(self.modules)} layers")
            kv_cache.advance(cache, length)
        elif state.layer != len(self.modules):  # every layer's attention must have run through the op, once
            raise RuntimeError(f"the attention op ran {state.layer} times for {len(self.modules)} layers")
        return hidden[0]

    def _begin_pass(self, held, rows: rowkernel.Rows | None) -> None:
        """Push this forward's state for kestrel_rows::pass_attend: the cache's
        buffers and the row lists, or nothing (each layer then calls kestrel::attend)."""
        if held is None:
            nothing = torch.empty(0, dtype=torch.int64)
            torch.ops.kestrel_rows.begin_pass([], [], 0, nothing, nothing, nothing, [])
            return
        length, keys, values = held
        torch.ops.kestrel_rows.begin_pass(keys, values, length, rows.prefix, rows.offsets, rows.extra, self.scales)

    def _rows(self, mask: torch.Tensor | None, count: int, cache) -> rowkernel.Rows | None:
        """The row kernel's key lists for this pass, where the row-invariant
        attention runs it: tree passes and one-token steps (a prefill, causal
        over several rows, goes to sdpa, core/attention.py, except where the
        kernel is the faster: rowkernel.prefills)."""
        dtype, device = self.decoder.embed_tokens.weight.dtype, self.decoder.embed_tokens.weight.device
        if not self.exact or not rowkernel.covers(dtype, device):
            return None
        if mask is None and count > 1 and not rowkernel.prefills(dtype, device):
            return None
        total = cache.get_seq_length() + count
        if mask is not None and mask.shape != (count, total):
            raise ValueError(f"the attention mask is {tuple(mask.shape)}; the pass has {count} rows over {total} positions")
        return rowkernel.Rows.of(mask, count, total)

    def decoder_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """(1, T) ids and positions -> (1, T, H) after the final norm: the
        transformers decoder's forward (embedding, rotary embedding, layers,
        norm), its layers run in compiled segments."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(hidden, position_ids)
        for start, end in self._segments_now():
            _run_pre_hooks(self.layers[start], hidden)
            hidden = self.runner(self.layers[start:end], hidden, cos, sin, position_ids)
        return decoder.norm(hidden)

    def _segments_now(self) -> list[tuple[int, int]]:
        hooked = tuple(index for index, layer in enumerate(self.layers) if layer._forward_pre_hooks)
        if hooked not in self._segments:
            if any(layer._forward_hooks for layer in self.layers):
                raise RuntimeError("compiled decoding runs forward pre-hooks on decoder layers, not forward hooks")
            self._segments[hooked] = segments(len(self.layers), set(hooked))
        return self._segments[hooked]

    @torch.inference_mode()
    def warm(self) -> None:
        """Compile now what decoding will run: a multi-row pass and a one-token
        step, with the layers' current hooks."""
        device = self.model.get_input_embeddings().weight.device
        cache = new_cache(self.model)
        self.forward(torch.arange(3, device=device), torch.arange(3, device=device), None, cache)
        self.forward(torch.tensor([5], device=device), torch.tensor([3], device=device), None, cache)


def _run_pre_hooks(layer, hidden: torch.Tensor) -> None:
    """What calling `layer` would run before its forward (core/capture.py's
    hooks keep its input)."""
    for key, hook in layer._forward_pre_hooks.items():
        if key in layer._forward_pre_hooks_with_kwargs:
            result = hook(layer, (hidden,), {})
        else:
            result = hook(layer, (hidden,))
        if result is not None:
            raise RuntimeError("compiled decoding runs forward pre-hooks that read a decoder layer's input, not ones that change it")


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
    found.suspended = True
    try:
        model.set_attn_implementation("sdpa")
        yield
    finally:
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


class _DamagedCache(logging.Filter):
    """Notes torch's "unable to load compiled graph" (an entry of its compile
    cache cut short, by a crash or a full disk while it was written) and keeps
    the traceback torch prints with it, at every start, off the terminal."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "unable to load compiled graph" in str(record.msg):
            self.seen += 1
            return False
        return True


@contextmanager
def _watching_the_cache() -> Iterator[_DamagedCache]:
    logger = logging.getLogger("torch._inductor.codecache")
    watch = _DamagedCache()
    logger.addFilter(watch)
    try:
        yield watch
    finally:
        logger.removeFilter(watch)


def _clear_damaged_cache(named: str = "") -> str:
    """Torch's compile cache held a damaged entry, which torch skips but keeps
    (and code compiled beside it read differently from a fresh compile's here)
    or fails on: Kestrel's own cache folder is emptied; a folder set by the user
    (TORCHINDUCTOR_CACHE_DIR), which other programs may share, loses only its
    unreadable graph entries and the files `named` (an error's text) points at.
    -> what the user is told."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = Path(cache_dir())
    own = folder.resolve() == (cache_root() / "inductor").resolve()
    try:
        if own:
            shutil.rmtree(folder)
        else:
            for path in [*_unreadable_entries(folder), *_named_files(folder, named)]:
                path.unlink(missing_ok=True)
    except OSError as error:
        return (f"torch's compile cache ({folder}) is damaged (a crash or a full disk while it was written?) and could not be "
                f"{'emptied' if own else 'mended'} ({error}); delete that folder to have the next start compile afresh")
    return (f"torch's compile cache ({folder}) was damaged (a crash or a full disk while it was written?); "
            f"{'it has been emptied' if own else 'its damaged entries were removed'}, and the next start compiles afresh")


def _unreadable_entries(folder: Path) -> list[Path]:
    """The graph entries (pickles) in torch's cache that no longer unpickle."""
    found = []
    for kind in ("fxgraph", "aotautograd"):
        for path in (folder / kind).rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                try:
                    pickle.loads(path.read_bytes())
                except Exception:  # cut short, or whatever else keeps torch from reading it
                    found.append(path)
    return found


def _named_files(folder: Path, said: str) -> list[Path]:
    """Files inside `folder` that an error message names."""
    names = re.findall(re.escape(str(folder)) + r"[^\s'\"():,]+", said)
    return [Path(name) for name in names if Path(name).is_file()]


# what reading a cut-short file of torch's compile cache raises (a generated module, a built library, a pickle)
CUT_SHORT = ("Failed to import", "file too short", "invalid ELF header", "UnpicklingError", "EOFError")


def _failure(error: Exception, what: str) -> str:
    """Why compiling `what` failed; a file of torch's compile cache that could not
    be read (cut short), which would fail every start, is dealt with."""
    said = str(error)
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        damaged = cache_dir() in said and any(sign in said for sign in CUT_SHORT)
    except OSError:  # a cache folder that cannot be made
        damaged = False
    if damaged:
        return _clear_damaged_cache(said)
    return f"compiling {what} failed ({type(error).__name__}: {said[:200]})"


def compile_model(model, progress: Callable[[str], None] | None = None) -> Compiled | None:
    """Compile the decoder layers now (a one-token step and a multi-row pass
    for each segment length) and check the compiled loop against the
    transformers decoder. -> the Compiled model, or None (model left eager)
    where that fails."""
    if model.device.type == "cpu" and not compiler_available():
        log.info("Decoding eagerly: torch.compile on CPUs is used on Linux with a C++ compiler (g++ or clang++)")
        return None
    use_compile_cache()  # where launch.py has not already
    problem = _layout_problem(model)
    if problem is not None:
        log.info(f"Decoding eagerly: {problem}")
        return None
    # each model's runner holds its own variants (_compiled_runner); the default limit of 8 would drop
    # to eager once a few segment lengths (EAGLE-3's captured layers split segments) are compiled
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    _constant_floats()
    compiled = None
    try:
        compiled = Compiled(model)
        model.set_attn_implementation(NAME)
        setattr(model, ATTRIBUTE, compiled)
        start = time.perf_counter()
        if progress:
            progress("Compiling the model (about a minute the first time; later starts read the cache)...")
        with _watching_the_cache() as watch:
            compiled.warm()
        problem = _clear_damaged_cache() if watch.seen else _loop_problem(compiled)
        if progress:
            progress(f"Compiled in {time.perf_counter() - start:.0f} s")
    except Exception as error:  # no usable compiler or an unsupported operation: stay eager
        if compiled is not None:
            uncompile(compiled)
        log.warning(f"Decoding eagerly: {_failure(error, 'the model')}")
        return None
    if problem is not None:
        uncompile(compiled)
        log.warning(f"Decoding eagerly: {problem}")
        return None
    return compiled


def _constant_floats() -> None:
    """Floats that modules hold (an RMSNorm's epsilon) become constants of the
    compiled code instead of inputs that each call turns into tensors again (12
    a segment call, about 5 us each). Layers that share compiled code must then
    hold the same floats (_layout)."""
    torch._dynamo.config.specialize_float = True


def decoder_problem(model) -> str | None:
    """Why Kestrel's loop over the decoder (embedding, rotary embedding,
    layers, final norm; here and in core/graphs.py) cannot stand in for this
    model's, or None."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) == 0:
        return f"{type(model).__name__} has no decoder layers in the expected place"
    missing = [name for name in ("embed_tokens", "rotary_emb", "norm") if not hasattr(decoder, name)]
    if missing:
        return f"{type(decoder).__name__} has no {', '.join(missing)}"
    return None


def _layout_problem(model) -> str | None:
    """Why this model's layers cannot run compiled here, or None: the loop
    needs a decoder with an embedding, a rotary embedding, layers and a final
    norm, and the op stands in for attention modules that hold their layer's
    scaling and are called through transformers' attention interface."""
    problem = decoder_problem(model)
    if problem is not None:
        return problem
    layers = model.get_decoder().layers
    for layer in layers:
        attention_module = getattr(layer, "self_attn", None)
        if not isinstance(getattr(attention_module, "scaling", None), float):
            return f"{type(layer).__name__} has no attention module with a scaling"
    first = _layout(layers[0])
    if any(_layout(layer) != first for layer in layers[1:]):  # segments share compiled code (_guards_kept)
        return "its decoder layers differ in structure, shapes or dtypes"
    return None


def _layout(layer) -> tuple:
    """What compiled code shared between layers relies on: classes, tensor
    names, shapes, dtypes, and the floats the modules hold (_constant_floats)."""
    tensors = tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in layer.state_dict().items())
    floats = tuple((name, value) for module in layer.modules() for name, value in vars(module).items() if type(value) is float)
    return tuple(type(module) for module in layer.modules()), tensors, floats


# how far the compiled loop's hidden states may lie from the transformers decoder's, relative to
# their largest magnitude: the compiled kernels' rounding, not a different computation (a float64
# model's RMSNorms compute in float32, whose casts Inductor may fuse away: 1e-7 is seen there)
LOOP_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@torch.inference_mode()
def _loop_problem(compiled: Compiled) -> str | None:
    """Whether the compiled loop computes what the transformers decoder does
    (a decoder that, say, scales its embedding would differ): None, or why not."""
    model = compiled.model
    device = model.get_input_embeddings().weight.device
    ids = torch.arange(1, 5, device=device)[None]
    with eager(model):
        reference = compiled.decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
    exact = compiled.exact
    compiled.exact = False  # sdpa, as the reference
    try:
        hidden = compiled.forward(ids[0], torch.arange(4, device=device), None, new_cache(model))
    finally:
        compiled.exact = exact
    return loop_difference(hidden, reference, f"the compiled decoder loop differs from {type(compiled.decoder).__name__}'s forward")


def loop_difference(hidden: torch.Tensor, reference: torch.Tensor, what: str) -> str | None:
    """`what`, with the relative error, where `hidden` lies further from the
    decoder's `reference` than LOOP_TOLERANCE allows for its dtype; else None."""
    error = float((hidden.double() - reference.double()).abs().max() / reference.double().abs().max().clamp_min(1e-30))
    tolerance = LOOP_TOLERANCE.get(reference.dtype, 5e-2)
    if not error <= tolerance:
        return f"{what} (relative error {error:.1e}, tolerance {tolerance:.0e})"
    return None


def forget(runners) -> None:
    """Drop what Dynamo compiled for these runners (a Compiled's, a
    CompiledHead's; None skipped) once their model is let go: it keeps a code
    object's variants, and their functions in this module's globals, for as
    long as the process runs, whatever became of the model (some 10 MB per
    load and unload). A runner called again after this compiles again."""
    try:
        from torch._dynamo.eval_frame import reset_code  # not public: where a torch lacks it, nothing is dropped
    except ImportError:
        return
    for runner in runners:
        code = getattr(getattr(runner, "_torchdynamo_orig_callable", None), "__code__", None)
        if code is not None:
            reset_code(code)


def uncompile(compiled: Compiled) -> None:
    compiled.model.__dict__.pop(ATTRIBUTE, None)
    for module in compiled.modules:
        module.__dict__.pop(PASS_OPS, None)
    compiled.model.set_attn_implementation(compiled.previous)


# The draft head, compiled: one decoder layer whose dozens of small ops cost more than its products
# (a forward of the bundled head at 4 rows: about 0.8 ms eager). Its attention, which appends to the
# head's cache, runs outside the graph in one opaque op, as the base model's does.


def head_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """query (B, H, T, D), this call's key/value (B, H_kv, T, D) -> (B, H, T, D):
    the head cache's attention (models/head.HeadCache.attend) for the current
    compiled head call, with its cache and mask."""
    state = getattr(_local, "head", None)
    if state is None:
        raise RuntimeError("the head's attention op runs inside CompiledHead calls only")
    cache, mask = state
    return cache.attend(query, key, value, mask).contiguous()  # the layout the graph was compiled for


_operators.define("head_attend(Tensor query, Tensor key, Tensor value) -> Tensor")
_operators.impl("head_attend", head_attend, "CompositeExplicitAutograd")


@torch.library.register_fake("kestrel::head_attend")
def _(query, key, value):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


class _OpaqueCache:
    """The cache a compiled head forward is traced with: attention goes through the op."""

    def attend(self, query, key, value, mask):
        return torch.ops.kestrel.head_attend(query, key, value)


_OPAQUE = _OpaqueCache()


def _run_head(head, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return head(embeddings, features, positions, None, _OPAQUE)  # mask and cache: CompiledHead's call state


def _head_guards_kept(entries) -> list[bool]:
    """As _guards_kept: a runner serves one head, so guards on its insides
    (its modules, packed weights and their attributes) are dropped; the
    activations' shapes and dtypes tell the variants apart."""
    return [not entry.name.startswith(("head.", "head._", "dict(type(head", "type(head")) for entry in entries]


class CompiledHead:
    """A draft head whose forward runs under torch.compile: called as the
    head is (embeddings, features, positions, mask, cache), and otherwise
    the head itself (its attributes are the head's). One variant for one
    row, one for any other row count, whatever the cache length."""

    def __init__(self, head):
        self.head = head
        code = _run_head.__code__.replace()  # a code object of its own: this head's variants are its own
        runner = types.FunctionType(code, _run_head.__globals__, "run_head")
        options = {**OPTIONS, "guard_filter_fn": _head_guards_kept}
        self.runner = torch.compile(runner, dynamic=True, options=options)

    def __getattr__(self, name):
        if name == "head":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.head, name)

    def __call__(self, embeddings, features, positions, mask, cache) -> torch.Tensor:
        outer = getattr(_local, "head", None)
        _local.head = (cache, mask)
        try:
            return self.runner(self.head, _fresh(embeddings), _fresh(features), _fresh(positions))
        finally:
            _local.head = outer


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous and at the start of its storage: Dynamo specializes
    variants on storage offsets 0 and 1 too, and a slice passed once would
    cost a recompile in the middle of decoding."""
    return tensor if tensor.is_contiguous() and tensor.storage_offset() == 0 else tensor.clone(memory_format=torch.contiguous_format)


@torch.inference_mode()
def _head_problem(compiled: CompiledHead, embed) -> str | None:
    """Compile what drafting runs (a prefill, a tree level of two siblings, a
    one-row step), comparing each with the eager head: None, or how they differ."""
    from models.head import HeadCache

    head, device = compiled.head, compiled.head.device
    generator = torch.Generator().manual_seed(0)
    prefix = 4
    tokens = torch.randint(0, embed.weight.shape[0], (1, prefix + 2), generator=generator).to(device)
    features = torch.randn(1, prefix + 2, head.feature_size, generator=generator).to(device=device, dtype=head.dtype)
    positions = torch.tensor([[*range(prefix), prefix, prefix]], device=device)
    siblings = torch.ones(1, 1, 2, prefix + 2, dtype=torch.bool, device=device)
    siblings[0, 0, :, prefix:] = torch.eye(2, dtype=torch.bool, device=device)
    calls = [(slice(0, prefix), None), (slice(prefix, prefix + 2), siblings), (slice(prefix, prefix + 1), siblings[:, :, :1, : prefix + 1])]
    caches, worst = (HeadCache(), HeadCache()), 0.0
    for part, mask in calls:
        eager, fast = (
            run(embed(tokens[:, part]), features[:, part], positions[:, part], mask, cache).double()
            for run, cache in zip((head, compiled), caches)
        )
        worst = max(worst, float((fast - eager).abs().max() / eager.abs().max().clamp_min(1e-30)))
        for cache in caches:
            cache.crop(prefix)
    tolerance = LOOP_TOLERANCE.get(head.dtype, 5e-2)
    if not worst <= tolerance:
        return f"the compiled draft head differs from the eager one (relative error {worst:.1e}, tolerance {tolerance:.0e})"
    return None


def compile_head(head, embed, progress: Callable[[str], None] | None = None) -> CompiledHead | None:
    """The draft head compiled and checked against its eager forward, or None
    (the head stays eager) where that fails."""
    use_compile_cache()
    _constant_floats()
    try:
        compiled = CompiledHead(head)
        start = time.perf_counter()
        if progress:
            progress("Compiling the draft head (cached for later starts)...")
        with _watching_the_cache() as watch:
            problem = _head_problem(compiled, embed)
        if watch.seen:
            problem = _clear_damaged_cache()
        if progress:
            progress(f"Compiled in {time.perf_counter() - start:.0f} s")
    except Exception as error:
        log.warning(f"Drafting eagerly: {_failure(error, 'the draft head')}")
        return None
    if problem is not None:
        log.warning(f"Drafting eagerly: {problem}")
        return None
    return compiled
