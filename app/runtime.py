"""The model the app serves, shared by every browser tab and API client; the
one queue in front of it; and the cancel signals of the page's requests."""

from __future__ import annotations

import gc
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from core.engine import Engine
from models.errors import KestrelError

log = logging.getLogger("kestrel")


class NoModelError(KestrelError):
    """No model is loaded (it was unloaded, or a load failed at start)."""


class ModelBusyError(KestrelError):
    """The queue in front of the model is full."""


class ModelLoadingError(KestrelError):
    """A model is being loaded; nothing can run until it is."""


class ModelChangedError(KestrelError):
    """The model a request was prepared for was unloaded or replaced while it waited for its turn."""


class TurnCancelled(Exception):
    """The request was cancelled while it waited for its turn."""


class ModelQueue:
    """First come, first served turns on the one model: page and API requests
    alike, so that two generations never run at once on the device. At most
    `max_waiting` requests wait; one more is refused at once."""

    def __init__(self, max_waiting: int = 16):
        if max_waiting < 1:
            raise ValueError(f"the queue must hold at least 1 waiting request, got {max_waiting}")
        self.max_waiting = max_waiting
        self._condition = threading.Condition()
        self._waiting: deque[object] = deque()  # tickets, oldest first
        self._running = False

    @property
    def waiting(self) -> int:
        with self._condition:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether a request holds the model or waits for it."""
        with self._condition:
            return self._running or bool(self._waiting)

    def check_room(self) -> None:
        """ModelBusyError where the queue is full now: a request that would be
        refused need not be read first (`enter` decides)."""
        with self._condition:
            if len(self._waiting) >= self.max_waiting:
                raise ModelBusyError(
                    f"the model is busy: {len(self._waiting)} {'request is' if len(self._waiting) == 1 else 'requests are'} already waiting "
                    f"(at most {self.max_waiting}); try again shortly"
                )

    def enter(self) -> object:
        """A ticket at the back of the queue; ModelBusyError when it is full."""
        with self._condition:
            self.check_room()  # the condition's lock is reentrant
            ticket = object()
            self._waiting.append(ticket)
            return ticket

    def wait(self, ticket: object, cancel: threading.Event | None = None) -> None:
        """Block until `ticket` is first and the model is free, then take the
        model. TurnCancelled (and out of the queue) if `cancel` is set first,
        even when the model is free at once: a Stop pressed before a request's
        turn means that it never runs."""
        with self._condition:
            while True:
                if cancel is not None and cancel.is_set():
                    self._waiting.remove(ticket)
                    self._condition.notify_all()
                    raise TurnCancelled
                if not self._running and self._waiting[0] is ticket:
                    break
                self._condition.wait(1.0)  # woken by leave() or wake(); the timeout is only a backstop
            self._waiting.popleft()
            self._running = True

    def leave(self) -> None:
        with self._condition:
            self._running = False
            self._condition.notify_all()

    def wake(self) -> None:
        """Let waiting requests look at their cancel signals now."""
        with self._condition:
            self._condition.notify_all()

    @contextmanager
    def turn(self, cancel: threading.Event | None = None) -> Iterator[None]:
        """Hold the model for the body of a with-statement."""
        self.wait(self.enter(), cancel)
        try:
            yield
        finally:
            self.leave()


class Runtime:
    """Holds one Engine. A new model is swapped in only once it has loaded,
    so a failed load leaves the previous one usable."""

    def __init__(self, engine_or_loader: Engine | Callable[[], Engine] | None, max_waiting: int = 16, reuse: bool = True):
        """reuse: requests continue the caches of earlier ones where their prompts
        continue them (Engine.stream's `reuse`); off, each reads its prompt afresh."""
        self._engine = engine_or_loader if isinstance(engine_or_loader, Engine) else None
        self._loader = None if isinstance(engine_or_loader, Engine) else engine_or_loader
        self._lock = threading.Lock()
        self._cancels: dict[str, threading.Event] = {}
        self.queue = ModelQueue(max_waiting)
        self.reuse = reuse
        self.loading: str | None = None  # what is being loaded, while a load runs
        self.on_stop: list[Callable[[], None]] = []  # run when the server stops (the chat page saves its replies)

    def stopping(self) -> None:
        """The server is stopping: let every part keep what it holds (each once)."""
        for action in self.on_stop:
            try:
                action()
            except Exception:  # noqa: BLE001 (one part's failure must not keep the others from saving)
                log.exception("saving on stop failed")

    @property
    def engine(self) -> Engine | None:
        with self._lock:
            if self._engine is None and self._loader is not None:
                loader, self._loader = self._loader, None
                self._engine = loader()
            return self._engine

    def require(self) -> Engine:
        if self.loading is not None:
            raise ModelLoadingError(f"{self.loading} is being loaded; try again when it is ready")
        engine = self.engine
        if engine is None:
            raise NoModelError("no model is loaded; load one in the Models tab")
        return engine

    @property
    def modes(self) -> tuple[str, ...]:
        engine = self.engine
        return engine.modes if engine is not None else ()

    @property
    def loaded_modes(self) -> tuple[str, ...]:
        """The modes of the model loaded now, () while none is (nothing is loaded for asking)."""
        with self._lock:
            engine = self._engine
        return engine.modes if engine is not None else ()

    def describe(self) -> str:
        if self.loading is not None:  # the model loaded before serves nothing meanwhile (require)
            return f"Loading {self.loading}..."
        engine = self.engine
        if engine is None:
            return "No model loaded."
        from models.eagle3 import Eagle3Head

        kind = "EAGLE-3" if isinstance(engine.head, Eagle3Head) else "EAGLE"
        head = f"with an {kind} draft head" if engine.head is not None else "without a draft head (vanilla only)"
        if engine.head is not None and (problem := engine.speculation_problem()):
            head = f"with an {kind} draft head, but vanilla only: {problem}"
        elif engine.head is not None and engine.exact:
            head += "; tree passes compute bit for bit as vanilla steps (greedy replies identical)"
        quantization = "" if engine.base.quantization == "none" else f", {engine.base.quantization}"
        compiled = ", compiled" if engine.compiled is not None else ", CUDA graphs" if engine.graphs_in_use else ""
        return f"{engine.base.name} ({engine.base.device}, {str(engine.base.dtype).removeprefix('torch.')}{quantization}{compiled}) {head}"

    def replace(self, loader: Callable[[], Engine], name: str = "a model") -> Engine:
        """Load with `loader`; on success the new engine replaces the old."""
        self.loading = name
        try:
            engine = loader()
        finally:
            self.loading = None
        with self._lock:
            replaced, self._engine, self._loader = self._engine, engine, None
        if replaced is not None and replaced.model is not engine.model:  # a new engine on the same model keeps its compiled code
            replaced.close()
        replaced = None  # before the collection: nothing here holds it
        free_memory()
        return engine

    def unload(self) -> bool:
        """Drop the model (or the one waiting to load); whether there was one."""
        with self._lock:
            held = self._engine is not None or self._loader is not None
            unloaded, self._engine, self._loader = self._engine, None, None
        if unloaded is not None:
            unloaded.close()
        unloaded = None  # before the collection: nothing here holds it
        free_memory()
        return held

    def check_loaded(self, engine: Engine, during: str) -> None:
        """ModelChangedError where the Models tab unloaded or replaced `engine` (in a
        turn of its own) since a request was prepared for it; `during` ends the message."""
        current = self.engine
        if current is not engine:
            now = "unloaded" if current is None else f"replaced by {current.base.name}"
            raise ModelChangedError(f"the model ({engine.base.name}) was {now} {during}")

    def cancel(self, key: str | None) -> None:
        """Stop the request of one browser session, running or waiting."""
        self.cancel_event(key).set()
        self.queue.wake()

    def cancel_event(self, key: str | None) -> threading.Event:
        """The cancel signal of one browser session (tests pass None)."""
        with self._lock:
            return self._cancels.setdefault(key or "local", threading.Event())

    def cancel_kept(self, key: str | None) -> None:
        """As cancel, where `key` has a signal already: a browser tab gone stops
        what it began, without a new signal kept for every tab that began nothing."""
        with self._lock:
            event = self._cancels.get(key or "local")
        if event is not None:
            event.set()
            self.queue.wake()

    def fresh_cancel(self, key: str | None) -> threading.Event:
        """A new, unset cancel signal for the next request under `key`: a
        decoding still ending (its page went away) keeps the one that stopped it."""
        with self._lock:
            self._cancels[key or "local"] = event = threading.Event()
            return event

    def drop_cancel(self, key: str | None, event: threading.Event | None = None) -> None:
        """Let go of `key`'s cancel signal once its request has ended (where it is
        still `event`: a later request's own is kept), so that the signals kept do
        not grow with every chat sent and every tab opened."""
        with self._lock:
            if event is None or self._cancels.get(key or "local") is event:
                self._cancels.pop(key or "local", None)


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
