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

import torch

from core.capture import LayerCapture
from core.training.answers import AnswerParams, cached_answers, generate_answers, read_prompts
from core.training.compare import drafted_accuracy
from core.training.features import MANIFEST, FeatureParams, extract_features, is_held_out
from core.training.report import write_report
from core.training.trainer import TrainParams, Trainer, frequent_tokens, head_config_for, initial_weights, new_head
from core.training.work import BASE_FILE, holds_a_run, start_run
from models import eagle3
from models.head import save_head, with_draft_vocabulary
from models.paths import write_whole

ANSWERS_FILE = "answers.jsonl"
PHASES_FILE = "phases.json"
EMBEDDING_ROWS = 4096  # embedding rows that tell one base model from another
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
        try:
            seconds = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError) as error:  # emptied or cut short (a power cut): the times alone are lost
            print(f"note: {path} cannot be read ({error}); the phases' times count from now", flush=True)
            seconds = {}
        self.seconds = seconds if isinstance(seconds, dict) else {}
        self.lock = threading.Lock()

    @contextmanager
    def phase(self, name: str):
        before, started, stop = self.seconds.get(name, 0.0), time.time(), threading.Event()

        def save_now() -> None:
            self._save(name, before + time.time() - started)

        def save_every() -> None:
            while not stop.wait(self.SAVE_EVERY):
                try:
                    save_now()
                except OSError:  # a full disk: the phase's own writing says so; the time is saved at its end
                    pass

        saver = threading.Thread(target=save_every, name="phase-clock", daemon=True)
        saver.start()
        failed = True
        try:
            yield
            failed = False
        finally:
            stop.set()
            saver.join()
            try:
                save_now()
            except OSError:
                if not failed:
                    raise  # else the error that stopped the phase is the one to tell

    def _save(self, name: str, seconds: float) -> None:
        with self.lock:
            self.seconds[name] = seconds
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")  # whole or not at all
            try:
                partial.write_text(json.dumps(self.seconds, indent=2) + "\n")
                partial.replace(self.path)
            except OSError as error:
                partial.unlink(missing_ok=True)
                raise OSError(f"{partial}: cannot be written ({error.strerror or error})") from error


class TrainingStopped(Exception):
    """The time budget ran out before any training step; the run's work is kept for --resume."""


def base_identity(base) -> dict:
    """How a work folder records its base model (see check_base_model)."""
    import hashlib

    import torch

    config = base.model.config
    weight = base.model.get_input_embeddings().weight
    rows = weight[:EMBEDDING_ROWS].detach().to("cpu", torch.bfloat16).contiguous()  # a large model's whole embedding is a GB
    return {
        "name": base.name,
        "quantization": base.quantization,
        "sizes": [config.model_type, config.hidden_size, config.num_hidden_layers, weight.shape[0]],
        "embedding": hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16],
    }


def recorded_base(work: Path) -> dict | None:
    """The base model recorded in `work` (check_base_model), or None."""
    try:
        recorded = json.loads((work / BASE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def recorded_base_problem(work: Path, base, recorded: dict | None = None) -> str | None:
    """Why `work`'s answers and features are not `base`'s, with what to give
    instead; None where they are, or where nothing is recorded (`recorded`:
    the record, where already read)."""
    recorded = recorded or recorded_base(work)
    if recorded is None:
        return None
    identity, name = base_identity(base), recorded.get("name")
    if (recorded.get("sizes"), recorded.get("embedding")) != (identity["sizes"], identity["embedding"]):
        return f"its answers and features came from another base model ({name}); this run loads {base.name}: give --model {name}"
    if recorded.get("quantization") != identity["quantization"]:
        quantization = recorded.get("quantization")
        return (f"its answers and features came from {name} with --quantization {quantization}, and this run loads it "
                f"with {base.quantization}: give --quantization {quantization}")  # fmt: skip
    return None


def check_base_model(work: Path, base) -> None:
    """Refuse to resume a work folder whose answers and features another base
    model made (or the same one quantized otherwise): they would be mixed
    with this one's, or fail hours later on a shape. The model is known by
    its sizes and its embedding's first rows (in bf16, so a float32 or
    bfloat16 load of the same weights is the same model), not by how it was
    named; a work folder from before this record gets it now."""
    recorded = recorded_base(work)
    if recorded is not None and not holds_a_run(work):
        recorded = None  # the record alone (a run refused after it loaded its model): no answers or features to keep apart
    if recorded is None:
        work.mkdir(parents=True, exist_ok=True)
        write_whole(work / BASE_FILE, json.dumps(base_identity(base), indent=2) + "\n")
    elif problem := recorded_base_problem(work, base, recorded):
        raise ValueError(f"{work}: {problem}, or another --work")


def held_out_and_short(answers, fraction: float) -> tuple[int, int]:
    """(answers to held-out prompts, answers shorter than 2 tokens, which teach nothing) of `answers`."""
    return (
        sum(is_held_out(answer.id, fraction) for answer in answers),
        sum(len(answer.answer_ids) < 2 for answer in answers),
    )


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
        layers = eagle3.training_layer_ids(base.model.config.num_hidden_layers)
        feature_params = replace(feature_params, layer_ids=layers)
        train_params = replace(train_params, loss_vocab=draft_vocab)
    suffix = "-eagle3" if third else ""
    kept_vocabulary = None
    head_config = head_config_for(base.model.config)  # what a head needs of the model: now, not after hours of answers
    if third:
        LayerCapture(base.model, layers)  # where an EAGLE-3 head's features are captured
    if train_params.init_head:  # the shapes now, not after hours of answers and features
        initial_weights(Path(train_params.init_head), new_head(head_config, 0))
        kept_vocabulary = initial_draft_ids(Path(train_params.init_head), draft_vocab)
    # a prompt and its answer within the model's context window: past it positions the model never learnt
    # (RoPE models answer on, other text), or none it has (GPT-2's learnt positions: an IndexError hours in)
    window = getattr(base.model.config.get_text_config(), "max_position_embeddings", None)
    longest, why = answer_params.max_prompt_tokens, ""
    if isinstance(window, int) and window - answer_params.max_new_tokens < longest:
        longest = window - answer_params.max_new_tokens
        why = f" (the model's context window of {window} tokens less --max-new-tokens {answer_params.max_new_tokens})"
        if longest < 1:
            raise ValueError(f"--max-new-tokens {answer_params.max_new_tokens}: leaves no room for a prompt in the model's "
                             f"context window of {window} tokens; give at most {window - 1}")  # fmt: skip
    prompts = read_prompts(paths.prompts, base.tokenizer, longest, why)  # first: a refusal leaves no record
    check_base_model(paths.work, base)
    run = start_run(paths.work)  # recorded in the head's report too: a --resume replaces this run's head alone
    clock = PhaseClock(paths.work / PHASES_FILE)
    if not any(is_held_out(prompt.id, feature_params.eval_fraction) for prompt in prompts):
        print(
            f"note: none of the {len(prompts)} prompts falls in the held-out {feature_params.eval_fraction:.0%} "
            "(chosen by id), so there will be no held-out figures; about 50 prompts or more give some", flush=True,
        )  # fmt: skip
    features = paths.work / f"features{suffix}"
    plan = {(prompt.id, sample) for prompt in prompts for sample in range(answer_params.samples_per_prompt)}
    taken = any(features.glob("*/shard-*.safetensors"))  # a plan with no shard yet (stopped before one) may change
    if not taken:
        (features / MANIFEST).unlink(missing_ok=True)
    with clock.phase("answers"):
        if taken:  # features were taken from the answers so far: they stay as they are
            answers = cached_answers(prompts, paths.work / ANSWERS_FILE, answer_params)
            note_kept_answers(features, answers, plan)
        else:
            answers = generate_answers(
                base, prompts, paths.work / ANSWERS_FILE, answer_params, budget.answers_deadline, progress
            )
            answers = [answer for answer in answers if (answer.id, answer.sample) in plan]  # not those of removed prompts
    if not answers and budget.answers_deadline is not None and time.time() >= budget.answers_deadline:
        raise TrainingStopped("before the first answer; a larger --time-budget-minutes or --answer-share gives the answers time")
    if not answers:
        raise ValueError(f"{paths.work / ANSWERS_FILE}: no answers yet; give the answer phase more time")
    with clock.phase(f"features{suffix}"):  # per kind of head: a work folder's answers may serve both
        shards = extract_features(base, answers, features, feature_params, progress, budget.train_deadline)
    if not shards["train"]:  # no training step is possible: a head would be written untrained
        held, short = held_out_and_short(answers, feature_params.eval_fraction)
        raise ValueError(
            f"nothing to train on: of the {len(answers)} answers, {held} answer held-out prompts (about "
            f"{feature_params.eval_fraction:.0%} of prompts, chosen by id) and {short} are shorter than 2 tokens; "
            f"give more prompts, or a larger --max-new-tokens, with another --work (or delete {paths.work}: its answers "
            "are kept for --resume, which keeps their settings); no head was written"
        )
    with clock.phase(f"training{suffix}"):
        trainer = Trainer(base, shards["train"], shards["eval"], paths.work / f"train{suffix}", train_params, kept_vocabulary)
        trainer.run(budget.train_deadline, progress)
        if trainer.step == 0 and trainer.total_steps > 0:  # a random head is no result: nothing is written
            raise TrainingStopped("before the first training step")
    head, training = trainer.head.eval(), trainer.summary()
    del trainer  # its copies of the embedding and lm_head go before the judging below makes its own
    if draft_vocab and not third:
        vocab_size = base.model.get_output_embeddings().weight.shape[0]
        chosen = kept_vocabulary if kept_vocabulary is not None else frequent_tokens(shards["train"], draft_vocab, vocab_size)
        head = with_draft_vocabulary(head, chosen)
    # the head as written, judged as eval-heads judges it (float32; its draft tokens against the base model's
    # greedy token over the whole vocabulary): training's own figures count its training vocabulary alone
    with clock.phase(f"training{suffix}"):
        final = drafted_accuracy(base, head, shards["eval"], train_params.unroll_steps, train_params.batch_tokens, progress)
    report = {
        "base_model": base.name,
        **base_folder(base.name),
        "arch": train_params.arch,
        "run": run,
        "data": {**data_summary(paths, prompts, answers, shards, answer_params, feature_params),
                 "planned_answers": len(plan), "unanswered": len(plan - {(a.id, a.sample) for a in answers}),
                 # answers of prompts (or samples) this run does not plan (gone from the file, or now skipped for their
                 # length), whose features were taken before: trained on too
                 "unplanned_answers": len({(a.id, a.sample) for a in answers} - plan),
                 "features_kept": taken},
        "training": training,
        "final_eval": final,
        "draft_vocab": len(head.draft_token_ids) if head.draft_token_ids is not None else None,  # as written (at most the vocabulary)
        "draft_vocab_from": "init_head" if kept_vocabulary is not None else "answers",
        "phases": {name.removesuffix(suffix): round(seconds, 1) for name, seconds in clock.seconds.items()
                   if name in ("answers", f"features{suffix}", f"training{suffix}")},  # this head's phases alone
    }
    # the report first: its run id is what lets a --resume stopped while the head was written replace that head
    write_report(paths.out, report)
    if third:
        eagle3.save(head, paths.out)
    else:
        save_head(head, paths.out)
    return report


def initial_draft_ids(folder: Path, draft_vocab: int | None) -> torch.Tensor | None:
    """The draft tokens of the --init-head head when it drafts among exactly
    `draft_vocab` of them: continuing or fine-tuning it keeps them (its
    training ranked them over far more answers than a fine-tuning set may
    hold), for the loss and the head written. None where it has none or
    another number of them (then the new answers' most frequent are taken)."""
    from models.head import read_checkpoint

    _, state, _ = read_checkpoint(folder)
    offsets = state.get("d2t")
    if offsets is None or not draft_vocab or offsets.numel() != draft_vocab:
        return None
    return (offsets.long() + torch.arange(offsets.numel())).sort().values


def base_folder(name: str) -> dict:
    """{"base_model_folder": the absolute path} of a base model loaded from a
    local folder or file, named as typed (relative to where the run started,
    which the page's list of trained heads cannot know); {} for a repo id."""
    from models.errors import KestrelError
    from models.paths import user_path

    try:
        path = user_path(name)
        return {"base_model_folder": str(path.resolve())} if path.exists() else {}
    except (OSError, ValueError, RuntimeError, KestrelError):  # a ~user that is no user here, a loop of links
        return {}


def note_kept_answers(features: Path, answers, plan: set) -> None:
    """Say where the answers whose features were taken differ from what this
    run plans (a time budget stopped them, or the prompts or samples changed)."""
    made = {(answer.id, answer.sample) for answer in answers}
    missing, extra = len(plan - made), len(made - plan)
    if not missing and not extra:
        return
    parts = [f"{missing} of the {len(plan)} answers this run plans are not among them"] if missing else []
    if extra:
        parts.append(f"{extra} answer prompts or samples this run does not plan, and are trained on")
    print(f"note: {features} holds the features of {len(answers)} answers, taken before this run and kept as they are: "
          f"{'; '.join(parts)} (a new --work answers exactly this run's prompts)", flush=True)  # fmt: skip


def data_summary(paths, prompts, answers, shards, answer_params: AnswerParams, feature_params: FeatureParams) -> dict:
    from core.training.trainer import shard_lengths

    files = shards["train"] + shards["eval"]
    rows = sum(sum(shard_lengths(path)) for path in files)
    return {
        "prompts_file": str(paths.prompts),
        "prompts": len(prompts),
        "eval_prompts": sum(is_held_out(prompt.id, feature_params.eval_fraction) for prompt in prompts),
        "eval_answers": sum(is_held_out(answer.id, feature_params.eval_fraction) for answer in answers),
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
