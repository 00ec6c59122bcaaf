"""Whether the Hugging Face hub can be reached now, and how long its requests
may wait. huggingface_hub retries a failed request five times with backoff
(about 25 s a file) before it looks in its cache, so a machine without a
network would wait that long for every load of a repo id. One quick probe
before the load tells: where the hub cannot be reached, loading asks the
cache alone (`local_files_only`), which answers at once with the files or
with "not in the local cache"."""

from __future__ import annotations

import errno
import urllib.parse
import urllib.request

PROBE_S = 3.0  # how long the hub may take to take a connection, and again to answer the probe, before it counts as unreachable
CONNECT_S = 10.0  # the longest any hub request waits for a connection ...
READ_S = 30.0  # ... and for each read: a download streams on, a hub that stops answering ends in an error


def reachable() -> bool:
    """False where HF_HUB_OFFLINE is set or the hub does not answer a request
    within PROBE_S to connect (the name's lookup included) and PROBE_S more to
    reply; True otherwise, and behind a proxy (which only the request itself
    can test)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    scheme = urllib.parse.urlsplit(constants.ENDPOINT).scheme  # HF_ENDPOINT where set
    proxies = urllib.request.getproxies()
    if proxies.get(scheme) or proxies.get("all"):
        return True
    return _answers(constants.ENDPOINT)


def _answers(url: str) -> bool:
    """Whether the hub at `url` answers a request, with any status: a host that
    takes the connection and never replies (a stalled proxy, a captive portal,
    a link left half open by sleep) is as unreachable as one that refuses it.
    A certificate refused counts as an answer, which the load's own request then
    names (a proxy or antivirus that inspects HTTPS). The name's lookup has no
    timeout of its own (an unanswering DNS server holds it for 10 s or more),
    so the probe runs in a thread that is waited for 2 * PROBE_S at most."""
    import ssl
    import threading

    import httpx2
    from huggingface_hub import get_session

    outcome: list[bool] = []

    def probe() -> None:
        try:
            get_session().head(url, timeout=PROBE_S)  # huggingface_hub's own client: its proxies and certificates
            outcome.append(True)
        except httpx2.InvalidURL:  # a malformed HF_ENDPOINT: the load's own request names it
            outcome.append(True)
        except httpx2.HTTPError as error:  # no such name (no network, no DNS), refused, timed out, closed unanswered
            outcome.append(any(isinstance(link, ssl.SSLCertVerificationError) for link in error_chain(error)))

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(2 * PROBE_S)
    return bool(outcome and outcome[0])


def bound_requests() -> None:
    """Have every request of huggingface_hub time out: its client waits forever
    by default (and model_info, which transformers asks before each load, asks
    for no timeout), so a hub that stops answering after the probe would hold
    the load, and the model queue behind it, for good. A client factory that
    someone else set (a program embedding Kestrel, a test's fake hub) is kept."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http  # huggingface_hub's default factory has no public name

    if _http._GLOBAL_CLIENT_FACTORY is _http.default_client_factory:
        set_client_factory(_bounded_client)


def _bounded_client():
    """huggingface_hub's default client (its offline check, request ids), its timeouts bounded."""
    from huggingface_hub.utils import _http

    client = _http.default_client_factory()
    client.event_hooks = {**client.event_hooks, "request": [*client.event_hooks["request"], _bound_timeouts]}
    return client


def _bound_timeouts(request) -> None:
    """Give each of the request's phases that has no timeout (None: it would wait
    for good) CONNECT_S to connect and READ_S to read, write or wait for a pooled
    connection; a timeout asked for (HF_HUB_DOWNLOAD_TIMEOUT, huggingface_hub's
    own longer wait for a file's metadata) is kept. httpx's read timeout is per
    read, so a large download streams for as long as it moves."""
    bounds = {"connect": CONNECT_S, "read": READ_S, "write": READ_S, "pool": READ_S}
    given = request.extensions.get("timeout", {})
    request.extensions["timeout"] = {phase: bound if given.get(phase) is None else given[phase] for phase, bound in bounds.items()}


HTTP_CLIENTS = ("httpx", "httpx2", "requests", "urllib3")  # the packages whose errors mean the request itself failed
ANSWERED = ("HTTPStatusError", "HTTPError")  # theirs for a status the server did send (404, 401, ...)


def error_chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def network_cause(error: BaseException) -> BaseException | None:
    """The HTTP client's own error in `error`'s chain where the request itself
    failed (a proxy that refuses, a TLS failure, a dropped connection:
    huggingface_hub lets some through as they are, and transformers wraps them
    in an OSError about local folders); None where there is none, and where the
    hub answered (a repo not found, a gated one: huggingface_hub's own errors
    name those)."""
    from huggingface_hub.errors import HfHubHTTPError

    chain = error_chain(error)
    if any(isinstance(link, HfHubHTTPError) for link in chain):
        return None
    for link in chain:
        if type(link).__module__.split(".")[0] in HTTP_CLIENTS and type(link).__name__ not in ANSWERED:
            return link
    return None


def no_folder(source: str) -> str:
    """", nor a folder ... here" for a repo id that could be a mistyped relative
    path (heads/typo): the likelier mistake, which the hub's answer does not name."""
    from pathlib import Path

    return "" if Path(source).exists() else f", nor a folder {Path(source).absolute()} here"


def answered_message(source: str, error: BaseException) -> str | None:
    """What the hub answered, where it refused the request otherwise than by
    naming the repo missing or gated: a login it does not take (a revoked or
    expired token, 401/403), or an error of its own; None where it did not answer."""
    from huggingface_hub.errors import HfHubHTTPError

    answer = next((link for link in error_chain(error) if isinstance(link, HfHubHTTPError)), None)
    status = getattr(getattr(answer, "response", None), "status_code", None)
    if status in (401, 403):
        return (f"{source}: the Hugging Face hub refused the saved login (HTTP {status}); log in again (hf auth login) "
                "or unset HF_TOKEN, which public repos do not need")  # fmt: skip
    if status is not None:
        first_line = (str(answer).splitlines() or [""])[0]
        return f"{source}: the Hugging Face hub answered HTTP {status} ({first_line}); try again later"
    return None


def unreachable_message(source: str, cause: BaseException) -> str:
    first_line = (str(cause).splitlines() or [""])[0]
    said = f"{source}: the Hugging Face hub cannot be reached ({type(cause).__name__}: {first_line}); "
    if "certificate" in first_line.lower():  # mostly a proxy or antivirus that inspects HTTPS with its own certificate
        return (said + "the certificate presented for the hub is not trusted here: where a proxy or antivirus inspects HTTPS, "
                "set SSL_CERT_FILE to a file holding its certificate (whoever runs the network has it), or set "
                "HF_HUB_OFFLINE=1 to load from the local cache alone")  # fmt: skip
    return said + "check the network and proxy settings (HTTPS_PROXY), or set HF_HUB_OFFLINE=1 to load from the local cache alone"


LOG_IN = "hf auth login, or set HF_TOKEN to an access token"  # the two ways huggingface_hub takes a login


def gated_message(source: str) -> str:
    return f"{source}: this repo is gated; accept its licence on huggingface.co and log in ({LOG_IN})"


def missing_message(source: str) -> str:
    """The hub's 401/404 for a repo, which does not tell a missing repo from a private one."""
    return f"{source}: no such repo on the Hugging Face hub (or it is private, and needs a login that may read it: {LOG_IN}){no_folder(source)}"


def disk_full_message(source: str, error: BaseException) -> str | None:
    """Where `error`'s chain says a disk is full (ENOSPC), that the Hugging Face
    cache's is, with the space left on it; None otherwise."""
    import shutil
    from pathlib import Path

    from huggingface_hub import constants

    if not any(isinstance(link, OSError) and link.errno == errno.ENOSPC for link in error_chain(error)):
        return None
    cache = Path(constants.HF_HUB_CACHE)
    free = shutil.disk_usage(next(folder for folder in (cache, *cache.parents) if folder.exists())).free
    return (f"{source}: the disk holding the Hugging Face cache ({cache}) is full ({free / 1e6:,.0f} MB free); "
            "free some space, or set HF_HUB_CACHE (or HF_HOME) to a folder on a disk with room")  # fmt: skip


def cache_write_message(source: str, error: BaseException) -> str | None:
    """What kept a download out of the Hugging Face cache where `error`'s chain
    says it: a full disk, or a folder that cannot be used (permission denied);
    None otherwise."""
    from huggingface_hub import constants

    full = disk_full_message(source, error)
    if full is not None:
        return full
    denied = next((link for link in error_chain(error) if isinstance(link, PermissionError)), None)
    if denied is None:
        return None
    return (f"{source}: permission denied on {denied.filename or constants.HF_HUB_CACHE} ({denied.strerror}); the Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}) must be yours to read and write (one made by another user, or with sudo, is "
            "not), or set HF_HUB_CACHE (or HF_HOME) to a folder of your own")  # fmt: skip
