"""The OpenAI-compatible HTTP API at /v1, served beside the page.

A thin shell over the engine's stream of steps: each request decodes on its
own thread in its turn in the model queue (app/decoding.py), shared with the
page; responses carry the engine's own statistics in `usage.speculative`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from app.decoding import Decoding, ServerStopping
from app.request import Generation, RequestError, model_defaults, parse_chat, parse_completion
from app.runtime import ModelBusyError, ModelChangedError, ModelLoadingError, NoModelError, Runtime
from core.detokenize import Detokenizer
from core.engine import Engine, Step
from core.prompt import opened_thinking
from core.stats import Snapshot
from models.errors import ChatTemplateError, KestrelError, json_kind

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413)
# a body that large is most often an attached photo (base64 image_url parts), which no size would let through
TEXT_ONLY = " (the models here read text only: image and audio parts are refused at any size)"
POLL_SECONDS = 0.1  # how often a waiting response checks that its client is still there
# a stream that waits for its turn, or for a long prompt to be read, sends an SSE comment this often: clients and
# proxies with a read timeout (30-60 s is common) would otherwise give up on a reply that is only queued
KEEPALIVE_SECONDS = 10.0
FINISH = {"stop": "stop", "length": "length", "context": "length"}  # engine -> OpenAI finish_reason
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
    503: "service_unavailable_error",
}  # fmt: skip
# seconds a client should wait before sending again (Retry-After), where waiting helps
RETRY_AFTER = {"queue_full": 1, "model_loading": 5, "model_changed": 1}
# errors a client's retry cannot mend: the official SDKs retry every 5xx (twice, by default) unless told not to,
# which would decode a request that ran out of memory three times, or knock on a server going down
NO_RETRY = {"no_model", "decoding_failed", "server_stopping"}
log = logging.getLogger("kestrel")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """JSON with non-ASCII characters escaped: a message may quote the
        request's own text, which can hold what UTF-8 cannot encode."""
        headers = {}
        if self.code in RETRY_AFTER:
            headers["Retry-After"] = str(RETRY_AFTER[self.code])
        if self.code in NO_RETRY:
            headers["x-should-retry"] = "false"
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json", headers=headers)


class StopScanner:
    """Cuts the reply at the first stop string. Text that could be the start
    of a stop string is held back until the next piece settles it. A step's
    tokens are read one at a time, as one-token-a-step decoding meets them, so
    the cut (which stop string, how many tokens) is the same in every mode."""

    def __init__(self, stops: tuple[str, ...], tokenizer, context: list[int] = ()):
        self.stops = stops
        self.pending = ""
        self.detokenizer = Detokenizer(tokenizer, context)  # the engine's context: the same text

    def scan(self, step: Step) -> tuple[str, int | None]:
        """(text safe to send, how many of the step's tokens come before the
        cut where a stop string ended the reply, else None)."""
        if not self.stops:
            return step.text, None
        sent = ""
        for index, token in enumerate(step.token_ids):
            text, stopped = self.push(self.detokenizer.push([token]))
            sent += text
            if stopped:
                return sent, index + 1
            held = self.detokenizer.held()  # a byte piece the detokenizer holds (Llama-2's newline, <0x0A>): a stop
            if held and any(stop in self.pending + held for stop in self.stops):  # string ending in it ends the reply at this token
                return sent + self.push(held)[0], index + 1
        if step.finish_reason is not None:  # the engine's last text also holds what its detokenizer held back
            text, stopped = self.push(self.detokenizer.flush())
            sent += text
            if stopped:
                return sent, len(step.token_ids)
        return sent, None

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string ended the reply)."""
        self.pending += text
        found = [index for index in (self.pending.find(stop) for stop in self.stops) if index >= 0]
        if found:
            text, self.pending = self.pending[: min(found)], ""
            return text, True
        keep = max((self._overlap(stop) for stop in self.stops), default=0)
        cut = len(self.pending) - keep
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def _overlap(self, stop: str) -> int:
        """Length of the longest end of `pending` that begins `stop`."""
        for size in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if stop.startswith(self.pending[-size:]):
                return size
        return 0

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


@dataclass
class Outcome:
    """How a request's decoding went, filled in as its steps are read."""

    mode: str
    prompt_tokens: int
    snapshot: Snapshot | None = None
    tokens: list[int] = field(default_factory=list)  # the reply's token ids, as the steps committed them
    accepted: int = 0  # drafted tokens accepted, over all steps
    finish_reason: str | None = None

    def add(self, step: Step) -> None:
        self.snapshot = step.stats
        self.tokens += step.token_ids
        self.accepted += step.accepted

    def cut(self, last: Step, kept: int) -> None:
        """Keep only the first `kept` tokens of the last step: a speculative
        step may commit tokens past the one that completes a stop string,
        which are cut from the text and so not counted either."""
        self.tokens = self.tokens[: len(self.tokens) - len(last.token_ids) + kept]
        self.accepted -= last.accepted - min(last.accepted, kept)
        self.snapshot = self.snapshot.without_last(len(last.token_ids) - kept)  # tau and the rates too

    def usage(self) -> dict:
        s = self.snapshot
        completion = len(self.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            # prompt tokens whose keys and values were kept from an earlier request, not read again
            "prompt_tokens_details": {"cached_tokens": s.reused_tokens if s else 0},
            "speculative": {
                "mode": self.mode,
                "mean_accepted_length": round(s.mean_accepted_length, 4) if s else 0.0,
                "forwards": s.forwards if s else 0,
                "accepted_draft_tokens": self.accepted,
                "acceptance_by_depth": [round(rate, 4) for rate in s.acceptance_by_depth] if s else [],
                "mean_tree_size": round(s.mean_tree_size, 2) if s else 1.0,
                "mean_tree_depth": round(s.mean_tree_depth, 2) if s else 0.0,
                "tokens_per_second": round(s.tokens_per_s, 2) if s else 0.0,
                "decoding_tokens_per_second": None if s is None or s.decoding_tokens_per_s is None else round(s.decoding_tokens_per_s, 2),
                "time_to_first_token": None if s is None or s.time_to_first_token is None else round(s.time_to_first_token, 4),
            },
        }


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to decode."""

    engine: Engine
    generation: Generation
    prompt_ids: list[int]
    mode: str
    clipped_from: int | None  # the max_tokens asked for, when the context window cut it
    # the <think> the chat template ended the prompt with (DeepSeek-R1's "<think>\n"), "" for none: the reply's
    # content begins with it, as clients fold reasoning only between <think> and </think>; not a generated token
    opener: str = ""


class Api:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/health", self.health, methods=["GET", "HEAD"])  # HEAD: health checks such as wget --spider
        router.add_api_route("/v1/models", self.models, methods=["GET", "HEAD"])
        router.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET", "HEAD"])
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        return router

    # --- endpoints -----------------------------------------------------------

    async def health(self) -> JSONResponse:
        queue = {"waiting": self.runtime.queue.waiting, "max_waiting": self.runtime.queue.max_waiting}
        if self.runtime.loading is not None:
            return JSONResponse({"status": "loading", "loading": self.runtime.loading, "queue": queue}, status_code=503)
        engine = self.runtime.engine
        if engine is None:
            return JSONResponse({"status": "no_model", "queue": queue}, status_code=503)
        return JSONResponse({"status": "ok", "model": engine.base.name, "queue": queue})

    async def models(self) -> Response:
        try:
            engine = self._engine()
        except ApiError as error:
            return error.response()
        return JSONResponse({"object": "list", "data": [model_card(engine)]})

    async def model(self, model_id: str) -> Response:
        try:
            engine = self._engine()
            self._check_model(engine, model_id, None)
        except ApiError as error:
            return error.response()
        return JSONResponse(model_card(engine))

    async def chat_completions(self, request: Request) -> Response:
        return await self._create(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._create(request, chat=False)

    # --- one request ---------------------------------------------------------

    async def _create(self, request: Request, chat: bool) -> Response:
        try:
            raw = await read_body(request)
            try:  # a full queue refuses at once, before the body is parsed and tokenized (a client's retries would each do it)
                self.runtime.queue.check_room()
            except ModelBusyError as error:
                raise ApiError(429, str(error), code="queue_full") from error
            # parsing and tokenizing a large body takes seconds: off the event loop, which serves every other client
            generation, prepared = await asyncio.to_thread(self._parse_and_prepare, raw, chat)
            changed = asyncio.Event()
            decoding = self._start(prepared, wake_up(changed))
        except RequestError as error:
            return ApiError(400, str(error), error.param, error.code).response()
        except ApiError as error:
            return error.response()
        outcome = Outcome(prepared.mode, len(prepared.prompt_ids))
        pieces = texts(decoding, changed, request, generation, outcome, prepared.engine.base.tokenizer, prepared.prompt_ids)
        pieces = opened(pieces, prepared.opener)
        reply_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        sampling = prepared.generation.sampling
        shape = Shape(reply_id, int(time.time()), prepared.engine.base.name, chat, prepared.clipped_from,
                      None if sampling.greedy else sampling.seed)  # fmt: skip
        if generation.stream:
            return StreamingResponse(
                stream_events(pieces, shape, outcome, generation.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            text = "".join([piece async for piece in pieces])
        except ApiError as error:
            return error.response()
        return JSONResponse(shape.whole(text, outcome))

    def _parse_and_prepare(self, raw: bytes, chat: bool) -> tuple[Generation, Prepared]:
        body = parse_json(raw)
        generation = parse_chat(body) if chat else parse_completion(body)
        return generation, self._prepare(generation)

    def _engine(self) -> Engine:
        try:
            return self.runtime.require()
        except ModelLoadingError as error:
            raise ApiError(503, str(error), code="model_loading") from error
        except NoModelError as error:
            raise ApiError(503, "no model is loaded; load one in the page's Models tab", code="no_model") from error

    def _check_model(self, engine: Engine, model_id: str, param: str | None) -> None:
        if model_id != engine.base.name:
            raise ApiError(
                404, f"the model {model_id!r} does not exist here; this server runs {engine.base.name!r}", param, "model_not_found"
            )

    def _prepare(self, generation: Generation) -> Prepared:
        engine = self._engine()
        self._check_model(engine, generation.model, "model")
        mode = generation.mode or ("eagle2" if "eagle2" in engine.modes else "vanilla")
        if mode not in engine.modes:
            why = engine.speculation_problem() if engine.head is not None else "no draft head is loaded"
            raise ApiError(400, f"kestrel.mode {mode} is not available: {why}; available: {', '.join(engine.modes)}", "kestrel.mode")
        unused = sorted(generation.tree_sent - {"lookup_tokens"}) if mode == "eagle" else []  # vanilla drafts no tree at all
        if unused:
            raise ApiError(
                400, f"kestrel.{unused[0]} shapes eagle2's dynamic tree; kestrel.mode eagle drafts EAGLE-1's fixed tree, "
                "which only kestrel.lookup_tokens changes", f"kestrel.{unused[0]}",
            )  # fmt: skip
        prompt_ids = self._prompt_ids(engine, generation)
        if not prompt_ids:
            raise ApiError(400, "the prompt reads as no tokens at all; send some text", "messages" if generation.messages is not None else "prompt")
        opener = "" if generation.messages is None else opened_thinking(engine.base.tokenizer, generation.messages, generation.template_options)
        room = engine.context_limit - len(prompt_ids)
        if room < 1:
            where = "messages" if generation.messages is not None else "prompt"
            raise ApiError(
                400, f"the prompt is {len(prompt_ids)} tokens; the model's context window is {engine.context_limit} tokens",
                where, "context_length_exceeded",
            )  # fmt: skip
        asked = generation.max_tokens
        limit = room if asked is None else min(asked, room)
        defaults = {name: value for name, value in model_defaults(engine.model).items() if name not in generation.sampling_sent}
        # a sampled reply without a seed draws one, which the response names (Shape.seed), as the page and chat do
        sampling = replace(generation.sampling, max_new_tokens=limit, **defaults).seeded()
        clipped_from = asked if asked is not None and asked > room and generation.max_tokens_sent else None  # a default is not "requested"
        return Prepared(engine, replace(generation, sampling=sampling), prompt_ids, mode, clipped_from, opener)

    def _prompt_ids(self, engine: Engine, generation: Generation) -> list[int]:
        if generation.messages is not None:
            try:
                return engine.encode(generation.messages, generation.template_options)
            except ChatTemplateError as error:  # the model's own chat template refused the conversation, saying why
                raise ApiError(400, f"messages: {error}", "messages") from error
            except Exception as error:  # the template failed otherwise
                raise ApiError(400, f"messages: the model's chat template refused them ({error})", "messages") from error
        if isinstance(generation.prompt, str):
            return engine.base.tokenizer(generation.prompt)["input_ids"]
        vocabulary = engine.model.get_input_embeddings().weight.shape[0]
        if max(generation.prompt) >= vocabulary:
            raise ApiError(400, f"prompt: token id {max(generation.prompt)} is outside the vocabulary (0-{vocabulary - 1})", "prompt")
        return list(generation.prompt)

    def _start(self, prepared: Prepared, on_change: Callable[[], None]) -> Decoding:
        engine, generation = prepared.engine, prepared.generation

        def steps(cancel):
            current = self.runtime.engine
            if current is not engine:  # the Models tab loaded or unloaded a model while this waited: not on the old one
                now = f"{current.base.name} is loaded now" if current is not None else "no model is loaded now"
                raise ModelChangedError(f"{engine.base.name} was replaced while this request waited for its turn ({now}); send it again")
            return engine.stream(
                prepared.prompt_ids, prepared.mode, generation.sampling, generation.tree, cancel,
                reuse=self.runtime.reuse, continues=generation.messages is None,
            )  # fmt: skip

        try:
            return Decoding(self.runtime.queue, steps, on_change=on_change)
        except ModelBusyError as error:
            raise ApiError(429, str(error), code="queue_full") from error


def wake_up(event: asyncio.Event) -> Callable[[], None]:
    """A callback for the decoding thread that sets `event` on this event loop."""
    loop = asyncio.get_running_loop()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop has closed: nobody is waiting
            pass

    return wake


async def texts(
    decoding: Decoding, changed: asyncio.Event, request: Request, generation: Generation, outcome: Outcome, tokenizer,
    prompt_ids: list[int],
) -> AsyncIterator[str]:
    """The reply's text as the steps commit, cut at a stop string, and "" when
    nothing came for KEEPALIVE_SECONDS. The decoding is cancelled when this
    ends early: a stop string, or the client gone."""
    scanner = StopScanner(generation.stop, tokenizer, prompt_ids if generation.messages is None else ())
    cursor = 0
    said = time.monotonic()  # when something last went out ("" when nothing did for KEEPALIVE_SECONDS)
    try:
        while True:
            try:
                await asyncio.wait_for(changed.wait(), POLL_SECONDS)
            except TimeoutError:
                pass
            changed.clear()
            if await request.is_disconnected():
                outcome.finish_reason = "cancelled"
                return
            if time.monotonic() - said >= KEEPALIVE_SECONDS:
                said = time.monotonic()
                yield ""
            for step in read_steps(decoding, cursor):
                cursor += 1
                outcome.add(step)
                text, kept = scanner.scan(step)
                stopped = kept is not None
                if stopped:
                    outcome.cut(step, kept)
                if stopped or step.finish_reason is not None:
                    text += "" if stopped else scanner.flush()
                    outcome.finish_reason = "stop" if stopped else FINISH.get(step.finish_reason, step.finish_reason)
                    if text:
                        yield text
                    return
                if text:
                    said = time.monotonic()
                    yield text
            if decoding.done_reading(cursor):
                read_steps(decoding, cursor)  # raises the error it ended with, should it have ended after the read above
                outcome.finish_reason = outcome.finish_reason or "cancelled"
                return
    finally:
        decoding.stop()


async def opened(pieces: AsyncIterator[str], opener: str) -> AsyncIterator[str]:
    """`pieces` behind `opener` (Prepared.opener): it goes out with the first
    text, or at the end of a reply that has none."""
    async for text in pieces:
        if text and opener:
            text, opener = opener + text, ""
        yield text
    if opener:
        yield opener


def read_steps(decoding: Decoding, cursor: int) -> list[Step]:
    try:
        return decoding.read(cursor, timeout=0)
    except ModelChangedError as error:
        raise ApiError(503, str(error), code="model_changed") from error
    except ServerStopping as error:  # Ctrl+C on the server
        raise ApiError(503, str(error), code="server_stopping") from error
    except KestrelError as error:
        raise ApiError(500, str(error), code="decoding_failed") from error
    except Exception as error:
        log.exception("decoding failed")
        raise ApiError(500, f"decoding failed: {type(error).__name__}: {error}", code="decoding_failed") from error


@dataclass(frozen=True)
class Shape:
    """The OpenAI response and chunk objects of one reply."""

    reply_id: str
    created: int
    model: str
    chat: bool
    clipped_from: int | None
    seed: int | None = None  # the seed a sampled reply was made with (drawn where none was sent); None when greedy

    def _base(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        body = {"id": self.reply_id, "object": kind, "created": self.created, "model": self.model}
        extra = {}
        if self.clipped_from is not None:
            extra["max_tokens_clipped"] = {"requested": self.clipped_from, "reason": "the context window"}
        if self.seed is not None:  # sent back as `seed`, it makes the same reply again
            extra["seed"] = self.seed
        if extra:
            body["kestrel"] = extra
        return body

    def whole(self, text: str, outcome: Outcome) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=outcome.finish_reason)
        return {**self._base(chunk=False), "choices": [choice], "usage": outcome.usage()}

    def chunk(self, delta: dict | str, finish_reason: str | None = None, include_usage: bool = False) -> str:
        """One SSE event: a chat delta ({"content": ...}) or a completion's text."""
        choice = {"index": 0, "delta": delta} if self.chat else {"index": 0, "text": delta}
        choice.update(logprobs=None, finish_reason=finish_reason)
        body = {**self._base(chunk=True), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return event(body)

    def usage_chunk(self, outcome: Outcome) -> str:
        return event({**self._base(chunk=True), "choices": [], "usage": outcome.usage()})


def event(body: dict, ascii_only: bool = False) -> str:
    """One SSE event; ascii_only for errors, whose message may quote what UTF-8 cannot encode."""
    return f"data: {json.dumps(body, ensure_ascii=ascii_only)}\n\n"


async def stream_events(pieces: AsyncIterator[str], shape: Shape, outcome: Outcome, include_usage: bool) -> AsyncIterator[str]:
    """Server-Sent Events in OpenAI's chunk format, ending with [DONE]."""
    empty = {"role": "assistant", "content": ""} if shape.chat else ""
    yield shape.chunk(empty, include_usage=include_usage)
    try:
        async for text in pieces:
            if not text:  # still waiting: a comment line, which SSE readers skip, keeps the connection alive
                yield ": waiting\n\n"
                continue
            yield shape.chunk({"content": text} if shape.chat else text, include_usage=include_usage)
        yield shape.chunk({} if shape.chat else "", outcome.finish_reason, include_usage)
        if include_usage:
            yield shape.usage_chunk(outcome)
    except ApiError as error:
        yield event(error.body(), ascii_only=True)
    yield "data: [DONE]\n\n"


def model_card(engine: Engine) -> dict:
    base = engine.base
    return {
        "id": base.name,
        "object": "model",
        "created": 0,
        "owned_by": "kestrel",
        "kestrel": {
            "head": engine.head_name,
            "modes": list(engine.modes),
            "context_window": engine.context_limit,
            "device": str(base.device),
            "dtype": str(base.dtype).removeprefix("torch."),
            "quantization": base.quantization,
            "compiled": engine.compiled is not None,
            "cuda_graphs": engine.graphs_in_use,
        },
    }


async def read_body(request: Request) -> bytes:
    """The request body, at most MAX_BODY_BYTES."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {int(declared)} bytes; at most {MAX_BODY_BYTES} are accepted{TEXT_ONLY}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes{TEXT_ONLY}")
            chunks.append(chunk)
    except ClientDisconnect as error:  # a client that hung up while sending: answered (to no one) without a traceback
        raise ApiError(400, f"the client closed the connection after {size} bytes of the request body") from error
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_kind(body)}")
    return body


def reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
