"""Whether the Hugging Face hub can be reached now. huggingface_hub retries a
failed request five times with backoff (about 25 s a file) before it looks in
its cache, so a machine without a network would wait that long for every
load of a repo id. One quick probe before the load tells: where the hub
cannot be reached, loading asks the cache alone (`local_files_only`), which
answers at once with the files or with "not in the local cache"."""

from __future__ import annotations

import socket
import urllib.parse
import urllib.request

PROBE_S = 3.0  # how long a connection to the hub may take before it counts as unreachable


def reachable() -> bool:
    """False where HF_HUB_OFFLINE is set or the hub's host does not resolve or
    accept a connection within PROBE_S; True otherwise, and behind a proxy
    (which only the request itself can test)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)  # HF_ENDPOINT where set
    proxies = urllib.request.getproxies()
    if proxies.get(endpoint.scheme) or proxies.get("all"):
        return True
    try:
        host = endpoint.hostname or ""
        port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    except ValueError:  # a port out of range: the request itself names the problem
        return True
    return _connects(host, port)


def _connects(host: str, port: int) -> bool:
    """Whether (host, port) takes a connection within PROBE_S, the name's lookup included:
    the lookup has no timeout of its own (an unanswering DNS server holds it for 10 s or
    more), so the probe runs in a thread that is waited for PROBE_S at most."""
    import threading

    outcome: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_S).close()
            outcome.append(True)
        except OSError:  # no such name (no network, no DNS), refused, or timed out
            outcome.append(False)

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(PROBE_S)
    return bool(outcome and outcome[0])


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
    return (f"{source}: the Hugging Face hub cannot be reached ({type(cause).__name__}: {first_line}); check the "
            "network and proxy settings (HTTPS_PROXY), or set HF_HUB_OFFLINE=1 to load from the local cache alone")  # fmt: skip
