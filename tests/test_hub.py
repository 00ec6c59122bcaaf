"""Repo ids without a network: the hub is probed once, then only the cache
is asked (no more connection attempts, so none of huggingface_hub's retries).
A hub that takes connections and never answers, and what the hub or the disk
says to a download, simulated in-process: nothing here reaches the network."""

import re
import shutil
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM

from models import hub
from models.base import load_base
from models.errors import NetworkError
from models.head import resolve_head_folder, save_head
from tests.factory import random_head, tiny_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network: every connection attempt fails as an unknown name and is
    recorded; the hub's cache is an empty folder of this test's own."""
    from huggingface_hub import constants

    attempts = []

    def no_network(address, *args, **kwargs):
        attempts.append(address)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)  # the runner's own proxy would skip the probe
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # as launch.py sets it
    return tmp_path / "hub", attempts


def cache_repo(cache, repo, folder, ref="main", commit=COMMIT):
    """Lay folder's files out as the hub's cache holds a download of repo at `ref` (a branch or tag)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / commit)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return root / "snapshots" / commit


def test_the_probe_reads_a_failed_connection_as_unreachable(offline, monkeypatch):
    assert not hub.reachable()
    for name in ("HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://proxy.invalid:3128")
        assert hub.reachable()  # behind a proxy only the request itself can tell
        monkeypatch.delenv(name)
    monkeypatch.setenv("NO_PROXY", "example.com")
    assert not hub.reachable()


def test_a_cached_head_loads_offline_after_one_probe(offline, tmp_path):
    cache, attempts = offline
    head = random_head(AutoModelForCausalLM.from_config(tiny_config()))
    snapshot = cache_repo(cache, "someone/tiny-head", save_head(head, tmp_path / "head"))
    assert resolve_head_folder("someone/tiny-head") == snapshot
    assert attempts == [("huggingface.co", 443)]


def test_a_head_missing_from_the_cache_fails_at_once_offline(offline):
    cache, attempts = offline
    with pytest.raises(NetworkError, match="someone/absent-head: not in the local cache"):
        resolve_head_folder("someone/absent-head")
    assert attempts == [("huggingface.co", 443)]


def test_a_cached_base_model_loads_offline_after_one_probe(offline, tiny_dir):
    cache, attempts = offline
    cache_repo(cache, "someone/tiny-base", tiny_dir)
    loaded = load_base("someone/tiny-base", dtype="float32")
    assert loaded.name == "someone/tiny-base"
    assert attempts == [("huggingface.co", 443)]
    with pytest.raises(NetworkError, match="someone/absent-base: not in the local cache"):
        load_base("someone/absent-base", dtype="float32")
    assert attempts == [("huggingface.co", 443)] * 2


PINNED = "fedcba9876543210fedcba9876543210fedcba98"


def test_a_pinned_revision_loads_every_file_from_its_own_snapshot_offline(offline, tmp_path, tiny_dir):
    """owner/name@REV (a tag, or a commit hash) reads the base model's config,
    tokenizer, weights and generation config, and the head's files, from REV's
    snapshot. The cache holds no default branch for either repo, so a file asked
    for without the revision is not found (a generation config not found is
    skipped silently: its top_k tells it was read)."""
    import json

    cache, _ = offline
    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    (base / "generation_config.json").write_text(json.dumps({"top_k": 7}))
    cache_repo(cache, "someone/tiny-base", base, ref="v1", commit=PINNED)
    for source in ("someone/tiny-base@v1", f"someone/tiny-base@{PINNED}"):
        loaded = load_base(source, dtype="float32")
        assert loaded.name == source  # what is keyed by the name (cached step costs, the API's model id) tells revisions apart
        assert loaded.model.generation_config.top_k == 7
    with pytest.raises(NetworkError, match="someone/tiny-base: not in the local cache"):  # the default branch, as before
        load_base("someone/tiny-base", dtype="float32")
    head = random_head(AutoModelForCausalLM.from_config(tiny_config()))
    snapshot = cache_repo(cache, "someone/tiny-head", save_head(head, tmp_path / "head"), ref="v1", commit=PINNED)
    assert resolve_head_folder("someone/tiny-head@v1") == resolve_head_folder(f"someone/tiny-head@{PINNED}") == snapshot
    with pytest.raises(NetworkError, match="someone/tiny-head: not in the local cache"):
        resolve_head_folder("someone/tiny-head")


def test_a_name_lookup_that_hangs_counts_as_unreachable_within_the_probe_s_time(offline, monkeypatch):
    """A DNS server that does not answer holds getaddrinfo for 10 s or more, which
    create_connection's timeout does not cover."""
    import threading
    import time

    release = threading.Event()

    def hanging(address, *args, **kwargs):
        release.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "create_connection", hanging)
    monkeypatch.setattr(hub, "PROBE_S", 0.2)
    started = time.monotonic()
    try:
        assert not hub.reachable()
        assert time.monotonic() - started < 5
    finally:
        release.set()


@pytest.fixture
def stalled_hub(monkeypatch, tmp_path):
    """A hub whose host takes connections and never answers (a stalled proxy, a
    captive portal, a link left half open by sleep), as HF_ENDPOINT; the hub's
    cache is an empty folder of this test's own, and huggingface_hub's client
    factory is its default one, as at a start."""
    import threading

    import transformers.utils.hub
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils import _http

    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])  # and never a byte back
            except OSError:  # the server closed at the test's end
                return

    threading.Thread(target=accept, daemon=True).start()
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)  # made again with this endpoint
    factory = _http._GLOBAL_CLIENT_FACTORY
    set_client_factory(_http.default_client_factory)
    yield tmp_path / "hub", constants.ENDPOINT
    set_client_factory(factory)  # closes the client and its connections to this server
    server.close()
    for connection in held:
        connection.close()


def finishes_within(seconds: float, call):
    """call()'s result (or its error, raised), failing the test where it is still waiting after `seconds`."""
    import threading

    outcome = []

    def run():
        try:
            outcome.append(("returned", call()))
        except BaseException as error:  # handed to the test
            outcome.append(("raised", error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    return value


def test_a_hub_that_takes_connections_and_never_answers_counts_as_unreachable(stalled_hub, monkeypatch, tiny_dir):
    """The probe asks for an answer, not a connection alone: a cached model then loads from the cache
    at once, where transformers' first request (model_info, without a timeout) would wait for good."""
    cache, _ = stalled_hub
    monkeypatch.setattr(hub, "PROBE_S", 0.3)
    assert not finishes_within(5, hub.reachable)
    cache_repo(cache, "someone/tiny-base", tiny_dir)
    loaded = finishes_within(60, lambda: load_base("someone/tiny-base", dtype="float32"))
    assert loaded.name == "someone/tiny-base"


def test_every_hub_request_times_out_where_the_hub_stops_answering_after_the_probe(stalled_hub, monkeypatch):
    """model_info asks huggingface_hub's client for no timeout at all (timeout=None), and so did the
    client; Kestrel's bounds each connection and each read (a download streams on)."""
    import httpx2
    from huggingface_hub import HfApi

    _, endpoint = stalled_hub
    monkeypatch.setattr(hub, "READ_S", 0.3)
    hub.bound_requests()
    with pytest.raises(httpx2.ReadTimeout):
        finishes_within(10, lambda: HfApi(endpoint=endpoint).model_info("someone/tiny-base", timeout=None))
    # a timeout asked for (HF_HUB_DOWNLOAD_TIMEOUT, huggingface_hub's longer wait for metadata) is kept, not cut
    request = httpx2.Request("GET", endpoint, extensions={"timeout": {"connect": 60.0, "read": 60.0, "write": None, "pool": None}})
    hub._bound_timeouts(request)
    assert request.extensions["timeout"] == {"connect": 60.0, "read": 60.0, "write": 0.3, "pool": 0.3}


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """The hub, answered in-process through huggingface_hub's own client (its
    client factory, with an httpx MockTransport): repos[id] maps each file name
    to its bytes; answers[id] is the hub's (status, X-Error-Code) for every
    request about that repo. A repo in neither is answered as the hub answers
    one that is private or missing (401 RepoNotFound). The probe is taken as
    answered; the hub's cache is an empty folder of this test's own."""
    import hashlib
    from urllib.parse import unquote

    import httpx2
    import transformers.utils.hub
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils import _http

    repos, answers = {}, {}
    route = re.compile(r"https://huggingface\.co/(?:api/models/)?([^/]+/[^/]+?)(?:/resolve/[^/]+/(.+)|/revision/[^/]+|/tree/[^?]+)?(?:\?.*)?$")

    def answer(request):
        url = str(request.url)
        matched = route.match(url)
        repo = matched.group(1) if matched else ""
        if repo in answers:
            status, code = answers[repo]
            return httpx2.Response(status, headers={"X-Error-Code": code, "X-Error-Message": code})
        if repo not in repos:
            return httpx2.Response(401, headers={"X-Error-Code": "RepoNotFound", "X-Error-Message": "Invalid username or password."})
        files = repos[repo]
        if matched.group(2):
            data = files.get(unquote(matched.group(2)))
            if data is None:
                return httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"', "Content-Length": str(len(data))}
            if request.method == "HEAD":
                return httpx2.Response(200, headers=headers)
            span = re.match(r"bytes=(\d+)-(\d*)", request.headers.get("Range", ""))
            if span:  # the safetensors headers are read by range
                data = data[int(span[1]) : int(span[2]) + 1 if span[2] else None]
                return httpx2.Response(206, headers={**headers, "Content-Length": str(len(data))}, content=data)
            return httpx2.Response(200, headers=headers, content=data)
        if "/tree/" in url:
            return httpx2.Response(200, json=[{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                                              for name, data in files.items()])  # fmt: skip
        return httpx2.Response(200, json={"id": repo, "sha": COMMIT, "siblings": [{"rfilename": name} for name in files]})

    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)  # made again with this endpoint
    monkeypatch.setattr(hub, "reachable", lambda: True)
    factory = _http._GLOBAL_CLIENT_FACTORY
    set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(answer), follow_redirects=True))
    yield repos, answers
    set_client_factory(factory)


def head_files_of(folder):
    return {file.name: file.read_bytes() for file in folder.iterdir() if file.is_file()}


def sharded_head(folder, into):
    """`folder`'s head in two safetensors shards and their index, as a large head is published."""
    import json

    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    keys = sorted(state)
    parts = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2], "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    into.mkdir()
    shutil.copy(folder / "config.json", into / "config.json")
    for name, part in parts.items():
        save_file({key: state[key] for key in part}, str(into / name))
    weight_map = {key: name for name, part in parts.items() for key in part}
    (into / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return into


def test_a_sharded_head_downloaded_online_loads_offline(fake_hub, monkeypatch, tmp_path):
    """Online a sharded head comes by snapshot_download, its index with its shards; offline the
    cache's index is found as the single weights files are."""
    from models.head import read_checkpoint

    repos, _ = fake_hub
    head = random_head(AutoModelForCausalLM.from_config(tiny_config()))
    repos["someone/sharded-head"] = head_files_of(sharded_head(save_head(head, tmp_path / "head"), tmp_path / "shards"))
    online = resolve_head_folder("someone/sharded-head")
    assert (online / "model-00002-of-00002.safetensors").is_file()
    monkeypatch.setattr(hub, "reachable", lambda: False)
    assert resolve_head_folder("someone/sharded-head") == online
    _, state, file = read_checkpoint(online)
    assert file.name == "model.safetensors.index.json" and torch.equal(state["fc.weight"], head.fc.weight)


def test_a_head_download_that_fills_the_disk_says_where_the_cache_is(fake_hub, monkeypatch, tmp_path):
    """Not "the hub cannot be reached": the disk that holds HF_HUB_CACHE, and the space left on it."""
    import errno

    import huggingface_hub.file_download

    from models.errors import CacheWriteError

    repos, _ = fake_hub
    repos["someone/tiny-head"] = head_files_of(save_head(random_head(AutoModelForCausalLM.from_config(tiny_config())), tmp_path / "head"))
    download = huggingface_hub.file_download.http_get

    def fills_the_disk(url, temp_file, **options):
        if url.endswith("model.safetensors"):
            temp_file.write(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")
        return download(url, temp_file, **options)

    monkeypatch.setattr(huggingface_hub.file_download, "http_get", fills_the_disk)
    cache = tmp_path / "hub"
    with pytest.raises(CacheWriteError, match=rf"someone/tiny-head: the disk holding the Hugging Face cache \({cache}\) is full \([\d,]+ MB free\)"):
        resolve_head_folder("someone/tiny-head")


def test_a_head_cache_not_writable_and_a_tls_failure_are_named_as_such(offline, monkeypatch):
    """A cache folder not the user's (made with sudo) is named with the folder; a TLS failure (a proxy
    that inspects HTTPS), which huggingface_hub raises as a file not in the cache, with its own words."""
    import errno

    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from models.errors import CacheWriteError

    cache, _ = offline
    locked = cache / "models--someone--tiny-head"

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(locked))

    def untrusted(*args, **kwargs):
        try:
            raise httpx2.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate in certificate chain")
        except httpx2.ConnectError as error:  # as huggingface_hub raises it when the cache has no copy
            raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub and we cannot find the requested files in the local cache.") from error

    monkeypatch.setattr(hub, "reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", denied)
    with pytest.raises(CacheWriteError, match=rf"someone/tiny-head: permission denied on {locked} \(Permission denied\); the Hugging Face cache \({cache}\) must be yours"):
        resolve_head_folder("someone/tiny-head")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", untrusted)
    with pytest.raises(NetworkError, match=r"someone/tiny-head: the Hugging Face hub cannot be reached \(ConnectError: \[SSL: CERTIFICATE_VERIFY_FAILED\].*inspects HTTPS, set SSL_CERT_FILE"):
        resolve_head_folder("someone/tiny-head")


def test_a_base_model_download_that_fills_the_disk_says_where_the_cache_is(fake_hub, monkeypatch, tiny_dir, tmp_path):
    """Not "cannot read the model files", which would send the user to download them again."""
    import errno

    import huggingface_hub.file_download

    from models.errors import CacheWriteError

    repos, _ = fake_hub
    repos["someone/tiny-base"] = head_files_of(tiny_dir)
    download = huggingface_hub.file_download.http_get

    def fills_the_disk(url, temp_file, **options):
        if url.endswith("model.safetensors"):
            temp_file.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return download(url, temp_file, **options)

    monkeypatch.setattr(huggingface_hub.file_download, "http_get", fills_the_disk)
    cache = tmp_path / "hub"
    with pytest.raises(CacheWriteError, match=rf"someone/tiny-base: the disk holding the Hugging Face cache \({cache}\) is full \([\d,]+ MB free\)"):
        load_base("someone/tiny-base", dtype="float32")


def test_a_repo_of_gguf_files_only_is_named_with_its_files(fake_hub):
    """transformers reads a repo without config.json as a config that names no model type."""
    from models.errors import MissingWeightsError

    repos, _ = fake_hub
    repos["someone/tiny-GGUF"] = {"README.md": b"hi", "tiny-Q8_0.gguf": b"GGUF", "tiny-Q4_K_M.gguf": b"GGUF"}
    with pytest.raises(MissingWeightsError, match=r"someone/tiny-GGUF: the repo holds GGUF files only \(tiny-Q4_K_M.gguf, tiny-Q8_0.gguf\), "
                                                  r"no config.json; download the .gguf file .* give its path \(--model path/to/file.gguf\)"):  # fmt: skip
        load_base("someone/tiny-GGUF", dtype="float32")


def test_a_gated_or_private_head_says_how_to_log_in_as_a_base_model_does(fake_hub):
    from models.errors import ModelNotFoundError

    _, answers = fake_hub
    answers["someone/gated"] = (401, "GatedRepo")
    log_in = "hf auth login, or set HF_TOKEN to an access token"
    for load in (resolve_head_folder, lambda source: load_base(source, dtype="float32")):
        with pytest.raises(NetworkError, match=re.escape(f"someone/gated: this repo is gated; accept its licence on huggingface.co and log in ({log_in})")):
            load("someone/gated")
        with pytest.raises(ModelNotFoundError, match=re.escape(f"someone/private: no such repo on the Hugging Face hub (or it is private, and needs a login that may read it: {log_in})")):
            load("someone/private")
