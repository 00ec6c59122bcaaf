"""Models tab: the catalog with memory estimates, trained heads, load and unload."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import gradio as gr
import pandas as pd
import torch

from app import render
from app.chat import mode_choices
from app.request import model_defaults
from app.runtime import Runtime
from app.session import load_pair, same_base
from core.engine import Engine
from core.training.report import REPORT_FILE
from models import bundled, catalog
from models.base import DTYPES, QUANTIZATIONS, GpuRoom, cpu_has_native_bf16, gpu_fit, resolve_device
from models.errors import HeadFormatError, KestrelError, OutOfMemoryError
from models.paths import user_path

DTYPE_CHOICES = ("auto", *sorted(DTYPES, key=lambda name: name == "float64"))  # the tab's: float64 (slow) last

log = logging.getLogger(__name__)


def detected_memory(device: torch.device | None = None) -> tuple[float | None, str]:
    """(GB, what it is): the memory of the GPU `device` names, else the system
    RAM (device: where models load, resolved; None: as --device auto)."""
    device = resolve_device("auto") if device is None else device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
        return props.total_memory / 1e9, f"GPU {props.name}"
    where = "models load on the CPU" if torch.cuda.is_available() else "no GPU detected"
    total = system_memory_gb()
    if total is None:
        return None, f"unknown memory ({where})"
    return total, f"system RAM ({where})"


def system_memory_gb() -> float | None:
    """The machine's RAM in GB (10^9 bytes, as the catalog's estimates): sysconf on Linux and macOS, GlobalMemoryStatusEx on Windows."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import ctypes

        class MemoryStatus(ctypes.Structure):  # MEMORYSTATUSEX
            _fields_ = [("length", ctypes.c_uint32), ("load", ctypes.c_uint32)] + [
                (name, ctypes.c_ulonglong) for name in ("total", "free", "page", "free_page", "virtual", "free_virtual", "free_extended")
            ]

        status = MemoryStatus(length=ctypes.sizeof(MemoryStatus))
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
            return status.total / 1e9
    except (AttributeError, ImportError, OSError):
        pass
    return None


def cpu_weight_bytes(device: torch.device | None = None) -> int | None:
    """Bytes a weight takes while a model loads on this machine's CPU (the dtype
    auto computes in: bf16 where the CPU has it natively, else float32); None
    where models load on a GPU (device: resolved; None: as --device auto)."""
    if (resolve_device("auto") if device is None else device).type == "cuda":
        return None
    return 2 if cpu_has_native_bf16() else 4


def catalog_frame(available_gb: float | None, load_bytes: int | None = None) -> pd.DataFrame:
    """load_bytes: on a CPU, cpu_weight_bytes(); each size's verdict here then
    weighs loading's peak too (catalog.cpu_load_gb), which exceeds every size
    but 16-bit's on CPUs without native bf16."""
    rows = []
    for entry in catalog.CATALOG:
        smallest = catalog.estimated_gb(entry, 4)
        row = {"model": entry.name, "parameters (B)": entry.parameters,
               f"4-bit on a {catalog.CONSUMER_GPU_NAME} GPU": catalog.fit(smallest, catalog.CONSUMER_GPU_GB)}  # fmt: skip
        peak = catalog.cpu_load_gb(entry, load_bytes) if load_bytes else 0.0
        for label, bits in (("4-bit", 4), ("8-bit", 8), ("16-bit", 16)):
            needed = catalog.estimated_gb(entry, bits)
            row[f"{label} GB"] = f"{needed:.1f} ({catalog.fit(max(needed, peak), available_gb)} here)"
        if load_bytes:
            row["load peak on this CPU GB"] = f"{peak:.1f}"
        row.update({"draft head": entry.head or "bundled", "head format": entry.kind})
        rows.append(row)
    return pd.DataFrame(rows)


def fit_warning(entry: catalog.CatalogEntry, memory: tuple[float | None, str], load_bytes: int | None, quantization: str = "auto") -> str:
    """What the catalog's verdict for `entry` at the size `quantization` loads
    means before a load of minutes (memory: detected_memory(); load_bytes:
    cpu_weight_bytes()); "" where it fits or memory is unknown."""
    available_gb, kind = memory
    bits = loaded_bits(entry, quantization, available_gb, on_gpu=load_bytes is None)
    needed = catalog.estimated_gb(entry, bits)
    peak = catalog.cpu_load_gb(entry, load_bytes) if load_bytes else 0.0
    verdict = catalog.fit(max(needed, peak), available_gb)
    if verdict in ("fits", "unknown"):
        return ""
    how = (f"about {needed:.1f} GB at {bits} bits" + (f", and loading on this CPU peaks at about {peak:.1f} GB" if peak > needed else ""))
    if verdict == "tight":
        return f"{entry.name} needs {how}: it fits the {available_gb:.1f} GB of {kind} only just; close other programs before Load."
    return (f"{entry.name} needs {how}, more than the {available_gb:.1f} GB of {kind}: loading it would run out of memory. "
            "Pick a smaller entry, or load it on a machine where the catalog says it fits.")  # fmt: skip


def loaded_bits(entry: catalog.CatalogEntry, quantization: str, available_gb: float | None, on_gpu: bool) -> int:
    """The bits `entry`'s decoder loads at under `quantization`. auto: on a GPU
    as models/base.py's auto picks (gpu_fit: 16 where the 16-bit weights take at
    most GPU_WEIGHTS_SHARE of its memory or bitsandbytes is missing, else 4);
    on a CPU 4, the smallest it may pick."""
    if quantization == "auto":
        if not on_gpu or available_gb is None:
            return 4
        room = GpuRoom(int(entry.parameters * 1e9), int(available_gb * 1e9))
        return 4 if gpu_fit(torch.bfloat16, room)[0] == "4bit" else 16
    return {"none": 16, "int8": 8, "8bit": 8}.get(quantization, 4)


def trained_heads(heads_dir: Path, base_name: str, base_config) -> list[str]:
    """Head folders (config.json + model.safetensors) under `heads_dir` made
    for this base: its name in the training report, or, without
    a report, matching hidden and vocabulary sizes."""
    found, base_config = [], base_config.get_text_config()  # a vision-language model's text sizes
    for config_file in sorted(heads_dir.glob("*/config.json")):
        folder = config_file.parent
        config, report = read_json(config_file), read_json(folder / REPORT_FILE)
        if config is None or not (folder / "model.safetensors").is_file():
            continue
        if report is not None and "base_model" in report:
            if any(same_base(name, base_name) for name in report_bases(report)):
                found.append(str(folder))
        elif config.get("hidden_size") == base_config.hidden_size and config.get("vocab_size") == base_config.vocab_size:
            found.append(str(folder))
    return found


def trained_base(folder: Path) -> str | None:
    """The base model a head folder's training report says it was trained for; None without one."""
    names = report_bases(read_json(folder / REPORT_FILE) or {})
    return names[0] if names else None


def report_bases(report: dict) -> list[str]:
    """The names a training report gives its base model: its folder's absolute
    path where it was a local one that is still there (the name as typed is
    relative to where the run started), then the name as typed (a repo id, or
    a folder named like one)."""
    folder, name = report.get("base_model_folder"), report.get("base_model")
    names = [folder] if isinstance(folder, str) and folder and Path(folder).exists() else []
    return names + ([name] if isinstance(name, str) and name else [])


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


LOADED = "Loaded."  # the Models tab's notice after a load


TRAINED_LABEL = "Heads you trained for this base"
MODEL_SETTING = "model"  # in settings.json: the choice of the model last loaded in the Models tab, the next start's


def remembered_model(settings: dict) -> dict | None:
    """The choice kept under MODEL_SETTING (model and head: None for the bundled
    ones; quantization, dtype), each value checked; None where none is kept or
    it is not one (a settings file edited by hand or from another version)."""
    choice = settings.get(MODEL_SETTING)
    if not isinstance(choice, dict):
        return None
    model, head = choice.get("model"), choice.get("head")
    quantization, dtype = choice.get("quantization", "auto"), choice.get("dtype", "auto")
    if not all(value is None or (isinstance(value, str) and value.strip()) for value in (model, head)):
        return None
    if quantization not in QUANTIZATIONS or dtype not in DTYPE_CHOICES:
        return None
    return {"model": model, "head": head, "quantization": quantization, "dtype": dtype}


def prepared(engine):
    """`engine` with its step costs read from the cache, or measured once for its model (a few seconds):
    before it replaces the loaded one, so that a failure there keeps that one."""
    engine.prepare_costs()
    return engine


def absolute(source: str | None) -> str | None:
    """A local path as an absolute one (the next start may run from another
    folder, as a desktop shortcut does); a repo id, or None, as it is."""
    path = user_path(source) if source is not None else None
    return str(path.resolve()) if path is not None and path.exists() else source


def base_name(engine: Engine | None) -> str | None:
    return engine.base.name if engine is not None else None


def error_text(error: Exception) -> str:
    """A failed load as the user reads it: Kestrel's errors (and bad values) name what is wrong
    themselves; any other is said with its kind."""
    return str(error) if isinstance(error, (KestrelError, ValueError)) else f"{type(error).__name__}: {error}"


class LibraryHandlers:
    def __init__(self, runtime: Runtime, heads_dir: Path, device: str = "auto", compile: str = "auto",
                 remember: Callable[[dict], None] | None = None):  # fmt: skip
        """device, compile: how models loaded here are placed and compiled (`ui --device/--compile`);
        remember: keeps a loaded model's choice for the next start (`remembered_model`)."""
        self.runtime = runtime
        self.heads_dir = heads_dir
        self.device, self.compile = device, compile
        self.remember = remember

    def status(self) -> str:
        return render.escape(self.runtime.describe())

    def modes(self, current: str, wanted: str | None = None) -> tuple[dict, str | None]:
        """The mode selector for the model loaded now, keeping `current` where it
        still applies (another tab may have loaded a model without a head), and
        the mode this tab wants back once it applies again: the one the user
        picked (`wanted`), else the one a model without it took away.
        Outputs: mode selector, wanted mode."""
        modes = self.runtime.modes or ("vanilla",)
        choices = mode_choices(modes)
        if current == "vanilla" and wanted in modes and wanted != current:  # the head was gone a while, and is back
            return gr.update(choices=choices, value=wanted), wanted
        # a value only where the current one is gone: the tab's select can come as the page loads,
        # with the selector's first value, and must not undo the saved mode that the page-load sets
        if current in modes:
            return gr.update(choices=choices), wanted
        return gr.update(choices=choices, value=modes[-1]), wanted or current

    def heads(self) -> dict:
        engine = self.runtime.engine
        choices = trained_heads(self.heads_dir, engine.base.name, engine.model.config) if engine is not None else []
        return gr.update(choices=choices, value=None, info=self.heads_info if choices else f"none yet: {self.heads_info}")

    @property
    def heads_info(self) -> str:
        """Where the trained-heads list looks."""
        return f"head folders in {self.heads_dir} made for the loaded base model (train-head --out there)"

    def pick(self, name: str, quantization: str = "auto") -> tuple:
        """A catalog row fills the model and head boxes, and the notice warns where
        it does not fit this machine at the chosen quantization. Outputs: model, head, notice."""
        entry = catalog.find(name)
        if entry is None:
            return gr.skip(), gr.skip(), gr.skip()
        return entry.base or "", entry.head or "", self.fit_notice(entry, quantization)

    def refit(self, name: str | None, quantization: str) -> str | dict:
        """The Quantization control changed while the boxes hold a catalog row
        (typing in them clears the row): its notice, weighed at the new choice."""
        entry = catalog.find(name) if name else None
        return gr.skip() if entry is None else self.fit_notice(entry, quantization)

    def fit_notice(self, entry: catalog.CatalogEntry, quantization: str) -> str:
        device = resolve_device(self.device)
        return render.escape(fit_warning(entry, detected_memory(device), cpu_weight_bytes(device), quantization))

    def load(self, model: str, head: str, trained: str | None, quantization: str, dtype: str) -> tuple:
        """Outputs: status, notice, mode selector."""
        model, head = (model or "").strip() or None, (head or "").strip() or None
        # its name only: a reference to the loaded engine held while it is replaced kept its memory (a compiled
        # model is a reference cycle) past the collection that replace runs, to some later one
        loaded_name = base_name(self.runtime.engine)
        if trained:  # the list is of heads for the loaded base: with an empty box, that base
            model = model or loaded_name
            # the base its training report names, else the loaded one (listed for its sizes); the list may
            # be older than the loaded base (another tab loaded one since, or unloaded it)
            names = report_bases(read_json(user_path(trained) / REPORT_FILE) or {}) or ([loaded_name] if loaded_name else [])
            trained_for = names[0] if names else None
            if names and not any(same_base(name, model or bundled.DEFAULT_NAME) for name in names):  # it would draft badly, or not load
                kept = "The previous model is still loaded." if loaded_name is not None else "No model is loaded."
                return self.status(), render.escape(
                    f"Loading failed: the head chosen under '{TRAINED_LABEL}' was made for {trained_for}, not for "
                    f"{model or bundled.DEFAULT_NAME}; put {trained_for} in the base model box, or clear that choice. {kept}"
                ), gr.skip()  # fmt: skip
        head = trained or head
        try:
            with self.runtime.queue.turn():  # after the requests already waiting, before later ones
                engine = self.runtime.replace(lambda: prepared(load_pair(model, head, quantization, dtype, self.device, self.compile)),
                                              model or "the bundled model")  # fmt: skip
        except Exception as error:  # KestrelError and ValueError name what is wrong; any other is said as it is
            if not isinstance(error, (KestrelError, ValueError)):
                log.exception("Loading a model in the Models tab failed")
            return self.status(), self.failed(error), gr.skip()
        notice = LOADED + recommended_sampling(engine)
        if self.remember is not None:
            try:
                self.remember({"model": absolute(model), "head": absolute(head), "quantization": quantization, "dtype": dtype})
            except OSError as error:
                notice += f" (It could not be kept as the model for the next start: {error}.)"
        modes = engine.modes
        mode_update = gr.update(choices=mode_choices(modes), value=modes[-1])
        return self.status(), render.escape(notice), mode_update

    def failed(self, error: Exception) -> str:
        """The notice of a load that failed: what went wrong, and which model is loaded now."""
        text = error_text(error)
        text = text if text.endswith((".", "?", "!")) else f"{text}."
        kept = "The previous model is still loaded." if self.runtime.engine is not None else "No model is loaded."
        if isinstance(error, OutOfMemoryError) and self.runtime.engine is not None:
            kept += " It stays loaded while another loads: Unload it first, then Load."
        which = " (the draft head)" if isinstance(error, HeadFormatError) else ""  # a base and a head may both be folders
        return f"Loading failed{which}: {render.escape(text)} {kept}"

    def load_here(self, model: str, head: str, trained: str | None, quantization: str, dtype: str,
                  progress=gr.Progress(track_tqdm=True)) -> tuple:  # fmt: skip
        """load, and this tab's wanted mode: a model loaded here sets the mode
        itself, so a mode wanted from before (one saved, or a model's without a
        head) is no longer given back. `progress`: the download's and the load's
        bars (huggingface_hub's and transformers' tqdm), shown on the page, not
        only in a terminal a desktop start has none of. Outputs: status, notice,
        mode selector, wanted mode."""
        status, notice, mode_update = self.load(model, head, trained, quantization, dtype)
        return status, notice, mode_update, None if notice.startswith(LOADED) else gr.skip()

    def unload(self) -> tuple:
        """Outputs: status, notice, mode selector."""
        try:
            with self.runtime.queue.turn():
                held = self.runtime.unload()
        except KestrelError as error:
            return self.status(), render.escape(str(error)), gr.skip()
        said = "Unloaded; memory freed." if held else "No model is loaded; there was nothing to unload."
        return self.status(), said, gr.update(choices=mode_choices(["vanilla"]), value="vanilla")


def recommended_sampling(engine: Engine) -> str:
    """Where the model's generation_config.json recommends sampling settings
    (Qwen3's, DeepSeek-R1-Distill's: greedy decoding makes their reasoning
    repeat itself), a sentence naming them for the Settings; "" otherwise.
    The API takes them where a request leaves them out (app/request.model_defaults)."""
    recommended = model_defaults(engine.model)
    if not recommended:
        return ""
    names = {"temperature": "Temperature", "top_p": "Top-p", "top_k": "Top-k"}
    listed = ", ".join(f"{names[name]} {value:g}" for name, value in recommended.items())
    return (f" The model recommends sampling with {listed} (its generation_config.json): set them in the Decoding settings of the Chat tab, "
            "where Temperature 0 decodes greedily, which it may not be made for.")  # fmt: skip
