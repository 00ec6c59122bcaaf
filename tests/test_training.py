import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.config import SamplingParams, TreeParams
from core.engine import Engine
from core.prompt import stop_token_ids
from core.training.answers import AnswerParams, generate_answers, read_answers, read_prompts
from core.training.features import FeatureParams, Sequence, extract_features, read_shard, write_shard
from core.training.pipeline import RunPaths, train_head
from core.training.report import REPORT_FILE, NOTES_FILE
from core.training.trainer import TrainParams, Trainer, evaluate, frozen_of, head_config_for, new_eagle3_head, new_head, unrolled_mask
from models.head import load_head

ANSWERS = AnswerParams(samples_per_prompt=2, max_new_tokens=24, batch_size=4, max_prompt_tokens=64)
FEATURES = FeatureParams(shard_tokens=300, batch_tokens=256, eval_fraction=0.25)
TRAIN = TrainParams(epochs=3, learning_rate=3e-3, warmup_steps=3, batch_tokens=256, bf16=False, checkpoint_every=4)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    generator = torch.Generator().manual_seed(0)
    lines = []
    for i in range(16):
        words = torch.randint(8, 64, (3 + i % 5,), generator=generator).tolist()
        lines.append(json.dumps({"id": f"p{i}", "turns": [" ".join(f"w{w - 8}" for w in words)]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def features(tiny_base, prompts_file, tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    prompts = read_prompts(prompts_file, tiny_base.tokenizer)
    answers = generate_answers(tiny_base, prompts, work / "answers.jsonl", ANSWERS, progress=False)
    return answers, extract_features(tiny_base, answers, work / "features", FEATURES, progress=False)


def test_answers_cover_every_prompt_and_sample(tiny_base, features):
    answers, _ = features
    assert {(a.id, a.sample) for a in answers} == {(f"p{i}", s) for i in range(16) for s in range(2)}
    stops = stop_token_ids(tiny_base.model, tiny_base.tokenizer)
    for answer in answers:
        assert answer.prompt_ids[-2:] == tiny_base.tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])
        assert answer.finished == (answer.answer_ids[-1] in stops)
        assert not stops & set(answer.answer_ids[:-1])


def test_answer_cache_resumes_without_regenerating(tiny_base, prompts_file, tmp_path):
    prompts = read_prompts(prompts_file, tiny_base.tokenizer)
    cache = tmp_path / "answers.jsonl"
    first = generate_answers(tiny_base, prompts, cache, ANSWERS, deadline=0.0, progress=False)
    assert first == []
    full = generate_answers(tiny_base, prompts, cache, ANSWERS, progress=False)
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:10]) + "\n" + lines[10][:7])  # a killed run: a cut last line
    resumed = generate_answers(tiny_base, prompts, cache, ANSWERS, progress=False)
    key = lambda a: (a.id, a.sample)  # noqa: E731
    assert sorted(resumed, key=key) == sorted(full, key=key)  # the same batches, the same seeds


def test_the_largest_seed_answers_and_trains(tiny_base, features, prompts_file, tmp_path):
    """--seed takes 0 to 2^63-1; the seeds derived from it per batch, step and
    epoch overflowed torch's generators past about 1.8e13, after the model had loaded."""
    from dataclasses import replace

    from core.training.answers import derived_seed

    largest = 2**63 - 1
    assert derived_seed(5, 7) == 5 * 1_000_003 + 7 and derived_seed(5, 1, 7919) == 5 * 7919 + 1  # as before, where it fits
    prompts = read_prompts(prompts_file, tiny_base.tokenizer)[:2]
    answers = generate_answers(tiny_base, prompts, tmp_path / "answers.jsonl", replace(ANSWERS, seed=largest), progress=False)
    assert len(answers) == 4
    _, shards = features
    assert Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "train", replace(TRAIN, epochs=1, seed=largest)).run(progress=False)


def test_a_full_disk_at_a_checkpoint_names_the_file_and_leaves_no_partial_one(tiny_base, features, tmp_path, monkeypatch):
    """torch.save on a full disk raises a RuntimeError naming neither file nor
    cause ("basic_ios::clear: iostream error"), and the phase clock's own
    failure then hid it behind a bare "[Errno 28]"."""
    from core.training import trainer as trainer_module
    from core.training.pipeline import PhaseClock

    def full(state, path):
        Path(path).write_bytes(b"half a checkpoint")
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(trainer_module.torch, "save", full)
    _, shards = features
    folder = tmp_path / "train"
    with pytest.raises(OSError, match=r"checkpoint\.pt\.partial: cannot be written \(basic_ios::clear: iostream error; [\d,]+ MB free on its disk\)"):
        Trainer(tiny_base, shards["train"], shards["eval"], folder, TRAIN).run(progress=False)
    assert [p.name for p in folder.glob("*.partial")] == []
    clock = PhaseClock(tmp_path / "phases.json")
    monkeypatch.setattr(Path, "write_text", lambda *args, **kwargs: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="the phase's own error"):  # not the clock's, which fails the same way after it
        with clock.phase("train"):
            raise OSError("the phase's own error")
    with pytest.raises(OSError, match=r"phases\.json\.partial: cannot be written \(No space left on device\)"):
        with clock.phase("train"):
            pass


def test_features_stop_between_shards_past_the_deadline_and_resume(tiny_base, features, tmp_path, monkeypatch):
    from core.training import features as extraction

    answers, shards = features
    folder = tmp_path / "features"
    clock = iter([0.0, 0.0, 2.0])  # two shards start before the deadline (1.0), the third after it
    monkeypatch.setattr(extraction.time, "time", lambda: next(clock, 2.0))
    with pytest.raises(extraction.FeaturesStopped, match=r"features: \d+ of \d+ shards are still to be taken"):
        extract_features(tiny_base, answers, folder, FEATURES, progress=False, deadline=1.0)
    assert len(list(folder.glob("*/shard-*.safetensors"))) == 2
    resumed = extract_features(tiny_base, answers, folder, FEATURES, progress=False)
    for split, paths in shards.items():
        assert [path.name for path in resumed[split]] == [path.name for path in paths]
        for mine, theirs in zip(resumed[split], paths):
            assert all(torch.equal(a.features, b.features) for a, b in zip(read_shard(mine), read_shard(theirs)))


def test_loss_mask_covers_exactly_the_answer(features):
    answers, shards = features
    by_tokens = {tuple(a.prompt_ids + a.answer_ids): a for a in answers}
    sequences = [s for split in shards.values() for path in split for s in read_shard(path)]
    assert len(sequences) == len([a for a in answers if len(a.answer_ids) >= 2])
    for sequence in sequences:
        answer = by_tokens[tuple(sequence.input_ids.tolist())]
        p, n = len(answer.prompt_ids), len(answer.answer_ids)
        expected = [0] * (p - 1) + [1] * n + [0]
        assert sequence.loss_mask.tolist() == expected  # token_{t+1} is an answer token
    assert shards["eval"] and shards["train"]


def test_features_are_the_post_norm_hidden_state(tiny_base, features):
    _, shards = features
    sequence = read_shard(shards["train"][0])[0]
    with torch.no_grad():
        hidden = tiny_base.model(sequence.input_ids.long()[None], output_hidden_states=True).hidden_states[-1][0]
    assert torch.allclose(sequence.features.double(), hidden, atol=2e-2 * hidden.abs().max().item())


def test_shards_round_trip(tmp_path):
    sequences = [
        Sequence(torch.arange(n, dtype=torch.int32), (torch.arange(n) % 2).to(torch.uint8), torch.randn(n, 8).bfloat16())
        for n in (3, 5, 1)
    ]
    write_shard(tmp_path / "shard.safetensors", sequences)
    for before, after in zip(sequences, read_shard(tmp_path / "shard.safetensors"), strict=True):
        assert torch.equal(before.input_ids, after.input_ids)
        assert torch.equal(before.loss_mask, after.loss_mask)
        assert torch.equal(before.features, after.features)
    assert not list(tmp_path.glob("*.partial"))


def test_unrolled_mask_matches_a_draft_chain():
    mask = unrolled_mask(4, 2)[0, 0].int()  # query t sees true keys <= t-2, step-1 key t-1, step-2 key t
    assert mask.tolist() == [
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
    ]


def test_training_lowers_the_loss(tiny_base, features, tmp_path):
    _, shards = features
    trainer = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path, TRAIN)
    frozen = frozen_of(tiny_base, bf16=False)
    before = evaluate(new_head(head_config_for(tiny_base.model.config), 0), shards["eval"], frozen, TRAIN)
    assert trainer.run(progress=False)
    after = trainer.final_eval()
    assert after["smooth_l1"][0] < before["smooth_l1"][0]
    assert after["cross_entropy"][0] < before["cross_entropy"][0]
    assert len(trainer.history) == TRAIN.epochs


def test_resume_continues_where_it_stopped(tiny_base, features, tmp_path):
    _, shards = features
    straight = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "a", TRAIN)
    straight.run(progress=False)
    stopped = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "b", TRAIN)
    assert not stopped.run(progress=False, stop_at=straight.steps_per_epoch + 2)  # mid-epoch, off the checkpoint grid
    resumed = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "b", TRAIN)
    assert resumed.step == straight.steps_per_epoch + 2
    assert resumed.run(progress=False)
    for key, value in straight.head.state_dict().items():
        assert torch.equal(value, resumed.head.state_dict()[key]), key
    assert [r["eval"] for r in resumed.history] == [r["eval"] for r in straight.history]


def test_a_half_written_last_line_is_cut_in_place(tmp_path, monkeypatch):
    """The cut rewrote the whole cache (emptied, then written): a kill during
    it lost the complete lines too, hours of answers."""
    from pathlib import Path

    from core.training.answers import drop_partial_line

    cache = tmp_path / "answers.jsonl"
    cache.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "ans')
    monkeypatch.setattr(Path, "write_bytes", lambda *args: pytest.fail("the cache was written anew"))
    drop_partial_line(cache)
    assert cache.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    drop_partial_line(cache)  # whole lines: left as they are
    assert cache.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'


def stopped_on_copied_features(tiny_base, features, tmp_path) -> tuple[Path, list[Path], list[Path]]:
    """A copy of the module's feature folder, and a run on it stopped at step 2
    (its checkpoint in tmp_path / "train") -> (the copy, its train and eval shards)."""
    _, shards = features
    copied = tmp_path / "features"
    shutil.copytree(shards["train"][0].parent.parent, copied)
    train = [copied / "train" / path.name for path in shards["train"]]
    evals = [copied / "eval" / path.name for path in shards["eval"]]
    assert not Trainer(tiny_base, train, evals, tmp_path / "train", TRAIN).run(progress=False, stop_at=2)
    return copied, train, evals


def test_damaged_work_files_are_named_with_what_to_delete(tiny_base, features, tmp_path, capsys):
    """A checkpoint or a feature shard cut short (a power cut between a write
    and its rename) ended --resume in torch's or safetensors' traceback, and an
    emptied phases.json in a JSON error naming no file."""
    from core.training.pipeline import PhaseClock
    from core.training.trainer import CHECKPOINT

    copied, train, evals = stopped_on_copied_features(tiny_base, features, tmp_path)
    checkpoint = tmp_path / "train" / CHECKPOINT
    whole = checkpoint.read_bytes()
    for damaged in (whole[:1000], b""):
        checkpoint.write_bytes(damaged)
        with pytest.raises(ValueError, match=f"{checkpoint}: cannot be read .*delete it to train from scratch"):
            Trainer(tiny_base, train, evals, tmp_path / "train", TRAIN)
    checkpoint.write_bytes(whole)
    train[0].write_bytes(train[0].read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{train[0]}: a feature shard that cannot be read .*delete the folder {copied} to extract"):
        Trainer(tiny_base, train, evals, tmp_path / "train", TRAIN)
    phases = tmp_path / "phases.json"
    phases.write_text("")
    assert PhaseClock(phases).seconds == {} and f"note: {phases} cannot be read" in capsys.readouterr().out


def test_a_diverging_run_stops_and_keeps_the_last_finite_head(tiny_base, features, tmp_path, monkeypatch):
    """A loss that turned NaN (too high a learning rate) went on training: every
    checkpoint after it held NaN weights, and the run wrote a head the app
    refuses, with exit status 0."""
    from core.training import trainer as trainer_module
    from core.training.trainer import CHECKPOINT, TrainingDiverged

    _, shards = features
    losses = trainer_module.forward_losses
    calls = []

    def turning_nan(*args, **kwargs):
        loss = losses(*args, **kwargs)
        calls.append(1)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(trainer_module, "forward_losses", turning_nan)
    trainer = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path, TRAIN)
    with pytest.raises(TrainingDiverged, match="training diverged at step 3: .*the checkpoint keeps the head of step 2.*--learning-rate"):
        trainer.run(progress=False)
    saved = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert saved["step"] == 2 and all(bool(torch.isfinite(value).all()) for value in saved["head"].values())
    assert all(bool(torch.isfinite(value).all()) for value in trainer.head.state_dict().values())


def test_a_checkpoint_of_features_from_other_answers_is_not_resumed(tiny_base, features, tmp_path):
    """Features extracted again after prompts were removed can plan as many
    steps as before; the checkpoint, trained on the removed prompts' answers,
    was resumed, and the report named the new prompts alone."""
    from core.training.features import MANIFEST

    copied, train, evals = stopped_on_copied_features(tiny_base, features, tmp_path)
    assert Trainer(tiny_base, train, evals, tmp_path / "train", TRAIN).step == 2  # the same answers: resumed
    manifest = json.loads((copied / MANIFEST).read_text())
    (copied / MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "0" * 64}))  # the same shards, as other answers made them
    with pytest.raises(ValueError, match="the checkpoint was made with other settings \\(the training data\\)"):
        Trainer(tiny_base, train, evals, tmp_path / "train", TRAIN)


@pytest.mark.skipif(os.name == "nt", reason="os.kill with SIGINT ends the process on Windows")
def test_ctrl_c_inside_an_optimizer_step_lands_after_it(tiny_base, features, tmp_path, monkeypatch):
    """Ctrl+C while the optimizer updates the parameters one by one: the step is
    applied whole and counted, then the run stops with its checkpoint, and the
    resumed run ends where an uninterrupted one does (a half-applied step was saved and applied again)."""
    import os
    import signal

    _, shards = features
    straight = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "a", TRAIN)
    straight.run(progress=False)
    stopped = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "b", TRAIN)
    step = stopped.optimizer.step

    def interrupted_step(*args, **kwargs):
        done = step(*args, **kwargs)
        if stopped.step == 3:  # lands once the parameters are updated, before the step is counted
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        return done

    monkeypatch.setattr(stopped.optimizer, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        stopped.run(progress=False)
    assert stopped.step == 4
    resumed = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "b", TRAIN)
    assert resumed.step == 4 and resumed.run(progress=False)
    for key, value in straight.head.state_dict().items():
        assert torch.equal(value, resumed.head.state_dict()[key]), key


def assert_drafts_losslessly(base, head, untrained, work, params=TRAIN) -> None:
    """The head drafts among its 24 tokens, greedy eagle2 equals vanilla with it,
    and on what it learnt from its loss is below the head it started as (any
    head decodes losslessly, an untrained one too)."""
    assert head.config.draft_vocab_size == 24 and len(set(head.draft_token_ids.tolist())) == 24
    engine = Engine(base, head)
    sampling = SamplingParams(max_new_tokens=20)
    for seed in range(3):
        prompt = torch.randint(8, 64, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        eagle = [t for s in engine.stream(prompt, "eagle2", sampling, TreeParams(8, 3, 2)) for t in s.token_ids]
        vanilla = [t for s in engine.stream(prompt, "vanilla", sampling) for t in s.token_ids]
        assert eagle == vanilla
    eagle3 = params.arch == "eagle3"
    shards = sorted((work / ("features-eagle3" if eagle3 else "features") / "train").glob("*.safetensors"))
    frozen = frozen_of(base, bf16=False, vocabulary=head.draft_token_ids.to(base.device) if eagle3 else None)
    trained, before = (evaluate(one.to(base.device, base.dtype), shards, frozen, params)["cross_entropy"][0] for one in (head, untrained))
    assert shards and trained < 0.9 * before, (trained, before)
    head.eval()


def test_trained_head_loads_strictly_and_decodes_losslessly(tiny_base, prompts_file, tmp_path):
    out = tmp_path / "head"
    paths = RunPaths(prompts_file, out, tmp_path / "work")
    report = train_head(tiny_base, paths, ANSWERS, FEATURES, TRAIN, progress=False, draft_vocab=24)
    assert (out / REPORT_FILE).is_file() and "EAGLE-1/2 head" in (out / NOTES_FILE).read_text()
    assert report["training"]["steps"] == report["training"]["total_steps"]
    config = tiny_base.model.config
    head = load_head(str(out), config.hidden_size, config.vocab_size, tiny_base.device, tiny_base.dtype)
    from core.training.compare import drafted_accuracy

    # the figures the run reports are the written head's, as eval-heads judges it (its 24 draft tokens)
    judged = drafted_accuracy(tiny_base, load_head(str(out), config.hidden_size, config.vocab_size), sorted((paths.work / "features" / "eval").glob("*.safetensors")))
    assert report["final_eval"]["accuracy"] == judged["accuracy"] and judged["positions"] > 0
    assert_drafts_losslessly(tiny_base, head, new_head(head_config_for(config), TRAIN.seed), paths.work)


def test_a_head_is_shaped_after_configs_of_other_names_and_a_config_it_cannot_be_is_refused_before_any_answer(
    tiny_base, prompts_file, tmp_path, monkeypatch
):
    """GPT-2's and GPT-NeoX's configs name their widths and norms otherwise
    (n_embd, layer_norm_epsilon, no inner width); one that names none is refused
    by field before the answers, where it failed after hours of answers and features."""
    from types import SimpleNamespace

    from transformers import GPT2Config, GPTNeoXConfig

    gpt2 = head_config_for(GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=48))
    assert (gpt2.hidden_size, gpt2.intermediate_size, gpt2.num_attention_heads, gpt2.rms_norm_eps) == (64, 256, 4, 1e-5)
    neox = head_config_for(GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=48))
    assert (neox.intermediate_size, neox.rms_norm_eps) == (96, 1e-5)
    odd = SimpleNamespace(model_type="odd", hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=48)
    with pytest.raises(ValueError, match="odd's config has no rms_norm_eps"):
        head_config_for(odd)
    monkeypatch.setattr(tiny_base.model, "config", SimpleNamespace(**{**tiny_base.model.config.to_dict(), "rms_norm_eps": None}))
    with pytest.raises(ValueError, match="config has no rms_norm_eps"):
        train_head(tiny_base, RunPaths(prompts_file, tmp_path / "head", tmp_path / "work"), ANSWERS, FEATURES, TRAIN, progress=False)
    assert not (tmp_path / "work" / "answers.jsonl").exists()


def test_eagle3_training_lowers_the_loss_and_the_head_decodes_losslessly(tiny_base, prompts_file, tmp_path):
    from dataclasses import replace

    from models.eagle3 import Eagle3Head

    out = tmp_path / "head"
    paths = RunPaths(prompts_file, out, tmp_path / "work")
    report = train_head(tiny_base, paths, ANSWERS, FEATURES, replace(TRAIN, arch="eagle3"), progress=False, draft_vocab=24)
    history = report["training"]["history"]
    assert report["arch"] == "eagle3" and len(history) == TRAIN.epochs
    assert history[-1]["train"]["cross_entropy"][0] < history[0]["train"]["cross_entropy"][0]
    assert all(value == 0 for value in history[-1]["train"]["smooth_l1"])  # no feature regression
    notes = (out / NOTES_FILE).read_text()
    assert "EAGLE-3 head" in notes and "EAGLE-1/2" not in notes and "SmoothL1" not in notes
    shard = read_shard(next((tmp_path / "work" / "features-eagle3" / "train").glob("*.safetensors")))[0]
    assert shard.aux.shape == (len(shard.input_ids), 3 * tiny_base.model.config.hidden_size)
    from core.capture import LayerCapture  # checked against transformers' output_hidden_states in test_eagle3

    capture = LayerCapture(tiny_base.model, (0, 1, 2))
    with torch.no_grad(), capture.during():
        tiny_base.model(shard.input_ids[None].to(tiny_base.device))
    expected = capture.features().float().cpu()
    assert torch.allclose(shard.aux.float(), expected, atol=2e-2 * float(expected.abs().max()))  # the layers the head reads
    config = tiny_base.model.config
    head = load_head(str(out), config.hidden_size, config.vocab_size, tiny_base.device, tiny_base.dtype, config.num_hidden_layers)
    assert isinstance(head, Eagle3Head) and head.layer_ids == (0, 1, 2)
    untrained = new_eagle3_head(tiny_base, head.draft_token_ids, TRAIN.seed)
    assert_drafts_losslessly(tiny_base, head, untrained, paths.work, replace(TRAIN, arch="eagle3"))


def test_read_answers_skips_a_cut_line(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"id": "a", "sample": 0, "prompt_ids": [1], "answer_ids": [2], "finished": True}) + '\n{"id": "b", "sam')
    assert [a.id for a in read_answers(path)] == ["a"]


def test_train_head_command_parses_its_options():
    from app.cli import build_parser

    args = build_parser().parse_args(
        ["train-head", "--prompts", "p.jsonl", "--out", "head", "--epochs", "3", "--resume", "--time-budget-minutes", "5"]
    )
    assert (args.command, args.prompts, args.out, args.epochs, args.resume) == ("train-head", "p.jsonl", "head", 3, True)
    assert args.time_budget_minutes == 5 and args.samples_per_prompt == 2 and args.work is None


def test_train_head_refuses_to_overwrite_an_earlier_run(tmp_path, prompts_file):
    from app.cli import main

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "answers.jsonl").write_text("")
    assert main(["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path)]) == 2


def test_train_head_refuses_what_would_lose_a_head_or_hours_before_any_work(tmp_path, prompts_file, capsys, monkeypatch):
    """An existing head in --out, --out the same as --init-head, a missing
    --init-head: refused before the model loads."""
    from transformers import AutoModelForCausalLM

    from app.cli import main
    from models import eagle3
    from models.head import save_head
    from tests.factory import random_eagle3_head, random_head, tiny_config

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("models.base.load_base", no_model)
    old = save_head(random_head(AutoModelForCausalLM.from_config(tiny_config())), tmp_path / "old-head")
    assert (old / "model.safetensors").stat().st_mode & 0o777 == 0o644  # readable by others, as config.json is
    typo = tmp_path / "typo"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "TRAINING.md").write_text("my notes")
    (old / "training_report.json").write_text(json.dumps({"arch": "eagle2"}))
    third = eagle3.save(random_eagle3_head(AutoModelForCausalLM.from_config(tiny_config())), tmp_path / "eagle3-head")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "x", "turns": ["w1"]}\n{"id": "y", "turns": ["w2"]}\n{"id": "x", "turns": ["w3"]}\n')
    cases = [
        (["--out", str(old)], "already holds a head or its notes"),
        (["--out", str(tmp_path / "mine")], "already holds a head or its notes"),  # someone's own TRAINING.md
        (["--out", str(old), "--resume", "--arch", "eagle3"], "holds an eagle2 head; this --arch eagle3 run would replace it"),
        (["--out", str(third), "--resume"], "holds an eagle3 head; this --arch eagle2 run would replace it"),  # no report: told by its keys
        (["--out", str(tmp_path / "new"), "--work", str(prompts_file)], "is a file; name a folder"),
        (["--out", str(tmp_path / "new"), "--work", str(tmp_path / "new")], "is the --out folder; give the run's work"),
        (["--out", str(tmp_path / "new"), "--work", str(prompts_file / "sub")], "--work"),
        (["--out", str(old), "--init-head", str(old), "--resume"], "is the --init-head folder"),
        (["--out", str(tmp_path / "new"), "--init-head", str(typo)], f"--init-head {typo}: no such folder"),
        (["--out", str(tmp_path / "new"), "--init-head", str(tmp_path)], "no config.json or model.safetensors"),
        (["--out", str(old), "--resume"], "holds no earlier run for --resume to continue"),  # nothing to resume: not replaced
        (["--out", str(tmp_path / "new"), "--resume"], f"--resume: {tmp_path / 'new' / 'work'} holds no earlier run to continue"),
        (["--out", str(tmp_path / "new"), "--init-head", str(third)], f"--init-head {third}: is an EAGLE-3 head"),
        (["--out", str(tmp_path / "new"), "--init-head", str(old), "--arch", "eagle3"], "an EAGLE-3 head is trained from scratch"),
    ]
    for options, message in cases:
        assert main(["train-head", "--prompts", str(prompts_file), *options]) == 2
        assert message in capsys.readouterr().err, options
    assert main(["train-head", "--prompts", str(dup), "--out", str(tmp_path / "new")]) == 2  # every line, not the first
    assert f"{dup}:3: id 'x' is already the id of line 1" in capsys.readouterr().err
    dup.write_text('{"id": "1", "turns": ["w1"]}\n{"turns": ["w2"]}\n')  # line 2's id would be its index, 1
    assert main(["train-head", "--prompts", str(dup), "--out", str(tmp_path / "new")]) == 2
    assert f"{dup}:2: has no id, and the one it would get (its line index from 0, '1') is the id of line 1" in capsys.readouterr().err
    assert (tmp_path / "mine" / "TRAINING.md").read_text() == "my notes"
    assert not (tmp_path / "new").exists() and not (old / "work").exists()  # a refused run leaves no folder behind
    (tmp_path / "fresh" / "work").mkdir(parents=True)  # only a model's record, as runs refused after loading it left before
    (tmp_path / "fresh" / "work" / "base-model.json").write_text("{}")
    with pytest.raises(AssertionError, match="the model must not load"):  # not "holds an earlier run": it goes on to load
        main(["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "fresh")])


def test_prompts_whose_answers_would_pass_the_context_window_are_skipped(tiny_base, prompts_file, tmp_path, capsys):
    """Nothing weighed a prompt and its answer against the context window:
    GPT-2's learnt positions ended in an IndexError hours into the answers,
    RoPE models answered past the positions they learnt."""
    from dataclasses import replace

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    window = tiny_base.model.config.max_position_embeddings  # 256
    why = f"the model's context window of {window} tokens less --max-new-tokens {window - 9}"
    longest = train_head(tiny_base, paths, replace(ANSWERS, max_new_tokens=window - 9), FEATURES, replace(TRAIN, epochs=1),
                         progress=False, draft_vocab=24)  # fmt: skip
    assert f"prompts longer than 9 tokens ({why}) skipped" in capsys.readouterr().out
    assert 0 < longest["data"]["prompts"] < 16
    for answer in (json.loads(line) for line in (paths.work / "answers.jsonl").read_text().splitlines()):
        assert len(answer["prompt_ids"]) + len(answer["answer_ids"]) <= window
    with pytest.raises(ValueError, match=f"--max-new-tokens {window}: leaves no room for a prompt in the model's context window of {window} tokens"):
        train_head(tiny_base, paths, replace(ANSWERS, max_new_tokens=window), FEATURES, TRAIN, progress=False, draft_vocab=24)


def test_a_resumed_run_keeps_the_answers_its_features_came_from(tiny_base, prompts_file, tmp_path, capsys):
    """After features are extracted (a time budget stopped the answers, here:
    fewer samples planned), a resumed run that plans more answers trains on
    the same ones instead of answering more and refusing its own features."""
    from dataclasses import replace

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    train_head(tiny_base, paths, replace(ANSWERS, samples_per_prompt=1), FEATURES, TRAIN, progress=False, draft_vocab=24)
    answers = (paths.work / "answers.jsonl").read_text()
    report = train_head(tiny_base, paths, ANSWERS, FEATURES, replace(TRAIN, epochs=3), progress=False, draft_vocab=24)
    assert (paths.work / "answers.jsonl").read_text() == answers
    out = capsys.readouterr().out
    assert report["data"]["answers"] == 16 and "holds the features of 16 answers, taken before this run" in out
    assert "16 of the 32 answers this run plans are not among them" in out and report["data"]["unanswered"] == 16
    assert report["data"]["features_kept"] and report["data"]["eval_answers"] > 0


def test_answers_of_prompts_removed_after_their_features_were_taken_are_recorded(tiny_base, prompts_file, tmp_path, capsys):
    """A resumed run whose prompts file lost prompts after their features were
    taken trains on their answers too (they stay as they are); the report and
    TRAINING.md named the shorter file alone, as if the head had not seen them."""
    from dataclasses import replace

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    train_head(tiny_base, paths, replace(ANSWERS, samples_per_prompt=1), FEATURES, replace(TRAIN, epochs=1), progress=False, draft_vocab=24)
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(prompts_file.read_text().splitlines(keepends=True)[:12]))  # p12 to p15 removed
    report = train_head(tiny_base, replace(paths, prompts=fewer), replace(ANSWERS, samples_per_prompt=1), FEATURES,
                        replace(TRAIN, epochs=1), progress=False, draft_vocab=24)  # fmt: skip
    assert report["data"]["prompts"] == 12 and report["data"]["answers"] == 16 and report["data"]["unplanned_answers"] == 4
    notes = (paths.out / "TRAINING.md").read_text()
    assert "4 of them answer prompts or samples this run does not plan (gone from its prompts file, or skipped there)" in notes


def test_a_checkpoint_made_with_other_settings_names_them(tiny_base, features, tmp_path):
    from dataclasses import replace

    _, shards = features
    Trainer(tiny_base, shards["train"], shards["eval"], tmp_path, TRAIN).run(progress=False, stop_at=4)
    with pytest.raises(ValueError) as error:
        Trainer(tiny_base, shards["train"], shards["eval"], tmp_path, replace(TRAIN, epochs=TRAIN.epochs + 1, learning_rate=1e-3, bf16=not TRAIN.bf16))
    assert (f"other settings (--epochs {TRAIN.epochs}, this run {TRAIN.epochs + 1}; --learning-rate {TRAIN.learning_rate:g}, this run 0.001; "
            f"--precision {'bf16' if TRAIN.bf16 else 'fp32'}, this run {'fp32' if TRAIN.bf16 else 'bf16'}); resume with the earlier ones") in str(error.value)


def test_resumed_answers_must_come_from_the_same_prompts_and_settings(tiny_base, prompts_file, tmp_path):
    from dataclasses import replace

    prompts = read_prompts(prompts_file, tiny_base.tokenizer)
    cache = tmp_path / "answers.jsonl"
    generate_answers(tiny_base, prompts[:2], cache, replace(ANSWERS, samples_per_prompt=1), progress=False)
    with pytest.raises(ValueError, match="made with --max-new-tokens 24, and this run asks for 12"):
        generate_answers(tiny_base, prompts[:2], cache, replace(ANSWERS, max_new_tokens=12), progress=False)
    changed = [replace(prompts[0], ids=prompts[0].ids[:-3] + prompts[1].ids[-3:] + (9,)), prompts[1]]
    with pytest.raises(ValueError, match=f"prompt {prompts[0].id} is not the one its cached answers answer"):
        generate_answers(tiny_base, changed, cache, ANSWERS, progress=False)
    more = generate_answers(tiny_base, prompts[:2], cache, ANSWERS, progress=False)  # more samples: fine
    assert len(more) == 4


def test_a_reduced_loss_vocabulary_still_tracks_chains_in_token_ids(tiny_base, features, tmp_path):
    _, shards = features
    params = TrainParams(epochs=1, warmup_steps=1, batch_tokens=256, bf16=False, loss_vocab=32)
    trainer = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path, params)
    assert trainer.frozen.lm_head.shape[0] == 32 and trainer.eval_frozen.lm_head.shape[0] == 64
    trainer.run(progress=False)
    train = trainer.history[0]["train"]
    assert train["chain_positions"][1] > 0.1 * train["positions"]  # feedable compares token ids, not row indices


def test_training_can_start_from_a_saved_head(tiny_base, features, tmp_path):
    from dataclasses import replace

    from models.errors import HeadFormatError
    from models.head import save_head, with_draft_vocabulary

    _, shards = features
    first = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "a", TRAIN)
    first.run(progress=False)
    save_head(with_draft_vocabulary(first.head, torch.arange(0, 64, 2)), tmp_path / "head")  # d2t is dropped
    params = replace(TRAIN, init_head=str(tmp_path / "head"))
    second = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "b", params)
    for key, value in first.head.state_dict().items():
        assert torch.equal(value, second.head.state_dict()[key]), key
    assert evaluate(second.head, shards["eval"], second.eval_frozen, params) == first.final_eval()
    assert second.run(progress=False, stop_at=2) is False
    assert not torch.equal(first.head.fc.weight, second.head.fc.weight)

    config = head_config_for(tiny_base.model.config)
    save_head(new_head(replace(config, intermediate_size=config.intermediate_size + 1), 0), tmp_path / "other")
    with pytest.raises(HeadFormatError, match="does not fit") as error:
        Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "c", replace(TRAIN, init_head=str(tmp_path / "other")))
    size, hidden = config.intermediate_size, config.hidden_size  # each wrong key named with its shape and the one needed
    assert f"mlp.down_proj.weight is ({hidden}, {size + 1}), this base model's head needs ({hidden}, {size})" in str(error.value)


def test_heads_are_judged_as_they_draft_on_the_same_positions(tiny_base, tiny_dir, features, tmp_path, capsys):
    """eval-heads' top-1 equals training's own evaluation for a head that drafts
    the whole vocabulary; an EAGLE-3 head is judged on the same positions, and a
    draft vocabulary without the base model's choices scores nothing."""
    from dataclasses import replace

    from core.training.compare import drafted_accuracy
    from core.training.trainer import new_eagle3_head

    answers, _ = features
    layer_ids = (0, 1, 2)
    shards = extract_features(tiny_base, answers, tmp_path / "features", replace(FEATURES, layer_ids=layer_ids), progress=False)
    trainer = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "train", replace(TRAIN, epochs=1))
    trainer.run(progress=False)
    own = trainer.final_eval()
    judged = drafted_accuracy(tiny_base, trainer.head, shards["eval"], steps=TRAIN.unroll_steps, batch_tokens=TRAIN.batch_tokens)
    assert judged["positions"] == own["positions"] and judged["accuracy"] == own["accuracy"]
    assert judged["chain_accuracy"] == own["chain_accuracy"] and 0 < judged["accuracy"][0] < 1

    lm_head = tiny_base.model.get_output_embeddings().weight.float()
    chosen = set()
    for path in shards["eval"]:
        for sequence in read_shard(path):
            chosen |= set((sequence.features.float() @ lm_head.T).argmax(-1).tolist())
    others = torch.tensor(sorted(set(range(lm_head.shape[0])) - chosen))
    assert len(others) > 0
    for draft_ids, bounded in ((torch.arange(lm_head.shape[0]), False), (others, True)):
        head = new_eagle3_head(tiny_base, draft_ids, seed=0)
        head.layer_ids = layer_ids
        figures = drafted_accuracy(tiny_base, head, shards["eval"])
        assert figures["positions"] == own["positions"]
        if bounded:
            assert figures["accuracy"] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="no captured layers"):
        drafted_accuracy(tiny_base, head, [p for p in features[1]["eval"]])

    from app.cli import main
    from models.head import save_head

    save_head(trainer.head, tmp_path / "head")
    command = ["eval-heads", "--features", str(tmp_path / "features"), "--model", str(tiny_dir), "--dtype", "float64"]
    assert main([*command, "--json", str(tmp_path / "figures.json"), str(tmp_path / "head")]) == 0
    figures = json.loads((tmp_path / "figures.json").read_text())[str(tmp_path / "head")]
    assert figures["accuracy"] == judged["accuracy"]
    printed = capsys.readouterr()
    assert f"; chain {100 * figures['chain_accuracy'][0]:.1f}% of {int(figures['chain_positions'][0])}, " in printed.out  # with its count
    assert f"judging {tmp_path / 'head'} (eval split)" in printed.err  # a progress bar while it judges
    assert main(command) == 2  # no head named
    other = tmp_path / "other"  # a head for another model: refused when it loads, after the first was judged
    shutil.copytree(tmp_path / "head", other)
    (other / "config.json").write_text(json.dumps({**json.loads((other / "config.json").read_text()), "hidden_size": 32}))
    (tmp_path / "figures.json").unlink()
    assert main([*command, "--json", str(tmp_path / "figures.json"), str(tmp_path / "head"), str(other)]) == 2
    assert list(json.loads((tmp_path / "figures.json").read_text())) == [str(tmp_path / "head")]
    assert f"with the 1 of 2 heads judged before it stopped; not judged: {other}" in capsys.readouterr().err
    assert main([*command, "--json", str(tmp_path / "figures.json"), str(tmp_path / "head"), str(tmp_path / "head")]) == 0
    printed = capsys.readouterr()
    assert printed.out.count(f"{tmp_path / 'head'}: top-1") == 1 and "stopped" not in printed.err  # named twice, judged once
    assert main(["eval-heads", "--features", str(tmp_path / "nowhere"), str(tmp_path / "head")]) == 2


@pytest.mark.skipif(os.name == "nt", reason="Windows has no SIGTERM to send: TerminateProcess ends a process at once")
def test_a_terminated_run_keeps_its_answers_and_its_clock(tiny_dir, prompts_file, tmp_path):
    """SIGTERM (a kill, a logout) stops train-head as Ctrl-C does: the phase
    clock and the caches are written, and --resume goes on from them."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    work = tmp_path / "work"
    command = [
        sys.executable, str(root / "launch.py"), "train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "head"),
        "--work", str(work), "--model", str(tiny_dir), "--dtype", "float32", "--threads", "1", "--answer-batch", "1",
        "--samples-per-prompt", "50", "--max-new-tokens", "64",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        answers = work / "answers.jsonl"
        if answers.is_file() and len(answers.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in err
    assert json.loads((work / "phases.json").read_text())["answers"] > 0
    assert len(read_answers(work / "answers.jsonl")) >= 3


def test_a_running_phase_writes_its_time_before_it_ends(tmp_path, monkeypatch):
    """A run killed outright (no handler runs) keeps the phase time written so
    far: the clock saves while the phase runs, and adds to earlier runs'."""
    from core.training.pipeline import PhaseClock

    path = tmp_path / "phases.json"
    path.write_text(json.dumps({"answers": 100.0}))
    clock = PhaseClock(path)
    monkeypatch.setattr(PhaseClock, "SAVE_EVERY", 0.05)
    with clock.phase("answers"):
        time.sleep(0.5)
        during = json.loads(path.read_text())["answers"]
    after = json.loads(path.read_text())["answers"]
    assert 100.05 < during <= after and after >= 100.5
    assert not path.with_name("phases.json.partial").exists()


def test_a_budget_spent_before_the_first_training_step_writes_no_head(tiny_base, prompts_file, tmp_path, monkeypatch, capsys):
    """A random head is no result: the run says that none was written, and a
    run cut in its answers says how many it learned from."""
    from app.cli import main
    from core.training import pipeline

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    monkeypatch.setattr(Trainer, "run", lambda self, deadline, progress: None)  # the deadline passed before step 1
    with pytest.raises(pipeline.TrainingStopped):
        train_head(tiny_base, paths, ANSWERS, FEATURES, TRAIN, progress=False, draft_vocab=24)
    assert not (paths.out / "model.safetensors").exists() and not (paths.out / REPORT_FILE).exists()

    monkeypatch.setattr("models.base.load_base", lambda *args, **kwargs: tiny_base)
    options = ["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "cli"), "--threads", "1", "--max-new-tokens", "24"]
    assert main([*options, "--time-budget-minutes", "1"]) == 75  # no head to use: a script's `&&` stops
    assert "stopped by the time budget (before the first training step); no head was written; run again with --resume" in capsys.readouterr().out
    monkeypatch.undo()
    report = {"data": {"prompts": 16, "samples_per_prompt": 2, "answers": 5, "planned_answers": 32, "unanswered": 27},
              "training": {"steps": 4, "total_steps": 4},
              "final_eval": {"accuracy": [0.5, 0.25]}}  # fmt: skip
    monkeypatch.setattr(pipeline, "train_head", lambda *args, **kwargs: report)
    monkeypatch.setattr("models.base.load_base", lambda *args, **kwargs: tiny_base)
    assert main([*options, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "held-out top-1 50.0%, 25.0% (draft steps 1..2, the written head, judged as eval-heads judges it)" in out
    assert "the time budget stopped the answers at 5 of 32; this head learned from those only" in out


def test_a_short_run_warms_up_for_a_tenth_of_its_steps():
    """The default 50 warm-up steps would leave a 30-step run below its peak
    rate throughout; a short run warms up for a tenth of its steps instead."""
    from core.training.trainer import learning_rate, warmup_steps

    params = TrainParams(learning_rate=1e-3)
    assert warmup_steps(30, params) == 3 and warmup_steps(2000, params) == 50 and warmup_steps(5, params) == 1
    rates = [learning_rate(step, 30, params) for step in range(30)]
    assert rates[2] == pytest.approx(1e-3) and max(rates) == pytest.approx(1e-3)
    assert rates[-1] < 0.15e-3  # decayed towards the floor (x0.1) by the end
    assert learning_rate(49, 2000, params) == pytest.approx(1e-3) and learning_rate(10, 2000, params) < 0.3e-3



def test_a_work_folder_is_resumed_only_with_the_base_model_that_made_it(tiny_base, tiny_dir, prompts_file, tmp_path):
    """Another model (same sizes, other weights), or the same one quantized
    otherwise, is refused before any answer: its answers and features would
    be mixed with the first one's."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from models.base import load_base
    from tests.factory import tiny_config

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    train_head(tiny_base, paths, replace(ANSWERS, samples_per_prompt=1), FEATURES, TRAIN, progress=False, draft_vocab=24)
    answers = (paths.work / "answers.jsonl").read_text()
    torch.manual_seed(5)
    other = replace(tiny_base, model=AutoModelForCausalLM.from_config(tiny_config()).eval(), name="other-model")
    with pytest.raises(ValueError, match=f"came from another base model \\({tiny_base.name}\\); this run loads other-model"):
        train_head(other, paths, ANSWERS, FEATURES, TRAIN, progress=False, draft_vocab=24)
    with pytest.raises(ValueError, match="with --quantization none, and this run loads it with int8: give --quantization none"):
        train_head(replace(tiny_base, quantization="int8"), paths, ANSWERS, FEATURES, TRAIN, progress=False, draft_vocab=24)
    assert (paths.work / "answers.jsonl").read_text() == answers
    same = load_base(str(tiny_dir), dtype="float32")  # the same weights, in another dtype
    assert same.dtype != tiny_base.dtype
    assert train_head(same, paths, ANSWERS, FEATURES, TRAIN, progress=False, draft_vocab=24)["data"]["answers"] == 16


def test_answers_stopped_before_any_feature_are_completed_and_those_of_removed_prompts_left_out(tiny_base, prompts_file, tmp_path):
    """Features stopped before their first shard fix nothing: a resumed run
    answers what its plan still lacks, and trains on its own prompts only."""
    from dataclasses import replace

    from core.training.features import FeaturesStopped

    work = tmp_path / "work"
    prompts = read_prompts(prompts_file, tiny_base.tokenizer)
    first = generate_answers(tiny_base, prompts, work / "answers.jsonl", replace(ANSWERS, samples_per_prompt=1), progress=False)
    with pytest.raises(FeaturesStopped):
        extract_features(tiny_base, first, work / "features", FEATURES, progress=False, deadline=0.0)
    assert (work / "features" / "manifest.json").is_file()
    half = tmp_path / "half.jsonl"
    half.write_text("".join(line + "\n" for line in prompts_file.read_text().splitlines()[:8]))
    report = train_head(tiny_base, RunPaths(half, tmp_path / "head", work), ANSWERS, FEATURES, TRAIN, progress=False, draft_vocab=24)
    data = report["data"]
    assert (data["prompts"], data["answers"], data["planned_answers"], data["unanswered"]) == (8, 16, 16, 0)
    assert not data["features_kept"] and len(read_answers(work / "answers.jsonl")) == 16 + 8


def test_a_run_with_nothing_to_train_on_writes_no_head_and_says_why(tiny_base, prompts_file, tmp_path):
    from dataclasses import replace

    from models.errors import HeadFormatError
    from models.head import save_head

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    every = replace(FEATURES, eval_fraction=1.0)  # every prompt held out
    with pytest.raises(ValueError, match="nothing to train on: of the 32 answers, 32 answer held-out prompts .* and 0 are shorter"):
        train_head(tiny_base, paths, ANSWERS, every, TRAIN, progress=False, draft_vocab=24)
    assert not paths.out.exists()
    config = head_config_for(tiny_base.model.config)
    save_head(new_head(replace(config, intermediate_size=config.intermediate_size + 1), 0), tmp_path / "other")
    fresh = RunPaths(prompts_file, tmp_path / "head2", tmp_path / "work2")
    with pytest.raises(HeadFormatError, match="does not fit"):  # before any answer is made
        train_head(tiny_base, fresh, ANSWERS, FEATURES, replace(TRAIN, init_head=str(tmp_path / "other")), progress=False)
    assert not (fresh.work / "answers.jsonl").exists()


def test_the_last_line_says_why_a_run_has_no_held_out_figures(tiny_base, prompts_file, tmp_path, monkeypatch, capsys):
    from app.cli import main
    from core.training import pipeline

    report = {"data": {"prompts": 16, "samples_per_prompt": 1, "answers": 14, "eval_prompts": 2, "eval_answers": 0,
                       "planned_answers": 16, "unanswered": 2, "features_kept": True},
              "training": {"steps": 4, "total_steps": 4}, "final_eval": {"accuracy": []}}  # fmt: skip
    monkeypatch.setattr(pipeline, "train_head", lambda *args, **kwargs: report)
    monkeypatch.setattr("models.base.load_base", lambda *args, **kwargs: tiny_base)
    assert main(["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "h"), "--threads", "1", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "no held-out figures (none of the 2 held-out prompts has an answer of 2 tokens or more here)" in out
    assert "note: 2 of the 16 answers this run plans were not made: the features in" in out and "time budget" not in out


def test_eval_heads_names_features_of_another_model_or_a_damaged_shard(tiny_base, features, tmp_path):
    """Before any head is judged: features of another width, token ids beyond
    the vocabulary, a shard that cannot be read, and a work folder recorded as
    another base model's are each one ValueError naming the shard or folder."""
    from core.training.compare import check_feature_shards
    from core.training.pipeline import BASE_FILE

    _, shards = features
    check_feature_shards(tiny_base, shards["eval"])  # the model's own: fine
    sequence = read_shard(shards["eval"][0])[0]
    narrow = tmp_path / "narrow" / "eval" / "shard-00000.safetensors"
    write_shard(narrow, [Sequence(sequence.input_ids, sequence.loss_mask, sequence.features[:, :32])])
    with pytest.raises(ValueError, match=f"{narrow}: features 32 wide, and the base model's hidden size is 64"):
        check_feature_shards(tiny_base, [narrow])
    beyond = tmp_path / "beyond" / "eval" / "shard-00000.safetensors"
    write_shard(beyond, [Sequence(sequence.input_ids + 1000, sequence.loss_mask, sequence.features)])
    with pytest.raises(ValueError, match="token id .* is outside the base model's vocabulary of 64"):
        check_feature_shards(tiny_base, [beyond])
    cut = tmp_path / "cut" / "eval" / "shard-00000.safetensors"
    cut.parent.mkdir(parents=True)
    cut.write_bytes(shards["eval"][0].read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{cut}: not a readable feature shard"):
        check_feature_shards(tiny_base, [cut])
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shards["eval"][0]))
    for name, change in (("no-lengths", lambda t: t.pop("lengths")), ("wrong-lengths", lambda t: t.update(lengths=t["lengths"] + 1))):
        foreign = tmp_path / name / "eval" / "shard-00000.safetensors"  # not written by train-head
        foreign.parent.mkdir(parents=True)
        changed = dict(tensors)
        change(changed)
        save_file(changed, str(foreign))
        with pytest.raises(ValueError, match=f"{foreign}: not a readable feature shard"):
            check_feature_shards(tiny_base, [foreign])
    work = tmp_path / "work"
    recorded = work / "features" / "eval" / "shard-00000.safetensors"
    write_shard(recorded, [sequence])
    (work / BASE_FILE).write_text(json.dumps({"name": "another", "quantization": "none", "sizes": [], "embedding": "x"}))
    with pytest.raises(ValueError, match=r"came from another base model \(another\); this run loads .*: give --model another"):
        check_feature_shards(tiny_base, [recorded])


def test_long_prompts_are_documents_made_of_the_models_own_answers(tiny_base, tiny_dir, prompts_file, tmp_path, capsys):
    from app.cli import main
    from core.training.answers import training_ids
    from core.training.features import is_held_out

    out, work = tmp_path / "long.jsonl", tmp_path / "docs"
    options = ["long-prompts", "--prompts", str(prompts_file), "--out", str(out), "--work", str(work), "--model", str(tiny_dir),
               "--documents", "12", "--count", "6", "--min-tokens", "60", "--max-tokens", "120", "--max-new-tokens", "24",
               "--min-passage-tokens", "8", "--answer-batch", "4", "--threads", "1"]  # fmt: skip
    assert main(options) == 0
    answers = read_answers(work / "documents.jsonl")
    questions = {pid: row["turns"][0] for pid, row in training_ids(prompts_file).items()}
    assert [answer.id for answer in answers] != [] and {answer.id for answer in answers} == set(
        [pid for pid in questions if not is_held_out(pid, 0.05)][:12]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and len({row["id"] for row in rows}) == 6
    assert [row["source"] for row in rows] == ["summarization-long", "rag-long"] * 3
    stops = set(stop_token_ids(tiny_base.model, tiny_base.tokenizer))
    decode = tiny_base.tokenizer.decode
    passages = {answer.id: decode([t for t in answer.answer_ids if t not in stops], skip_special_tokens=True).strip() for answer in answers}
    for row in rows:
        prompt = row["turns"][0]
        used = [pid for pid, text in passages.items() if text and text in prompt]
        assert len(used) >= 2, row  # several of the model's answers make each document
        if row["source"] == "rag-long":
            assert "Passage 1: " in prompt and any(questions[pid].strip() in prompt for pid in used)  # asks what one passage answers
    first = (work / "documents.jsonl").read_text()
    assert main(options) == 0  # a rerun reuses the answers and writes the same prompts
    assert (work / "documents.jsonl").read_text() == first and [json.loads(line) for line in out.read_text().splitlines()] == rows

    assert main([*options[:-4], "--documents", "4", "--min-tokens", "200", "--max-tokens", "100"]) == 2  # min above max
    # documents longer than all the passages can make: said, with the way out
    assert main([*options[:13], "--min-tokens", "5000", "--max-tokens", "6000", *options[17:]]) == 0
    assert "documents are shorter than --min-tokens 5000" in capsys.readouterr().out
    # documents shorter than every passage: each still holds one (it was empty, or an IndexError)
    assert main([*options[:13], "--min-tokens", "1", "--max-tokens", "5", *options[17:]]) == 0
    for row in [json.loads(line) for line in out.read_text().splitlines()]:
        assert any(text and text in row["turns"][0] for text in passages.values()), row


def test_long_prompts_refuses_another_models_answers_a_second_run_and_passages_longer_than_answers(
    tiny_dir, prompts_file, tmp_path, capsys
):
    from app.cli import main
    from app.instance import DataLock
    from core.training.work import LOCK_FILE
    from tests.factory import save_tiny_model

    out, work = tmp_path / "long.jsonl", tmp_path / "docs"
    options = ["long-prompts", "--prompts", str(prompts_file), "--out", str(out), "--work", str(work), "--model", str(tiny_dir),
               "--documents", "8", "--count", "2", "--min-tokens", "30", "--max-tokens", "60", "--max-new-tokens", "16",
               "--min-passage-tokens", "4", "--answer-batch", "4", "--threads", "1"]  # fmt: skip
    assert main([*options[:-6], "--min-passage-tokens", "17", *options[-4:]]) == 2  # before the model loads
    assert "--min-passage-tokens 17: is above --max-new-tokens 16" in capsys.readouterr().err and not work.exists()
    assert main([*options[:6], str(prompts_file), *options[7:]]) == 2
    assert f"--work {prompts_file}: is a file" in capsys.readouterr().err
    lock = DataLock(work, LOCK_FILE)
    assert lock.acquire()  # as a run working there holds it
    assert main(options) == 2 and "another Kestrel command is working in this folder" in capsys.readouterr().err
    lock.release()
    assert main(options) == 0
    other = save_tiny_model(tmp_path / "other", "qwen3", seed=5)
    assert main([*options[:8], str(other), *options[9:]]) == 2  # the cached answers are the first model's
    assert "its answers and features came from another base model" in capsys.readouterr().err


def test_fine_tuning_keeps_the_initial_heads_draft_vocabulary(tiny_base, prompts_file, tmp_path):
    from dataclasses import replace

    from models.head import save_head, with_draft_vocabulary

    chosen = torch.arange(1, 64, 2)  # 32 odd tokens, not the answers' most frequent
    save_head(with_draft_vocabulary(new_head(head_config_for(tiny_base.model.config), 0), chosen), tmp_path / "start")
    params = replace(TRAIN, epochs=1, init_head=str(tmp_path / "start"))
    paths = RunPaths(prompts=prompts_file, out=tmp_path / "kept", work=tmp_path / "w1")
    report = train_head(tiny_base, paths, ANSWERS, FEATURES, params, progress=False, draft_vocab=32)
    config = tiny_base.model.config
    drafted = lambda folder: load_head(str(folder), config.hidden_size, config.vocab_size).draft_token_ids.cpu()  # noqa: E731
    assert torch.equal(drafted(tmp_path / "kept"), chosen) and report["draft_vocab_from"] == "init_head"
    assert f"It started from the head in `{tmp_path / 'start'}` (`--init-head`) and keeps its draft tokens" in (tmp_path / "kept" / NOTES_FILE).read_text()
    # another number of draft tokens: the new answers' most frequent, as for a fresh head
    paths = RunPaths(prompts=prompts_file, out=tmp_path / "other", work=tmp_path / "w2")
    report = train_head(tiny_base, paths, ANSWERS, FEATURES, params, progress=False, draft_vocab=16)
    assert len(drafted(tmp_path / "other")) == 16 and report["draft_vocab_from"] == "answers"


def test_a_resume_keeps_the_quantization_its_answers_were_made_with(tmp_path, capsys):
    """auto is a probe of milliseconds that can decide otherwise from one run to
    the next: resuming (or judging) a work folder under auto loads the base
    model as its answers and features were made; a quantization asked for by
    name is as asked (check_base_model refuses it where it differs)."""
    from app.cli import recorded_quantization
    from core.training.pipeline import BASE_FILE

    work = tmp_path / "work"
    assert recorded_quantization(work, "auto") == "auto"  # nothing recorded: a new run
    work.mkdir()
    for recorded, asked, loaded in (("int8", "auto", "int8"), ("none", "auto", "none"), ("int8", "none", "none"), ("4bit", "auto", "4bit"), ("8bit", "auto", "auto")):
        (work / BASE_FILE).write_text(json.dumps({"name": "m", "quantization": recorded}))
        assert recorded_quantization(work, asked) == loaded, (recorded, asked)
    assert "--quantization auto: none, as " in capsys.readouterr().out


def test_tensors_that_cannot_be_written_are_named_by_their_file(tmp_path):
    """safetensors' own error (a full disk) names no file and is no OSError: the
    command line would show a traceback."""
    from models.paths import save_tensors

    target = tmp_path / "a-file" / "shard.safetensors"
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(OSError, match=f"{target}: cannot be written"):
        save_tensors({"x": torch.zeros(2)}, target)


def test_notes_without_held_out_prompts_have_no_empty_row_or_figures(tiny_base, prompts_file, tmp_path):
    from core.training.report import render_markdown

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    report = train_head(tiny_base, paths, ANSWERS, FEATURES, TRAIN, progress=False, draft_vocab=24)
    empty = {"positions": 0, "accuracy": [], "chain_accuracy": [], "cross_entropy": [], "smooth_l1": []}
    for record in report["training"]["history"]:
        record["eval"] = empty
    notes = render_markdown({**report, "final_eval": empty})
    assert "| eval |" not in notes and "Final held-out" not in notes
    assert "No held-out figures: no held-out prompt has an answer of 2 tokens or more." in notes
    # the notes say what this run did: its number of unrolled steps, its draft tokens, the answers the budget cut
    assert "draft steps 1/2/3" in notes and "drafting from 24 of the base model's tokens" in notes
    one_step = {**report, "draft_vocab": None, "training": {**report["training"], "params": {**report["training"]["params"], "unroll_steps": 1}},
                "final_eval": {**empty, "positions": 10, "accuracy": [0.5], "chain_accuracy": [0.5]},
                "data": {**report["data"], "planned_answers": 32, "unanswered": 20, "features_kept": False}}  # fmt: skip
    notes = render_markdown(one_step)
    assert "1/2/3" not in notes and "one draft step (no unrolled steps)" in notes and "1 unrolled step " in notes
    assert "top-1 50.0% for step 1;" in notes and "draft tokens" not in notes and "drafting from the whole vocabulary" in notes
    assert "the time budget stopped the answers at 12 of 32 planned" in notes


def test_a_budget_spent_before_the_first_answer_is_a_budget_stop(tiny_base, prompts_file, tmp_path):
    """Said as the other budget stops are (no head; --resume goes on), not as an error."""
    import time

    from core.training.pipeline import Budget, TrainingStopped

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    with pytest.raises(TrainingStopped, match="before the first answer"):
        train_head(tiny_base, paths, ANSWERS, FEATURES, TRAIN, Budget(answers_deadline=time.time() - 1), progress=False, draft_vocab=24)
    assert not (paths.out / "model.safetensors").exists()


def test_a_step_interrupted_midway_is_counted_once(tiny_base, features, tmp_path):
    """Ctrl-C inside a step (its metrics taken, its update not made): the resumed
    run does that step again, and the epoch's figures count it once."""
    _, shards = features
    straight = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "a", TRAIN)
    straight.run(progress=False)
    stopped = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "b", TRAIN)
    update, calls = stopped.optimizer.step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return update(*args, **kwargs)

    stopped.optimizer.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        stopped.run(progress=False)
    resumed = Trainer(tiny_base, shards["train"], shards["eval"], tmp_path / "b", TRAIN)
    assert resumed.step == 2 and resumed.run(progress=False)
    assert [r["train"]["positions"] for r in resumed.history] == [r["train"]["positions"] for r in straight.history]


def test_a_work_folder_serving_both_kinds_of_head_times_each_alone(tiny_base, prompts_file, tmp_path):
    """An EAGLE-3 head trained on an EAGLE-2 run's answers (the same --work) is
    not reported with the EAGLE-2 run's features and training time."""
    from dataclasses import replace

    work = tmp_path / "work"
    train_head(tiny_base, RunPaths(prompts_file, tmp_path / "eagle2", work), ANSWERS, FEATURES, TRAIN, progress=False, draft_vocab=24)
    report = train_head(tiny_base, RunPaths(prompts_file, tmp_path / "eagle3", work), ANSWERS, FEATURES,
                        replace(TRAIN, arch="eagle3"), progress=False, draft_vocab=24)  # fmt: skip
    clock = json.loads((work / "phases.json").read_text())
    assert {"features", "training", "features-eagle3", "training-eagle3"} <= set(clock)
    assert report["phases"] == {"answers": round(clock["answers"], 1), "features": round(clock["features-eagle3"], 1),
                                "training": round(clock["training-eagle3"], 1)}  # fmt: skip


def test_an_interrupted_run_points_to_resume_only_where_there_is_work(tmp_path, prompts_file, monkeypatch, capsys):
    """Ctrl+C while the model loads leaves nothing to resume (--resume would be
    refused); once answers are made, the same command with --resume goes on."""
    from app.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("models.base.load_base", interrupted)
    options = ["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "head")]
    assert main(options) == 130
    assert "--resume" not in capsys.readouterr().err
    (tmp_path / "head" / "work" / "answers.jsonl").write_text("")  # as a run stopped in its answers leaves it
    assert main([*options, "--resume"]) == 130
    assert "interrupted (the work done so far is kept: run the same command with --resume to continue)" in capsys.readouterr().err
    # the hint is told without torch: a Ctrl+C in the first seconds comes while torch is being imported, and
    # importing it again from the handler raised a traceback over "interrupted"
    script = ("import sys; from argparse import Namespace; from app.cli import resume_hint; "
              f"hints = [resume_hint(Namespace(command=c, work={str(tmp_path / 'head' / 'work')!r}, out=None)) for c in ('chat', 'train-head')]; "
              "print(hints[1]); assert 'torch' not in sys.modules and hints[0] == ''")  # fmt: skip
    ran = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, capture_output=True, text=True)
    assert ran.returncode == 0 and "run the same command with --resume" in ran.stdout, ran.stderr


def test_a_second_run_in_a_work_folder_is_refused_while_the_first_works(tmp_path, prompts_file, monkeypatch, capsys):
    """Two train-head runs on one --out had both passed the check for an
    earlier run (the first had written nothing yet) and answered into the same
    cache, each prompt twice."""
    from app.cli import main
    from app.instance import DataLock
    from core.training.work import LOCK_FILE, holds_a_run

    def loaded(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("models.base.load_base", loaded)
    work = tmp_path / "head" / "work"
    lock = DataLock(work, LOCK_FILE)
    assert lock.acquire()  # the first run, working
    lock.announce("long-prompts")
    assert main(["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "head")]) == 2
    assert f"{work}: another long-prompts run is working in this folder" in capsys.readouterr().err
    (work / "answers.jsonl").write_text("")  # once it has written answers: still said as busy, not as an earlier run to --resume
    assert main(["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "head")]) == 2
    assert f"{work}: another long-prompts run is working in this folder" in capsys.readouterr().err
    lock.release()
    (work / "answers.jsonl").unlink()
    assert not holds_a_run(work)  # the lock's file alone is no run to resume
    with pytest.raises(AssertionError, match="the model must not load"):
        main(["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "head")])


def test_a_record_alone_does_not_hold_a_work_folder_to_another_model(tiny_base, tmp_path):
    """A run refused once it had loaded a model left only that model's record:
    a run with another model (the fix) takes the folder, where one with
    answers or features is still refused."""
    from core.training.pipeline import BASE_FILE, check_base_model, recorded_base

    work = tmp_path / "work"
    work.mkdir()
    (work / BASE_FILE).write_text(json.dumps({"name": "other", "quantization": "none", "sizes": [1], "embedding": "x"}))
    check_base_model(work, tiny_base)
    assert recorded_base(work)["name"] == tiny_base.name
    (work / BASE_FILE).write_text(json.dumps({"name": "other", "quantization": "none", "sizes": [1], "embedding": "x"}))
    (work / "answers.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"came from another base model \(other\)"):
        check_base_model(work, tiny_base)


def test_self_prompts_are_requests_the_model_writes_itself(prompts_file, tmp_path, capsys):
    from app.cli import main
    from core.training.features import is_held_out
    from core.training.self_prompts import REQUESTS_FILE, read_requests
    from tests.factory import save_tiny_model

    model = save_tiny_model(tmp_path / "spread", sharpness=1.0)  # spread-out sampling: some requests end, some do not
    out, work = tmp_path / "self.jsonl", tmp_path / "w"
    options = ["self-prompts", "--prompts", str(prompts_file), "--out", str(out), "--work", str(work), "--model", str(model),
               "--count", "24", "--max-new-tokens", "40", "--answer-batch", "8", "--threads", "1", "--dtype", "float32"]  # fmt: skip
    assert main(options) == 0
    records = read_requests(work / REQUESTS_FILE)
    assert len(records) == 24 and not any(is_held_out(rid, 0.05) for rid in records)  # held-out figures stay on the file's prompts
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    usable = {rid for rid, record in records.items() if record["finished"] and record["own_words"] and len(record["text"].split()) >= 3}
    unfinished = sum(not record["finished"] for record in records.values())
    assert 0 < len(rows) <= len(usable) and 0 < unfinished  # the cut ones are left out
    assert {row["id"] for row in rows} <= usable and len({row["turns"][0] for row in rows}) == len(rows)
    assert all(row["source"] == "self" and row["turns"][0] == records[row["id"]]["text"] for row in rows)
    assert f"{len(rows)} requests written to {out} ({24 - len(rows)} of 24 left out" in capsys.readouterr().out

    first = out.read_text()
    cache = work / REQUESTS_FILE
    lines = cache.read_text().splitlines(keepends=True)
    edited = {**json.loads(lines[0]), "text": "w9 w9 w9 edited", "finished": True, "own_words": 3}
    cache.write_text("".join([json.dumps(edited) + "\n", *lines[1:]]))
    assert main(options) == 0 and "w9 w9 w9 edited" in out.read_text()  # a rerun takes them from the cache
    cache.write_text("".join(lines))
    cache.write_text("".join(lines[:10]) + lines[10][:7])  # a run killed mid-batch, mid-line
    assert main(options) == 0 and out.read_text() == first and read_requests(cache) == records  # resumed as sampled before

    assert main([*options, "--keep-prompts"]) == 0  # the file's own prompts first, each with its id
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    own = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    assert kept[: len(own)] == own and kept[len(own) :] == rows
    capsys.readouterr()
    assert main([*options[:10], "12", *options[11:]]) == 0  # fewer: the first 12, from the cache
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [row["id"] for row in rows if row["id"] in set(list(records)[:12])]
    assert main([*options[:10], "26", *options[11:]]) == 0 and len(read_requests(cache)) == 26  # more: two more written
    assert main(options) == 0 and out.read_text() == first  # and back
    assert main([*options, "--temperature", "0.5"]) == 2  # not mixed with requests sampled otherwise
    assert f"{work}: its requests were made with --temperature 1.0, and this run asks for 0.5" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"  # another file's openings: not mixed with the cached requests' (said before loading)
    other.write_text("".join(json.dumps({"id": f"o{i}", "turns": [f"w{i} w{i + 1} w{i + 2}"]}) + "\n" for i in range(8, 30)))
    assert main([*options[:2], str(other), *options[3:]]) == 2
    assert f"{work}: its requests were opened with other words" in capsys.readouterr().err
    assert main([*options[:6], str(tmp_path / "w1"), *options[7:11], "--max-new-tokens", "1", *options[13:]]) == 2
    assert "none of the 24 requests is worth training on" in capsys.readouterr().err


def test_a_request_is_decoded_whole_and_ends_where_the_template_goes_on_to_the_reply():
    from types import SimpleNamespace

    from core.training.self_prompts import user_turn, written_text
    from tests.factory import tiny_tokenizer

    pieces = {1: "How", 2: " do", 3: " I", 4: " make", 5: " bread", 6: " [/INST]", 7: " Sure", 9: ""}
    decode = lambda ids, skip_special_tokens=True: "".join(pieces[i] for i in ids).lstrip()  # a piece's space dropped at the start
    tokenizer = SimpleNamespace(decode=decode)
    assert written_text(tokenizer, [1, 2, 3], [4, 5, 9], [9], "") == ("How do I make bread", "make bread", True)
    assert written_text(tokenizer, [1, 2, 3], [4, 5, 6, 7], [9], "[/INST]") == ("How do I make bread", "make bread", True)
    assert written_text(tokenizer, [1, 2, 3], [4, 5, 7], [9], "[/INST]") == ("How do I make bread Sure", "make bread Sure", False)
    assert written_text(tokenizer, [1, 2, 3], [9], [9], "") == ("How do I", "", True)  # no words of the model's own
    assert written_text(tokenizer, [], [1, 2, 9], [9], "") == ("How do", "How do", True)

    chatml = tiny_tokenizer()  # the user's turn ends with a control token, which stops sampling
    assert user_turn(chatml).prefix == "<|im_start|> user " and user_turn(chatml).end == ""
    chatml.chat_template = "{{ bos_token }}[INST] {{ messages[0]['content'] }} [/INST]"  # ends with plain text
    assert user_turn(chatml) == type(user_turn(chatml))("<s>[INST] ", "[/INST]")
    chatml.chat_template = None  # no template: a plain transcript
    assert user_turn(chatml).end == "Assistant:" and user_turn(chatml).prefix.endswith("User: ")


def test_self_prompts_open_with_words_of_the_files_prompts_but_never_of_held_out_ones(tmp_path):
    from core.training.features import is_held_out
    from core.training.self_prompts import SelfParams, openings, request_ids

    held = [f"q{i}" for i in range(400) if is_held_out(f"q{i}", 0.05)][:3]
    kept = [f"q{i}" for i in range(400) if not is_held_out(f"q{i}", 0.05)][:5]
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": pid, "turns": [f"secret{n} words of a held-out prompt"]} for n, pid in enumerate(held)]
    rows += [{"id": pid, "turns": [f"Open{n} the door please"]} for n, pid in enumerate(kept)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    opened = openings(path, 300, SelfParams(opening_words=2, seed=3), 0.05)
    assert len(opened) == 300 and not any("secret" in text for text in opened)
    assert {len(text.split()) for text in opened} == {0, 1, 2}  # none to --opening-words words
    assert {text.split()[0] for text in opened if text} == {f"Open{n}" for n in range(5)}
    assert opened == openings(path, 300, SelfParams(opening_words=2, seed=3), 0.05)  # fixed by the seed
    alone = tmp_path / "held.jsonl"
    alone.write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    with pytest.raises(ValueError, match="every prompt is in train-head's held-out split"):
        openings(alone, 1, SelfParams(), 0.05)
    ids = request_ids(500, 7, 0.05)
    assert len(set(ids)) == 500 and not any(is_held_out(rid, 0.05) for rid in ids) and ids[0].startswith("self-7-")


def test_resume_replaces_only_the_head_the_resumed_run_wrote(tiny_base, prompts_file, tmp_path, monkeypatch, capsys):
    """--resume with another run's --work wrote over a head copied out of its
    own run (its work folder deleted, as a final head allows) or a downloaded
    one: its weights replaced and its notes telling the other run's data."""
    from dataclasses import replace

    from app.cli import main
    from core.training.work import RUN_FILE

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load")

    paths = RunPaths(prompts_file, tmp_path / "h1", tmp_path / "h1" / "work")
    train_head(tiny_base, paths, replace(ANSWERS, samples_per_prompt=1), FEATURES, replace(TRAIN, epochs=1), progress=False, draft_vocab=24)
    assert json.loads((paths.out / REPORT_FILE).read_text())["run"] == json.loads((paths.work / RUN_FILE).read_text())["run"]
    copy = tmp_path / "h1copy"
    shutil.copytree(paths.out, copy, ignore=shutil.ignore_patterns("work"))
    other = tmp_path / "wk3"  # another run's work
    other.mkdir()
    (other / "answers.jsonl").write_text("")
    weights = (copy / "model.safetensors").read_bytes()
    monkeypatch.setattr("models.base.load_base", no_model)
    command = ["train-head", "--prompts", str(prompts_file), "--threads", "1", "--resume"]
    assert main([*command, "--out", str(copy), "--work", str(other)]) == 2
    assert f"--out {copy}: holds a head that the run in {other} did not write" in capsys.readouterr().err
    report = json.loads((copy / REPORT_FILE).read_text())
    (copy / REPORT_FILE).write_text(json.dumps({key: value for key, value in report.items() if key != "run"}))
    assert main([*command, "--out", str(copy), "--work", str(paths.work)]) == 2  # a head that records no run: not proven its own
    assert "did not write (or that records no run" in capsys.readouterr().err
    (copy / REPORT_FILE).unlink()
    (copy / NOTES_FILE).unlink()  # a downloaded head: config.json and model.safetensors alone
    assert main([*command, "--out", str(copy), "--work", str(other)]) == 2
    assert f"the run in {other} did not write" in capsys.readouterr().err
    assert (copy / "model.safetensors").read_bytes() == weights and not (other / "features").exists()
    with pytest.raises(AssertionError, match="the model must not load"):  # the run that wrote it goes on
        main([*command, "--out", str(paths.out), "--work", str(paths.work)])


def test_long_prompts_use_the_answers_they_plan_of_those_cached(tiny_base, tiny_dir, prompts_file, tmp_path):
    """A work folder holding more answers (an earlier, larger --documents; a
    prompt file with the same prompts under other ids) made the documents of
    all of them, or failed with a KeyError on a question of another file."""
    from app.cli import main
    from core.training.answers import training_ids
    from core.training.features import is_held_out

    out, work = tmp_path / "long.jsonl", tmp_path / "docs"
    options = ["long-prompts", "--prompts", str(prompts_file), "--out", str(out), "--work", str(work), "--model", str(tiny_dir),
               "--count", "8", "--min-tokens", "60", "--max-tokens", "120", "--max-new-tokens", "24",
               "--min-passage-tokens", "8", "--answer-batch", "4", "--threads", "1"]  # fmt: skip
    assert main([*options, "--documents", "12"]) == 0
    assert main([*options, "--documents", "4"]) == 0
    planned = [pid for pid in training_ids(prompts_file) if not is_held_out(pid, 0.05)][:4]
    stops, decode = set(stop_token_ids(tiny_base.model, tiny_base.tokenizer)), tiny_base.tokenizer.decode
    passages = {answer.id: decode([t for t in answer.answer_ids if t not in stops], skip_special_tokens=True).strip()
                for answer in read_answers(work / "documents.jsonl")}  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        used = {pid for pid, text in passages.items() if text and text in row["turns"][0]}
        assert used and used <= set(planned), row
    renamed = tmp_path / "renamed.jsonl"  # the same prompts, other ids
    renamed.write_text("".join(json.dumps({**row, "id": f"q{pid[1:]}"}) + "\n" for pid, row in training_ids(prompts_file).items()))
    assert main([*options[:2], str(renamed), *options[3:], "--documents", "4"]) == 0
    assert main([*options, "--documents", "4"]) == 0  # the other file's answers, cached beside these, are left out
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_a_folder_that_is_no_work_folder_is_refused_as_what_it_looks_like(tmp_path, prompts_file, monkeypatch, capsys):
    """--work naming a head's folder: with --resume a run started afresh inside
    it (answers, features and checkpoints among the head's files), and without
    it the refusal advised --resume."""
    from transformers import AutoModelForCausalLM

    from app.cli import main
    from core.training.work import holds_a_run
    from models.head import save_head
    from tests.factory import random_head, tiny_config

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("models.base.load_base", no_model)
    head = save_head(random_head(AutoModelForCausalLM.from_config(tiny_config())), tmp_path / "head")
    before = sorted(path.name for path in head.iterdir())
    for resume in ([], ["--resume"]):
        assert main(["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "new"), "--work", str(head), *resume]) == 2
        err = capsys.readouterr().err
        assert f"{head}: holds config.json, model.safetensors, which no training run writes: it looks like a draft head's" in err
        assert "pass --resume" not in err
    assert sorted(path.name for path in head.iterdir()) == before and not holds_a_run(head)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("")
    assert main(["train-head", "--prompts", str(prompts_file), "--out", str(tmp_path / "new"), "--work", str(notes), "--resume"]) == 2
    assert "holds todo.txt, which no training run writes: it looks like a folder of other files" in capsys.readouterr().err
    from core.training.work import not_a_work_folder

    killed = tmp_path / "killed"  # a run killed while it wrote a file whole leaves NAME.partial: still its work folder
    killed.mkdir()
    for name in ("base-model.json.partial", "run.json", "answers.jsonl", "phases.json.partial"):
        (killed / name).write_text("")
    assert not_a_work_folder(killed) is None


def test_a_full_disk_leaves_the_report_and_head_whole_and_names_the_file(tiny_base, prompts_file, tmp_path, monkeypatch):
    """The report was written in place: a full disk left training_report.json
    cut (JSON that no longer reads), and answers appended to a full disk
    stopped the run with a bare "[Errno 28]"."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    from core.training.report import write_report
    from models.head import save_head
    from tests.factory import random_head, tiny_config

    report = {"run": "r", "data": {}, "notes": ["x" * 5000]}
    (tmp_path / REPORT_FILE).write_text(json.dumps(report))
    (tmp_path / NOTES_FILE).write_text("notes")
    written = Path.write_text

    def half(path, text, *args, **kwargs):  # a disk that fills halfway through the file
        written(path, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match=rf"{REPORT_FILE}: cannot be written \(No space left on device\)"):
        write_report(tmp_path, {**report, "run": "s"})
    assert json.loads((tmp_path / REPORT_FILE).read_text()) == report and (tmp_path / NOTES_FILE).read_text() == "notes"
    monkeypatch.undo()
    model = AutoModelForCausalLM.from_config(tiny_config())
    folder = save_head(random_head(model), tmp_path / "head")
    files = {name: (folder / name).read_bytes() for name in ("model.safetensors", "config.json")}

    def half_tensors(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a head")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_tensors)
    with pytest.raises(OSError, match=r"model\.safetensors(\.partial)?: cannot be written"):
        save_head(random_head(model, seed=1), folder)
    assert {name: (folder / name).read_bytes() for name in files} == files
    monkeypatch.undo()
    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match=r"config\.json: cannot be written \(No space left on device\)"):
        save_head(random_head(model, seed=1), folder)
    monkeypatch.undo()
    assert {name: (folder / name).read_bytes() for name in files} != files  # the weights were replaced whole
    assert json.loads((folder / "config.json").read_bytes()) == json.loads(files["config.json"])
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "model.safetensors"]
    if not Path("/dev/full").exists():
        return
    cache = tmp_path / "work" / "answers.jsonl"
    cache.parent.mkdir()
    cache.symlink_to("/dev/full")  # every write fails as on a full disk
    prompts = read_prompts(prompts_file, tiny_base.tokenizer)[:2]
    with pytest.raises(OSError, match=rf"{cache}: cannot be written \(No space left on device\)"):
        generate_answers(tiny_base, prompts, cache, ANSWERS, progress=False)


def test_the_head_is_judged_under_a_progress_bar(tiny_base, prompts_file, tmp_path, capsys):
    """The held-out judging after each epoch and of the written head showed
    nothing while the training bar stood at its end."""
    from dataclasses import replace

    paths = RunPaths(prompts_file, tmp_path / "head", tmp_path / "work")
    train_head(tiny_base, paths, replace(ANSWERS, samples_per_prompt=1), FEATURES, replace(TRAIN, epochs=2), draft_vocab=24)
    err = capsys.readouterr().err
    assert "epoch 1 held-out" in err and "epoch 2 held-out" in err and "judging the head (held-out)" in err


def test_settings_hold_a_work_folder_only_once_something_was_made_with_them(tiny_base, prompts_file, tmp_path, monkeypatch, capsys):
    """self-prompts whose model was missing recorded its --temperature before
    failing, and the next run, with another, was refused ("its requests were
    made with --temperature 0.5") although no request was made; the settings
    file alone then held the folder to the model an earlier run had loaded."""
    from app.cli import main
    from core.training.answers import check_settings
    from core.training.pipeline import BASE_FILE, check_base_model, recorded_base

    def missing(*args, **kwargs):
        raise ValueError("no such model here")

    monkeypatch.setattr("models.base.load_base", missing)
    work = tmp_path / "w"
    options = ["self-prompts", "--prompts", str(prompts_file), "--out", str(tmp_path / "self.jsonl"), "--work", str(work), "--count", "4"]
    for temperature in ("0.5", "1.0"):
        assert main([*options, "--temperature", temperature]) == 2
        assert capsys.readouterr().err == "error: no such model here\n"
    (work / BASE_FILE).write_text(json.dumps({"name": "other", "quantization": "none", "sizes": [1], "embedding": "x"}))
    check_base_model(work, tiny_base)  # no request was made by that model: the folder is this one's
    assert recorded_base(work)["name"] == tiny_base.name
    cache = work / "documents.jsonl"  # long-prompts' answers, shared with train-head: the same rule
    cache.write_text("")  # opened for the first batch, which never came
    check_settings(cache, {"max_new_tokens": 8}, {"max_new_tokens": "--max-new-tokens"}, "answers")
    check_settings(cache, {"max_new_tokens": 9}, {"max_new_tokens": "--max-new-tokens"}, "answers")
    cache.write_text('{"id": "p0"}\n')  # once an answer is there, its settings hold
    with pytest.raises(ValueError, match="its answers were made with --max-new-tokens 9, and this run asks for 8"):
        check_settings(cache, {"max_new_tokens": 8}, {"max_new_tokens": "--max-new-tokens"}, "answers")


def test_a_damaged_settings_file_or_manifest_is_named_and_written_whole(tiny_base, features, prompts_file, tmp_path, monkeypatch, capsys):
    """An emptied requests-settings.json stopped self-prompts with a bare
    "Expecting value: line 1 column 1 (char 0)"; a full disk cut it, or the
    features' manifest, or the record of the base model."""
    from app.cli import main
    from core.training.answers import check_settings
    from core.training.pipeline import BASE_FILE, check_base_model

    def missing(*args, **kwargs):
        raise ValueError("no such model here")

    monkeypatch.setattr("models.base.load_base", missing)
    work = tmp_path / "w"
    options = ["self-prompts", "--prompts", str(prompts_file), "--out", str(tmp_path / "self.jsonl"), "--work", str(work), "--count", "4"]
    assert main(options) == 2 and capsys.readouterr().err == "error: no such model here\n"
    (work / "requests.jsonl").write_text('{"id": "self-0-0"}\n')
    (work / "requests-settings.json").write_text("")
    assert main(options) == 2
    assert capsys.readouterr().err == (
        f"error: {work / 'requests-settings.json'}: cannot be read (Expecting value: line 1 column 1 (char 0)); it records the "
        "settings requests.jsonl's requests were made with: delete it and give the settings they were made with, or give "
        "another --work for new requests\n"
    )
    (work / "requests-settings.json").unlink()
    answers, shards = features
    folder = tmp_path / "features"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"answers": 3')
    with pytest.raises(ValueError, match=f"{folder / 'manifest.json'}: cannot be read .*; delete the folder {folder} to extract"):
        extract_features(tiny_base, answers, folder, FEATURES, progress=False)

    written = Path.write_text

    def half(path, text, *args, **kwargs):  # a disk that fills halfway through the file
        written(path, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    cache, settings = work / "answers.jsonl", {"max_new_tokens": 8, "temperature": 0.7}
    check_settings(cache, settings, {}, "answers")
    check_base_model(work, tiny_base)
    extract_features(tiny_base, answers, tmp_path / "whole", FEATURES, progress=False)
    kept = {path: path.read_bytes() for path in (work / "answers-settings.json", work / BASE_FILE, tmp_path / "whole" / "manifest.json")}
    (work / BASE_FILE).write_text(json.dumps({"name": "other", "quantization": "none", "sizes": [1], "embedding": "x"}))
    (work / "requests.jsonl").unlink()  # no work there: the record is written again
    kept[work / BASE_FILE] = (work / BASE_FILE).read_bytes()
    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match="answers-settings.json(.partial)?: cannot be written"):
        check_settings(cache, {**settings, "max_new_tokens": 9}, {}, "answers")
    with pytest.raises(OSError, match=f"{BASE_FILE}(.partial)?: cannot be written"):
        check_base_model(work, tiny_base)
    with pytest.raises(OSError, match="manifest.json(.partial)?: cannot be written"):
        extract_features(tiny_base, answers, tmp_path / "whole", FEATURES, progress=False)  # its manifest written again
    monkeypatch.undo()
    assert {path: path.read_bytes() for path in kept} == kept


def test_a_draft_step_no_position_reaches_has_no_figure(tiny_base, tiny_dir, features, tmp_path, capsys):
    """eval-heads --steps deeper than every sequence printed top-1 0.0% for
    the steps with no position to judge: they are n/a, and null in --json."""
    from app.cli import main
    from core.training.report import _percent
    from core.training.trainer import Totals
    from models.head import save_head

    totals = Totals()
    for step, (positions, correct) in enumerate([(4, 3), (0, 0)]):  # step 2 reached by no position
        for name, value in (("positions", positions), ("correct", correct), ("chain_total", positions), ("chain_correct", correct),
                            ("smooth_l1", 0.5), ("cross_entropy", 1.0)):  # fmt: skip
            totals.add(step, name, value if positions else 0.0)
    summary = totals.summary()
    assert summary["accuracy"] == [0.75, None] and summary["chain_accuracy"] == [0.75, None] and summary["smooth_l1"] == [0.125, None]
    assert _percent(summary["accuracy"]) == "75.0% / n/a"

    _, shards = features
    deepest = max(len(sequence.input_ids) for path in shards["eval"] for sequence in read_shard(path))
    save_head(new_head(head_config_for(tiny_base.model.config), seed=0), tmp_path / "head")
    command = ["eval-heads", "--features", str(shards["eval"][0].parent.parent), "--model", str(tiny_dir), "--dtype", "float64",
               "--steps", str(deepest + 1), "--json", str(tmp_path / "figures.json"), str(tmp_path / "head")]  # fmt: skip
    assert main(command) == 0
    figures = json.loads((tmp_path / "figures.json").read_text())[str(tmp_path / "head")]
    assert figures["accuracy"][0] is not None and figures["accuracy"][-1] is None and figures["chain_accuracy"][-1] is None
    printed = capsys.readouterr().out
    assert ", n/a; chain " in printed and f", n/a of 0 ({int(figures['positions'])} positions)" in printed  # the last step's
    assert "0.0% of 0" not in printed


def test_features_given_from_inside_their_folder_are_checked_against_their_work_folder_s_model(tiny_base, features, tmp_path, monkeypatch):
    """Shards found from `eval-heads --features .` are eval/shard-*: three
    parents up is '.', not the work folder whose record names the model."""
    from core.training.compare import check_feature_shards
    from core.training.pipeline import BASE_FILE

    _, shards = features
    work = tmp_path / "work"
    (work / "features" / "eval").mkdir(parents=True)
    shutil.copy(shards["eval"][0], work / "features" / "eval" / "shard-00000.safetensors")
    (work / BASE_FILE).write_text(json.dumps({"name": "another", "quantization": "none", "sizes": [], "embedding": "x"}))
    monkeypatch.chdir(work / "features")
    with pytest.raises(ValueError, match=r"came from another base model \(another\)"):
        check_feature_shards(tiny_base, [Path("eval/shard-00000.safetensors")])


def test_long_prompts_say_what_gives_more_passages(tiny_base, tiny_dir, prompts_file, tmp_path, monkeypatch, capsys):
    """A file of 3 prompts was told to answer more prompts (--documents), which
    cannot give more than the file has; answers shorter than
    --min-passage-tokens are said as such."""
    from app.cli import main
    from core.training import documents
    from core.training.answers import Answer

    few = tmp_path / "few.jsonl"
    few.write_text("".join(line + "\n" for line in prompts_file.read_text().splitlines()[:3]))  # p0..p2, none held out
    options = ["long-prompts", "--prompts", str(few), "--out", str(tmp_path / "long.jsonl"), "--work", str(tmp_path / "w"),
               "--model", str(tiny_dir), "--max-new-tokens", "8", "--min-passage-tokens", "8", "--threads", "1"]  # fmt: skip
    assert main(options) == 2
    err = capsys.readouterr().err
    assert f"there are 3: {few} gives 3 prompts to answer (train-head's held-out ones are left out): give a file of more prompts" in err
    assert "--documents" not in err

    def short(base, prompts, cache, params, deadline, progress):  # answers that end after 2 tokens
        return [Answer(prompt.id, 0, list(prompt.ids), [5, 6], True) for prompt in prompts]

    monkeypatch.setattr(documents, "generate_answers", short)
    with pytest.raises(ValueError, match=r"there are 0: 4 of the 4 answers are shorter: lower --min-passage-tokens; or answer more prompts \(--documents\)$"):
        documents.long_prompts(tiny_base, prompts_file, tmp_path, 4, documents.LongParams(min_passage=8), AnswerParams(1, 24), progress=False)
