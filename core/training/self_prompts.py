"""Training prompts written by the base model itself.

A head learns what the model says after the prompts it is trained on. A file
of a few hundred prompts covers few topics, and a head trained on many
answers to them drafts better on them than on what users ask (the bundled
head's last stage: 63.5% right at the first draft step on its training
positions against 58.8% on held-out prompts'). An instruction-tuned model
given its chat template up to the user's turn writes a user's request itself;
sampled, each one is new (the "Magpie" way of making instruction data). Each
request here starts from the first few words of a prompt of the file (none
to --opening-words), so that the kinds of request follow the file's
(questions, instructions, code) while their topics are the model's own.

The prompts train-head holds out never lend their words, and the written
prompts get ids outside the held-out split, so that held-out figures stay on
the file's own prompts. Requests are generated in seeded batches and cached
in the work folder with the settings and openings they were made with, so a
rerun reuses them and a stopped run resumes with what an uninterrupted one
would have written."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from core.prompt import control_texts, render_chat, stop_token_ids
from core.training.answers import (
    AnswerParams, Prompt, check_settings, derived_seed, drop_partial_line, generate_rows, recorded_settings, training_ids,
)
from core.training.features import FeatureParams, is_held_out

REQUESTS_FILE = "requests.jsonl"  # the generated requests, in --work
MARK = "\u2063KESTREL-USER-TURN\u2063"  # stands for the user's text while the template is rendered
# settings a cache's requests depend on, with the options that set them (their openings are checked apart)
CACHE_SETTINGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "batch_size": "--answer-batch"}


@dataclass(frozen=True)
class SelfParams:
    count: int = 2000  # requests to generate (fewer prompts come out: unfinished, short and repeated ones are dropped)
    max_new_tokens: int = 128  # longest request in tokens; longer ones are dropped as unfinished
    temperature: float = 1.0  # sampling temperature of the requests
    opening_words: int = 3  # each request starts from the first 0..this many words of a file prompt
    batch_size: int = 32  # requests per generate call; the batches (and so the samples) depend on it
    seed: int = 0  # seeds the openings' choice and each batch's sampling; names the requests (self-SEED-N)
    min_words: int = 3  # shorter requests are dropped


@dataclass(frozen=True)
class UserTurn:
    prefix: str  # the template's text before the user's message (a system prompt it adds, the user's header)
    end: str  # the plain text that follows the user's message ("[/INST]", "Assistant:"), or "" where a control token does


def user_turn(tokenizer) -> UserTurn:
    """Where the user's message starts and ends in the model's chat template."""
    text = render_chat(tokenizer, [{"role": "user", "content": MARK}])
    if text.count(MARK) != 1:
        raise ValueError("this model's chat template does not show the user's message as written, so it cannot write requests")
    prefix, after = text.split(MARK)
    after = after.strip()
    controls = control_texts(tokenizer)
    if not after or any(after.startswith(control) for control in controls):
        return UserTurn(prefix, "")
    end = after.splitlines()[0]
    for control in controls:  # the plain text before the next control token
        end = end.split(control)[0]
    return UserTurn(prefix, end.strip())


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
    texts = [text for text in texts if text.strip()]
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


def check_request_cache(work: Path, opened: list[str], params: SelfParams, openings_of: Callable[[int], list[str]] | None = None) -> None:
    """Refuse to add requests to a cache made with other settings or other
    openings (another prompt file, --seed or --opening-words): a resumed run
    would mix them silently, or take words from prompts held out since. Said
    before the model loads; the settings are then recorded beside the cache.
    Another --count is the same openings, more or fewer (each is drawn after
    those before it): `openings_of(count)` checks the cached run's count."""
    cache = work / REQUESTS_FILE
    digest = opening_digest(opened)
    saved = recorded_settings(cache, "requests")  # none where no request is cached yet
    count = saved.get("count")
    recounted = isinstance(count, int) and count != len(opened) and openings_of is not None
    if saved.get("openings", digest) != digest and not (recounted and opening_digest(openings_of(count)) == saved["openings"]):
        raise ValueError(
            f"{work}: its requests were opened with other words (the --prompts file, --seed or --opening-words was "
            "another); give the same ones, or another --work for new requests"
        )
    wanted = {key: getattr(params, key) for key in CACHE_SETTINGS}
    check_settings(cache, {**wanted, "openings": digest, "count": len(opened)}, CACHE_SETTINGS, "requests")


def opening_digest(opened: list[str]) -> str:
    return hashlib.sha256(json.dumps(opened).encode()).hexdigest()[:16]


def prepare_requests(prompts_path: Path, work: Path, params: SelfParams) -> tuple[list[str], list[str]]:
    """(each request's id, its opening words), checked against the requests
    cached in `work` (check_request_cache): for generate_requests, said
    wrong before the model loads."""
    fraction = FeatureParams().eval_fraction
    opened = openings(prompts_path, params.count, params, fraction)
    check_request_cache(work, opened, params, lambda count: openings(prompts_path, count, params, fraction))
    return request_ids(params.count, params.seed, fraction), opened


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


def written_text(tokenizer, opening_ids: list[int], made: list[int], stops: list[int], end: str) -> tuple[str, str, bool]:
    """(the request, the model's own part of it, whether it ended) from the
    opening's tokens and the sampled ones, decoded together (a tokenizer that
    drops a piece's leading space would join the opening to the next word).
    A request ends at a stop token, or where the template's text after a
    user's message (`end`) begins: the model went on to write the reply."""
    ended = any(token in stops for token in made)
    made = made[: next((i for i, token in enumerate(made) if token in stops), len(made))]
    opening = tokenizer.decode(opening_ids, skip_special_tokens=True)
    text = tokenizer.decode(opening_ids + made, skip_special_tokens=True)
    start = len(opening) if text.startswith(opening) else 0
    if end and end in text[start:]:
        text, ended = text[: start + text[start:].index(end)], True
    return text.strip(), text[start:].strip(), ended


@torch.inference_mode()
def generate_requests(
    base, prompts_path: Path, work: Path, params: SelfParams, planned: tuple[list[str], list[str]], progress: bool = True
) -> list[dict]:
    """Generate (or take from the cache) `params.count` requests, with the ids
    and openings prepare_requests `planned`; returns the prompt rows worth
    training on, in id order."""
    from tqdm import tqdm

    tokenizer = base.tokenizer
    turn = user_turn(tokenizer)
    ids, opened = planned
    cache = work / REQUESTS_FILE
    drop_partial_line(cache)
    done = read_requests(cache)
    sampling = AnswerParams(1, params.max_new_tokens, params.temperature, params.batch_size)
    stops = sorted(stop_token_ids(base.model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    prefix_ids = tokenizer(turn.prefix, add_special_tokens=False)["input_ids"]
    batches = [list(range(start, min(start + params.batch_size, params.count))) for start in range(0, params.count, params.batch_size)]
    bar = tqdm(total=params.count, initial=sum(rid in done for rid in ids), unit="request", desc="requests", disable=not progress)
    with open(cache, "a", encoding="utf-8") as out:
        for number, batch in enumerate(batches):
            todo = [index for index in batch if ids[index] not in done]
            if not todo:
                continue
            # the whole batch, done rows too: a resumed batch is the batch an uninterrupted run sampled
            rows = [(Prompt(ids[i], tuple(tokenizer(turn.prefix + opened[i], add_special_tokens=False)["input_ids"])), 1) for i in batch]
            made = generate_rows(base, rows, sampling, stops, pad, derived_seed(params.seed, number), greedy=False)
            for index, (prompt, _), request in zip(batch, rows, made):
                if ids[index] in done:
                    continue
                shared = next((k for k, (a, b) in enumerate(zip(prefix_ids, prompt.ids)) if a != b), min(len(prefix_ids), len(prompt.ids)))
                text, own, ended = written_text(tokenizer, list(prompt.ids[shared:]), request.answer_ids, stops, turn.end)
                record = {"id": ids[index], "opening": opened[index], "text": text, "own_words": len(own.split()), "finished": ended}
                done[ids[index]] = record
                out.write(json.dumps(record) + "\n")
            out.flush()
            bar.update(len(todo))
    bar.close()
    return usable(done, ids, prompts_path, tokenizer, params)


def usable(done: dict[str, dict], ids: list[str], prompts_path: Path, tokenizer, params: SelfParams) -> list[dict]:
    """The requests worth training on: finished, with words of the model's
    own, of at least params.min_words words, once each (case and spacing
    aside), none repeating a prompt of the file, none holding the template's
    control tokens."""
    controls = control_texts(tokenizer)
    seen = {" ".join(str(row["turns"][0]).lower().split()) for row in training_ids(prompts_path).values()}
    rows = []
    for rid in ids:
        record = done.get(rid)
        if record is None or not record.get("finished") or not record.get("own_words"):
            continue
        text = record["text"]
        key = " ".join(text.lower().split())
        if len(text.split()) < params.min_words or key in seen or any(control in text for control in controls):
            continue
        seen.add(key)
        rows.append({"id": rid, "source": "self", "turns": [text]})
    return rows
