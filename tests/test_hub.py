"""Repo ids without a network: the hub is probed once, then only the cache
is asked (no more connection attempts, so none of huggingface_hub's retries)."""

import shutil
import socket

import pytest
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
