"""Loading a base model with its draft head into an Engine."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from core.engine import Engine
from models import bundled
from models.base import load_base
from models.head import load_head

BUNDLED_HEAD = bundled.BUNDLED_HEAD


def default_head(model: str | None) -> Path | None:
    """The bundled head when the base model is the bundled default."""
    if model in (None, bundled.DEFAULT_NAME) and (BUNDLED_HEAD / "config.json").is_file():
        return BUNDLED_HEAD
    return None


def check_source(model: str | None) -> None:
    """A base model that is neither a file or folder here nor a repo id is
    refused as such, before what it would lack (a draft head) is said."""
    from models.base import pinned_repo
    from models.paths import user_path

    if model is not None and model != bundled.DEFAULT_NAME and not user_path(model).exists():
        pinned_repo(model)


def load_pair(
    model: str | None = None,
    head: str | None = None,
    quantization: str = "none",
    dtype: str = "auto",
    device: str = "auto",
    compile: str = "off",
    with_head: bool = True,
) -> Engine:
    """with_head False: the base model alone (vanilla decoding), no head loaded or compiled.
    A head that is missing or not a head is said before the base model loads (a large one takes minutes)."""
    from models.head import check_fits_sizes, resolve_head_folder

    head_source = (head or default_head(model)) if with_head else None
    if head_source is not None:
        head_source = resolve_head_folder(str(head_source))
        with made_for(head_source, model):
            check_fits_sizes(head_source, *folder_sizes(model))  # its files read (head_files), and its sizes and layers
    base = load_base(model, quantization, dtype, device)
    draft_head = None if head_source is None else load_draft_head(base, head_source)
    return Engine(base, draft_head, head or "bundled", compile)


@contextlib.contextmanager
def made_for(head_folder: Path, model: str | None):
    """A head whose sizes do not fit the base model, and which names the one
    it was made for (a speculators-library head's verifier): the error says which."""
    from models.eagle3 import verifier_of
    from models.errors import HeadMismatchError

    try:
        yield
    except HeadMismatchError as error:
        try:
            named = verifier_of(json.loads((head_folder / "config.json").read_text(encoding="utf-8")))
        except (OSError, ValueError):
            named = None
        model = model or bundled.DEFAULT_NAME
        if named is None or same_base(named, model) or (model == bundled.DEFAULT_NAME and named.endswith(f"/{model}")):
            raise  # made for the model given (the bundled one is its repo's conversion): the error as it is
        raise HeadMismatchError(f"{error} (the head was made for {named}: give that as the base model)") from error


def same_base(trained_for: str, loaded: str) -> bool:
    """Whether two base-model names (repo ids, or paths as typed) name one model:
    `tiny`, `./tiny/` and its absolute path are the same folder."""
    from models.errors import KestrelError
    from models.paths import user_path

    if trained_for == loaded:
        return True
    try:
        first, second = user_path(str(trained_for)), user_path(str(loaded))
        return first.exists() and second.exists() and first.resolve() == second.resolve()
    except (OSError, ValueError, KestrelError):  # KestrelError: a ~user that is no user here
        return False


SIZES = ("hidden_size", "vocab_size", "num_hidden_layers")  # what folder_sizes reads


def folder_sizes(model: str | None) -> tuple[int | None, int | None, int | None]:
    """(hidden size, vocabulary, decoder layers) from the base model's
    config.json, read before its weights: a local folder's, or a repo id's
    already in the Hugging Face cache (read there, without the network); None
    for what it does not say, and for a GGUF file, the bundled model or a repo
    id not in the cache."""
    try:
        file = config_file(model) if model else None
        settings = json.loads(file.read_text(encoding="utf-8")) if file is not None else None
    except (OSError, ValueError):
        settings = None
    if not isinstance(settings, dict):
        return None, None, None
    sizes = [settings.get(name) for name in SIZES]
    return tuple(size if isinstance(size, int) and not isinstance(size, bool) else None for size in sizes)


def config_file(model: str) -> Path | None:
    """A local folder's config.json, or a repo id's in the Hugging Face cache (at its @revision); None otherwise."""
    from huggingface_hub import try_to_load_from_cache

    from models.paths import user_path
    from models.repo import parse_repo

    path = user_path(model)
    if path.is_dir():
        return path / "config.json"
    repo = parse_repo(model)
    cached = try_to_load_from_cache(repo.id, "config.json", revision=repo.revision) if repo is not None and not path.exists() else None
    return Path(cached) if isinstance(cached, str) else None


def load_draft_head(base, source, dtype=None):
    """The head at `source` (any kind), checked against `base` and placed on its
    device, in `dtype` (default: the base model's)."""
    from models.head import resolve_head_folder

    config = base.model.config.get_text_config()  # a vision-language model keeps its text model's sizes apart
    vocab = base.model.get_output_embeddings().weight.shape[0]
    folder = resolve_head_folder(str(source))
    with made_for(folder, base.name):
        return load_head(folder, config.hidden_size, vocab, base.device, dtype or base.dtype, config.num_hidden_layers)


def prepare_costs(engine: Engine, remeasure: bool = False) -> None:
    """Read this device's step costs from the cache, or measure them with a
    progress line in the terminal (a few seconds, once per device, model,
    dtype and thread count): the planner sizes draft trees by them."""

    terminal = sys.stderr.isatty()

    def show(done: int, total: int, description: str) -> None:  # on stderr: `chat ... > reply.txt` keeps the reply alone
        if terminal:
            end = "" if done < total else "\n"
            print(f"\rMeasuring this device's step costs (once): [{done}/{total}] {description:<28}", end=end, file=sys.stderr, flush=True)
        elif done in (0, total):  # a log gets the start and the end, not every update
            print(f"Measuring this device's step costs (once): {'done' if done else f'{total} measurements'}", file=sys.stderr, flush=True)

    engine.prepare_costs(show, remeasure)
