"""The benchmark: decoding modes and transformers' own generate, timed fairly.

Fair timing: one process, warm-up prompts excluded, modes interleaved prompt by
prompt, tokens/s = total tokens / total seconds of each mode."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch

from core import compiled
from core.calibration import setting_of
from core.config import MODES, TREE_LIMITS, SamplingParams, TreeParams
from core.engine import Engine
from core.prompt import BenchPrompt
from core.stats import SHORT_REPLY
from models.errors import KestrelError

# transformers' generate, plain and with prompt-lookup decoding; llama.cpp on the same GGUF (core/llama_stick.py)
BASELINES = ("generate", "prompt-lookup", "llama.cpp")
PROMPT_LOOKUP_TOKENS = 10  # drafted tokens per step for the prompt-lookup baseline


def parse_mode(label: str, tree: TreeParams) -> tuple[str, TreeParams]:
    """A mode label -> (mode, tree). "eagle2:8/4/2" runs eagle2 with total_tokens 8,
    depth 4 and top_k 2, and "eagle2:8/4/2/6" adds 6 lookup tokens; the other
    settings come from `tree`. Plain labels use `tree` itself. "eagle2@NAME"
    drafts with the other head called NAME (`head_of`)."""
    named, colon, shape = label.partition(":")
    mode, at, head = named.partition("@")
    if at and not head:
        raise ValueError(f"bad mode {label!r}: name the other head after @ (eagle2@NAME, with --other-head NAME=FOLDER), or drop the @")
    if head and mode not in ("eagle", "eagle2"):
        raise ValueError(f"bad mode {label!r}: only eagle and eagle2 draft with a head (@{head})")
    if mode not in MODES + BASELINES:
        raise ValueError(f"unknown mode {label!r}; choose from {', '.join(MODES + BASELINES)}")
    if colon and not shape:  # a label of its own (no summary reads it) for the same decoding as `mode`
        raise ValueError(f"bad mode {label!r}: write the tree after ':' (eagle2:TOTAL/DEPTH/TOP_K[/LOOKUP]), or drop the ':'")
    if not shape:
        return mode, tree
    if mode == "eagle":
        raise ValueError(f"bad mode {label!r}: eagle drafts EAGLE-1's fixed tree; tree shapes are for eagle2")
    try:
        numbers = [int(part) for part in shape.split("/")]
        fields = dict(zip(("total_tokens", "depth", "top_k", "lookup_tokens"), numbers, strict=False))
        if len(numbers) not in (3, 4) or mode != "eagle2":
            raise ValueError
    except ValueError:
        raise ValueError(f"bad mode {label!r}: write eagle2:TOTAL/DEPTH/TOP_K[/LOOKUP]") from None
    for field, value in fields.items():
        low, high = TREE_LIMITS[field]
        if not low <= value <= high:
            raise ValueError(f"bad mode {label!r}: its {field} must be from {low} to {high}, got {value}")
    try:
        return mode, replace(tree, **fields)
    except ValueError as error:  # a value TreeParams refuses (total_tokens 1)
        raise ValueError(f"bad mode {label!r}: {error}") from None


# The untimed warm-up's prompts (--warmup N runs the first N, round again past the last), none of them
# a timed one: a chat, a code and a quoting request, so that drafting, the planner and the context
# branch have all run once, and every mode's first timed reply is not its first one.
WARMUP_PROMPTS = (
    "Give three tips for sleeping better, one sentence each.",
    "Write a Python function that returns the largest number in a list, without using max().",
    "Repeat this sentence word for word, then say how many words it has: The quick brown fox jumps over the lazy dog.",
)
WARMUP_TOKENS = 16  # each warm-up reply's length


def warmup_messages(index: int) -> list[dict]:
    """The conversation of the `index`-th warm-up reply (from 0)."""
    return [{"role": "user", "content": WARMUP_PROMPTS[index % len(WARMUP_PROMPTS)]}]


class LlamaStick:
    """llama.cpp in a helper process of another Python (core/llama_stick.py),
    fed the same prompt token ids, greedy."""

    def __init__(self, python: str | None, engine: Engine, sampling: SamplingParams):
        from models import bundled

        if not python:
            raise ValueError("mode llama.cpp needs --llama-python: a Python with llama-cpp-python installed")
        if not sampling.greedy:
            raise ValueError("mode llama.cpp is measured greedy only; use --temperature 0")
        name = engine.base.name
        gguf = bundled.gguf_path() if name == bundled.DEFAULT_NAME else Path(name)
        if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
            raise ValueError(f"mode llama.cpp needs a .gguf model file, and {name} is not one")
        script = Path(__file__).with_name("llama_stick.py")
        try:
            self.process = subprocess.Popen(
                [python, str(script), str(gguf), str(torch.get_num_threads()), str(engine.context_limit)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
        except OSError as error:
            raise ValueError(f"--llama-python {python}: cannot run it ({error})") from None
        try:
            answer = self._read()
        except ValueError:
            answer = {}
        if not answer.get("ready"):
            self.process.kill()
            problem = answer.get("problem", "is llama-cpp-python installed there?")
            raise ValueError(f"--llama-python {python}: llama.cpp did not start ({problem})")
        self.stop_ids = sorted(engine.stop_ids)

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            try:
                code = self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None and code < 0:  # killed by a signal: llama.cpp itself crashed
                raise ValueError(
                    f"llama.cpp's helper process crashed (signal {-code}); a llama-cpp-python built for this CPU's "
                    "AMX can crash where the system does not enable AMX: see the README's Performance section"
                )
            raise ValueError("llama.cpp's helper process ended early (is llama-cpp-python installed there?)")
        return json.loads(line)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        request = {"ids": prompt_ids, "max_new_tokens": max_new_tokens, "stop": self.stop_ids}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        return {"tokens": len(answer["ids"]), "seconds": answer["seconds"], "forwards": None, "draft_seconds": None,
                "verify_seconds": None, "accepted_lengths": None, "tree_nodes": None, "tree_depths": None,
                "output_ids": answer["ids"]}  # fmt: skip

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def head_of(label: str) -> str | None:
    """NAME of a label "eagle2@NAME[:shape]": the other head it drafts with; None for the engine's own."""
    return label.partition(":")[0].partition("@")[2] or None


def check_head_named(label: str, names) -> None:
    """A mode "eagle2@NAME" needs an other head called NAME among `names`."""
    name = head_of(label)
    if name is not None and name not in names:
        known = ", ".join(sorted(names)) or "none given"
        raise ValueError(f"--modes {label}: no other head called {name!r} (known: {known}); give --other-head {name}=FOLDER")


class BenchCancelled(KestrelError):
    """A benchmark stopped by its cancel signal; `result` holds the prompts it finished (None if none)."""

    def __init__(self, result: dict | None):
        super().__init__("stopped")
        self.result = result


def run_once(
    engine: Engine, prompt_ids: list[int], label: str, sampling: SamplingParams, tree: TreeParams,
    stick: LlamaStick | None = None, cancel: threading.Event | None = None, reuse: bool = False,
) -> dict:
    """One prompt through one mode -> tokens, seconds, accepted lengths, output
    ids; with `reuse`, Kestrel's modes continue the caches of the engine's last
    request made so (a conversation's next turn, Engine.stream)."""
    mode, tree = parse_mode(label, tree)
    if mode == "llama.cpp":
        return stick.run(prompt_ids, sampling.max_new_tokens)
    if mode in BASELINES:
        return _run_generate(engine, prompt_ids, mode, sampling, cancel)
    started = time.perf_counter()
    steps = list(engine.stream(prompt_ids, mode=mode, sampling=sampling, tree=tree, cancel=cancel, reuse=reuse))
    seconds = time.perf_counter() - started
    stats = steps[-1].stats
    return {
        "tokens": stats.tokens,
        "seconds": seconds,
        "forwards": stats.forwards,
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "accepted_lengths": [len(step.token_ids) for step in steps],
        "tree_nodes": stats.mean_tree_size * (stats.forwards - 1),  # over the steps after the prefill
        "tree_depths": stats.mean_tree_depth * (stats.forwards - 1),
        "first_token_seconds": stats.time_to_first_token,  # the prompt's reading and the first token
        "reused_tokens": stats.reused_tokens,
        "output_ids": [token for step in steps for token in step.token_ids],
    }


def fresh_first_token_seconds(engine: Engine, prompt_ids: list[int], label: str, sampling: SamplingParams, tree: TreeParams) -> float:
    """Seconds to the first token when the whole prompt is read afresh (the
    caches kept for the next turn are left as they are)."""
    mode, tree = parse_mode(label, tree)
    steps = engine.stream(prompt_ids, mode=mode, sampling=sampling, tree=tree)
    try:
        return next(steps).stats.time_to_first_token
    finally:
        steps.close()


def _run_generate(engine: Engine, prompt_ids: list[int], mode: str, sampling: SamplingParams, cancel: threading.Event | None = None) -> dict:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Cancelled(StoppingCriteria):  # the cancel signal ends generate within a step, as it ends Kestrel's modes
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), cancel is not None and cancel.is_set(), dtype=torch.bool, device=input_ids.device)

    config = baseline_config(engine, len(prompt_ids), mode, sampling)
    inputs = torch.tensor([prompt_ids], device=engine.base.device)
    if not sampling.greedy and sampling.seed is not None:
        torch.manual_seed(sampling.seed)  # generate draws from torch's global generator: the seed repeats its sample
    started = time.perf_counter()
    with torch.inference_mode(), compiled.eager(engine.model), _model_config(engine.model, config):  # transformers' own code, as its users run it
        output = engine.model.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=config,
                                       stopping_criteria=StoppingCriteriaList([Cancelled()]))  # fmt: skip
    seconds = time.perf_counter() - started
    ids = output[0, len(prompt_ids) :].tolist()
    return {"tokens": len(ids), "seconds": seconds, "forwards": None, "draft_seconds": None, "verify_seconds": None,
            "accepted_lengths": None, "tree_nodes": None, "tree_depths": None, "output_ids": ids}  # fmt: skip


def baseline_config(engine: Engine, prompt_tokens: int, mode: str, sampling: SamplingParams):
    """Kestrel's settings alone, for transformers' generate: nothing from the
    model's generation_config.json (a Qwen2.5's repetition_penalty 1.05, a
    no_repeat_ngram_size, suppress_tokens), which Kestrel's modes never apply."""
    from transformers import GenerationConfig

    room = engine.context_limit - prompt_tokens  # where Kestrel's modes stop too (finish_reason "context")
    options = dict(max_new_tokens=min(sampling.max_new_tokens, room), eos_token_id=sorted(engine.stop_ids), pad_token_id=0)
    if sampling.greedy:
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    if mode == "prompt-lookup":
        options["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    return GenerationConfig(**options)


@contextmanager
def _model_config(model, config) -> Iterator[None]:
    """Within the block `config` is also the model's own generation config:
    generate fills what a config passed to it leaves unset (None) from the
    model's, so passing it alone would still bring the model's penalties in."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved


def check_turn_names(prompts: list[BenchPrompt], turns: int) -> None:
    """A later turn's row is named ID#N: no prompt may already be called so."""
    names = {prompt.id for prompt in prompts}
    for prompt in prompts:
        for turn in range(2, min(turns, 1 + len(prompt.follow_ups)) + 1):
            if f"{prompt.id}#{turn}" in names:
                raise ValueError(f"prompt {prompt.id}#{turn}: the rows of prompt {prompt.id}'s turn {turn} are named so in a "
                                 "--turns run; rename that prompt")  # fmt: skip


def run_bench(
    engine: Engine,
    prompts: list[BenchPrompt],
    modes: tuple[str, ...] = ("vanilla", "eagle2"),
    sampling: SamplingParams = SamplingParams(),
    tree: TreeParams = TreeParams(),
    warmup: int = 1,
    progress: Callable[[int, int, str], None] | None = None,
    llama_python: str | None = None,
    other_heads: dict[str, Engine] | None = None,
    partial: Callable[[dict], None] | None = None,
    cancel: threading.Event | None = None,
    turns: int = 1,
) -> dict:
    """Every prompt through every mode, interleaved; -> the JSON-ready result.
    other_heads: engines on the same base model with other heads, which modes
    labelled "eagle2@NAME" draft with (two heads compared in one run).
    partial: called with the result so far after each prompt's last mode
    ("complete" false), so that a run cut short keeps what it measured.
    cancel: when set, the run stops within one step and raises BenchCancelled.
    turns: user turns of each prompt to run as one conversation, each mode
    answering with its own replies; Kestrel's modes continue the last turn's
    caches (Engine.stream's reuse), and each later turn's first token is also
    timed with the conversation read afresh. Later turns' rows are named
    ID#2, ID#3, ..."""
    other_heads = other_heads or {}
    engines = {}
    for label in modes:
        mode, _ = parse_mode(label, tree)
        check_head_named(label, other_heads)
        name = head_of(label)
        engines[label] = other_heads[name] if name else engine
        if mode in MODES and mode not in engines[label].modes:
            raise ValueError(f"mode {mode} needs a draft head; give --head")
    check_turn_names(prompts, turns)
    encoded = [engine.encode([{"role": "user", "content": prompt.text}]) for prompt in prompts]
    for prompt, ids in zip(prompts, encoded):  # before anything runs, not when its turn comes
        if len(ids) >= engine.context_limit:
            raise ValueError(f"prompt {prompt.id}: {len(ids)} tokens; the model's context window is {engine.context_limit}")
    stick = LlamaStick(llama_python, engine, sampling) if "llama.cpp" in modes else None
    rows, total, done = [], len(prompts) * len(modes), 0
    left_out = []  # conversations with a turn past the context window: every mode's rows of them dropped

    def check_cancel() -> None:  # a prompt whose rows are cut short does not count: only finished prompts do
        if cancel is not None and cancel.is_set():
            raise BenchCancelled(bench_result(engine, engines, sampling, tree, warmup, other_heads, rows, complete=False, turns=turns,
                                              left_out=left_out, learned=learned) if rows else None)  # fmt: skip

    learned = {"before_warmup": planner_learned(engines, tree, sampling)}  # a long-lived server's engine has learnt from earlier replies
    try:
        for index in range(warmup):  # none of the timed prompts: their replies' first tokens would be decoded twice
            ids = engine.encode(warmup_messages(index))
            for mode in modes:
                check_cancel()
                run_once(engines[mode], ids, mode, replace(sampling, max_new_tokens=WARMUP_TOKENS), tree, stick, cancel)
        learned["before_timing"] = planner_learned(engines, tree, sampling)
        for prompt, ids in zip(prompts, encoded):
            measured = []  # this prompt's rows, kept once every mode has run it in full
            for index, mode in enumerate(modes):
                if progress:
                    progress(done, total, f"{prompt.id} / {mode}")
                check_cancel()
                if turns == 1:
                    result = run_once(engines[mode], ids, mode, sampling, tree, stick, cancel)
                    check_cancel()
                    measured.append({"id": prompt.id, "source": prompt.source, "mode": mode, **result})
                else:
                    try:
                        measured += _conversation(engines[mode], prompt, mode, sampling, tree, stick, cancel, turns, check_cancel)
                    except TurnTooLong as error:  # the modes would be compared over different turns: none is kept
                        left_out.append(str(error))
                        measured, done = None, done + len(modes) - index
                        break
                done += 1
            rows += measured or []
            if partial is not None and done < total and rows:  # none yet: a conversation left out comes first
                partial(bench_result(engine, engines, sampling, tree, warmup, other_heads, rows, complete=False, turns=turns, left_out=left_out,
                                     learned=learned))
    finally:
        if stick is not None:
            stick.close()
    if progress:
        progress(total, total, "done")
    if not rows and left_out:
        raise ValueError(f"every conversation has a turn past the context window ({left_out[0]}, ...); use fewer --turns "
                         "or a smaller --max-new-tokens")  # fmt: skip
    return bench_result(engine, engines, sampling, tree, warmup, other_heads, rows, complete=True, turns=turns, left_out=left_out,
                        learned=learned)


class TurnTooLong(ValueError):
    """A later turn of a conversation that does not fit the context window (its length depends on the replies before it)."""


def _conversation(engine: Engine, prompt: BenchPrompt, label: str, sampling, tree, stick, cancel, turns: int, check_cancel) -> list[dict]:
    """A prompt's first `turns` user turns through one mode, as one conversation -> a row per turn."""
    ours = parse_mode(label, tree)[0] in MODES
    if ours:
        engine.forget()  # the first turn reads its prompt afresh, as in a one-turn run
    messages, rows = [], []
    for turn, text in enumerate((prompt.text, *prompt.follow_ups)[:turns], start=1):
        messages.append({"role": "user", "content": text})
        ids = engine.encode(messages)
        if len(ids) + 1 >= engine.context_limit:
            raise TurnTooLong(f"prompt {prompt.id}, turn {turn} ({label}): {len(ids)} tokens, past the model's context window of "
                              f"{engine.context_limit}")  # fmt: skip
        extra = {"turn": turn, "prompt_tokens": len(ids)}
        if ours and turn > 1:
            extra["fresh_first_token_seconds"] = fresh_first_token_seconds(engine, ids, label, sampling, tree)
            check_cancel()
        result = run_once(engine, ids, label, sampling, tree, stick, cancel, reuse=ours)
        check_cancel()
        name = prompt.id if turn == 1 else f"{prompt.id}#{turn}"
        rows.append({"id": name, "source": prompt.source, "mode": label, **extra, **result})
        reply = engine.base.tokenizer.decode(result["output_ids"], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    return rows


def later_turns(rows: list[dict], modes: tuple[str, ...]) -> dict:
    """Per mode, over the rows of turns after the first that were also timed
    read afresh: their count, seconds to the first token with the kept caches
    and read afresh, prompt tokens and tokens kept."""
    found = {}
    for mode in modes:
        chosen = [row for row in rows if row["mode"] == mode and row.get("fresh_first_token_seconds") is not None]
        if chosen:
            found[mode] = {
                "turns": len(chosen),
                "first_token_seconds": sum(row["first_token_seconds"] for row in chosen),
                "fresh_first_token_seconds": sum(row["fresh_first_token_seconds"] for row in chosen),
                "prompt_tokens": sum(row["prompt_tokens"] for row in chosen),
                "reused_tokens": sum(row["reused_tokens"] for row in chosen),
            }
    return found


def bench_result(
    engine: Engine,
    engines: dict[str, Engine],
    sampling: SamplingParams,
    tree: TreeParams,
    warmup: int,
    other_heads: dict[str, Engine],
    rows: list[dict],
    *,
    complete: bool,
    turns: int = 1,
    left_out: list[str] | None = None,
    learned: dict | None = None,
) -> dict:
    """The JSON-ready result of the rows measured (every mode of each finished
    prompt); engines: the engine of each mode label; learned: what each planned
    mode's planner had learnt before the warm-up and before the first timed
    prompt (planner_learned)."""
    modes = tuple(engines)
    summary = summarize(rows, modes, sampling)
    summary["left_out"] = list(left_out or [])
    summary["planner_learned"] = dict(learned or {})
    # how planned drafts' measured times relate to the cost table's (core/calibration.DraftTiming)
    summary["draft_timing"] = {}
    for label in modes:
        if plans(label, tree):
            scale, extra = engines[label].calibrations.timing.fit
            summary["draft_timing"][label] = {"scale": scale, "extra_ms": 1000 * extra}
    finished = sum(row.get("turn", 1) == 1 for row in rows) // len(modes) if modes else 0
    return {
        "complete": complete,
        "settings": {
            **settings_of(engine, modes, sampling, tree, finished, warmup),
            "head": engine.head_name,
            "turns": turns,
            "other_heads": {name: other.head_name for name, other in other_heads.items()},
        },
        "summary": summary,
        "modes": {mode: mode_totals([row for row in rows if row["mode"] == mode]) for mode in modes},
        "prompts": rows,
    }


def planner_learned(engines: dict[str, Engine], tree: TreeParams, sampling: SamplingParams) -> dict[str, dict[str, int]]:
    """Per mode that plans its trees (eagle2 at the default tree): what its
    planner has learnt so far for this run's sampling (Calibrations.learned)."""
    return {label: engines[label].calibrations.learned(setting_of(sampling)) for label in engines if plans(label, tree)}


def plans(label: str, tree: TreeParams) -> bool:
    """Whether the mode `label` sizes its trees by the planner (eagle2 at the default tree)."""
    mode, shape = parse_mode(label, tree)
    return mode == "eagle2" and shape.planned


def learned_words(learned: dict[str, int]) -> str | None:
    """What a planner had learnt (Calibrations.learned) in words; None where nothing."""
    nodes = learned["head_nodes"] + learned["context_nodes"]
    parts = [f"{nodes} verified draft nodes"] if nodes else []
    if learned["drafts_timed"]:  # the drafts' timing is learnt under every sampling setting alike
        parts.append(f"{learned['drafts_timed']} timed drafts")
    return " and ".join(parts) or None


def settings_of(engine, modes, sampling, tree, count, warmup) -> dict:
    return {
        "model": engine.base.name,
        "quantization": engine.base.quantization,
        "dtype": str(engine.base.dtype).removeprefix("torch."),
        "device": str(engine.base.device),
        "exact_trees": engine.exact,
        "compiled": engine.compiled is not None,
        "cuda_graphs": engine.graphs_in_use,
        "threads": torch.get_num_threads(),
        "modes": list(modes),
        "prompts": count,
        "warmup": warmup,
        "sampling": asdict(sampling),
        "tree": asdict(tree),
    }


def mode_totals(rows: list[dict]) -> dict:
    tokens = sum(row["tokens"] for row in rows)
    seconds = sum(row["seconds"] for row in rows)
    totals = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0}
    # the rate after the first token, without the prompt's reading (which long prompts make most of a reply's time)
    firsts = [row.get("first_token_seconds") for row in rows]
    decoding = seconds - sum(firsts) if rows and None not in firsts else 0.0
    totals["decoding_tokens_per_s"] = (tokens - len(rows)) / decoding if decoding > 0 and tokens > len(rows) else None
    if rows and rows[0]["forwards"] is not None:
        forwards = sum(row["forwards"] for row in rows)
        draft = sum(row["draft_seconds"] for row in rows)
        verify = sum(row["verify_seconds"] for row in rows)
        steps = forwards - len(rows)  # the prefills are not trees
        totals.update(
            mean_accepted_length=tokens / forwards if forwards else 0.0,
            mean_tree_size=sum(row["tree_nodes"] for row in rows) / steps if steps else 1.0,
            mean_tree_depth=sum(row["tree_depths"] for row in rows) / steps if steps else 0.0,
            # where a step's time goes: head drafting, base verify (+ accept, commit), the rest
            time_split={"draft": draft / seconds, "verify": verify / seconds, "other": 1 - (draft + verify) / seconds},
        )
    else:
        totals["mean_accepted_length"] = None
    return totals


def summarize(rows: list[dict], modes: tuple[str, ...], sampling: SamplingParams) -> dict:
    totals = {mode: mode_totals([row for row in rows if row["mode"] == mode]) for mode in modes}
    vanilla, eagle2 = totals.get("vanilla"), totals.get("eagle2")
    summary = {
        "speedup": eagle2["tokens_per_s"] / vanilla["tokens_per_s"] if vanilla and eagle2 else None,
        "mean_accepted_length": eagle2["mean_accepted_length"] if eagle2 else None,
        "identical_fraction": None,
        "vanilla_tokens_per_s": vanilla["tokens_per_s"] if vanilla else None,
        "eagle2_tokens_per_s": eagle2["tokens_per_s"] if eagle2 else None,
    }
    # greedy replies are compared in every mode; sampled ones where one seed drew them all in
    # Kestrel's own modes, which then make the same sample (core/sampling.Noise), not other engines'
    if vanilla and (sampling.greedy or sampling.seed is not None):
        outputs = {(row["id"], row["mode"]): row["output_ids"] for row in rows}
        ids = sorted({row["id"] for row in rows})
        identical = {
            mode: sum(outputs[(i, mode)] == outputs[(i, "vanilla")] for i in ids) / len(ids)
            for mode in modes
            if ids and mode != "vanilla" and (sampling.greedy or totals[mode]["mean_accepted_length"] is not None)
        }
        summary["identical_fraction"] = identical.get("eagle2")
        summary["identical_fraction_by_mode"] = identical
    by_source = {}
    for source in sorted({row["source"] for row in rows}):
        chosen = [row for row in rows if row["source"] == source]
        by_source[source] = {
            mode: mode_totals([row for row in chosen if row["mode"] == mode])["mean_accepted_length"] for mode in modes
        }
    summary["tau_by_source"] = by_source
    summary["later_turns"] = later_turns(rows, modes)
    return summary


def format_table(result: dict) -> str:
    lines = [f"{'mode':<18}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}{'decode/s':>10}{'tau':>7}{'speedup':>9}{'nodes':>7}{'depth':>7}  time split"]
    base = result["modes"].get("vanilla", {}).get("tokens_per_s")
    for mode, totals in result["modes"].items():
        tau = totals["mean_accepted_length"]
        tau_text = "-" if tau is None else f"{tau:.2f}"
        speed = f"{totals['tokens_per_s'] / base:.2f}x" if base else "-"
        split = totals.get("time_split")
        split_text = " ".join(f"{name} {share:.0%}" for name, share in split.items()) if split else ""
        nodes, depth = totals.get("mean_tree_size"), totals.get("mean_tree_depth")
        shape = f"{nodes:>7.1f}{depth:>7.1f}" if nodes is not None else f"{'-':>7}{'-':>7}"
        decoding = totals.get("decoding_tokens_per_s")
        decoding_text = "-" if decoding is None else f"{decoding:.2f}"
        lines.append(
            f"{mode:<18}{totals['tokens']:>8}{totals['seconds']:>10.1f}{totals['tokens_per_s']:>10.2f}"
            f"{decoding_text:>10}{tau_text:>7}{speed:>9}{shape}  {split_text}"
        )
    summary = result["summary"]
    sampling = result["settings"]["sampling"]
    if summary["speedup"] is not None:
        identical = summary["identical_fraction"]
        lines.append(f"eagle2 speedup {summary['speedup']:.2f}x, tau {summary['mean_accepted_length']:.2f}, "
                     f"identical_fraction {'n/a (sampled without a seed)' if identical is None else f'{identical:.2f}'}")  # fmt: skip
    replies = "replies" if result["settings"].get("turns", 1) > 1 else "prompts"  # a --turns run compares each turn's reply
    for mode, fraction in summary.get("identical_fraction_by_mode", {}).items():
        if fraction < 1:
            lines.append(f"note: {mode}'s replies differ from vanilla's on {1 - fraction:.0%} of the {replies}, "
                         "so its tokens/s times other text")  # fmt: skip
    greedy = sampling["temperature"] == 0 or sampling["top_k"] == 1 or sampling["top_p"] == 0
    if not greedy and sampling["seed"] is not None:
        lines.append(f"sampled with seed {sampling['seed']} (--seed {sampling['seed']} repeats it)")
    rows = result["prompts"]
    if rows and (mean := sum(row["tokens"] for row in rows) / len(rows)) < SHORT_REPLY:
        lines.append(f"note: the replies average {mean:.0f} tokens, too few to time well (reading each prompt "
                     "takes much of a reply's time); raise --max-new-tokens for speed figures")  # fmt: skip
    for mode, later in summary.get("later_turns", {}).items():
        kept, fresh = later["first_token_seconds"], later["fresh_first_token_seconds"]
        lines.append(f"{mode}, {later['turns']} later turn{'s' if later['turns'] != 1 else ''}: first token after {kept / later['turns']:.2f} s on average with the kept caches "
                     f"({later['reused_tokens']:,} of {later['prompt_tokens']:,} prompt tokens kept), {fresh / later['turns']:.2f} s read afresh"
                     + (f" ({fresh / kept:.1f}x)" if kept > 0 else ""))  # fmt: skip
    for reason in summary.get("left_out", []):
        lines.append(f"note: left out, {reason}: every mode's rows of that conversation are dropped")
    for mode, learned in summary.get("planner_learned", {}).get("before_warmup", {}).items():
        words = learned_words(learned)
        if words:  # a long-lived server's engine (the Compare tab's): its first timed trees are sized from that
            lines.append(f"note: {mode}'s planner had learnt from {words} (earlier replies) before this run, "
                         "as a server that has answered before has")  # fmt: skip
    modes = result["modes"]
    own = [mode for mode in modes if parse_mode(mode, TreeParams())[0] in MODES]  # Kestrel's: vanilla, eagle, eagle2 (any head or shape)
    if "prompt-lookup" in modes and own:  # transformers' generate runs eagerly, Kestrel's modes through its own passes and kernels
        if "generate" in modes and modes["generate"]["tokens_per_s"]:
            lookup = modes["prompt-lookup"]["tokens_per_s"] / modes["generate"]["tokens_per_s"]
            lines.append(f"prompt-lookup {lookup:.2f}x of generate, both transformers' generate (run eagerly); set beside "
                         "eagle2 / vanilla, this compares the drafting alone")  # fmt: skip
        else:
            lines.append(f"note: prompt-lookup runs transformers' generate eagerly, where {', '.join(own)} run{'s' if len(own) == 1 else ''} Kestrel's own passes; "
                         "add generate to --modes to compare the drafting alone (prompt-lookup / generate)")  # fmt: skip
    for source, taus in summary["tau_by_source"].items():
        drafted = [f"{m} {t:.2f}" for m, t in taus.items() if t is not None]
        if drafted:  # none where only baselines ran, which count no forwards
            lines.append(f"tau on {source}: " + ", ".join(drafted))
    return "\n".join(lines)
