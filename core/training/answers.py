"""Self-distillation data: the base model answers the training prompts itself.

Answers are generated with Hugging Face `generate` (left-padded batches): this
is offline data generation, not decoding, so the engine is not involved.
Sample 0 of each prompt is greedy, later samples use `temperature`. Every batch
is appended to a JSONL cache as soon as it is done; a resumed run skips the
batches already there. Batches are fixed by the prompt list and the parameters
alone, and each is seeded by its index, so a resumed run produces the same
records as an uninterrupted one."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.prompt import PromptFileError, encode_chat, prompt_rows, stop_token_ids
from models.paths import write_whole


@dataclass(frozen=True)
class AnswerParams:
    samples_per_prompt: int = 2  # sample 0 greedy, the others sampled at `temperature`
    max_new_tokens: int = 256  # longer answers are cut (and marked unfinished)
    temperature: float = 0.7  # for samples 1..n-1
    batch_size: int = 32  # prompts per generate call
    max_prompt_tokens: int = 512  # longer prompts are skipped
    seed: int = 0


@dataclass(frozen=True)
class Prompt:
    id: str
    ids: tuple[int, ...]  # the chat-templated prompt, ending with the assistant header


@dataclass(frozen=True)
class Answer:
    id: str  # the prompt's id
    sample: int
    prompt_ids: list[int]
    answer_ids: list[int]  # the reply, ending with its stop token when finished
    finished: bool  # False when cut by max_new_tokens


def read_prompts(path: Path, tokenizer, max_prompt_tokens: int = 512, why: str = "") -> list[Prompt]:
    """JSONL lines {"id", "turns": [first turn = the user prompt, ...]}, checked
    as bench's are (PromptFileError names the file and line). A prompt without
    an id is known by its line index from 0. `why`: what sets the longest, said with it."""
    prompts, skipped = [], 0
    for prompt_id, record in training_ids(Path(path)).items():
        messages = [{"role": "user", "content": record["turns"][0]}]
        ids = encode_chat(tokenizer, messages)
        if len(ids) <= max_prompt_tokens:
            prompts.append(Prompt(prompt_id, tuple(ids)))
        else:
            skipped += 1
    if skipped:
        print(f"{path}: {skipped} prompts longer than {max_prompt_tokens} tokens{why} skipped, {len(prompts)} kept", flush=True)
    if not prompts:
        raise ValueError(f"{path}: every prompt is longer than {max_prompt_tokens} tokens{why}; training needs shorter ones")
    return prompts


def training_ids(path: Path) -> dict[str, dict]:
    """id -> row of every prompt line (prompt_rows checks each line), a line
    without an id known by its line index from 0. PromptFileError where that
    index is another line's id: their answers would be taken for each other's."""
    rows = list(prompt_rows(Path(path)))
    explicit = {str(row["id"]): index for index, row in rows if "id" in row}
    ids = {}
    for index, row in rows:
        prompt_id = str(row.get("id", index))
        if "id" not in row and prompt_id in explicit:
            raise PromptFileError(
                f"{path}:{index + 1}: has no id, and the one it would get (its line index from 0, {prompt_id!r}) is "
                f"the id of line {explicit[prompt_id] + 1}; give it an id"
            )
        ids[prompt_id] = row
    return ids


def plan_batches(prompts: list[Prompt], params: AnswerParams) -> list[list[tuple[Prompt, int]]]:
    """All (prompt, sample) pairs, sample-major (every prompt gets its greedy answer
    before any gets a second one), length-sorted within a sample to limit padding."""
    by_length = sorted(prompts, key=lambda prompt: (len(prompt.ids), prompt.id))
    pairs = [(prompt, sample) for sample in range(params.samples_per_prompt) for prompt in by_length]
    return [pairs[start : start + params.batch_size] for start in range(0, len(pairs), params.batch_size)]


def read_answers(path: Path) -> list[Answer]:
    """The cached answers; a truncated last line (a killed run) is ignored."""
    if not path.is_file():
        return []
    answers = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            answers.append(Answer(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return answers


def cached_answers(prompts: list[Prompt], cache: Path, params: AnswerParams) -> list[Answer]:
    """The answers in `cache`, checked as a resumed run checks them, none added."""
    drop_partial_line(cache)
    cached = read_answers(cache)
    check_cache(prompts, cache, cached, params)
    return cached


def generate_answers(
    base, prompts: list[Prompt], cache: Path, params: AnswerParams, deadline: float | None = None, progress: bool = True
) -> list[Answer]:
    """Answer every (prompt, sample) pair not yet in `cache`, appending to it;
    stops between batches once time.time() passes `deadline`."""
    from tqdm import tqdm

    drop_partial_line(cache)
    cached = read_answers(cache)
    check_cache(prompts, cache, cached, params)
    done = {(answer.id, answer.sample) for answer in cached}
    planned = list(enumerate(plan_batches(prompts, params)))
    batches = [(index, batch) for index, batch in planned if not all((prompt.id, sample) in done for prompt, sample in batch)]
    stops = sorted(stop_token_ids(base.model, base.tokenizer))
    pad = base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else stops[0]
    cache.parent.mkdir(parents=True, exist_ok=True)
    total = sum(len(batch) for _, batch in planned)  # every planned answer; a resumed run starts at those it has
    bar = tqdm(total=total, initial=total - sum(len(batch) for _, batch in batches), unit="answer", desc="answers", disable=not progress)
    try:
        with open(cache, "a", encoding="utf-8") as out:
            for index, batch in batches:
                if deadline is not None and time.time() > deadline:
                    break
                answers = answer_batch(base, batch, params, stops, pad, seed=derived_seed(params.seed, index))
                for answer in answers:
                    if (answer.id, answer.sample) not in done:
                        out.write(json.dumps(answer.__dict__) + "\n")
                out.flush()
                bar.update(len(batch))
                bar.set_postfix(tokens=sum(len(answer.answer_ids) for answer in answers))
    except OSError as error:  # a full disk: the file, which Python's own error leaves unnamed (a half line is cut at the next run)
        raise OSError(f"{cache}: cannot be written ({error.strerror or error})") from error
    finally:
        bar.close()
    return read_answers(cache)


# the answer settings a cache's answers depend on, with the options that set them
CACHE_SETTINGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--answer-temperature"}


def check_cache(prompts: list[Prompt], cache: Path, cached: list[Answer], params: AnswerParams) -> None:
    """Refuse to add to (and report on) cached answers made from other prompts
    or with other answer settings: a resumed run would mix the two silently.
    The settings are kept beside the cache (answers-settings.json)."""
    check_settings(cache, {key: getattr(params, key) for key in CACHE_SETTINGS}, CACHE_SETTINGS, "answers")
    prompt_ids = {prompt.id: list(prompt.ids) for prompt in prompts}
    for answer in cached:
        if answer.id in prompt_ids and answer.prompt_ids != prompt_ids[answer.id]:
            raise ValueError(
                f"{cache.parent}: prompt {answer.id} is not the one its cached answers answer (the prompt file "
                "changed); give another --work for new answers"
            )


def check_settings(cache: Path, wanted: dict, options: dict[str, str], kind: str) -> None:
    """Refuse to add to a cache of `kind` (answers, requests) made with other
    settings than `wanted` (those named in `options`, by their option), then
    record `wanted` beside it (CACHE-settings.json) for the next run to check."""
    saved = recorded_settings(cache, kind)
    for key, option in options.items():
        if key in saved and saved[key] != wanted[key]:
            raise ValueError(
                f"{cache.parent}: its {kind} were made with {option} {saved[key]}, and this run asks for "
                f"{wanted[key]}; give {option} {saved[key]}, or another --work for new {kind}"
            )
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_whole(settings_file(cache), json.dumps(wanted) + "\n")  # whole: a cut file would stop every later run


def settings_file(cache: Path) -> Path:
    """Where the settings of `cache`'s records are kept: CACHE-settings.json beside it."""
    return cache.with_name(f"{cache.stem}-settings.json")


def recorded_settings(cache: Path, kind: str) -> dict:
    """The settings `cache`'s records of `kind` were made with; {} where it
    holds none yet (a run that failed before its first batch, its model
    missing say, recorded settings that nothing was made with). ValueError
    naming the file where it cannot be read."""
    recorded = settings_file(cache)
    if not (cache.is_file() and cache.stat().st_size and recorded.is_file()):
        return {}
    try:
        saved = json.loads(recorded.read_text(encoding="utf-8"))
        problem = None if isinstance(saved, dict) else "not a JSON object"
    except (OSError, ValueError) as error:  # cut short or emptied (a full disk, an editor)
        problem = str(error)
    if problem:
        raise ValueError(
            f"{recorded}: cannot be read ({problem}); it records the settings {cache.name}'s {kind} were made with: "
            f"delete it and give the settings they were made with, or give another --work for new {kind}"
        )
    return saved


def drop_partial_line(path: Path) -> None:
    """A killed run can leave a half-written last line; cut it before appending."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # cut in place: a rewrite killed midway would lose the whole lines too
        os.truncate(path, data.rfind(b"\n") + 1)


def derived_seed(seed: int, index: int, factor: int = 1_000_003) -> int:
    """The seed of one batch, step or epoch of a run seeded `seed`: distinct
    per index, and within what torch's generators take for any --seed (a
    product past 2^64 ended a run once its model had loaded); the plain
    product where that fits."""
    return (seed * factor + index) % 2**63


@torch.inference_mode()
def answer_batch(base, batch, params: AnswerParams, stops: list[int], pad: int, seed: int) -> list[Answer]:
    """One generate call; greedy and sampled pairs never share a batch row's
    settings, so a mixed batch is split in two."""
    results = []
    for greedy in (True, False):
        rows = [(prompt, sample) for prompt, sample in batch if (sample == 0) == greedy]
        if rows:
            results += generate_rows(base, rows, params, stops, pad, seed, greedy)
    return results


def generate_rows(base, rows, params, stops, pad, seed, greedy) -> list[Answer]:
    """One left-padded generate call over (prompt, sample) rows, all greedy or all sampled."""
    width = max(len(prompt.ids) for prompt, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (prompt, _) in enumerate(rows):  # left padding
        input_ids[row, width - len(prompt.ids) :] = torch.tensor(prompt.ids)
        attention[row, width - len(prompt.ids) :] = 1
    torch.manual_seed(seed)
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": params.temperature, "top_p": 1.0, "top_k": 0}
    output = base.model.generate(
        input_ids=input_ids.to(base.device),
        attention_mask=attention.to(base.device),
        max_new_tokens=params.max_new_tokens,
        eos_token_id=stops,
        pad_token_id=pad,
        **sampling,
    )[:, width:].tolist()  # (B, new)
    answers = []
    for (prompt, sample), tokens in zip(rows, output):
        ends = [position for position, token in enumerate(tokens) if token in stops]
        finished = bool(ends)
        tokens = tokens[: ends[0] + 1] if finished else tokens
        answers.append(Answer(prompt.id, sample, list(prompt.ids), tokens, finished))
    return answers
