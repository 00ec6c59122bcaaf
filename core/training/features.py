"""Base-model features of the self-distilled answers, streamed to disk in shards.

One shard is a safetensors file of whole sequences (prompt + answer), concatenated:
  features   (N, H) bf16   post-final-norm last hidden state at every position
  input_ids  (N,)   int32  the tokens
  loss_mask  (N,)   uint8  1 at position t when the pair (feature_t, token_{t+1})
                           -> feature_{t+1} is trained: t from the position before
                           the first answer token to the one before the last
  lengths    (S,)   int64  sequence lengths (they split the rows)
  aux        (N, 3H) bf16  for EAGLE-3 heads only: the inputs of three decoder
                           layers (core/capture.py), what the head reads
Prompt positions are kept (unmasked) because the head attends to them at
inference: prefill feeds it the prompt's features too.

Shards are planned from the answers alone and each written atomically, so a
resumed run skips the shards present. A held-out split (by prompt id) goes to
its own folder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.training.answers import Answer
from models.base import out_of_memory
from models.paths import write_whole

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class FeatureParams:
    shard_tokens: int = 65536  # rows per shard (about 75 MB of bf16 features at H=576)
    batch_tokens: int = 8192  # padded tokens per base-model forward
    eval_fraction: float = 0.05  # prompts held out for evaluation
    layer_ids: tuple[int, ...] | None = None  # EAGLE-3: also store these layers' inputs (aux); None = EAGLE-1/2


@dataclass
class Sequence:
    input_ids: torch.Tensor  # (L,) int32
    loss_mask: torch.Tensor  # (L,) uint8
    features: torch.Tensor  # (L, H) bf16
    aux: torch.Tensor | None = None  # (L, 3H) bf16 for EAGLE-3


def is_held_out(prompt_id: str, fraction: float) -> bool:
    """A stable split by prompt: every sample of a prompt lands on the same side."""
    digest = hashlib.sha256(prompt_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def loss_mask_of(prompt_length: int, length: int) -> torch.Tensor:
    """1 at t in [prompt_length - 1, length - 2]: token_{t+1} is an answer token."""
    mask = torch.zeros(length, dtype=torch.uint8)
    mask[prompt_length - 1 : length - 1] = 1
    return mask


def plan_shards(answers: list[Answer], params: FeatureParams) -> list[list[Answer]]:
    """Length-sorted sequences cut into shards of about `shard_tokens` rows."""
    ordered = sorted(answers, key=lambda a: (len(a.prompt_ids) + len(a.answer_ids), a.id, a.sample))
    shards, current, rows = [], [], 0
    for answer in ordered:
        current.append(answer)
        rows += len(answer.prompt_ids) + len(answer.answer_ids)
        if rows >= params.shard_tokens:
            shards.append(current)
            current, rows = [], 0
    if current:
        shards.append(current)
    return shards


class FeaturesStopped(Exception):
    """The time budget ran out between shards; the shards written so far are kept for --resume."""


def extract_features(
    base, answers: list[Answer], folder: Path, params: FeatureParams, progress: bool = True,
    deadline: float | None = None,
) -> dict[str, list[Path]]:
    """Write train/ and eval/ shards under `folder`; returns the shard files per split.
    Past `deadline` (time.time()) no new shard starts: FeaturesStopped names how far it got."""
    from tqdm import tqdm

    answers = [answer for answer in answers if len(answer.answer_ids) >= 2]
    _check_manifest(folder, answers, params)
    splits = {"train": [], "eval": []}
    for answer in answers:
        splits["eval" if is_held_out(answer.id, params.eval_fraction) else "train"].append(answer)
    plans = {split: plan_shards(chosen, params) for split, chosen in splits.items()}
    files = {split: [_shard_path(folder, split, index) for index in range(len(plan))] for split, plan in plans.items()}
    pending = [(split, index) for split, plan in plans.items() for index in range(len(plan)) if not files[split][index].is_file()]
    total = sum(len(a.prompt_ids) + len(a.answer_ids) for split, index in pending for a in plans[split][index])
    bar = tqdm(total=total, unit="token", unit_scale=True, desc="features", disable=not progress or not total)  # no bar where every shard is taken
    for done, (split, index) in enumerate(pending):
        if deadline is not None and time.time() > deadline:
            bar.close()
            left = len(pending) - done
            raise FeaturesStopped(f"features: {left} of {sum(map(len, files.values()))} shards are still to be taken")
        sequences = [
            sequence for batch in _batches(plans[split][index], params.batch_tokens)
            for sequence in forward_batch(base, batch, params.layer_ids)
        ]  # fmt: skip
        write_shard(files[split][index], sequences)
        bar.update(sum(len(sequence.input_ids) for sequence in sequences))
    bar.close()
    return files


def _check_manifest(folder: Path, answers: list[Answer], params: FeatureParams) -> None:
    """Refuse to mix shards planned from a different answer set."""
    fingerprint = hashlib.sha256(
        json.dumps(sorted((a.id, a.sample, len(a.answer_ids)) for a in answers)).encode()
    ).hexdigest()
    manifest = {"answers": len(answers), "fingerprint": fingerprint, **params.__dict__}
    manifest["layer_ids"] = list(params.layer_ids) if params.layer_ids else None  # as JSON reads it back
    path = folder / MANIFEST
    if path.is_file():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:  # cut short or emptied (a full disk)
            raise ValueError(f"{path}: cannot be read ({error}); delete the folder {folder} to extract the features again") from error
        if previous != manifest:
            raise ValueError(
                f"{folder}: features were extracted from {previous.get('answers')} answers with other settings; "
                f"now {len(answers)}; delete the folder to extract them again"
            )
    folder.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(manifest, indent=2) + "\n")


def _shard_path(folder: Path, split: str, index: int) -> Path:
    return folder / split / f"shard-{index:05d}.safetensors"


def _batches(answers: list[Answer], batch_tokens: int) -> list[list[Answer]]:
    """Consecutive (length-sorted) answers, at most `batch_tokens` padded tokens each."""
    batches, current = [], []
    for answer in answers:
        length = len(answer.prompt_ids) + len(answer.answer_ids)
        if current and (len(current) + 1) * length > batch_tokens:
            batches.append(current)
            current = []
        current.append(answer)
    return batches + ([current] if current else [])


@torch.inference_mode()
def forward_batch(base, answers: list[Answer], layer_ids: tuple[int, ...] | None = None) -> list[Sequence]:
    """One right-padded base-model forward; padding sits after each sequence, so
    causal attention never lets a real position see it. With layer_ids, the
    inputs of those layers are captured too (EAGLE-3)."""
    from core.capture import LayerCapture

    lengths = [len(a.prompt_ids) + len(a.answer_ids) for a in answers]
    ids = torch.zeros((len(answers), max(lengths)), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, answer in enumerate(answers):
        ids[row, : lengths[row]] = torch.tensor(answer.prompt_ids + answer.answer_ids)
        attention[row, : lengths[row]] = 1
    capture = LayerCapture(base.model, layer_ids) if layer_ids else None
    with capture.during() if capture else contextlib.nullcontext():
        hidden = base.model.get_decoder()(
            input_ids=ids.to(base.device), attention_mask=attention.to(base.device)
        ).last_hidden_state  # (B, T, H), after the final norm
    aux = capture.batched() if capture else None  # (B, T, 3H)
    return [
        Sequence(
            input_ids=ids[row, :length].to(torch.int32),
            loss_mask=loss_mask_of(len(answer.prompt_ids), length),
            features=hidden[row, :length].to("cpu", torch.bfloat16),
            aux=None if aux is None else aux[row, :length].to("cpu", torch.bfloat16),
        )
        for row, (answer, length) in enumerate(zip(answers, lengths))
    ]


def write_shard(path: Path, sequences: list[Sequence]) -> None:
    from models.paths import save_tensors

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        "features": torch.cat([s.features for s in sequences]).contiguous(),
        "input_ids": torch.cat([s.input_ids for s in sequences]),
        "loss_mask": torch.cat([s.loss_mask for s in sequences]),
        "lengths": torch.tensor([len(s.input_ids) for s in sequences], dtype=torch.int64),
    }
    if sequences[0].aux is not None:
        tensors["aux"] = torch.cat([s.aux for s in sequences]).contiguous()
    partial = path.with_suffix(".partial")
    save_tensors(tensors, partial)
    partial.replace(path)  # atomic: a killed run never leaves a half shard


class DamagedShardError(ValueError):
    """A feature shard that cannot be read (cut short by a power cut, a disk error)."""


@contextlib.contextmanager
def reading_shard(path: Path):
    """Reading the shard at `path`: any error but memory running out (safetensors'
    own, no OSError, for a shard cut short; KeyError for one of other keys)
    becomes a DamagedShardError naming it and what to delete."""
    try:
        yield
    except Exception as error:
        if out_of_memory(error):
            raise
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DamagedShardError(f"{path}: a feature shard that cannot be read ({reason}); delete the folder {path.parent.parent} "
                                "to extract the features again (the answers are kept)") from error  # fmt: skip


def shard_tensors(path: Path, names: tuple[str, ...]) -> list[torch.Tensor]:
    """Some of a shard's tensors, read alone; DamagedShardError where it cannot be read."""
    from safetensors import safe_open

    with reading_shard(path), safe_open(str(path), framework="pt") as shard:
        return [shard.get_tensor(name) for name in names]


def read_shard(path: Path) -> list[Sequence]:
    from safetensors.torch import load_file

    with reading_shard(path):
        tensors = load_file(str(path))
        lengths = tensors["lengths"].tolist()
    aux = tensors["aux"].split(lengths) if "aux" in tensors else [None] * len(lengths)
    return [
        Sequence(input_ids, loss_mask, features, extra)
        for input_ids, loss_mask, features, extra in zip(
            tensors["input_ids"].split(lengths), tensors["loss_mask"].split(lengths),
            tensors["features"].split(lengths), aux,
        )
    ]  # fmt: skip
