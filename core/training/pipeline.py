"""The whole train-head run: answers -> features -> training -> head folder and
report. Every phase resumes from its cache in the work folder; the wall time
of each phase accumulates over runs in work/phases.json."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from core.training.answers import AnswerParams, cached_answers, generate_answers, read_prompts
from core.training.features import MANIFEST, FeatureParams, extract_features, is_held_out
from core.training.report import write_report
from core.training.trainer import TrainParams, Trainer, frequent_tokens
from models import eagle3
from models.head import save_head, with_draft_vocabulary

ANSWERS_FILE = "answers.jsonl"
PHASES_FILE = "phases.json"
# Tokens the head drafts among: on the bundled 135M model the 8192 most frequent
# answer tokens cut drafting time by more than half and tau by about 5% (README).
DRAFT_VOCAB = 8192


@dataclass(frozen=True)
class RunPaths:
    prompts: Path  # JSONL prompt file
    out: Path  # the head folder written at the end
    work: Path  # caches: answers, feature shards, checkpoints


@dataclass(frozen=True)
class Budget:
    answers_deadline: float | None = None  # time.time() after which no new answer batch starts
    train_deadline: float | None = None  # ... no new training step


class PhaseClock:
    """Seconds per phase, accumulated across resumed runs. A running phase's
    time is also written every SAVE_EVERY seconds, so a run killed outright
    (SIGKILL, a power cut) loses at most that much of it."""

    SAVE_EVERY = 60.0

    def __init__(self, path: Path):
        self.path = path
        self.seconds = json.loads(path.read_text()) if path.is_file() else {}
        self.lock = threading.Lock()

    @contextmanager
    def phase(self, name: str):
        before, started, stop = self.seconds.get(name, 0.0), time.time(), threading.Event()

        def save_now() -> None:
            self._save(name, before + time.time() - started)

        def save_every() -> None:
            while not stop.wait(self.SAVE_EVERY):
                save_now()

        saver = threading.Thread(target=save_every, name="phase-clock", daemon=True)
        saver.start()
        try:
            yield
        finally:
            stop.set()
            saver.join()
            save_now()

    def _save(self, name: str, seconds: float) -> None:
        with self.lock:
            self.seconds[name] = seconds
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")  # whole or not at all
            partial.write_text(json.dumps(self.seconds, indent=2) + "\n")
            partial.replace(self.path)


class TrainingStopped(Exception):
    """The time budget ran out before any training step; the run's work is kept for --resume."""


def train_head(
    base,
    paths: RunPaths,
    answer_params: AnswerParams,
    feature_params: FeatureParams,
    train_params: TrainParams,
    budget: Budget = Budget(),
    progress: bool = True,
    draft_vocab: int | None = DRAFT_VOCAB,
) -> dict:
    """Run (or resume) every phase; returns the report written next to the head.
    draft_vocab: the head drafts among this many most frequent answer tokens
    (None: the whole vocabulary); drafting cost shrinks with it. An EAGLE-3
    head (train_params.arch) is trained over that vocabulary from the start,
    on features that include three captured layers (their own cache folders)."""
    third = train_params.arch == "eagle3"
    if third:
        layers = eagle3.default_layer_ids(base.model.config.num_hidden_layers)
        feature_params = replace(feature_params, layer_ids=layers)
        train_params = replace(train_params, loss_vocab=draft_vocab)
    suffix = "-eagle3" if third else ""
    clock = PhaseClock(paths.work / PHASES_FILE)
    prompts = read_prompts(paths.prompts, base.tokenizer, answer_params.max_prompt_tokens)
    if not any(is_held_out(prompt.id, feature_params.eval_fraction) for prompt in prompts):
        print(
            f"note: none of the {len(prompts)} prompts falls in the held-out {feature_params.eval_fraction:.0%} "
            "(chosen by id), so there will be no held-out figures; about 50 prompts or more give some", flush=True,
        )  # fmt: skip
    features = paths.work / f"features{suffix}"
    with clock.phase("answers"):
        if (features / MANIFEST).is_file():  # features were taken from the answers so far: they stay as they are
            answers = cached_answers(prompts, paths.work / ANSWERS_FILE, answer_params)
            planned = len(prompts) * answer_params.samples_per_prompt
            if len(answers) < planned:
                print(f"note: {features} holds the features of {len(answers)} of {planned} planned answers, made before "
                      "the time budget stopped the answers; they are kept as they are (a new --work answers every prompt)",
                      flush=True)  # fmt: skip
        else:
            answers = generate_answers(
                base, prompts, paths.work / ANSWERS_FILE, answer_params, budget.answers_deadline, progress
            )
    if not answers:
        raise ValueError(f"{paths.work / ANSWERS_FILE}: no answers yet; give the answer phase more time")
    with clock.phase("features"):
        shards = extract_features(base, answers, features, feature_params, progress, budget.train_deadline)
    with clock.phase("training"):
        trainer = Trainer(base, shards["train"], shards["eval"], paths.work / f"train{suffix}", train_params)
        trainer.run(budget.train_deadline, progress)
        if trainer.step == 0 and trainer.total_steps > 0:  # a random head is no result: nothing is written
            raise TrainingStopped("before the first training step")
        final = trainer.final_eval()
    head = trainer.head.eval()
    if third:
        eagle3.save(head, paths.out)
    else:
        if draft_vocab:
            vocab_size = base.model.get_output_embeddings().weight.shape[0]
            head = with_draft_vocabulary(head, frequent_tokens(shards["train"], draft_vocab, vocab_size))
        save_head(head, paths.out)
    report = {
        "base_model": base.name,
        "arch": train_params.arch,
        "data": data_summary(paths, prompts, answers, shards, answer_params, feature_params),
        "training": trainer.summary(),
        "final_eval": final,
        "draft_vocab": draft_vocab,
        "phases": {name: round(seconds, 1) for name, seconds in clock.seconds.items()},
    }
    write_report(paths.out, report)
    return report


def data_summary(paths, prompts, answers, shards, answer_params: AnswerParams, feature_params: FeatureParams) -> dict:
    from core.training.trainer import shard_lengths

    files = shards["train"] + shards["eval"]
    rows = sum(sum(shard_lengths(path)) for path in files)
    return {
        "prompts_file": str(paths.prompts),
        "prompts": len(prompts),
        "eval_prompts": sum(is_held_out(prompt.id, feature_params.eval_fraction) for prompt in prompts),
        "answers": len(answers),
        "samples_per_prompt": answer_params.samples_per_prompt,
        "temperature": answer_params.temperature,
        "max_new_tokens": answer_params.max_new_tokens,
        "finished_fraction": sum(answer.finished for answer in answers) / len(answers),
        "answer_tokens": sum(len(answer.answer_ids) for answer in answers),
        "feature_rows": rows,
        "shards": len(files),
        "feature_megabytes": sum(path.stat().st_size for path in files) / 2**20,
    }
