"""One request decoding on its own thread, in its turn in the model queue.

The page and the HTTP API read the steps made so far whenever they are ready
for them; the decoding never waits for a reader (a browser rendering, a slow
client), and a reader that goes away cancels it within one step."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from app.runtime import ModelQueue, TurnCancelled
from core.engine import Step


class Decoding:
    def __init__(
        self,
        queue: ModelQueue,
        steps: Callable[[threading.Event], Iterator[Step]],
        cancel: threading.Event | None = None,
        on_change: Callable[[], None] | None = None,
    ):
        """Queue `steps(cancel)` (ModelBusyError at once if the queue is full)
        and start it; `on_change` is called from the decoding thread after
        each step and at the end."""
        self.cancel = cancel or threading.Event()
        self._steps: list[Step] = []
        self._error: BaseException | None = None
        self._finished = False
        self._condition = threading.Condition()
        self._on_change = on_change
        self._queue = queue
        self._ticket = queue.enter()
        self._thread = threading.Thread(target=self._run, args=(steps,), name="kestrel-decoding", daemon=True)
        self._thread.start()

    def _run(self, steps: Callable[[threading.Event], Iterator[Step]]) -> None:
        try:
            self._queue.wait(self._ticket, self.cancel)
            try:
                for step in steps(self.cancel):
                    with self._condition:
                        self._steps.append(step)
                        self._condition.notify_all()
                    if self._on_change is not None:
                        self._on_change()
            finally:
                self._queue.leave()
        except TurnCancelled:
            pass
        except BaseException as error:  # handed to the reader, which reports it
            self._error = error
        with self._condition:
            self._finished = True
            self._condition.notify_all()
        if self._on_change is not None:
            self._on_change()

    @property
    def finished(self) -> bool:
        with self._condition:
            return self._finished

    def read(self, cursor: int, timeout: float | None = None) -> list[Step]:
        """The steps after the first `cursor`, waiting up to `timeout` seconds
        for one (None: until one comes or the decoding ends). Once it has
        ended and every step is read, raises the error it ended with, if any."""
        with self._condition:
            self._condition.wait_for(lambda: len(self._steps) > cursor or self._finished, timeout)
            new = self._steps[cursor:]
            if not new and self._finished and self._error is not None:
                raise self._error
            return new

    def done_reading(self, cursor: int) -> bool:
        """True once the decoding has ended and `cursor` steps are all there are."""
        with self._condition:
            return self._finished and cursor >= len(self._steps)

    def stop(self) -> None:
        """Cancel: the decoding ends within one step (or leaves the queue)."""
        self.cancel.set()
        self._queue.wake()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
