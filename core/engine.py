"""The engine: one generator of step events for vanilla, EAGLE and EAGLE-2.

Every mode runs the same loop: prefill -> draft -> verify -> accept -> commit
-> yield. Vanilla decoding is the case where the draft tree is the root alone,
so its single verified node yields exactly the next token."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from core import attention, compiled, costs, graphs, kv_cache, rowkernel
from core.argmax import ScreenedArgmax
from core.capture import LayerCapture
from core.calibration import Calibrations, CurvePoint, DraftTiming, setting_of
from core.config import MODES, SamplingParams, TreeParams
from core.detokenize import Detokenizer, byte_ids
from core.drafter import STATIC_PATHS, Drafter, Planning, draft_vocabulary
from core.prompt import encode_chat, load_prompts, stop_token_ids
from core.sampling import FLOAT32_TEMPERATURE, Noise, probabilities, sample
from core.stats import Recorder, Snapshot
from core.tree import make_tree, shallower
from core.tree_check import EXPLICIT, MODEL_MASK, ONE_PASS, chunk_mask, not_finite, rows_differing, tree_problem
from core.verify import NodeArgmax, NodeGumbel, NodeLogits, NodeSample, accept, base_forward, logit_form, logits_of, next_logits, verify_tree
from models import int4, int8
from models.base import LoadedModel, memory_error, out_of_memory
from models.bundled import BUNDLED_HEAD, cache_root
from models.errors import KestrelError, OutOfMemoryError, UnsupportedArchitectureError
from models.head import DraftHead, HeadCache


COMPILE_CHOICES = ("auto", "on", "graphs", "off")
log = logging.getLogger("kestrel")

# prompt tokens per prefill forward: a long prompt is read in chunks, so Stop
# and a client that goes away take effect between them, the page shows how far
# reading has got, and a forward's activations stay the size of one chunk
PREFILL_CHUNK = 512

# conversations whose caches are kept for their next turn (Engine.stream's reuse): the latest
# always, the ones before it while they are among the last KEPT_CONVERSATIONS and their caches
# together stay within KEPT_BYTES (a chat taken up again in another tab, API clients taking turns)
KEPT_CONVERSATIONS = 4
KEPT_BYTES = 1 << 30

SAMPLE_TEXT = Path(__file__).resolve().parent.parent / "assets" / "prompts" / "tasks.jsonl"  # ordinary text for measuring costs


def costs_folder() -> Path:
    """Where measured step costs are cached; KESTREL_COSTS_DIR overrides it."""
    override = os.environ.get("KESTREL_COSTS_DIR")
    return Path(override).expanduser() if override else cache_root() / "costs"


def rope_settings(config) -> dict:
    """The model's RoPE parameters (transformers' `rope_parameters`, older configs' `rope_scaling`); {} where none."""
    settings = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return settings if isinstance(settings, dict) else {}


def rope_boundary(config) -> int | None:
    """The position where LongRoPE (Phi-3.5's, Phi-4-mini's) turns from its short
    factors to its long ones, or None. transformers picks one set for a whole
    forward from its furthest position, so a pass that crosses it computes
    every row otherwise than one-token steps do."""
    settings = rope_settings(config)
    if settings.get("rope_type") != "longrope":
        return None
    return settings.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)


class ContextOverflowError(KestrelError):
    """The prompt does not fit in the model's context window."""


class NonFiniteError(KestrelError):
    """The model's numbers are not finite: overflowed in float16 (whose range ends at 65,504), or damaged weights."""


@dataclass(frozen=True)
class Step:
    token_ids: tuple[int, ...]  # tokens committed by this step, in order (a final stop token included)
    text: str  # new text they decode to (never a split character)
    accepted: int  # how many of token_ids were drafted and accepted; the rest came from the base model
    tree_size: int  # nodes verified in this step's base-model forward (1 for vanilla and prefill)
    draft_seconds: float  # head forwards of this step
    verify_seconds: float  # base-model forward, acceptance and cache commit of this step
    stats: Snapshot  # running statistics of the whole request
    finish_reason: str | None = None  # None while decoding; else stop, length, context or cancelled
    accepted_text: str = ""  # the start of `text` that the accepted tokens decode to ("" if they end mid-character)


@dataclass(frozen=True)
class Reading:
    """A prompt longer than PREFILL_CHUNK being read: `done` of its `total`
    tokens so far (Engine.stream with reading=True yields these before the prefill Step)."""

    done: int
    total: int


@dataclass
class _Kept:
    """What a request left in the caches, for a later one that starts
    the same way (a chat's next turn): the base cache holding `tokens`, the
    token after them (the reply's last, not yet read; None if there is none),
    and the head's cache and the pairs it has not read yet (features (T, F),
    next tokens (T,)), together one (feature, next token) pair per token in
    `tokens` (None where no head drafted)."""

    tokens: list[int]
    following: int | None
    cache: object
    head_cache: HeadCache | None
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt_length: int = 0  # how many of `tokens` the request's prompt held (the rest are its reply; at most len(tokens))
    long_rope: bool = False  # LongRoPE: the base cache was read with the long factors (core.engine.rope_boundary)

    def continue_head(self, drafter: Drafter, length: int) -> None:
        """Give `drafter` the head's pairs for the first `length` tokens."""
        drafter.cache, pending = self._head_pairs(length, copy=False)
        if pending is not None:
            drafter.pending = [pending]

    def _head_pairs(self, length: int, copy: bool) -> tuple[HeadCache, tuple[torch.Tensor, torch.Tensor] | None]:
        """The head's pairs for the first `length` tokens: its cache, cut back
        in place (or a copy of its start), and the pending pairs up to them."""
        cached = min(length, self.head_cache.length)
        if copy:
            head_cache = HeadCache()
            if cached:
                head_cache.keys = self.head_cache.keys[:, :, :cached].clone()
                head_cache.values = self.head_cache.values[:, :, :cached].clone()
        else:
            head_cache = self.head_cache
            head_cache.crop(cached)
        if length == cached:
            return head_cache, None
        features, next_tokens = (part[: length - cached] for part in self.pending)
        return head_cache, (features.clone(), next_tokens.clone()) if copy else (features, next_tokens)

    def reusable(self, prompt_ids: list[int], drafting: bool) -> int:
        """How many of the base cache's positions a request for `prompt_ids`
        can keep: the tokens it shares with them, less one, so that the last
        shared token is read again (its features start the head's pairs and,
        if nothing else is new, give the first token's logits); 0 where a
        drafting request finds no head cache to continue."""
        if drafting and self.head_cache is None:
            return 0
        known = self.tokens if self.following is None else [*self.tokens, self.following]
        shared = 0
        for ours, theirs in zip(known, prompt_ids):
            if ours != theirs:
                break
            shared += 1
        return max(0, shared - 1)

    def prefix_copy(self, model, length: int) -> _Kept | None:
        """A copy of the caches of the first `length` tokens, these left as they
        are; None where the base cache's layers cannot be copied so."""
        cache = kv_cache.copy_prefix(self.cache, model, length)
        if cache is None:
            return None
        head_cache, pending = self._head_pairs(length, copy=True) if self.head_cache is not None else (None, None)
        following = self.tokens[length] if length < len(self.tokens) else self.following
        return _Kept(self.tokens[:length], following, cache, head_cache, pending, min(length, self.prompt_length), self.long_rope)

    def nbytes(self) -> int:
        """The memory its caches hold (their buffers' room to grow included)."""
        head = [self.head_cache.keys, self.head_cache.values, *(self.pending or ())] if self.head_cache is not None else []
        return kv_cache.nbytes(self.cache) + sum(tensor.numel() * tensor.element_size() for tensor in head if tensor is not None)


class Engine:
    def __init__(self, base: LoadedModel, head: DraftHead | None = None, head_name: str | None = None, compile: str = "off"):
        """compile: "off", "on" (torch.compile the base model's decoder layers),
        "graphs" (steps and tree passes replayed as CUDA graphs, core/graphs.py;
        on CPUs the same static passes, uncaptured) or "auto" (on CPUs with a
        C++ compiler, graphs on CUDA GPUs); a model that fails to compile stays
        eager (core/compiled.py), one whose graphs fail to capture decodes eagerly."""
        if compile not in COMPILE_CHOICES:
            raise ValueError(f"unknown compile setting {compile!r}; choose one of {', '.join(COMPILE_CHOICES)}")
        try:
            self._set_up(base, head, head_name, compile)
        except Exception as error:  # the self-checks' passes and the weights' packed copies take memory beyond the model's
            if isinstance(error, KestrelError) or not out_of_memory(error):
                raise
            raise memory_error(base.name, base.quantization, "prepare the loaded model for decoding") from error

    def _set_up(self, base: LoadedModel, head: DraftHead | None, head_name: str | None, compile: str) -> None:
        """The engine's parts for `base` and `head`, as __init__ describes."""
        self.base = base
        self.head = head
        self.head_name = head_name if head is not None else None  # where the head came from, for display
        self.model = base.model
        self.stop_ids = stop_token_ids(base.model, base.tokenizer)
        byte_ids(base.tokenizer)  # read from the vocabulary once now (0.1 s for 49k pieces), not in the first reply's time
        # a vision-language model (Gemma 3) keeps its text model's window in its text config
        self.context_limit = getattr(base.model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
        self.rope_boundary = rope_boundary(base.model.config)
        self.argmax = ScreenedArgmax(base.model.get_output_embeddings())
        self.vocabulary = None if head is None else draft_vocabulary(head, base.model)
        # the head as drafting runs it: int8 linears where they pay (models/int8.py)
        self.draft_head = head if head is None else int8.drafting_head(head)
        if self.model.config._attn_implementation == attention.NAME:
            attention.use(self.model, False)  # sdpa until _make_exact shows the row-invariant attention exact here
        # an engine made again for the same model keeps its compiled layers or graphs where the setting asks for them
        self.compiled, self.graphed = compiled.of(self.model), graphs.of(self.model)
        wants_graphs = compile == "graphs" or (compile == "auto" and graphs.worth_trying(base.device))
        if self.compiled is not None and (compile == "off" or wants_graphs):
            compiled.uncompile(self.compiled)
            self.compiled = None
        if self.graphed is not None and not wants_graphs:
            graphs.ungraph(self.graphed)
            self.graphed = None
        if self.compiled is None and self.graphed is None and wants_graphs:
            self.graphed = graphs.graph_model(self.model, capture=base.device.type == "cuda")
        if self.compiled is None and self.graphed is None and (compile == "on" or (compile == "auto" and compiled.worth_trying(base.device, base.dtype))):
            self.compiled = compiled.compile_model(self.model, lambda line: log.info(line))
        if self.compiled is not None and self.draft_head is not None:  # the compiler works here: the head too
            embed = head.embed_tokens if head.embed_tokens is not None else self.model.get_input_embeddings()
            self.draft_head = compiled.compile_head(self.draft_head, embed, lambda line: log.info(line)) or self.draft_head
        # whether this model honours tree masks, asked of the model itself (core/tree_check.py)
        self._tree_problem = tree_problem(self.model) if head is not None and self._setup_problem() is None else None
        # whether tree passes compute every node bit for bit as a vanilla step would (core/attention.py);
        # asked on CPUs only: GPU libraries pick kernels by shape, and a per-row attention over
        # 60-node trees would cost a GPU thousands of small launches per pass. Asked with or without
        # a head, so that the model's own replies (vanilla) do not depend on whether a head is loaded
        self.exact = self.speculation_problem() is None and base.device.type == "cpu" and self.graphed is None and self._make_exact()
        # how a prompt's later chunks are read after the cache of the earlier ones, asked of the model as it now runs
        # (core/tree_check.py): MPT's attention reads a boolean mask inverted, Bloom's and Falcon's ALiBi take none.
        # A sliding window's cache keeps fewer keys than an explicit mask over the whole prompt would cover:
        # its chunks go without one, and transformers masks each from the cache it holds
        self.chunk_mask = MODEL_MASK if kv_cache.has_sliding_window(self.model.config) else chunk_mask(self.model)
        # EAGLE-3 heads read hidden states of chosen base layers, captured during each base forward
        self.capture = LayerCapture(self.model, head.layer_ids) if head is not None and head.layer_ids else None
        if self.capture is not None and self.compiled is not None:
            with self.capture.during():  # captured layers start compiled segments of their own: compile those now
                self.compiled.warm()
        self.costs: costs.Costs | None = None  # this device's step costs, measured or read from the cache on first need
        self._costs_graphed = self._passes_graphed()  # whether self.costs are those of graphed passes
        self.calibrations = Calibrations()  # acceptance by draft confidence, learned over every request
        self._kept: list[_Kept] = []  # the caches of requests made with reuse (`stream`), the latest first

    def forget(self) -> None:
        """Drop the caches kept from earlier requests (their memory too)."""
        self._kept = []

    @property
    def kept_conversations(self) -> tuple[_Kept, ...]:
        """The caches kept for a conversation's next turn, the latest first."""
        return tuple(self._kept)

    def _take_kept(self, prompt_ids: list[int], drafting: bool) -> tuple[_Kept | None, int]:
        """The kept caches that continue furthest into `prompt_ids` (the latest
        of equals) and how many of their positions it keeps, taken out of the kept ones where the
        prompt continues their whole prompt (a next turn, or the same prompt
        answered again); else a copy of the part it continues, the rest kept
        as it was: every conversation starts with the chat template's opening
        (and often one system prompt), which in a short chat is most of it,
        and a new chat, or a message edited before the last, must not cut
        another conversation or branch back to that. (None, 0) where none
        continues it."""
        # LongRoPE: a prompt past the boundary is read with the long factors, one before it with the short ones
        long_rope = self.rope_boundary is not None and len(prompt_ids) > self.rope_boundary
        shares = [kept.reusable(prompt_ids, drafting) if kept.long_rope == long_rope else 0 for kept in self._kept]
        if not shares or max(shares) == 0:
            return None, 0
        best = shares.index(max(shares))
        kept = self._kept[best]
        if shares[best] >= kept.prompt_length - 1:  # reusable keeps one shared token less
            return self._kept.pop(best), shares[best]
        copied = kept.prefix_copy(self.model, shares[best])
        return copied, shares[best] if copied is not None else 0

    def _keep(self, kept: _Kept | None) -> None:
        """Keep a finished request's caches first; the older ones while the rules of KEPT_CONVERSATIONS allow."""
        if kept is None:
            return
        room, older = KEPT_BYTES, []
        if self.base.device.type == "cuda":  # a GPU's memory is the model's first: a quarter of what is free at most
            device = self.base.device
            spare = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # free to torch, not to the driver
            room = min(room, (torch.cuda.mem_get_info(device)[0] + spare) // 4)
        # an earlier state of this same conversation (its tokens start the new ones) is never the better one to
        # continue; but where the new one holds LongRoPE's long factors and it the short ones, it is the one a
        # prompt back before the boundary (an earlier message edited) can continue
        others = [other for other in self._kept if kept.tokens[: len(other.tokens)] != other.tokens or other.long_rope != kept.long_rope]
        for other in others[: KEPT_CONVERSATIONS - 1]:
            room -= other.nbytes()
            if room < 0:
                break
            older.append(other)
        self._kept = [kept, *older]

    def _row_kernel(self) -> str | None:
        """Which row attention this engine runs: "tiles" (bf16 on AMX or as vdpbf16ps), "vectors", or None (torch's)."""
        if not (self.exact and rowkernel.covers(self.base.dtype, self.base.device)):
            return None
        return "tiles" if self.base.dtype == torch.bfloat16 and rowkernel.tiles() else "vectors"

    def _draft_kernel(self) -> str:
        """What drafting runs on: the head's linears' kernel, compiled or not, and the vocabulary's."""
        compiled_head = "compiled" if isinstance(self.draft_head, compiled.CompiledHead) else "eager"
        return f"{int8.kernel_of(self.draft_head)}/{compiled_head}/{type(self.vocabulary.packed).__name__}"

    def _screen_route(self) -> str | None:
        """Where the greedy lm_head screen multiplies one row (chosen by measuring, see int8.PackedRows)."""
        if not self.argmax.enabled:
            return None
        return "tiles" if self.argmax.rows.one_row_tiles else "vector"

    def close(self) -> None:
        """Let go of what outlives the engine otherwise: the code torch.compile
        made for its model and head (core/compiled.forget). For an engine that
        will not decode again (unloaded, replaced)."""
        compiled.forget([getattr(self.compiled, "runner", None), getattr(self.draft_head, "runner", None)])

    def prepare_costs(self, progress: costs.Progress | None = None, remeasure: bool = False) -> costs.Costs | None:
        """The step costs the planner sizes trees by: read from the cache for
        this device, model, head (and their files' contents), dtype,
        quantization and thread count, else measured (a few seconds) and
        cached; while another process measures, its table is waited for and
        read. Graphs given up (core/graphs.py), while measuring or after, the
        table of eager passes. None without a head."""
        if self.head is None or self.speculation_problem() is not None:
            return None
        if self.costs is not None and not remeasure and self._costs_graphed == self._passes_graphed():
            return self.costs
        found = self._read_or_measure_costs(progress, remeasure)
        if found is None:  # graphs given up while measuring: the eager passes' table
            found = self._read_or_measure_costs(progress, remeasure)
        self.costs, self._costs_graphed = found, self._passes_graphed()
        return found

    def _read_or_measure_costs(self, progress: costs.Progress | None, remeasure: bool) -> costs.Costs | None:
        """The cached step costs of the passes as they run now, else measured
        and cached; None where graphs were given up while measuring (a
        capture ran out of memory, say): that table is partly eager."""
        graphed = self._passes_graphed()
        base = self.base
        head = str(BUNDLED_HEAD) if self.head_name == "bundled" else self.head_name
        key = costs.cache_key(
            base.device, costs.where(base.name), costs.where(self.head_name), base.dtype, base.quantization,
            compiled=self.compiled is not None, graphs=graphed, row_kernel=self._row_kernel(),
            int4_kernel=int4.kernel_of(self.model), draft_kernel=self._draft_kernel(), screen=self._screen_route(),
            model_contents=costs.contents(base.name), head_contents=costs.contents(head),
        )  # fmt: skip
        folder = costs_folder()
        found = None if remeasure else costs.load_cached(folder, key)
        if found is None:
            with costs.measuring(folder):  # one process measures at a time
                found = None if remeasure else costs.load_cached(folder, key, warn=False)  # measured by the one waited for
                if found is None:
                    self.calibrations.timing = DraftTiming()  # relative to the table about to be measured
                    found = costs.measure(
                        self.model, self.argmax, lambda: self._drafter("eagle2", TreeParams(16)), self.context_limit, progress, self._sample_text()
                    )
                    if graphed and not self._passes_graphed():
                        return None
                    try:
                        costs.save_cached(folder, key, found)
                    except OSError as error:  # a read-only cache: measured again next start
                        log.warning(f"The measured step costs could not be cached ({error})")
        return found

    def _passes_graphed(self) -> bool:
        """Whether the base model's passes run through core/graphs.py (captured or not) and it has not given up."""
        return self.graphed is not None and self.graphed.problem is None

    def _sample_text(self) -> list[int] | None:
        """Token ids of ordinary text for measuring step costs: the passages of
        the bundled task prompts (assets/prompts/tasks.jsonl), as this model's
        tokenizer reads them; None where the file is missing or unreadable."""
        try:
            passages = [prompt.text for prompt in load_prompts(SAMPLE_TEXT)]
        except (OSError, ValueError):  # PromptFileError names what is wrong; the costs then use random tokens
            return None
        return self.base.tokenizer("\n\n".join(passages), add_special_tokens=False)["input_ids"] or None

    def _make_exact(self) -> bool:
        """Switch to row-invariant attention when, with it, the whole forward is
        row-invariant on this device (checked bit for bit); else keep sdpa,
        with which greedy replies equal vanilla's up to rounding near-ties."""
        self._use_exact(True)
        try:
            exact = rows_differing(self.model) == 0
        except Exception as error:
            if out_of_memory(error):  # says nothing of the attention
                self._use_exact(False)
                raise
            # NotImplementedError: an attention feature the row-invariant one does not model; any
            # other: a forward that takes no tree mask (Falcon's ALiBi), vanilla only as it was
            exact = False
        if not exact:
            self._use_exact(False)
        self.argmax.row_by_row = exact  # unscreened greedy choices then take one lm_head row at a time
        return exact

    def _use_exact(self, exact: bool) -> None:
        if self.compiled is not None:
            self.compiled.exact = exact  # the compiled layers' attention op picks it
        else:
            attention.use(self.model, exact)

    @property
    def graphs_in_use(self) -> bool:
        """Whether the base model's passes replay as CUDA graphs (not given up)."""
        return self.graphed is not None and self.graphed.capture and self.graphed.problem is None

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this model and head can run."""
        return MODES if self.head is not None and self.speculation_problem() is None else ("vanilla",)

    def speculation_problem(self) -> str | None:
        """Why speculative modes cannot run on this base model, or None."""
        return self._setup_problem() or self._tree_problem

    def _setup_problem(self) -> str | None:
        config = self.model.config
        if kv_cache.has_sliding_window(config):
            return f"speculative decoding does not support sliding-window attention ({config.model_type})"
        if "dynamic" in str(rope_settings(config).get("rope_type")):
            return "speculative decoding does not support dynamic RoPE scaling (its frequencies follow each pass's furthest position)"
        if config._attn_implementation not in ("sdpa", attention.NAME, compiled.NAME, graphs.NAME):
            return f"speculative decoding needs sdpa attention, not {config._attn_implementation}"
        return None

    @torch.inference_mode()
    def next_token_margin(self, token_ids: list[int]) -> float:
        """The top-2 logit margin for the token after `token_ids`, from one
        plain forward: how close the base model's greedy choice there was."""
        top = torch.topk(next_logits(self.model, torch.tensor(token_ids, device=self.base.device)).double(), 2).values
        return float(top[0] - top[1])

    def calibration_curve(self, sampling: SamplingParams) -> list[CurvePoint]:
        """How often the head's drafted nodes were accepted, by draft confidence, under these sampling settings."""
        return self.calibrations.get("head", setting_of(sampling)).curve()

    def encode(self, messages: list[dict], template_options: dict | None = None) -> list[int]:
        return encode_chat(self.base.tokenizer, messages, template_options)

    def chat(
        self,
        messages: list[dict],
        mode: str = "eagle2",
        sampling: SamplingParams = SamplingParams(),
        tree: TreeParams = TreeParams(),
        cancel: threading.Event | None = None,
        reading: bool = False,
        reuse: bool = False,
    ) -> Iterator[Step | Reading]:
        return self.stream(self.encode(messages), mode, sampling, tree, cancel, reading, reuse)

    def stream(
        self,
        prompt_ids: list[int],
        mode: str = "eagle2",
        sampling: SamplingParams = SamplingParams(),
        tree: TreeParams = TreeParams(),
        cancel: threading.Event | None = None,
        reading: bool = False,
        reuse: bool = False,
        continues: bool = False,
    ) -> Iterator[Step | Reading]:
        """Decode after `prompt_ids`, yielding one Step per base-model forward
        (a prompt read in several chunks is one Step), and with `reading` a
        Reading before each chunk of a prompt longer than one.

        With `reuse`, the caches of an earlier request made with `reuse` are
        continued where its tokens (prompt and reply) start this prompt, so
        a chat's next turn reads only what is new, and this request's caches
        are kept in turn for the next (KEPT_CONVERSATIONS). Every token's keys and values are
        still computed from the same tokens at the same positions; on CPUs
        where prompts are read row by row (core/rowkernel.prefills) they are
        the same bits as a fresh read's; elsewhere a reply read back from the
        cache and one read in a chunk may differ in rounding. Speculative and
        vanilla decoding continue the same caches alike.

        With `continues`, the reply's text continues the prompt's (a
        completion, not a chat reply): a space the tokenizer writes before
        the reply's first word is kept (core/detokenize.Detokenizer).

        The steps' figures (time to first token, tokens/s) count from this
        call's start: kept caches copied, a head's costs measured on first
        need, all are part of the wait."""
        started = time.perf_counter()
        drafter = self._drafter(mode, tree, sampling)
        check_prompt(self, prompt_ids)  # a refused prompt takes no kept caches
        whole = False  # whether the caches hold what run.kept() describes: not after an error inside a forward
        try:
            kept, first = self._take_kept(prompt_ids, drafter is not None) if reuse else (None, 0)  # copying may run out of memory
            passive = drafter is None and reuse and self._drafting_ready(kept, first)
            if passive:  # vanilla keeps the head's pairs for the next turn (it never drafts): a drafting turn after it reads only what is new
                drafter = Drafter(self.draft_head, self.model, tree, None, self.vocabulary)
            run = _Run(self, list(prompt_ids), drafter, sampling, kept, first, passive, continues, started)
            yield from _steps(run, cancel, reading)
            whole = True
        except GeneratorExit:  # closed at a yield, between forwards
            whole = True
            raise
        except Exception as error:
            if isinstance(error, KestrelError) or not out_of_memory(error):
                raise
            self._kept = []  # kept caches too: their memory goes back
            weights = "" if self.base.quantization in ("4bit", "int4") else " 4-bit weights,"
            raise OutOfMemoryError(
                f"{self.base.name}: out of memory while decoding; try{weights} a shorter conversation or a smaller tree (Total tokens)"
            ) from error
        finally:
            if reuse and whole:
                self._keep(run.kept())

    def _drafting_ready(self, kept: _Kept | None, first: int) -> bool:
        """Whether a vanilla request continuing `kept` (None: reading afresh)
        can leave caches a drafting request continues: a head that drafts for
        this model, and the head's pairs of the positions it keeps."""
        if self.head is None or self.speculation_problem() is not None:
            return False
        return not first or kept.head_cache is not None

    def _drafter(self, mode: str, tree: TreeParams, sampling: SamplingParams = SamplingParams()) -> Drafter | None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode == "vanilla":
            return None
        if self.head is None:
            raise ValueError(f"mode {mode} needs a draft head, and none is loaded")
        problem = self.speculation_problem()
        if problem is not None:
            raise UnsupportedArchitectureError(f"{self.base.name}: {problem}; use vanilla")
        planning = None
        if mode == "eagle2" and tree.planned:
            setting = setting_of(sampling)
            planning = Planning(
                self.prepare_costs(),
                self.calibrations.get("head", setting),
                self.calibrations.get("context", setting),
                self.calibrations.continuation(setting),
                self.calibrations.timing,
            )
        static = STATIC_PATHS if mode == "eagle" else None
        return Drafter(self.draft_head, self.model, tree, static, self.vocabulary, planning)


def check_prompt(engine: Engine, prompt_ids: list[int]) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= engine.context_limit:
        raise ContextOverflowError(f"the prompt is {len(prompt_ids)} tokens; the model's context window is {engine.context_limit}")


def _steps(run: _Run, cancel: threading.Event | None, reading: bool) -> Iterator[Step | Reading]:
    for done in run.read_prompt():
        if cancel is not None and cancel.is_set():
            yield run.cancelled()
            return
        if reading:
            yield Reading(done, len(run.prompt_ids))
    if cancel is not None and cancel.is_set():  # before the prompt's last chunk too: a Stop already pressed costs no forward
        yield run.cancelled()
        return
    yield run.prefill()
    while run.finish_reason is None:
        if cancel is not None and cancel.is_set():
            yield run.cancelled()
            return
        yield run.step()


class _Run:
    """The state of one request: base cache, committed length, root token."""

    def __init__(
        self, engine: Engine, prompt_ids: list[int], drafter: Drafter | None, sampling: SamplingParams,
        kept: _Kept | None = None, first: int = 0, passive: bool = False, continues: bool = False,
        started: float | None = None,
    ):  # fmt: skip
        """kept, first: caches to continue and how many of their positions this
        prompt keeps (Engine._take_kept); continues: the reply's text continues
        the prompt's (Engine.stream); passive: `drafter` only gathers the
        head's pairs, for a later request, and drafts nothing (vanilla);
        started: the perf_counter time the request's figures count from (default: now)."""
        self.engine, self.model, self.drafter, self.sampling = engine, engine.model, drafter, sampling
        self.passive = passive
        self.prompt_ids = prompt_ids
        self.device = self.model.get_input_embeddings().weight.device
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()))
        vocabulary = engine.model.get_output_embeddings().weight.shape[0]
        self.noise = Noise(seed, vocabulary, self.device)
        # sampling over the whole vocabulary from the screened lm_head (verify.NodeGumbel); a
        # temperature so small that logits / temperature leave float32's range takes the full product
        # the screen reads the lm_head alone: a scale the model puts on its logits goes into the temperature, a softcap cannot
        scale, softcap = logit_form(self.model.config)
        self.screen_temperature = sampling.temperature / scale
        whole = sampling.top_p == 1.0 and not 0 < sampling.top_k < vocabulary and softcap is None
        self.screened_sampling = not sampling.greedy and whole and engine.argmax.enabled and self.screen_temperature >= FLOAT32_TEMPERATURE
        self.sliding = kv_cache.has_sliding_window(self.model.config)  # its cache is never continued (kept)
        self.chunk_mask = engine.chunk_mask
        # prompt tokens per prefill forward; a model that reads no later chunk right reads its prompt in one
        self.chunk = PREFILL_CHUNK if self.chunk_mask != ONE_PASS else 1 << 62
        self.first = first  # the positions kept from an earlier request (0 without kept caches)
        if self.first:
            self.cache = kept.cache
            kv_cache.commit(self.cache, self.first, [])  # cut back to the shared tokens
            if drafter is not None:
                kept.continue_head(drafter, self.first)  # the pairs whose next token is among them
        else:
            self.cache = kv_cache.new_cache(self.model)
        self.cached_ids = prompt_ids[: self.first]  # the tokens in the base cache, in order
        self.long_rope = kept.long_rope if self.first else False  # LongRoPE: the base cache holds the long factors' keys
        self.recorder = Recorder(started=time.perf_counter() if started is None else started, reused=self.first)
        self.detokenizer = Detokenizer(engine.base.tokenizer, prompt_ids if continues else ())
        self.started = time.perf_counter()  # the prefill's time runs from here
        self.committed = self.first  # tokens in the base cache
        self.root = -1  # the last sampled token, not yet in the cache
        self.finish_reason: str | None = None

    @torch.inference_mode()  # the pending features joined as the steps' tensors are made
    def kept(self) -> _Kept | None:
        """This request's caches, for the next request to continue: the head's
        with the pairs it has not read yet (read when the next request drafts,
        so a Stop while a long prompt is read costs no head forward over it)."""
        following = self.root if self.root >= 0 else self.prompt_ids[self.committed] if self.committed < len(self.prompt_ids) else None
        if not self.committed or self.sliding or self.chunk_mask == ONE_PASS:  # never continued: a window's cache, or one read whole
            return None
        head_cache, pending = None, None
        if self.drafter is not None:
            pending = self.drafter.joined_pending()
            if self.drafter.cache.length + (0 if pending is None else len(pending[1])) == self.committed:
                head_cache = self.drafter.cache
            else:
                pending = None
        prompt_length = min(len(self.prompt_ids), len(self.cached_ids))
        return _Kept(self.cached_ids, following, self.cache, head_cache, pending, prompt_length, self.long_rope)

    def chunks(self) -> list[tuple[int, int]]:
        """The prompt's chunks after the kept positions: every `chunk` tokens from
        the first. A prompt past the LongRoPE boundary has no chunk ending at or
        before it: transformers turns a whole forward to the long factors once
        its furthest position passes the boundary, and `generate` reads such a
        prompt in one forward, every position with the long factors."""
        total = len(self.prompt_ids)
        ends = list(range(self.first + self.chunk, total, self.chunk)) + [total]
        boundary = self.engine.rope_boundary
        if boundary is not None and total > boundary:
            ends = [end for end in ends if end > boundary]
        return list(zip([self.first, *ends[:-1]], ends))

    def read_prompt(self) -> Iterator[int]:
        """Forward the prompt's chunks but the last, yielding before each how many tokens are read."""
        for start, end in self.chunks()[:-1]:
            yield start
            self._commit_prompt(start, end, self._read(start, end)[1], self.prompt_ids[end])

    @torch.inference_mode()
    def prefill(self) -> Step:
        """The prompt's last chunk (after read_prompt's) and the first token."""
        total = len(self.prompt_ids)
        start = self.chunks()[-1][0]
        features, head_features = self._read(start, total)
        if not bool(torch.isfinite(features[-1]).all()):  # NaN would read as a choice of token 0, a reply of nothing
            said = not_finite("the features of the prompt's last token", features.dtype)
            raise NonFiniteError(f"{self.engine.base.name}: {said}")
        if self.sampling.greedy:
            self.root = self.engine.argmax(features[-1:])[0]
        elif self.screened_sampling:
            self.root = self.engine.argmax.sample(features[-1:], [self.noise.at(total)], self.screen_temperature)[0]
        else:
            logits = logits_of(self.model, features[-1:])[0]
            self.root = sample(probabilities(logits, self.sampling), self.noise.at(total))
        verified = time.perf_counter()
        self._commit_prompt(start, total, head_features, self.root)
        drafted = time.perf_counter()
        return self._emit([self.root], accepted=0, tree_size=1, tree_depth=0, times=(drafted - verified, verified - self.started))

    @torch.inference_mode()
    def _read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt tokens [start, end) into the base cache -> _forward's features."""
        tokens = torch.tensor(self.prompt_ids[start:end], device=self.device)
        positions = torch.arange(start, end, device=self.device)
        mask = None  # causal; after the first chunk spelt out where it may be: each row sees what is read and its own prefix
        if start and self.chunk_mask == EXPLICIT:
            mask = torch.ones(end - start, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
        features = self._forward(lambda: base_forward(self.model, tokens, positions, mask, self.cache))
        self.committed = end
        self.cached_ids.extend(self.prompt_ids[start:end])
        self.long_rope = self.long_rope or self._past_boundary(end)
        return features

    def _past_boundary(self, end: int) -> bool:
        """Whether a forward over positions before `end` reads them with LongRoPE's long factors."""
        return self.engine.rope_boundary is not None and end > self.engine.rope_boundary

    def _read_again(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The root at the LongRoPE boundary, with the short factors' cache:
        every cached token read again with the root in one forward, with the
        long factors (as transformers' `generate` reads a Phi-3's sequence
        again when it first passes the boundary) -> the root's _forward features."""
        tokens = torch.tensor([*self.cached_ids, self.root], device=self.device)
        positions = torch.arange(len(tokens), device=self.device)
        self.cache = kv_cache.new_cache(self.model)  # the new cache holds every position before the root's, as the old one did
        features, head_features = self._forward(lambda: base_forward(self.model, tokens, positions, None, self.cache))
        self.long_rope = True
        return features[-1:], head_features[-1:]

    def _commit_prompt(self, start: int, end: int, head_features: torch.Tensor, next_token: int) -> None:
        if self.drafter is not None:
            if start == self.first:  # the context branch matches from the conversation's first token (the head reads pairs after it)
                self.drafter.index.extend(self.prompt_ids[: start + 1])
            next_tokens = self.prompt_ids[start + 1 : end] + [next_token]
            self.drafter.commit(head_features, torch.tensor(next_tokens, device=self.device))

    @torch.inference_mode()
    def step(self) -> Step:
        start = time.perf_counter()
        tree = self._draft()
        drafted = time.perf_counter()
        if not self.long_rope and self._past_boundary(self.committed + 1):  # _draft left the root alone
            features, head_features = self._read_again()
        else:
            features, head_features = self._forward(lambda: verify_tree(self.model, tree, self.committed, self.cache))
        if self.sampling.greedy:
            path, bonus = accept(tree, NodeArgmax(self.engine.argmax, features, tree))
        elif self.screened_sampling:
            choice = NodeGumbel(self.engine.argmax, features, tree, self.screen_temperature, self.noise, self.committed)
            path, bonus = accept(tree, choice)
        else:
            logits = NodeLogits(self.model, features, tree, self.engine.argmax.row_by_row)
            path, bonus = accept(tree, NodeSample(logits, tree, self.sampling, self.noise, self.committed))
        kv_cache.commit(self.cache, self.committed, path)
        if self.drafter is not None:
            self.drafter.observe(path)
        self.cached_ids.extend(tree.tokens[path].tolist())
        new_tokens = tree.tokens[path[1:]].tolist() + [bonus]
        self.committed += len(path)
        self.root = bonus
        verified = time.perf_counter()
        step = self._emit(
            new_tokens, len(path) - 1, tree.size, int(tree.depths.max()), (drafted - start, verified - drafted)
        )
        if self.drafter is not None:  # after the last step too: the next request may continue the head's cache
            ids = torch.tensor(new_tokens, device=self.device)
            self.drafter.commit(head_features[path], ids)
        return step

    def _forward(self, run) -> tuple[torch.Tensor, torch.Tensor]:
        """One base forward -> (features (T, H) after the final norm, the head's
        input features: the same, or for EAGLE-3 the captured layers (T, 3H))."""
        capture = self.engine.capture
        if capture is None or self.drafter is None:
            features = run()
            return features, features
        with capture.during():
            features = run()
        return features, capture.features()

    def _draft(self):
        """The draft tree, the root alone for vanilla decoding, and near the
        context window's end (or a RoPE boundary) the part of the tree that fits before it."""
        root_only = make_tree(self.root, [], [])
        if self.drafter is None or self.passive:
            return root_only
        tree = self.drafter.draft(self.root)
        room = self.engine.context_limit - self.committed - 1  # positions left after the root's
        boundary = self.engine.rope_boundary
        if boundary is not None and not self.long_rope:  # no node past it while the cache holds the short factors: a pass
            room = min(room, max(boundary - self.committed, 0))  # reaching it turns every row's RoPE to the long factors
        if int(tree.depths.max()) < room:
            return tree
        self.drafter.discard()  # not the tree the planner chose: its verdicts would mislead calibration
        return shallower(tree, room)

    def cancelled(self) -> Step:
        self.finish_reason = "cancelled"
        return Step((), self.detokenizer.flush(), 0, 0, 0.0, 0.0, self.recorder.snapshot(), "cancelled")

    def _emit(self, tokens: list[int], accepted: int, tree_size: int, tree_depth: int, times) -> Step:
        """Cut `tokens` at a stop token or the token budget and make the Step."""
        budget = self.sampling.max_new_tokens - self.recorder.tokens
        tokens = tokens[:budget]  # first: a stop token past the budget ends no reply (vanilla never reaches it)
        for index, token in enumerate(tokens):
            if token in self.engine.stop_ids:
                tokens, self.finish_reason = tokens[: index + 1], "stop"
                break
        if self.finish_reason is None and len(tokens) >= budget:
            self.finish_reason = "length"
        if self.finish_reason is None and self.committed + 1 >= self.engine.context_limit:
            self.finish_reason = "context"
        draft_seconds, verify_seconds = times
        # the depth chart takes what the verifier accepted, the rest what the reply got
        self.recorder.record(len(tokens), accepted, tree_size, tree_depth, draft_seconds, verify_seconds)
        accepted = min(accepted, len(tokens))
        accepted_text = self.detokenizer.push(tokens[:accepted]) if accepted else ""
        text = accepted_text + self.detokenizer.push(tokens[accepted:])
        if self.finish_reason is not None:
            text += self.detokenizer.flush()
        return Step(
            tuple(tokens), text, accepted, tree_size, draft_seconds, verify_seconds,
            self.recorder.snapshot(), self.finish_reason, accepted_text,
        )  # fmt: skip
