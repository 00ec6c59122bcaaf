"""One streamed reply: the engine's Step events folded into text coloured by
origin, statistics and a tokens/s curve. Shared by the Chat and Compare tabs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from app.decoding import Decoding
from app.render import BASE, DRAFT, add_segment, split_step
from app.runtime import ModelQueue
from core.config import SamplingParams, TreeParams
from core.engine import Engine, Reading, Step
from core.prompt import thinks
from core.stats import Snapshot

RATE_INTERVAL = 0.25  # seconds between points of the tokens/s curve


@dataclass
class Reply:
    segments: list[list[str]] = field(default_factory=list)  # [text, origin] runs
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    snapshot: Snapshot | None = None
    tree_size: int = 0  # nodes verified in the latest step
    rate_points: list[tuple[float, float]] = field(default_factory=list)  # (seconds, tokens/s over the interval)
    finish_reason: str | None = None
    last_sample: tuple[float, int] = (0.0, 0)  # (seconds, tokens) at the latest curve point
    reading: Reading | None = None  # how far a long prompt is read, until its first token
    reasoning: bool = False  # made by a reasoning model (core/prompt.thinks): the page folds its <think> part

    @property
    def reading_text(self) -> str:
        """"Reading the conversation: 40% of 6,020 tokens..." while a long prompt is read, else ""."""
        if self.reading is None:
            return ""
        share = self.reading.done / self.reading.total
        return f"Reading the conversation: {share:.0%} of {self.reading.total:,} tokens..."

    def add(self, step: Step | Reading) -> None:
        if isinstance(step, Reading):
            self.reading = step
            return
        self.reading = None
        for text, origin in split_step(step.text, step.accepted_text):
            add_segment(self.segments, text, origin)
        self.text += step.text
        self.token_ids.extend(step.token_ids)
        self.snapshot = step.stats
        self.tree_size = step.tree_size or self.tree_size
        self.finish_reason = step.finish_reason
        self._sample_rate(step.stats)

    def _sample_rate(self, snapshot: Snapshot) -> None:
        """A point at the first token (the prompt's reading in its interval), then every RATE_INTERVAL and at
        the end: a reply shorter than the interval still draws a line, from its first token to its last."""
        last_seconds, last_tokens = self.last_sample
        first = not self.rate_points and snapshot.tokens > 0
        if first or snapshot.seconds - last_seconds >= RATE_INTERVAL or self.finish_reason is not None:
            elapsed = snapshot.seconds - last_seconds
            if elapsed > 0:
                self.rate_points.append((round(snapshot.seconds, 3), (snapshot.tokens - last_tokens) / elapsed))
            self.last_sample = (snapshot.seconds, snapshot.tokens)

    @property
    def drafted_share(self) -> float:
        drafted = sum(len(text) for text, origin in self.segments if origin == DRAFT)
        total = sum(len(text) for text, origin in self.segments if origin in (DRAFT, BASE))
        return drafted / total if total else 0.0


def follow_reply(
    queue: ModelQueue,
    engine: Engine,
    messages: list[dict],
    mode: str,
    sampling: SamplingParams,
    tree: TreeParams,
    cancel: threading.Event | None,
    interval: float = 0.0,
    reuse: bool = False,
    check: Callable[[], None] | None = None,
) -> Iterator[Reply]:
    """The reply as it grows (the same object, updated in place), at most
    every `interval` seconds and always at the end. The decoding runs on its
    own thread in its turn in `queue` and never waits for the caller: while the
    page renders one update, the steps of the next accumulate. Closing the
    generator cancels the decoding. `reuse`: continue the caches of the last
    reply made with it where this conversation starts as that one did
    (Engine.stream), as a chat's next turn does. `check`: called once the
    turn has come, before decoding; what it raises ends the reply (that the
    engine is still the one loaded, say)."""
    reply = Reply(reasoning=thinks(engine.base.tokenizer))

    def decode(stop: threading.Event):
        if check is not None:
            check()
        return engine.chat(messages, mode, sampling, tree, stop, reading=True, reuse=reuse)

    decoding = Decoding(queue, decode, cancel)
    cursor = 0
    try:
        while True:
            shown = time.monotonic()
            steps = decoding.read(cursor)
            if not steps:
                return
            for step in steps:
                reply.add(step)
            cursor += len(steps)
            yield reply
            if reply.finish_reason is not None:
                return
            time.sleep(max(0.0, interval - (time.monotonic() - shown)))
    finally:
        if not decoding.finished:
            decoding.stop()


class Throttle:
    """True at most every `interval` seconds, and always for the final update."""

    def __init__(self, interval: float):
        self.interval = interval
        self.last = float("-inf")

    def ready(self, final: bool = False) -> bool:
        now = time.monotonic()
        if final or now - self.last >= self.interval:
            self.last = now
            return True
        return False
