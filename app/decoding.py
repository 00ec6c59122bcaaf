"""One request decoding in its turn in the model queue, off the reader's thread.

The page and the HTTP API read the steps made so far whenever they are ready
for them; the decoding never waits for a reader (a browser rendering, a slow
client), and a reader that goes away cancels it within one step.

Where the process's main thread serves decodings (`launch.py ui`: the web
server runs on its own thread), each decoding runs there once its turn
comes; elsewhere on a thread of its own. Measured on the 2-core machine with
the compiled layers and 2 threads, through the live server (4 alternating
rounds against the `chat` command, 200 greedy tokens): the API's tokens/s
were 0.84-0.93x the command's with decodings on their own threads and
0.99-1.04x on the main thread, streamed or not."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator

from app.runtime import ModelQueue, TurnCancelled
from core.engine import Reading, Step
from models.errors import KestrelError


class ServerStopping(KestrelError):
    """A decoding cut short because the server is stopping."""


class MainThread:
    """Runs decodings on the thread that calls `serve` (the main thread),
    one at a time; `run` runs a job inline when nothing serves."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._serving = False
        self._stopped = False  # serving has ended (Ctrl+C): decodings still waiting for the model no longer start

    def run(self, job: Callable[[], None]) -> None:
        """Run `job` on the serving thread and wait for it; its exception is raised here.
        ServerStopping once serving has ended."""
        done, failure = threading.Event(), []
        with self._lock:
            serving, stopped = self._serving, self._stopped
            if serving:
                self._jobs.put((job, done, failure))
        if stopped:
            raise ServerStopping("the server is stopping")
        if not serving:
            job()
            return
        done.wait()
        if failure:
            raise failure[0]

    def serve(self, alive: Callable[[], bool]) -> None:
        """Run the jobs that come while alive(); Ctrl+C stops serving (the job it
        interrupts ends with it). Jobs left then are failed, not lost in the queue,
        and so are those that come later (requests that waited for the model)."""
        with self._lock:
            self._serving = True
        try:
            while alive():
                try:
                    job, done, failure = self._jobs.get(timeout=0.5)
                except queue.Empty:
                    continue
                try:
                    job()
                except Exception as error:  # handed to the job's decoding, which reports it
                    failure.append(error)
                except BaseException:  # Ctrl+C: the decoding it interrupts ends, and serving stops
                    failure.append(ServerStopping("the server is stopping"))
                    raise
                finally:
                    done.set()
        finally:
            with self._lock:
                self._serving, self._stopped = False, True
            while True:
                try:
                    _, done, failure = self._jobs.get_nowait()
                except queue.Empty:
                    break
                failure.append(ServerStopping("the server is stopping"))
                done.set()


def forget_locals(error: BaseException) -> None:
    """Clear the variables of the finished frames in `error`'s traceback and
    its causes'. Kept with the error until a reader reports it, they held the
    model and the failed run's caches, in a reference cycle that only a garbage
    collection ends: memory an Unload or an out-of-memory error meant to free."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


MAIN_THREAD = MainThread()
LIVE: weakref.WeakSet[Decoding] = weakref.WeakSet()  # decodings whose threads may still run
EXIT_WAIT_S = 10.0


@atexit.register
def _end_decodings_at_exit() -> None:
    """Cancel the decodings still running when the process exits and wait for
    them (each ends within one step). A decoding thread left inside a torch
    call while Python shuts down is unwound through C++ code that cannot be,
    and the process aborts (SIGABRT) instead of exiting."""
    decodings = list(LIVE)
    for decoding in decodings:
        decoding.stop()
    deadline = time.monotonic() + EXIT_WAIT_S
    for decoding in decodings:
        decoding.join(max(0.0, deadline - time.monotonic()))


class Decoding:
    def __init__(
        self,
        queue: ModelQueue,
        steps: Callable[[threading.Event], Iterator[Step | Reading]],
        cancel: threading.Event | None = None,
        on_change: Callable[[], None] | None = None,
    ):
        """Queue `steps(cancel)` (ModelBusyError at once if the queue is full)
        and start it; `on_change` is called from the thread that decodes after
        each step and at the end."""
        self.cancel = cancel or threading.Event()
        self._steps: list[Step | Reading] = []
        self._error: BaseException | None = None
        self._finished = False
        self._condition = threading.Condition()
        self._on_change = on_change
        self._queue = queue
        self._ticket = queue.enter()
        self._thread = threading.Thread(target=self._run, args=(steps,), name="kestrel-decoding", daemon=True)
        LIVE.add(self)
        self._thread.start()

    def _run(self, steps: Callable[[threading.Event], Iterator[Step | Reading]]) -> None:
        try:
            self._queue.wait(self._ticket, self.cancel)
            try:
                MAIN_THREAD.run(lambda: self._decode(steps))  # one decoding holds the turn: the main thread is free
            finally:
                self._queue.leave()
        except TurnCancelled:
            pass
        except BaseException as error:  # handed to the reader, which reports it
            self._error = error
            forget_locals(error)
        steps = None  # this frame stays in the error's traceback: not the model and the request through it
        with self._condition:
            self._finished = True
            self._condition.notify_all()
        LIVE.discard(self)
        if self._on_change is not None:
            self._on_change()

    def _decode(self, steps: Callable[[threading.Event], Iterator[Step | Reading]]) -> None:
        stream = steps(self.cancel)
        try:
            for step in stream:
                with self._condition:
                    self._steps.append(step)
                    self._condition.notify_all()
                if self._on_change is not None:
                    self._on_change()
        finally:  # closed here, in the model's turn: an error kept with its frames would otherwise close it later, anywhere
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    @property
    def finished(self) -> bool:
        with self._condition:
            return self._finished

    def read(self, cursor: int, timeout: float | None = None) -> list[Step | Reading]:
        """The steps after the first `cursor`, waiting up to `timeout` seconds
        for one (None: until one comes or the decoding ends). Once it has
        ended and every step is read, raises the error it ended with, if any,
        once: the reader's frames join its traceback, and kept here too it would
        hold them (and what they hold) in a cycle; reads after that find the end."""
        with self._condition:
            self._condition.wait_for(lambda: len(self._steps) > cursor or self._finished, timeout)
            new = self._steps[cursor:]
            if not new and self._finished and self._error is not None:
                error, self._error = self._error, None
                try:
                    raise error
                finally:
                    del error  # this frame joins its traceback: not the error through it
            return new

    def done_reading(self, cursor: int) -> bool:
        """True once the decoding has ended and `cursor` steps are all there are."""
        with self._condition:
            return self._finished and cursor >= len(self._steps)

    def stop(self) -> None:
        """Cancel: the decoding ends within one step (or leaves the queue). Once
        its final step is made there is nothing to cancel, and `cancel` is left
        alone: a browser session's decodings share it, so setting it would cancel
        the next one (its thread may still be leaving the queue here)."""
        with self._condition:
            if self._steps and getattr(self._steps[-1], "finish_reason", None) is not None:  # a Reading has none
                return
        self.cancel.set()
        self._queue.wake()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
