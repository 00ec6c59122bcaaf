"""The HTTP server: the page at / and the OpenAI-compatible API at /v1, on
one port, behind the access rules a local server owes its user.

- Loopback by default; the Host header must name this machine, so that a web
  page cannot reach the server through a rebound DNS name.
- A /v1 request that a browser makes from another site (its Origin header) is
  refused unless that origin was allowed with --allow-origin (or is the page's,
  --page-origin); another origin reads only its refusal, which names the option.
- The page's routes take requests from the page itself only: this machine's
  names at this port, the address reached (with --listen), or an address given
  with --page-origin (behind a proxy).
- With an API key, every /v1 call needs `Authorization: Bearer KEY`."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import uvicorn
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, Response
from gradio.blocks import BlockFunction
from starlette.exceptions import HTTPException

from app import render
from app.api import Api, ApiError
from app.decoding import MAIN_THREAD
from app.runtime import Runtime

LOCALHOST = "127.0.0.1"
ICON = Path(__file__).resolve().parent.parent / "assets" / "kestrel.svg"
# Host names no web page can rebind to its own address: this machine's own. Others (host.docker.internal,
# *.localhost) are looked up by the network's name server where Docker Desktop is not installed, or in some
# browsers: a network that answers for them could serve a page under one and rebind it here, so they are
# only answered when named with --allow-host.
LOCAL_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")  # what --allow-host takes
API_PATHS = ("/v1/", "/health")
# pages whose state (the chat shown, the last values sent to each component: about half a MB each)
# the server keeps, the least recently used dropped first; Gradio's 10,000 kept every reload's for
# days of use. A tab whose state was dropped goes on as after a server restart (the chat it names)
PAGE_SESSIONS_KEPT = 64
MAX_UPLOAD = "64mb"  # a file the page takes (a chat to import, a benchmark's prompts); Gradio's default has no limit
ORIGINS_TOLD = 100  # refused origins named on the terminal, at most (a client that is no browser can send any)
log = logging.getLogger("kestrel")


@dataclass(frozen=True)
class Access:
    host: str = LOCALHOST  # the interface to listen on; 0.0.0.0 with --listen
    auth: tuple[str, str] | None = None  # the page's login (--auth USER:PASS)
    api_key: str | None = None  # required as a Bearer token on /v1 when set
    allow_origins: tuple[str, ...] = ()  # other sites' pages that may call /v1 (CORS)
    allow_hosts: tuple[str, ...] = ()  # other names this computer is reached by (--allow-host host.docker.internal), lower case
    page_origins: tuple[str, ...] = ()  # the page's own addresses behind a proxy (--page-origin https://chat.example), http(s)

    @property
    def loopback(self) -> bool:
        return self.host == LOCALHOST

    def allows(self, origin: str) -> bool:
        """Whether `origin` may call /v1: named with --allow-origin, itself or by its
        scheme (moz-extension://*; null only as itself), or the page's (--page-origin)."""
        if origin in self.allow_origins or origin in self.page_origins:
            return True
        return "://" in origin and origin.split("://", 1)[0] + "://*" in self.allow_origins


def new_api_key() -> str:
    return "kestrel-" + secrets.token_urlsafe(24)


def is_api(path: str) -> bool:
    return path.startswith(API_PATHS) or path == "/v1"


# An origin as a browser sends it (RFC 6454): scheme://host[:port], of any scheme, as extensions'
# (chrome-extension://ID, moz-extension://UUID) and desktop apps' pages (app://obsidian.md, tauri://localhost) have
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://([A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?")
# Every origin of one scheme: a browser's extensions (Firefox gives each install of one its own id), not every web site
ORIGIN_SCHEME = re.compile(r"(?!(?:https?|null)://)[a-z][a-z0-9+.-]*://\*")


def allowable_origin(value: str) -> bool:
    """What --allow-origin takes: an origin, SCHEME://* or null (the origin of
    file:// pages, and of any web site's sandboxed frames: ui.access_from asks for an API key with it)."""
    return value == "null" or ORIGIN.fullmatch(value) is not None or ORIGIN_SCHEME.fullmatch(value) is not None


def origin_refusal(origin: str) -> str:
    """Why a request from the page at `origin` is refused, with the --allow-origin that would allow it."""
    if origin == "null":
        return ("requests from a page without an origin (Origin: null: a file:// page, or a sandboxed frame of any web site) are not allowed; "
                "start Kestrel with --allow-origin null and an --api-key to allow them")  # fmt: skip
    if not allowable_origin(origin):
        return f"requests from the web page at {origin!r} are not allowed, nor can they be: that is no origin (scheme://host[:port])"
    return f"requests from the web page at {origin} are not allowed; start Kestrel with --allow-origin {origin} to allow them"


class Guard:
    """ASGI middleware enforcing `Access` before any route runs."""

    def __init__(self, app, access: Access, port: int, version: str):
        self.app = app
        self.access = access
        self.version = version  # the page's (page_version)
        self.own_origins = {f"http://{name}:{port}" for name in ("127.0.0.1", "localhost", "[::1]")}
        self.told: set[str] = set()  # the refused origins named on the terminal

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        origin = headers.get("origin")
        cross_site = scope["type"] == "http" and is_api(scope["path"]) and origin is not None
        if cross_site:  # an allowed origin reads every answer; any other is refused below, and reads why
            send = with_cors(send, origin)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await refusal(scope, receive, send)
        if scope["type"] == "http" and not is_api(scope["path"]):
            send = with_headers(send, PAGE_POLICY)
        if stale_event(scope, headers, self.version):  # Gradio's page shows `detail` as the event's error
            response = JSONResponse({"detail": STALE_PAGE, "error": STALE_PAGE}, status_code=409)
            response.raw_headers.append(STALE_HEADER)
            return await response(scope, receive, send)
        if cross_site and scope["method"] == "OPTIONS":  # a CORS preflight: a refused origin's passes too, so that
            # the request after it is sent and its refusal read (the page would see only "Failed to fetch")
            return await self._preflight(headers.get("access-control-request-headers", ""))(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, scope, headers: dict) -> Response | None:
        name = host_name(headers.get("host", ""))
        if self.access.loopback and name not in LOCAL_NAMES and name.lower() not in self.access.allow_hosts:
            shown = headers.get("host", "(none)")
            allow = f"; start Kestrel with --allow-host {name.lower()} to answer to it" if HOST_NAME.fullmatch(name.lower()) else ""
            return ApiError(403, f"Host {shown!r} is not this computer; Kestrel answers to 127.0.0.1, localhost and ::1, and to "
                            f"the names given with --allow-host (host.docker.internal from a container in Docker Desktop){allow}").response()  # fmt: skip
        origin = headers.get("origin")
        if not is_api(scope["path"]):  # the page: its own actions only (Gradio's CORS check leaves a header out, refusing
            # nothing, and a form POST needs no preflight: any site's page could upload files here, or run events), and
            # its own reads (Gradio's CORS answers any localhost origin: a page another local server serves could read
            # /config and the queue's data). A link or a navigation to the page sends no Origin
            if origin is not None and not self._own(origin, headers):
                proxied = f"; where that is the page behind a proxy, start Kestrel with --page-origin {origin}" if web_origin(origin) else ""
                return ApiError(403, f"the page's actions come from the page itself, not from the web page at {origin}{proxied}",
                                code="origin_not_allowed").response()  # fmt: skip
            return None  # Gradio checks its login
        if origin is not None and origin not in self.own_origins and not self.access.allows(origin) and scope.get("method") != "OPTIONS":
            message = origin_refusal(origin)
            if origin not in self.told and len(self.told) < ORIGINS_TOLD:  # on the terminal too: the page may show no more than
                self.told.add(origin)  # "Failed to fetch", or nothing
                log.warning("Refused: %s", message)
            return ApiError(403, message, code="origin_not_allowed").response()
        if self.access.api_key is not None and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.access.api_key.encode()):
                return ApiError(
                    401, "a valid API key is required: send the header Authorization: Bearer <key>", code="invalid_api_key"
                ).response()
        return None

    def _own(self, origin: str, headers: dict) -> bool:
        """Whether `origin` is the page's: this machine's names at this port, the
        address the browser reached the server by (with --listen), or one given
        with --page-origin (the page's address behind a proxy that sends its own
        Host). An origin allowed with --allow-origin may call /v1, not act as the page."""
        proxied = origin in self.access.page_origins
        return origin in self.own_origins or origin.split("://", 1)[-1] == headers.get("host") or proxied

    @staticmethod
    def _preflight(requested: str) -> Response:
        """A preflight: no body (a 204 has none). The headers it asks to send
        are allowed as asked: clients add their own (the official JavaScript
        SDK sends X-Stainless-* on every request). An origin not allowed gets
        the same answer, and its request after it only its 403 (Guard._refusal)."""
        names = {name.lower(): name for name in ["Authorization", "Content-Type"]}  # header names are case-insensitive
        for name in requested.split(","):
            if HEADER_NAME.fullmatch(name.strip()):
                names.setdefault(name.strip().lower(), name.strip())
        return Response(status_code=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": ", ".join(names.values()),
            "Access-Control-Max-Age": "600", "Vary": "Access-Control-Request-Headers",
        })  # fmt: skip


def host_name(host: str) -> str:
    """The name part of a Host header, in lower case (names are case-insensitive):
    'LocalHost:7860' -> 'localhost', '[::1]:80' -> '::1'."""
    host = host.lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def web_origin(origin: str) -> bool:
    return origin.startswith(("http://", "https://")) and ORIGIN.fullmatch(origin) is not None


def with_headers(send, added: list[tuple[bytes, bytes]]):
    async def send_with_headers(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *added]}
        await send(message)

    return send_with_headers


HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110's token)


# Headers a page's script may read beyond the safelisted ones: when to retry, and whether to (the SDKs read both)
EXPOSED = b"Retry-After, x-should-retry"


def with_cors(send, origin: str):
    cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"access-control-expose-headers", EXPOSED), (b"vary", b"Origin")]
    return with_headers(send, cors)


# The API's paths without /v1, as a client whose base URL lacks it asks for them.
MISSING_V1 = ("/chat/completions", "/completions", "/models", "/models/{rest:path}")
# The page shows text that a model wrote or a user pasted. Should markup in it
# ever become a tag, it fetches no image from elsewhere (a request that would
# tell another host the chat was read) and sends no form there.
PAGE_POLICY = [(b"content-security-policy", b"img-src 'self' data: blob:; form-action 'self'")]


def build_http_app(demo: gr.Blocks, runtime: Runtime, access: Access, port: int):
    """The ASGI app: the API's routes first, then the page mounted at /."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    api = Api(runtime).router()
    app.include_router(api)

    async def unknown(request: Request) -> Response:
        path = request.url.path
        allowed = allowed_methods(api.routes, path)
        if allowed:
            error = ApiError(405, f"{request.method} is not allowed on {path}; use {' or '.join(allowed)}", code="method_not_allowed")
            response = error.response()
            response.headers["Allow"] = ", ".join(allowed)
            return response
        return ApiError(404, f"no such API endpoint: {request.method} {path}{endpoint_hint(path)}", code="unknown_url").response()

    async def without_v1(request: Request) -> Response:
        path = request.url.path
        return ApiError(
            404, f"no such API endpoint: {request.method} {path}; the API is at /v1{path} (a client's base URL ends in /v1)",
            code="unknown_url",
        ).response()

    every = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    for path in ("/v1", "/v1/{rest:path}", "/health"):
        app.add_api_route(path, unknown, methods=every)
    for path in MISSING_V1:  # a client whose base URL lacks /v1: a hint, not the page's bare 404
        app.add_api_route(path, without_v1, methods=every)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return ApiError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        # no log here: Starlette raises the error again once this answer is sent, and the server logs its traceback
        return ApiError(500, f"internal error: {type(error).__name__}").response()

    demo.queue()
    calm_queue(demo)
    demo.state_session_capacity = PAGE_SESSIONS_KEPT
    version = page_version(demo)
    # run_history: Gradio's own record of every event's inputs and outputs, kept in the browser's storage, would
    # keep a chat's text there after Delete had removed it (and answer its history routes with the user's HF token)
    app = gr.mount_gradio_app(
        app, demo, path="/", server_name=access.host, server_port=port, auth=access.auth, show_error=True,
        css=render.CSS, js=render.page_js(version), favicon_path=str(ICON), max_file_size=MAX_UPLOAD, run_history=False,
    )  # fmt: skip
    return Guard(app, access, port, version)


def endpoint_hint(path: str) -> str:
    """What a client asking for `path` most likely has to change, or ''."""
    if path.startswith("/v1/v1/") or path == "/v1/v1":
        return "; the base URL has /v1 twice: end it in a single /v1 (this client adds the other)"
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        return ("; Kestrel serves no Responses API, only Chat Completions at /v1/chat/completions (and legacy completions at /v1/completions): "
                "set the client to its chat-completions mode")  # fmt: skip
    return ""


def allowed_methods(routes, path: str) -> tuple[str, ...]:
    """The methods the API's routes answer on `path`; () for a path they do not serve."""
    methods = set()
    for route in routes:
        if isinstance(route, APIRoute) and route.path_regex.match(path):
            methods |= route.methods
    return tuple(sorted(methods))


def free_port(host: str, start: int, tries: int = 100) -> int:
    """`start`, or the next port that can be bound on `host`."""
    last = min(start + tries - 1, 65535)
    for port in range(start, last + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            if os.name != "nt":  # as the server binds: a port in TIME_WAIT is free (on Windows the option would
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # let the probe share a port in use)
            try:
                probe.bind((host, port))
            except PermissionError as error:  # not in use: a port below 1024 as a user (Linux, macOS)
                if port < 1024:
                    raise OSError(f"port {port} on {host} cannot be used ({error.strerror}): ports below 1024 need "
                                  "administrator rights; choose --port 1024 or higher") from error  # fmt: skip
                continue
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {start}-{last} on {host}; choose a port outside these with --port")


# The page names each event by its number in the page it was served. A page opened before
# Kestrel restarted with other events (an upgrade) would have the new server run whichever
# handler now has that number, on that page's inputs: the page sends the version it was
# served with (render.STALE_JS), and an event from another version is refused.
PAGE_HEADER = "x-kestrel-page"
STALE_HEADER = (b"x-kestrel-stale", b"1")
STALE_PAGE = "This page is from before Kestrel was restarted as another version: reload the page to go on (saved chats are kept)."


def page_version(demo: gr.Blocks) -> str:
    """What the page's event numbers mean: each event's handler, triggers, inputs,
    outputs and steps, and each component's kind, hashed, components by their
    place in the page (Gradio numbers them across all the pages a process builds).
    The same Kestrel gives the same version at every start; other events, another."""
    places = {component["id"]: place for place, component in enumerate(demo.config["components"])}
    places[demo.config["layout"]["id"]] = "page"  # the page's own events (load, unload)
    events = [event_shape(event, demo.fns[event["id"]], places) for event in demo.config["dependencies"]]
    components = [component.get("type") for component in demo.config["components"]]
    text = json.dumps([events, components], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def event_shape(event: dict, block_fn: BlockFunction, places: dict) -> list:
    """An event as page_version hashes it: components by their place (an id
    without one, were Gradio to add such, as it is)."""

    def place(block_id):
        return places.get(block_id, block_id)

    handler = getattr(block_fn.fn, "__qualname__", None)  # None for a step that runs in the page alone
    steps = [event.get(key) for key in ("backend_fn", "js", "trigger_after", "trigger_only_on_success", "trigger_only_on_failure")]
    targets = [[place(target), name] for target, name in event["targets"]]
    return [event["id"], handler, targets, [place(i) for i in event["inputs"]], [place(i) for i in event["outputs"]], *steps]


def stale_event(scope: dict, headers: dict, version: str) -> bool:
    """Whether this request runs an event of a page served by another version
    (a page that sends no version, such as a script's client, is let through)."""
    sent = headers.get(PAGE_HEADER)
    return scope["type"] == "http" and scope["path"].endswith("/queue/join") and sent is not None and sent != version


# Gradio's queue looks for new page events every 1 ms and for progress every
# 10 ms (off Windows), each time taking the GIL: about 1,000 wake-ups a second
# and 7% of a core here with nothing to do, which the decoding thread pays for.
# A page event then starts within 20 ms instead of 1 ms.
QUEUE_POLL_SECONDS = 0.02
PROGRESS_POLL_SECONDS = 0.1


def calm_queue(demo: gr.Blocks) -> None:
    demo._queue.sleep_when_free = QUEUE_POLL_SECONDS
    demo._queue.progress_update_sleep_when_free = PROGRESS_POLL_SECONDS


class QuietStop(logging.Filter):
    """Once the server is stopping, uvicorn cancels the streams still open
    after GRACE_SECONDS (every open page has one) and logs each as an error
    with its traceback: the expected way to stop, so not printed."""

    def __init__(self, server: uvicorn.Server):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.server.should_exit:
            return True
        cancelled = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
        return not (cancelled or "timeout graceful shutdown exceeded" in record.getMessage())


# How long a stopping server waits for open connections. Every open page and
# Gradio client holds a heartbeat stream that never ends by itself, so this
# is how long quitting takes whenever one is open.
GRACE_SECONDS = 0.5


class Server:
    """Serves the page and the API (on `port`, or the next free one) until
    closed; `start` returns once it is up, `wait` blocks until it stops."""

    def __init__(self, demo: gr.Blocks, runtime: Runtime, access: Access = Access(), port: int = 7860):
        port = free_port(access.host, port)
        self.access, self.port, self.runtime = access, port, runtime
        self.app = build_http_app(demo, runtime, access, port)
        config = uvicorn.Config(
            self.app, host=access.host, port=port, log_level="warning",
            timeout_graceful_shutdown=GRACE_SECONDS, ws="none",
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._quiet = QuietStop(self._server)
        logging.getLogger("uvicorn.error").addFilter(self._quiet)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}/"

    def start(self, timeout: float = 60) -> str:
        self._thread = threading.Thread(target=self._server.run, name="kestrel-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the server did not start on {self.access.host}:{self.port}")
            time.sleep(0.05)
        return self.url

    def wait(self) -> None:
        """Block until the server stops, decoding its requests on this thread
        meanwhile (app/decoding.py); Ctrl+C arrives here as KeyboardInterrupt."""
        MAIN_THREAD.serve(lambda: self._thread is not None and self._thread.is_alive())

    def close(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        logging.getLogger("uvicorn.error").removeFilter(self._quiet)

