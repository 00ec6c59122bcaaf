"""Held-out top-1 of draft heads of any kind on the same stored features.

Each head is judged as the engine drafts with it: its argmax over its own draft
vocabulary (the base lm_head's rows for an EAGLE-1/2 head, its own lm_head for
an EAGLE-3 head), mapped to token ids, against the base model's greedy token
over the whole vocabulary. A token outside a head's draft vocabulary counts as
a miss, so heads with different vocabularies are compared on the same
positions. Steps after the first feed the head its own earlier outputs, as a
draft chain does (the training-time test of core.training.trainer)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from core.training.features import read_shard
from core.training.trainer import Totals, count_step, fed_back, frozen_of, make_batch, plan_epoch, shard_lengths, unrolled_mask
from models.eagle3 import Eagle3Head
from models.head import HeadCache


def check_feature_shards(base, shards: list[Path]) -> None:
    """Each shard readable and of `base`: its features as wide as the base
    model's hidden size (the captured layers three times that) and its tokens
    inside its vocabulary; a work folder that records its base model
    (train-head's) names another one. ValueError naming the shard; read from
    the headers and token ids only, before any head is judged."""
    from safetensors import safe_open

    from core.training.pipeline import recorded_base_problem

    hidden = base.model.config.hidden_size
    vocabulary = base.model.get_input_embeddings().weight.shape[0]
    # the work folder above features/SPLIT/shard: resolved, as shards found from `--features .` have no parents to go up
    problem = recorded_base_problem(shards[0].resolve().parent.parent.parent, base) if shards else None
    if problem:
        raise ValueError(f"{shards[0].parent.parent}: {problem}")
    for path in shards:
        try:
            with safe_open(str(path), "pt") as shard:
                width = shard.get_slice("features").get_shape()[1]
                aux = shard.get_slice("aux").get_shape()[1] if "aux" in shard.keys() else None
                largest = int(shard.get_tensor("input_ids").max())
                rows = {name: shard.get_slice(name).get_shape()[0] for name in ("features", "input_ids", "loss_mask", *(["aux"] if aux else []))}
                lengths = shard.get_tensor("lengths")
        except Exception as error:  # noqa: BLE001 (safetensors' own errors: a shard cut short or not one at all)
            raise ValueError(f"{path}: not a readable feature shard ({type(error).__name__}: {error}); take the features again") from error
        if len(set(rows.values())) > 1 or int(lengths.sum()) != rows["features"] or bool((lengths <= 0).any()):
            counts = ", ".join(f"{name} {count}" for name, count in rows.items())
            raise ValueError(
                f"{path}: not a readable feature shard (rows: {counts}; its sequence lengths add up to {int(lengths.sum())});"
                " take the features again"
            )
        if width != hidden or aux not in (None, 3 * hidden):
            raise ValueError(f"{path}: features {width} wide, and the base model's hidden size is {hidden}: they come from another model (give it with --model)")
        if largest >= vocabulary:
            raise ValueError(f"{path}: token id {largest} is outside the base model's vocabulary of {vocabulary}: the features come from another model (give it with --model)")


@torch.no_grad()
def drafted_accuracy(base, head, shards: list[Path], steps: int = 3, batch_tokens: int = 2048, progress: bool = False,
                     label: str = "judging the head (held-out)") -> dict:
    """{"positions", "accuracy": [step 1, 2, ...], "chain_accuracy": [...]} over
    the answer positions of `shards` (EAGLE-3 shards hold both kinds of features);
    `progress`: a bar counting the sequences judged, described by `label`."""
    from tqdm import tqdm

    frozen = frozen_of(base, bf16=False)
    head = head.place(frozen.embed.device, torch.float32).eval()
    third = isinstance(head, Eagle3Head)
    draft_ids = head.draft_token_ids
    rows = frozen.lm_head if draft_ids is None or third else frozen.lm_head[draft_ids]
    totals = Totals()
    bar = tqdm(total=sum(len(shard_lengths(path)) for path in shards) if progress else 0, unit="seq",
               desc=label, leave=False, disable=not progress)  # fmt: skip
    for path in shards:
        sequences = read_shard(path)
        if third and sequences[0].aux is None:
            raise ValueError(f"{path}: holds no captured layers; an EAGLE-3 head needs features from `train-head --arch eagle3`")
        lengths = [[len(sequence.input_ids) for sequence in sequences]]
        for _, indices in plan_epoch([path], lengths, batch_tokens, 0, 0):
            batch = make_batch([sequences[i] for i in indices], frozen)
            _judge(head, batch, frozen.lm_head, rows, draft_ids, third, steps, totals)
            bar.update(len(indices))
    bar.close()
    summary = totals.summary()
    return {key: summary[key] for key in ("positions", "accuracy", "chain_accuracy", "chain_positions")}


def _judge(head, batch, lm_head, rows, draft_ids, third: bool, steps: int, totals: Totals) -> None:
    valid0 = batch.loss_mask
    base_argmax = torch.full(valid0.shape, -1, dtype=torch.long, device=valid0.device)
    base_argmax[valid0] = F.linear(batch.targets[valid0], lm_head).argmax(-1)
    feedable = base_argmax == batch.next_next_ids  # the data's next token is the base's choice
    inputs = batch.aux if third else batch.features
    cache, chain, prediction = HeadCache(), torch.ones_like(valid0), None
    for step in range(steps):
        if step > 0:
            inputs = fed_back(prediction, batch, third)
        prediction = head(batch.next_embeddings, inputs, batch.positions, unrolled_mask(inputs.shape[1], step, inputs.device), cache)
        valid = valid0 & (batch.positions >= step)
        chosen = prediction[valid]
        logits = head.lm_head(head.norm(chosen)) if third else F.linear(chosen, rows)
        tokens = logits.argmax(-1)
        if draft_ids is not None:
            tokens = draft_ids[tokens]
        correct = torch.zeros_like(valid)
        correct[valid] = tokens == base_argmax[valid]
        chain = count_step(totals, step, valid, correct, chain, feedable)
        totals.add(step, "smooth_l1", 0.0)  # losses are not judged here
        totals.add(step, "cross_entropy", 0.0)
