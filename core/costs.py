"""The measured cost model: how long one step's parts take on this device.

A speculative step costs head expansions (one per tree depth, each over the
frontier's width), one base-model pass over the tree's nodes, and a fixed
overhead. How the tree pass grows with its node count is what differs most
between devices: on a 2-core CPU 16 nodes cost about twice one node, on a
GPU 60 nodes cost hardly more than one. The planner (core/planner.py) sizes
each tree from these measurements, so they are taken on the device in use,
once, and cached on disk per device, model, head (and what their files
hold), dtype, quantization and thread count."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from core import kv_cache
from core.drafter import Expander
from core.file_lock import lock_now, unlock
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


CPUINFO = Path("/proc/cpuinfo")  # Linux's description of the processor
# what tells a processor's generation from another's of the same name: a VM's "AMD EPYC" is any of
# five generations (x86: vendor, family, model, stepping); an Arm Linux's cpuinfo names no model at
# all (its implementer, variant and part do); (field, as the name writes it)
CPU_IDS = (("vendor_id", ""), ("cpu family", "family "), ("model", "model "), ("stepping", "stepping "),
           ("CPU implementer", "implementer "), ("CPU variant", "variant "), ("CPU part", "part "))  # fmt: skip
CPU_FLAGS = ("flags", "Features")  # x86's and Arm's instruction set extensions


def device_name(device: torch.device) -> str:
    """What the timings depend on: the processor's model (and the GPU's). A
    CPU's name with what tells its generation apart where the system says
    it (Linux: "AMD EPYC (AuthenticAMD family 25 model 1 stepping 1)"; a
    Mac: its brand string; else a digest of its instruction set extensions)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    fields = _cpu_fields()
    name = fields.get("model name") or _mac_brand() or platform.processor() or platform.machine()
    ids = [f"{label}{fields[field]}" for field, label in CPU_IDS if fields.get(field)]
    flags = next((fields[field] for field in CPU_FLAGS if fields.get(field)), None)
    if not ids and flags:
        ids = [f"flags {hashlib.sha256(flags.encode()).hexdigest()[:8]}"]
    return f"{name} ({' '.join(ids)})" if ids else name


def _cpu_fields() -> dict[str, str]:
    """The first processor's fields in CPUINFO ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        lines = CPUINFO.read_text(errors="replace").splitlines()
    except OSError:
        return fields
    for line in lines:
        if not line.strip():
            if fields:
                break  # the next processor's (the same model; big.LITTLE's first core names the system)
            continue
        field, _, value = line.partition(":")
        fields.setdefault(field.strip(), value.strip())
    return fields


def _mac_brand() -> str | None:
    """macOS's name of the processor ("Apple M2 Pro"); None elsewhere."""
    if sys.platform != "darwin":
        return None
    try:
        answer = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return answer.stdout.strip() or None


def where(name: str | None) -> str | None:
    """A model or head as the cache knows it: a local folder by its full path
    (`./head` from two working folders is two heads, `head` and `./head/` one),
    anything else (a hub id) as given."""
    if name is None:
        return None
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")  # a model's or head's weights (and shard indexes)


def contents(name: str | None) -> str | None:
    """What the model or head `name` holds, as far as a stat tells: a digest
    of its config.json and its weight files' names, sizes and modification
    times (never their bytes: they may be gigabytes), so that another model
    or head saved at the same path (a head trained again into its folder) is
    measured again. A file (GGUF) by its own size and time; a hub repo id by
    the snapshot of it in the Hugging Face cache (the commit's folder); None
    where no such files are found."""
    folder = _files_folder(name)
    if folder is None:
        return None
    digest = hashlib.sha256(str(folder).encode())
    try:
        if folder.is_file():
            files = [folder]
        else:
            if (folder / "config.json").is_file():
                digest.update((folder / "config.json").read_bytes())
            files = sorted(path for path in folder.iterdir() if path.name.endswith(WEIGHT_SUFFIXES))
        for file in files:
            stat = file.stat()  # a hub snapshot's links: their blobs'
            digest.update(f"\n{file.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    except OSError:
        return None
    return digest.hexdigest()[:16]


def _files_folder(name: str | None) -> Path | None:
    """The local folder or file `name` names, or for a hub repo id its snapshot folder in the Hugging Face cache."""
    if name is None:
        return None
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve()
    from models.errors import KestrelError
    from models.repo import parse_repo

    try:
        repo = parse_repo(name)
    except KestrelError:  # no repo id either
        return None
    if repo is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo.id, "config.json", revision=repo.revision)
    return Path(cached).parent if isinstance(cached, str) else None


def cache_key(
    device: torch.device, model: str, head: str | None, dtype: torch.dtype, quantization: str,
    compiled: bool = False, row_kernel: str | None = None, int4_kernel: str | None = None, draft_kernel: str | None = None,
    graphs: bool = False, screen: str | None = None, model_contents: str | None = None, head_contents: str | None = None,
) -> dict:  # fmt: skip
    """model_contents, head_contents: `contents` of the model and the head."""
    import transformers

    return {
        "version": VERSION,
        "device": device_name(device),
        "device_type": device.type,
        "model": model,
        "head": head,
        "model_contents": model_contents,
        "head_contents": head_contents,
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
        "transformers": transformers.__version__,  # its attention and cache code runs in every pass
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


def load_cached(folder: Path, key: dict, warn: bool = True) -> Costs | None:
    """The cached measurement for exactly this key, or None. A file that
    cannot be read or is damaged is measured again, with a warning naming it
    (`warn`: a second look at the same file says nothing)."""
    path = cache_file(folder, key)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return Costs.from_dict(data["costs"]) if data.get("key") == key else None
    except (FileNotFoundError, NotADirectoryError):  # not measured yet (or no folder there to hold it)
        return None
    # RecursionError: JSON nested deeper than the parser goes ("[" * 200000)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        if warn:
            log.warning(f"{path}: the cached step costs cannot be read ({type(error).__name__}: {error}); measuring them again")
        return None


LOCK_FILE = "measuring.lock"
LOCK_WAIT = 600  # seconds to wait for another process's measurement before measuring alongside it
LOCK_POLL = 0.1  # seconds between looks at the lock


@contextlib.contextmanager
def measuring(folder: Path) -> Iterator[None]:
    """Held while this process measures, one process at a time per cache
    folder: two measuring at once (two starts, the app and a bench) slow
    each other's passes, and each would cache its slowed times. An OS file
    lock in `folder`, which ends with its process however that ends; where
    none can be taken (a read-only folder, a file system without locks), or
    another process holds it past LOCK_WAIT, measured without it."""
    handle = _lock(folder)
    try:
        yield
    finally:
        if handle is not None:
            unlock(handle)


def _lock(folder: Path):
    """The open lock file, locked; None where no lock was taken."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / LOCK_FILE, "a+b")  # noqa: SIM115 (held open while the lock is held)
    except OSError:
        return None
    deadline, said = time.monotonic() + LOCK_WAIT, False
    while True:
        try:
            if lock_now(handle):
                return handle
            if time.monotonic() > deadline:
                log.warning(f"{folder / LOCK_FILE}: another process has measured step costs for {LOCK_WAIT} s; measuring alongside it")
                handle.close()
                return None
        except OSError:  # the file system takes no locks
            handle.close()
            return None
        if not said:
            log.info("Another process is measuring step costs; waiting for it")
            said = True
        time.sleep(LOCK_POLL)


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
    try:
        temporary.write_text(json.dumps({"key": key, "costs": costs.to_dict()}, indent=1), encoding="utf-8")
        temporary.replace(path)
    except OSError:  # a full disk: no half-written file left behind (the measurement is kept in memory)
        temporary.unlink(missing_ok=True)
        raise
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
