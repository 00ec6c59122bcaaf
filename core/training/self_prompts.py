"""Training prompts written by the base model itself.

A head learns what the model says after the prompts it is trained on. A file
of a few hundred prompts covers few topics, and a head trained on many
answers to them drafts better on them than on what users ask (the bundled
head's last stage: 63.5% right at the first draft step on its training
positions against 58.8% on held-out prompts'). An instruction-tuned model given its chat template
up to the user's turn writes a user's request itself; sampled at temperature
1, each one is new (the "Magpie" way of making instruction data). Each
request here starts from the first few words of a prompt of the file (none
to --opening-words), so that the kinds of request follow the file's
(questions, instructions, code) while their topics are the model's own.

The prompts train-head holds out never lend their words, and the written
prompts get ids outside the held-out split, so that held-out figures stay on
the file's own prompts. Requests are generated in seeded batches and cached
in the work folder, so a rerun reuses them and a stopped run resumes."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from core.prompt import _control_texts, _render, stop_token_ids
from core.training.answers import AnswerParams, Prompt, _generate, derived_seed, drop_partial_line, training_ids
from core.training.features import FeatureParams, is_held_out

REQUESTS_FILE = "requests.jsonl"  # the generated requests, in --work
MARK = "\u2063KESTREL-USER-TURN\u2063"  # stands for the user's text while the template is rendered


@dataclass(frozen=True)
class SelfParams:
    count: int = 2000  # requests to generate (fewer prompts come out: unfinished, short and repeated ones are dropped)
    max_new_tokens: int = 128  # longest request in tokens; longer ones are dropped as unfinished
    temperature: float = 1.0
    opening_words: int = 3  # each request starts from the first 0..this many words of a file prompt
    batch_size: int = 32
    seed: int = 0
    min_words: int = 3  # shorter requests are dropped


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text before a user's first message (its system
    prompt, if it adds one, and the user header)."""
    text = _render(tokenizer, [{"role": "user", "content": MARK}])
    if MARK not in text:
        raise ValueError("this model's chat template does not show the user's message as written, so it cannot write requests")
    return text.split(MARK)[0]


def request_ids(count: int, seed: int, fraction: float) -> list[str]:
    """`count` ids for generated requests, none of them in the held-out split."""
    ids, number = [], 0
    while len(ids) < count:
        candidate = f"self-{seed}-{number}"
        if not is_held_out(candidate, fraction):
            ids.append(candidate)
        number += 1
    return ids


def openings(prompts_path: Path, count: int, params: SelfParams, fraction: float) -> list[str]:
    """The opening words of each request, drawn from the file's prompts that are not held out."""
    texts = [row["turns"][0] for pid, row in training_ids(prompts_path).items() if not is_held_out(pid, fraction)]
    texts = [text for text in texts if isinstance(text, str) and text.strip()]
    if not texts:
        raise ValueError(
            f"{prompts_path}: every prompt is in train-head's held-out split (about {fraction:.0%} of prompts, chosen by "
            "id), and held-out prompts never lend their words to requests; give a file of more prompts"
        )
    rng = random.Random(params.seed)
    chosen = []
    for _ in range(count):
        words = rng.choice(texts).split()
        chosen.append(" ".join(words[: rng.randint(0, params.opening_words)]))
    return chosen


def read_requests(path: Path) -> dict[str, dict]:
    """id -> cached record; a cut last line (a killed run) is ignored."""
    records = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
                records[record["id"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return records


@torch.inference_mode()
def generate_requests(base, prompts_path: Path, work: Path, params: SelfParams, progress: bool = True) -> list[dict]:
    """Generate (or take from the cache) `params.count` requests; returns
    the prompt rows worth training on, in id order."""
    from tqdm import tqdm

    fraction = FeatureParams().eval_fraction
    tokenizer = base.tokenizer
    prefix = user_turn_prefix(tokenizer)
    ids = request_ids(params.count, params.seed, fraction)
    opened = openings(prompts_path, params.count, params, fraction)
    cache = work / REQUESTS_FILE
    settings = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "opening_words": params.opening_words}
    check_settings(cache, settings)
    drop_partial_line(cache)
    done = read_requests(cache)
    answer = AnswerParams(1, params.max_new_tokens, params.temperature, params.batch_size)
    stops = sorted(stop_token_ids(base.model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    batches = [list(range(start, min(start + params.batch_size, params.count))) for start in range(0, params.count, params.batch_size)]
    bar = tqdm(total=params.count, initial=sum(rid in done for rid in ids), unit="request", desc="requests", disable=not progress)
    with open(cache, "a", encoding="utf-8") as out:
        for number, batch in enumerate(batches):
            todo = [index for index in batch if ids[index] not in done]
            if not todo:
                continue
            # the whole batch, done rows too: a resumed batch is the batch an uninterrupted run sampled
            rows = [(Prompt(ids[i], tuple(tokenizer(prefix + opened[i], add_special_tokens=False)["input_ids"])), 1) for i in batch]
            made = _generate(base, rows, answer, stops, pad, derived_seed(params.seed, number), greedy=False)
            for index, request in zip(batch, made):
                if ids[index] in done:
                    continue
                body = tokenizer.decode([token for token in request.answer_ids if token not in stops], skip_special_tokens=True)
                record = {"id": ids[index], "text": (opened[index] + body).strip(), "finished": request.finished}
                done[ids[index]] = record
                out.write(json.dumps(record) + "\n")
            out.flush()
            bar.update(len(todo))
    bar.close()
    return usable(done, ids, prompts_path, tokenizer, params)


def usable(done: dict[str, dict], ids: list[str], prompts_path: Path, tokenizer, params: SelfParams) -> list[dict]:
    """The finished requests of at least params.min_words words, once each
    (case and spacing aside), none repeating a prompt of the file, none
    holding the template's control tokens."""
    controls = _control_texts(tokenizer)
    seen = {" ".join(str(row["turns"][0]).lower().split()) for row in training_ids(prompts_path).values()}
    rows = []
    for rid in ids:
        record = done.get(rid)
        if record is None or not record["finished"]:
            continue
        text = record["text"]
        key = " ".join(text.lower().split())
        if len(text.split()) < params.min_words or key in seen or any(control in text for control in controls):
            continue
        seen.add(key)
        rows.append({"id": rid, "source": "self", "turns": [text]})
    return rows


def check_settings(cache: Path, settings: dict) -> None:
    """Refuse to add requests made with other settings to a cache (they
    would be mixed silently); the settings are kept beside it."""
    recorded = cache.with_name(f"{cache.stem}-settings.json")
    if recorded.is_file():
        saved = json.loads(recorded.read_text(encoding="utf-8"))
        for key, value in settings.items():
            if key in saved and saved[key] != value:
                option = "--" + key.replace("_", "-")
                raise ValueError(
                    f"{cache.parent}: its requests were made with {option} {saved[key]}, and this run asks for {value}; "
                    f"give {option} {saved[key]}, or another --work"
                )
    cache.parent.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps(settings) + "\n", encoding="utf-8")
