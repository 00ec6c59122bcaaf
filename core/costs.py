"""The measured cost model: how long one step's parts take on this device.

A speculative step costs head expansions (one per tree depth, each over the
frontier's width), one base-model pass over the tree's nodes, and a fixed
overhead. How the tree pass grows with its node count is what differs most
between devices: on a 2-core CPU 16 nodes cost about twice one node, on a
GPU 60 nodes cost hardly more than one. The planner (core/planner.py) sizes
each tree from these measurements, so they are taken on the device in use,
once, and cached on disk per device, model, head, dtype, quantization and
thread count."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from core import kv_cache
from core.drafter import Expander
from core.tree import make_tree
from core.verify import NodeArgmax, base_forward, verify_tree

log = logging.getLogger("kestrel")

# tree nodes measured on CPUs, where large trees never pay. 17: Kestrel's AMX kernels take 16 rows a
# tile, so a 17th node starts a second block of tiles; between 16 and 32 alone the curve put it at
# 20.4 ms on the reference Xeon, where passes of 17 and 18 nodes took 25.0 and 25.8 ms (16: 20.2).
CPU_SIZES = (1, 2, 4, 8, 16, 17, 32)
GPU_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)  # and on GPUs, where they can
# context lengths measured. Attention over the cache grows each node's cost with the context:
# on the 2-core EPYC a 4-node pass cost 13.1 / 17.4 / 28.6 ms after 512 / 2048 / 5000 tokens, one
# node 11.6 / 12.7 / 19.3. Extended from 64 and 512 alone, a noise-sized slope had put a 4-node
# pass at 5000 below a one-node pass, and long chats decoded slower in eagle2 than in vanilla.
CONTEXTS = (64, 512, 2048)
WIDTHS = (1, 2, 4, 8, 16)  # frontier widths of a head expansion measured
REPEATS = 3  # timings per point; the median is kept
ROUNDS = 5  # rounds over every tree size, each size once a round; the median of each size's rounds is kept
VERSION = 19  # bump when what is measured changes, so old cache files are ignored


@dataclass(frozen=True)
class Costs:
    """Seconds per step part, measured; linear in between measured points."""

    sizes: tuple[int, ...]  # tree node counts measured, ascending, from 1
    contexts: tuple[int, ...]  # context lengths measured, ascending
    verify: tuple[tuple[float, ...], ...]  # [context][size]: base tree pass + greedy acceptance + cache commit
    widths: tuple[int, ...]  # head expansion widths measured, ascending, from 1
    expand: tuple[float, ...]  # [width]: one head expansion + its top-k over the draft vocabulary
    overhead: float  # the rest of a step (bookkeeping, detokenizing), measured on a vanilla decode

    @property
    def largest_tree(self) -> int:
        return self.sizes[-1]

    def verify_seconds(self, nodes: int, context: int) -> float:
        """A tree pass of `nodes` nodes after `context` committed tokens."""
        rows = [_interpolate(self.sizes, row, nodes) for row in self.verify]
        return max(_interpolate(self.contexts, rows, context), 1e-9)

    def verify_curve(self, context: int, largest: int | None = None) -> torch.Tensor:
        """(largest,) float64: verify_seconds(n, context) for n = 1 .. largest (default: the largest measured).
        Within the measured sizes, interpolated between the measured contexts' whole curves (every draft asks)."""
        largest = largest or self.largest_tree
        if largest > self.largest_tree:
            curve = torch.tensor([self.verify_seconds(n, context) for n in range(1, largest + 1)], dtype=torch.float64)
            return torch.cummax(curve, dim=0).values
        return torch.tensor(self.verify_list(context)[:largest], dtype=torch.float64)

    def verify_list(self, context: int) -> list[float]:
        """verify_curve(context) up to the largest measured tree, in Python
        floats (the same arithmetic): every draft asks, and plans in Python."""
        curves = self._size_curves
        if len(self.contexts) == 1:
            return [max(value, 1e-9) for value in curves[0]]
        index = 1
        while index < len(self.contexts) - 1 and context > self.contexts[index]:
            index += 1
        x0, x1 = self.contexts[index - 1], self.contexts[index]
        share = (context - x0) / (x1 - x0)
        curve = [low + (high - low) * share for low, high in zip(curves[index - 1], curves[index])]
        if context > self.contexts[-1]:  # extended past the longest measured context: never below what was measured there
            curve = [max(value, floor) for value, floor in zip(curve, curves[-1])]
        # more nodes never cost less (a pass over more nodes does the same work and more)
        highest, result = -math.inf, []
        for value in curve:
            highest = max(highest, max(value, 1e-9))
            result.append(highest)
        return result

    @functools.cached_property
    def _size_curves(self) -> list[list[float]]:
        """Each measured context's seconds for n = 1 .. largest_tree nodes."""
        sizes = range(1, self.largest_tree + 1)
        return [[_interpolate(self.sizes, row, n) for n in sizes] for row in self.verify]

    def expand_seconds(self, width: int) -> float:
        return max(_interpolate(self.widths, self.expand, width), 0.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Costs:
        """The table as saved; ValueError where it is not one that measure()
        makes (a damaged or hand-edited file is then measured again)."""
        costs = cls(
            sizes=tuple(int(size) for size in data["sizes"]),
            contexts=tuple(int(context) for context in data["contexts"]),
            verify=tuple(tuple(float(seconds) for seconds in row) for row in data["verify"]),
            widths=tuple(int(width) for width in data["widths"]),
            expand=tuple(float(seconds) for seconds in data["expand"]),
            overhead=float(data["overhead"]),
        )
        increasing = lambda values: bool(values) and all(a < b for a, b in zip(values, values[1:]))  # noqa: E731
        times = [seconds for row in costs.verify for seconds in row] + list(costs.expand) + [costs.overhead]
        if not (increasing(costs.sizes) and increasing(costs.contexts) and increasing(costs.widths)):
            raise ValueError("sizes, contexts and widths must be increasing and not empty")
        if len(costs.verify) != len(costs.contexts) or any(len(row) != len(costs.sizes) for row in costs.verify):
            raise ValueError("verify must hold one time per size for each context")
        if len(costs.expand) != len(costs.widths) or not all(math.isfinite(t) and t >= 0 for t in times):
            raise ValueError("expand must hold one time per width, and every time must be a finite number >= 0")
        return costs


def _interpolate(xs: tuple[int, ...], ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends."""
    if len(xs) == 1:
        return float(ys[0])
    index = 1
    while index < len(xs) - 1 and x > xs[index]:
        index += 1
    x0, x1, y0, y1 = xs[index - 1], xs[index], float(ys[index - 1]), float(ys[index])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def device_name(device: torch.device) -> str:
    """What the timings depend on: the processor's model (and the GPU's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def where(name: str | None) -> str | None:
    """A model or head as the cache knows it: a local folder by its full path
    (`./head` from two working folders is two heads, `head` and `./head/` one),
    anything else (a hub id) as given."""
    if name is None:
        return None
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def cache_key(
    device: torch.device, model: str, head: str | None, dtype: torch.dtype, quantization: str,
    compiled: bool = False, row_kernel: str | None = None, int4_kernel: str | None = None, draft_kernel: str | None = None,
    graphs: bool = False, screen: str | None = None,
) -> dict:  # fmt: skip
    return {
        "version": VERSION,
        "device": device_name(device),
        "device_type": device.type,
        "model": model,
        "head": head,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": quantization,
        "compiled": compiled,
        "graphs": graphs,
        "row_kernel": row_kernel,
        "int4_kernel": int4_kernel,
        "draft_kernel": draft_kernel,
        "screen": screen,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernels": kernel_sources(),
    }


@functools.cache
def kernel_sources() -> str:
    """A digest of the sources of Kestrel's C++ kernels: a change to them (a
    faster loop, another layout) changes what a pass costs, so the table is
    measured again."""
    from core import rowkernel
    from models import int4, int8

    return hashlib.sha256((int4.SOURCE + int8.SOURCE + rowkernel.SOURCE).encode()).hexdigest()[:16]


def cache_file(folder: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"costs-{digest}.json"


def load_cached(folder: Path, key: dict) -> Costs | None:
    """The cached measurement for exactly this key, or None."""
    path = cache_file(folder, key)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Costs.from_dict(data["costs"]) if isinstance(data, dict) and data.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable or damaged: measured again
        return None


STALE_SECONDS = 3600  # a temporary cost file this old was left by a killed process


def save_cached(folder: Path, key: dict, costs: Costs) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("costs-*.tmp"):  # left by a process killed while it wrote (others finish within seconds)
        try:
            if time.time() - stale.stat().st_mtime > STALE_SECONDS:
                stale.unlink()
        except OSError:
            pass
    path = cache_file(folder, key)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")  # per process: two starts may measure at once
    temporary.write_text(json.dumps({"key": key, "costs": costs.to_dict()}, indent=1), encoding="utf-8")
    temporary.replace(path)
    return path


Progress = Callable[[int, int, str], None]


@torch.inference_mode()
def measure(
    model, argmax, drafter_for: Callable[[], object], context_limit: int, progress: Progress | None = None,
    text: list[int] | None = None,
) -> Costs:  # fmt: skip
    """Time tree passes of every size at every context length, head
    expansions of every width, and a step's fixed overhead, on `model` as it
    runs. `drafter_for()` makes a fresh Drafter; `argmax` is the engine's.
    `text`: token ids of ordinary text, repeated as the context and giving
    each tree its root. The greedy argmax's screen costs what the logits'
    shape makes it cost, and after random tokens the logits are flat as a
    reply's seldom are (an integer screen then costs twice a reply's), so
    random tokens stand in only where no text is given."""
    device = model.get_input_embeddings().weight.device
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    contexts = tuple(c for c in CONTEXTS if c + sizes[-1] < context_limit) or (min(CONTEXTS[0], context_limit // 2),)
    total, done = len(contexts) * (len(sizes) * ROUNDS + 1) + 1, 0
    vocabulary = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    verify, expand, features = [], [], None
    for context in contexts:
        _report(progress, done, total, f"base model, {context}-token context")
        if text and max(text) < vocabulary:  # ids the embedding holds (a tokenizer may know more)
            repeated = torch.tensor(text * (context // len(text) + 1), dtype=torch.long)
            tokens, root = repeated[:context].to(device), int(repeated[context])
        else:
            tokens = torch.randint(0, vocabulary, (context,), generator=generator).to(device)
            root = None
        cache = kv_cache.new_cache(model)
        features = base_forward(model, tokens, torch.arange(context, device=device), None, cache)
        done += 1
        trees = [_bushy_tree(size, vocabulary, generator, root) for size in sizes]
        runs = [lambda tree=tree: _verify_once(model, argmax, tree, context, cache) for tree in trees]
        for run in runs:
            run()  # first calls allocate
        # every size timed once per round, rounds repeated: a slow spell of the machine (they last
        # seconds here) then lands on one round of every size, not on all timings of one size
        rounds: list[list[float]] = [[] for _ in sizes]
        for _ in range(ROUNDS):
            for index, (size, run) in enumerate(zip(sizes, runs)):
                _report(progress, done, total, f"tree pass of {size} nodes")
                rounds[index].append(_median(run, device, repeats=1))
                done += 1
        verify.append(monotone([statistics.median(times) for times in rounds]))
    _report(progress, done, total, "draft head")
    drafter = drafter_for()
    if drafter is not None:
        features = torch.randn(len(features), drafter.head.feature_size, generator=generator).to(device)  # what the head reads
        drafter.commit(features, torch.randint(0, vocabulary, (len(features),), generator=generator).to(device))
        drafter.catch_up()
        for width in WIDTHS:
            expand.append(_median(lambda width=width: _expand_once(drafter, width), device, width == WIDTHS[0]))
        overhead = _median(lambda: _commit_once(drafter, features[:2]), device)
    else:
        expand, overhead = [0.0] * len(WIDTHS), 0.0
    done += 1
    _report(progress, done, total, "done")
    return Costs(sizes, contexts, tuple(verify), WIDTHS, tuple(expand), overhead)


def _report(progress: Progress | None, done: int, total: int, what: str) -> None:
    if progress is not None:
        progress(done, total, what)


def _bushy_tree(size: int, vocabulary: int, generator: torch.Generator, root: int | None = None):
    """A tree of `size` nodes shaped like EAGLE-2's: a few children per node, depth about 5,
    at `root` (default: a random token)."""
    parents = [(node - 1) // 3 - 1 if node > 0 else -1 for node in range(size - 1)]
    tokens = torch.randint(0, vocabulary, (size,), generator=generator).tolist()
    return make_tree(tokens[0] if root is None else root, tokens[1:], parents)


def _verify_once(model, argmax, tree, context: int, cache) -> None:
    features = verify_tree(model, tree, context, cache)
    NodeArgmax(argmax, features, tree)(0)
    kv_cache.commit(cache, context, [])


def _expand_once(drafter, width: int) -> None:
    committed = drafter.cache.length
    hidden = Expander(drafter).expand(list(range(width)), [0] * width, [-1] * width)  # width first-level nodes
    drafter.top(hidden, drafter.params.top_k)
    drafter.cache.crop(committed)


def _commit_once(drafter, features: torch.Tensor) -> None:
    """A step's head commit of its accepted tokens (two here): the bulk of a step's overhead."""
    committed = drafter.cache.length
    drafter.commit(features, torch.zeros(len(features), dtype=torch.long, device=features.device))
    drafter.catch_up()
    drafter.cache.crop(committed)


def monotone(seconds: list[float]) -> tuple[float, ...]:
    """Measured seconds by ascending tree size, each no more than any larger
    tree's: a pass over more nodes does the same work and more, so a smaller
    tree measured dearer met a slow moment of the machine."""
    result = list(seconds)
    for index in range(len(result) - 2, -1, -1):
        result[index] = min(result[index], result[index + 1])
    return tuple(result)


def _median(run: Callable[[], None], device: torch.device, warm_up: bool = False, repeats: int = REPEATS) -> float:
    if warm_up:
        run()  # first calls allocate
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
