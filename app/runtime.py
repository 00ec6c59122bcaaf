"""The model the app serves, shared by every browser tab, and the cancel
signals of the requests running on it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

from core.engine import Engine
from models.errors import KestrelError


class NoModelError(KestrelError):
    """No model is loaded (it was unloaded, or a load failed at start)."""


class Runtime:
    """Holds one Engine. A new model is swapped in only once it has loaded,
    so a failed load leaves the previous one usable."""

    def __init__(self, engine_or_loader: Engine | Callable[[], Engine] | None):
        self._engine = engine_or_loader if isinstance(engine_or_loader, Engine) else None
        self._loader = None if isinstance(engine_or_loader, Engine) else engine_or_loader
        self._lock = threading.Lock()
        self._cancels: dict[str, threading.Event] = {}

    @property
    def engine(self) -> Engine | None:
        with self._lock:
            if self._engine is None and self._loader is not None:
                loader, self._loader = self._loader, None
                self._engine = loader()
            return self._engine

    def require(self) -> Engine:
        engine = self.engine
        if engine is None:
            raise NoModelError("no model is loaded; load one in the Models tab")
        return engine

    @property
    def modes(self) -> tuple[str, ...]:
        engine = self.engine
        return engine.modes if engine is not None else ()

    def describe(self) -> str:
        engine = self.engine
        if engine is None:
            return "No model loaded."
        head = "with an EAGLE draft head" if engine.head is not None else "without a draft head (vanilla only)"
        quantization = "" if engine.base.quantization == "none" else f", {engine.base.quantization}"
        return f"{engine.base.name} ({engine.base.device}, {str(engine.base.dtype).removeprefix('torch.')}{quantization}) {head}"

    def replace(self, loader: Callable[[], Engine]) -> Engine:
        """Load with `loader`; on success the new engine replaces the old."""
        engine = loader()
        with self._lock:
            self._engine, self._loader = engine, None
        free_memory()
        return engine

    def unload(self) -> None:
        with self._lock:
            self._engine, self._loader = None, None
        free_memory()

    def cancel_event(self, key: str | None) -> threading.Event:
        """The cancel signal of one browser session (tests pass None)."""
        with self._lock:
            return self._cancels.setdefault(key or "local", threading.Event())


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
