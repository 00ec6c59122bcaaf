"""Draft-head training on stored base-model features (EAGLE-1/2 recipe plus
EAGLE-3's training-time test).

Step 0 is the EAGLE-1 objective: at position t the head reads
(feature_t, token_{t+1}) and predicts feature_{t+1}. Unrolled step k > 0 feeds
the head its own step k-1 predictions, shifted by one position, in place of the
true features, exactly as a greedy draft chain of depth k+1 does at inference:
its query at t sees the true-feature keys up to t-k and the keys its own chain
wrote at t-k+1..t (one per earlier step). Without it the head only ever sees
true features and its second draft step is rarely right.

loss_k = SmoothL1(pred_k, feature_{t+1}) + ce_weight * CE(softmax(lm_head(feature_{t+1})),
         log_softmax(lm_head(pred_k))), over answer positions; total = sum_k decay^k loss_k.

EAGLE-3 heads (arch "eagle3", Li et al. 2025) read three captured base layers
at step 0 and their own output h after it, and are trained without the
feature regression: loss_k = CE(softmax(base lm_head(feature_{t+1})) over the
draft vocabulary, log_softmax(head lm_head(norm(h_k)))). Positions whose next
token is outside the draft vocabulary are dropped (a stand-in for the base
model's own top-1, which would need the full lm_head at every position)."""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from core.training.answers import derived_seed
from core.training.features import Sequence, read_shard, shard_tensors
from models.eagle3 import Eagle3Head
from models.head import DraftHead, HeadCache, HeadConfig

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainParams:
    epochs: int = 2
    learning_rate: float = 1e-3  # peak, after warm-up; cosine decay to min_lr_ratio of it
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    batch_tokens: int = 2048  # padded positions per optimizer step
    unroll_steps: int = 3  # 1 = plain EAGLE; k adds k-1 training-time-test steps
    step_decay: float = 0.8  # weight of unrolled step k is step_decay**k
    ce_weight: float = 0.1  # EAGLE's weight of the token cross-entropy
    loss_vocab: int | None = 8192  # training CE over the most frequent answer tokens only (None: all);
    # lm_head over the full vocabulary is most of a step's cost. Evaluation always uses all tokens.
    noise: float = 0.05  # half-width of the uniform noise on input features, times their rms
    grad_clip: float = 0.5  # gradient value clipping (EAGLE)
    bf16: bool = True  # bf16 autocast (fp32 master weights); fp32 otherwise
    checkpoint_every: int = 50  # optimizer steps between checkpoints
    seed: int = 0
    init_head: str | None = None  # folder of a head to start from (continue or fine-tune) instead of a fresh one
    arch: str = "eagle2"  # eagle2 (EAGLE-1/2 head) or eagle3 (its draft vocabulary is the loss vocabulary)


# train-head's options for the settings a checkpoint must match
OPTIONS = {
    "epochs": "--epochs", "learning_rate": "--learning-rate", "batch_tokens": "--batch-tokens",
    "unroll_steps": "--unroll-steps", "loss_vocab": "--draft-vocab", "bf16": "--precision", "seed": "--seed",
    "init_head": "--init-head", "arch": "--arch",
}  # fmt: skip


@dataclass
class Frozen:
    """The base model's pieces the head is trained against (never updated)."""

    embed: torch.Tensor  # (V, H) input embedding, fp32
    lm_head: torch.Tensor  # (V', H) output layer rows the loss uses, in the compute dtype
    vocabulary: torch.Tensor | None = None  # (V',) token id of each lm_head row; None: all, in order
    drafted: torch.Tensor | None = None  # (V,) bool: token ids in `vocabulary` (all True without one)


@dataclass
class Batch:
    features: torch.Tensor  # (B, T, H) fp32 feature_t
    next_embeddings: torch.Tensor  # (B, T, H) embed(token_{t+1})
    targets: torch.Tensor  # (B, T, H) feature_{t+1}
    next_next_ids: torch.Tensor  # (B, T) token_{t+2} (-1 where none)
    loss_mask: torch.Tensor  # (B, T) bool
    positions: torch.Tensor  # (B, T)
    aux: torch.Tensor | None = None  # (B, T, 3H) captured layers at t, for EAGLE-3 heads


@dataclass
class Totals:
    """Sums over positions; `summary()` turns them into means."""

    positions: list[float] = field(default_factory=list)  # per step
    smooth_l1: list[float] = field(default_factory=list)
    cross_entropy: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)  # draft argmax == base argmax, teacher-forced
    chain_total: list[float] = field(default_factory=list)  # earlier steps of the chain all right
    chain_correct: list[float] = field(default_factory=list)  # ... and this one too

    def add(self, step: int, name: str, value: float) -> None:
        values = getattr(self, name)
        while len(values) <= step:
            values.append(0.0)
        values[step] += value

    def merge(self, other: Totals) -> None:
        for name in (entry.name for entry in fields(self)):
            for step, value in enumerate(getattr(other, name)):
                self.add(step, name, value)

    def summary(self) -> dict:
        """Means per step; None for a step with nothing to average (no position reaches a draft step deeper
        than the longest sequence, no chain one whose earlier steps all missed): no figure, not 0%."""
        steps = len(self.positions)
        per = lambda name, den: [getattr(self, name)[k] / den[k] if den[k] else None for k in range(steps)]  # noqa: E731
        return {
            "positions": self.positions[0] if steps else 0,
            "smooth_l1": per("smooth_l1", self.positions),
            "cross_entropy": per("cross_entropy", self.positions),
            "accuracy": per("correct", self.positions),
            "chain_accuracy": per("chain_correct", self.chain_total),
            "chain_positions": list(self.chain_total),
        }


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl+C and the signals made to raise as it does wait until the block
    has run, then raise (on the main thread; elsewhere no signal lands)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    numbers = [signal.SIGINT, *(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))]
    previous = {number: signal.getsignal(number) for number in numbers}
    raising = {number: handler for number, handler in previous.items() if callable(handler)}  # not SIG_DFL, SIG_IGN
    caught: list[int] = []
    for number in raising:
        signal.signal(number, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for number, handler in raising.items():
            signal.signal(number, handler)
        if caught:
            raising[caught[0]](caught[0], None)


def head_config_for(model_config) -> HeadConfig:
    """One decoder layer shaped like the base model's. ValueError naming what
    a config lacks (checked before any answers: it failed after hours of them)."""
    rope = getattr(model_config, "rope_parameters", None) or {}
    theta = getattr(model_config, "rope_theta", None) or rope.get("rope_theta", 10000.0)

    def first(*names: str, otherwise=None):
        for name in names:
            value = getattr(model_config, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
        if otherwise is not None:
            return otherwise
        kind = getattr(model_config, "model_type", None) or type(model_config).__name__
        raise ValueError(f"{kind}'s config has no {names[0]} (nor {', '.join(names[1:])}): a draft head cannot be shaped after this model")

    hidden = first("hidden_size", "n_embd", "d_model")
    heads = first("num_attention_heads", "n_head")
    return HeadConfig(
        hidden_size=hidden,
        # GPT-2's n_inner None means 4 x its width, as do configs that name no inner width
        intermediate_size=first("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", otherwise=4 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=first("num_key_value_heads", otherwise=heads),
        vocab_size=first("vocab_size"),
        rms_norm_eps=first("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"),
        rope_theta=float(theta),
    )


def new_head(config: HeadConfig, seed: int) -> DraftHead:
    """fc starts as the identity on the feature half (and small on the embedding
    half), so the untrained head already passes feature_t through the residual."""
    torch.manual_seed(seed)
    head = DraftHead(config)
    h = config.hidden_size
    with torch.no_grad():
        head.fc.weight[:, :h].mul_(0.1)
        head.fc.weight[:, h:].copy_(torch.eye(h))
        head.fc.bias.zero_()
    return head


def new_eagle3_head(base, draft_ids: torch.Tensor | None, seed: int) -> Eagle3Head:
    """An EAGLE-3 head for `base` drafting among `draft_ids` (None: all tokens),
    features from layers 2, L//2 and L-3 (eagle3.training_layer_ids). Its lm_head and norm start as the
    base model's (rows of the draft vocabulary), so its first output already
    reads like a base feature; the rest is freshly initialised."""
    from models import eagle3

    torch.manual_seed(seed)
    model = base.model
    vocab = model.get_output_embeddings().weight.shape[0]
    draft_ids = torch.arange(vocab) if draft_ids is None else draft_ids.cpu()
    config = replace(head_config_for(model.config), bias=False, draft_vocab_size=len(draft_ids))
    head = eagle3.new_head(config, eagle3.training_layer_ids(model.config.num_hidden_layers), draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[draft_ids.to(base.device)].float().cpu())
        head.norm.weight.copy_(model.get_decoder().norm.weight.float().cpu())
    return head


def _shown(name: str, value) -> str:
    """A setting's value as its option takes it: --epochs 3, --learning-rate 0.0002, --precision bf16."""
    if name == "bf16" and isinstance(value, bool):
        return "bf16" if value else "fp32"
    if name == "loss_vocab" and value is None:  # the whole vocabulary, which --draft-vocab takes as 0
        return "0"
    if isinstance(value, list | tuple):
        return ",".join(_shown("", item) for item in value)
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def initial_weights(folder: Path, head: DraftHead) -> dict[str, torch.Tensor]:
    """The weights of the head in `folder`, checked against the one being trained;
    its draft vocabulary (d2t) is dropped: training always covers all tokens."""
    from models.errors import HeadFormatError
    from models.head import read_checkpoint

    _, state, file = read_checkpoint(folder)
    state = {key: value.float() for key, value in state.items() if key != "d2t"}
    expected = {key: tuple(value.shape) for key, value in head.state_dict().items()}
    found = {key: tuple(value.shape) for key, value in state.items()}
    if found != expected:
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        shapes = [f"{key} is {found[key]}, this base model's head needs {expected[key]}"
                  for key in sorted(set(found) & set(expected)) if found[key] != expected[key]]  # fmt: skip
        problems = shapes[:2] + [f"{key} is missing" for key in missing[:2]] + [f"{key} is not a key of this kind of head" for key in extra[:2]]
        raise HeadFormatError(f"{file}: does not fit a head for this base model ({'; '.join(problems)})")
    return state


def frozen_of(base, bf16: bool, vocabulary: torch.Tensor | None = None) -> Frozen:
    """`vocabulary`: token ids whose rows of lm_head the loss uses (None: all).
    Everything lives on the base model's device, where the head trains."""
    embed = base.model.get_input_embeddings().weight.detach().float()
    lm_head = base.model.get_output_embeddings().weight.detach()
    drafted = torch.ones(lm_head.shape[0], dtype=torch.bool, device=lm_head.device)
    if vocabulary is not None:
        vocabulary = vocabulary.to(lm_head.device)
        lm_head = lm_head[vocabulary]
        drafted = torch.zeros_like(drafted).index_fill_(0, vocabulary, True)
    return Frozen(embed, lm_head.to(torch.bfloat16 if bf16 else torch.float32), vocabulary, drafted)


def frequent_tokens(shards: list[Path], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens of the shards, sorted by id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in shards:
        ids, mask = shard_tensors(path, ("input_ids", "loss_mask"))
        ids, mask = ids.long(), mask.bool()
        counts += torch.bincount(ids[1:][mask[:-1]], minlength=vocab_size)  # token_{t+1} of trained t
    return counts.topk(min(size, vocab_size)).indices.sort().values


def make_batch(sequences: list[Sequence], frozen: Frozen) -> Batch:
    """Right-padded; position t pairs feature_t with token_{t+1}. Assembled on
    the CPU, then moved to the device of `frozen` in one copy per tensor."""
    length = max(len(s.input_ids) for s in sequences)
    size = frozen.embed.shape[1]
    features = torch.zeros(len(sequences), length + 1, size)
    ids = torch.zeros(len(sequences), length + 2, dtype=torch.long)
    next_next = torch.full((len(sequences), length + 2), -1, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    aux = None if sequences[0].aux is None else torch.zeros(len(sequences), length, sequences[0].aux.shape[-1])
    for row, s in enumerate(sequences):
        n = len(s.input_ids)
        features[row, :n] = s.features.float()
        if aux is not None:
            aux[row, :n] = s.aux.float()
        ids[row, :n] = s.input_ids.long()
        next_next[row, :n] = s.input_ids.long()
        mask[row, :n] = s.loss_mask.bool()
    device = frozen.embed.device
    features = features.to(device)
    return Batch(
        features=features[:, :-1],
        next_embeddings=F.embedding(ids[:, 1:-1].to(device), frozen.embed),
        targets=features[:, 1:],
        next_next_ids=next_next[:, 2:].to(device),
        loss_mask=mask.to(device),
        positions=torch.arange(length, device=device).expand(len(sequences), length),
        aux=None if aux is None else aux.to(device),
    )


def unrolled_mask(length: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(1, 1, T, (step+1) T) bool: the query of unrolled step `step` at t sees the
    true-input keys at <= t - step and the key of each later step j at t - step + j."""
    t = torch.arange(length, device=device)
    blocks = [t[None, :] <= (t[:, None] - step)]
    blocks += [t[None, :] == (t[:, None] - step + j) for j in range(1, step + 1)]
    return torch.cat(blocks, dim=1)[None, None]


def forward_losses(
    head: DraftHead, batch: Batch, frozen: Frozen, params: TrainParams, noise: torch.Generator | None, totals: Totals
) -> torch.Tensor:
    """The weighted loss of all unrolled steps; adds metrics to `totals`."""
    length, device = batch.features.shape[1], batch.features.device
    third = isinstance(head, Eagle3Head)
    inputs = batch.aux if third else batch.features
    if noise is not None:  # drawn on the CPU: the same noise on every device
        rms = inputs.pow(2).mean().sqrt()
        amplitude = params.noise * rms
        inputs = inputs + (torch.rand(inputs.shape, generator=noise).to(device) * 2 - 1) * amplitude
    valid0 = batch.loss_mask
    if third:  # train only where the next token can be drafted at all
        valid0 = valid0 & frozen.drafted[batch.next_next_ids.clamp(min=0)] & (batch.next_next_ids >= 0)
    target_rows = batch.targets[valid0]  # (M, H)
    with torch.no_grad():
        target_logits = F.linear(target_rows.to(frozen.lm_head.dtype), frozen.lm_head).float()  # (M, V)
        target_probs = target_logits.softmax(-1)
        base_argmax = target_logits.argmax(-1)
        del target_logits
    base_argmax_full = torch.full(valid0.shape, -1, dtype=torch.long, device=device)
    base_argmax_full[valid0] = base_argmax if frozen.vocabulary is None else frozen.vocabulary[base_argmax]
    feedable = base_argmax_full == batch.next_next_ids  # (B, T) the base's choice is the data's next token
    chain = torch.ones_like(valid0)
    cache, total, prediction = HeadCache(), 0.0, None
    for step in range(params.unroll_steps):
        if step > 0:
            inputs = fed_back(prediction, batch, third)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=params.bf16):
            mask = unrolled_mask(length, step, device)
            prediction = head(batch.next_embeddings, inputs, batch.positions, mask, cache)
        valid = valid0 & (batch.positions >= step)  # (B, T)
        rows = valid[valid0]  # which of the M target rows this step trains
        predicted = prediction[valid].float()  # (m, H)
        if third:  # the head's own norm and lm_head over the draft vocabulary; no feature regression
            smooth_l1 = torch.zeros(len(predicted), device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=params.bf16):
                logits = head.lm_head(head.norm(prediction[valid])).float()  # (m, V')
        else:
            smooth_l1 = F.smooth_l1_loss(predicted, target_rows[rows], reduction="none").mean(-1)
            logits = F.linear(predicted.to(frozen.lm_head.dtype), frozen.lm_head).float()  # (m, V)
        cross_entropy = -(target_probs[rows] * logits.log_softmax(-1)).sum(-1)
        weight = 1.0 if third else params.ce_weight
        total = total + params.step_decay**step * (smooth_l1.mean() + weight * cross_entropy.mean())
        with torch.no_grad():
            correct = torch.zeros_like(valid)
            correct[valid] = logits.argmax(-1) == base_argmax[rows]
            chain = count_step(totals, step, valid, correct, chain, feedable)
            totals.add(step, "smooth_l1", float(smooth_l1.sum()))
            totals.add(step, "cross_entropy", float(cross_entropy.sum()))
    return total


def fed_back(prediction: torch.Tensor, batch: Batch, third: bool) -> torch.Tensor:
    """The inputs of an unrolled step after the first: the previous step's
    outputs, shifted so that position t reads its prediction of feature_t
    (position 0, never trained past step 0, keeps a placeholder)."""
    first = prediction[:, :1] if third else batch.features[:, :1]
    return torch.cat([first, prediction[:, :-1]], dim=1)


def count_step(totals: Totals, step: int, valid, correct, chain, feedable) -> torch.Tensor:
    """Adds one unrolled step's positions, right drafts and greedy-chain counts
    to `totals` (all (B, T) bool); returns this step's chain: the positions
    whose drafts so far were all right and fed the data's own tokens."""
    fed = torch.ones_like(valid) if step == 0 else F.pad((chain & feedable)[:, :-1], (1, 0))
    considered = valid & fed
    chain = considered & correct
    totals.add(step, "positions", float(valid.sum()))
    totals.add(step, "correct", float(correct.sum()))
    totals.add(step, "chain_total", float(considered.sum()))
    totals.add(step, "chain_correct", float(chain.sum()))
    return chain


def shard_lengths(path: Path) -> list[int]:
    return shard_tensors(path, ("lengths",))[0].tolist()


def plan_epoch(shards: list[Path], lengths: list[list[int]], batch_tokens: int, seed: int, epoch: int):
    """[(shard index, [sequence indices])] in training order: shards shuffled,
    length-bucketed batches shuffled within each shard."""
    generator = torch.Generator().manual_seed(derived_seed(seed, epoch, 7919))
    plan = []
    for shard in torch.randperm(len(shards), generator=generator).tolist():
        order = sorted(range(len(lengths[shard])), key=lambda i: lengths[shard][i])
        batches, current = [], []
        for index in order:
            if current and (len(current) + 1) * lengths[shard][index] > batch_tokens:
                batches.append(current)
                current = []
            current.append(index)
        batches += [current] if current else []
        plan += [(shard, batches[i]) for i in torch.randperm(len(batches), generator=generator).tolist()]
    return plan


def warmup_steps(total: int, params: TrainParams) -> int:
    """Warm-up steps: params.warmup_steps, but at most a tenth of a short run's
    steps, so that a short run still trains mostly at its peak rate and decays."""
    return max(1, min(params.warmup_steps, total // 10))


def learning_rate(step: int, total: int, params: TrainParams) -> float:
    warmup = warmup_steps(total, params)
    if step < warmup:
        return params.learning_rate * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = params.min_lr_ratio
    return params.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(head: DraftHead, shards: list[Path], frozen: Frozen, params: TrainParams, progress: bool = False,
             desc: str = "held-out") -> dict:
    """The metrics of `head` over `shards`; `progress`: a bar named `desc`, counting sequences."""
    from tqdm import tqdm

    head.eval()
    totals = Totals()
    bar = tqdm(total=sum(len(shard_lengths(path)) for path in shards) if progress else 0, unit="seq", desc=desc,
               leave=False, disable=not progress)  # fmt: skip
    for path in shards:
        sequences = read_shard(path)
        for _, indices in plan_epoch([path], [[len(s.input_ids) for s in sequences]], params.batch_tokens, 0, 0):
            forward_losses(head, make_batch([sequences[i] for i in indices], frozen), frozen, params, None, totals)
            bar.update(len(indices))
    bar.close()
    head.train()
    return totals.summary()


class TrainingDiverged(ValueError):
    """A training step's loss or gradients were not finite numbers (too high a learning rate)."""


def data_fingerprint(train_shards: list[Path]) -> str | None:
    """Which answers the shards' features were extracted from: their folder's
    manifest (core/training/features.py); None where there is none."""
    from core.training.features import MANIFEST

    if not train_shards:
        return None
    try:
        return json.loads((train_shards[0].parent.parent / MANIFEST).read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


class Trainer:
    """Resumable training: a checkpoint every `checkpoint_every` steps, at the
    time budget and at Ctrl-C; a resumed run replays the same batch order and
    the same noise, so it ends where an uninterrupted run would."""

    def __init__(self, base, train_shards: list[Path], eval_shards: list[Path], folder: Path, params: TrainParams,
                 vocabulary: torch.Tensor | None = None):
        """vocabulary: the loss's tokens where given (the --init-head head's draft
        tokens), else params.loss_vocab of the train shards' most frequent."""
        self.params, self.folder = params, folder
        self.train_shards, self.eval_shards = train_shards, eval_shards
        vocab_size = base.model.get_output_embeddings().weight.shape[0]
        if vocabulary is None and params.loss_vocab:
            vocabulary = frequent_tokens(train_shards, params.loss_vocab, vocab_size)
        self.frozen = frozen_of(base, params.bf16, vocabulary)
        if params.arch == "eagle3":  # its lm_head only knows the draft vocabulary, so it is judged there too
            self.eval_frozen = self.frozen
            self.head = new_eagle3_head(base, vocabulary, params.seed).to(base.device).train()
        else:
            self.eval_frozen = frozen_of(base, params.bf16)
            self.head = new_head(head_config_for(base.model.config), params.seed).to(base.device).train()
        if params.init_head:
            if params.arch == "eagle3":
                raise ValueError("--init-head continues EAGLE-1/2 heads only; train an EAGLE-3 head from scratch")
            self.head.load_state_dict(initial_weights(Path(params.init_head), self.head), strict=True)
        self.optimizer = torch.optim.AdamW(
            self.head.parameters(), lr=params.learning_rate, betas=(0.9, 0.95), weight_decay=params.weight_decay
        )
        self.lengths = [shard_lengths(path) for path in train_shards]
        self.data = data_fingerprint(train_shards)
        self.steps_per_epoch = len(plan_epoch(train_shards, self.lengths, params.batch_tokens, params.seed, 0))
        self.total_steps = params.epochs * self.steps_per_epoch
        self.step, self.seconds, self.history = 0, 0.0, []
        self.train_totals = Totals()
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / CHECKPOINT).is_file():
            self._load()

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps

    def run(self, deadline: float | None = None, progress: bool = True, stop_at: int | None = None) -> bool:
        """Train until done, past `deadline` (time.time()) or at step `stop_at`; True when done."""
        from tqdm import tqdm

        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", desc="train", disable=not progress)
        started, failed = time.time(), True
        try:
            if self.step and self.step % self.steps_per_epoch == 0 and self._epoch_unevaluated():
                self._end_epoch(self.step // self.steps_per_epoch - 1, progress)  # killed between the last step and its eval
            while not self.finished:
                epoch, offset = divmod(self.step, self.steps_per_epoch)
                plan = plan_epoch(self.train_shards, self.lengths, self.params.batch_tokens, self.params.seed, epoch)
                loaded, sequences = None, []
                for shard, indices in plan[offset:]:
                    if (deadline is not None and time.time() > deadline) or self.step == stop_at:
                        failed = False
                        return False
                    if shard != loaded:
                        sequences, loaded = read_shard(self.train_shards[shard]), shard
                    self._train_step([sequences[i] for i in indices])
                    bar.update(1)
                    accuracy = self.train_totals.summary()["accuracy"][0]  # None: no position counted yet
                    bar.set_postfix(loss=f"{self.last_loss:.3f}", acc="n/a" if accuracy is None else f"{accuracy:.2f}")
                    if self.step % self.params.checkpoint_every == 0:
                        self._save(started)
                        started = time.time()
                self._end_epoch(epoch, progress)
            failed = False
            return True
        finally:  # every exit, Ctrl-C included, leaves a checkpoint
            bar.close()
            try:
                self._save(started)
            except OSError:
                if not failed:
                    raise  # else the error that stopped the run is the one to tell (a full disk: the same again)

    def _train_step(self, sequences: list[Sequence]) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step, self.total_steps, self.params)
        noise = torch.Generator().manual_seed(derived_seed(self.params.seed, self.step))
        batch = make_batch(sequences, self.frozen)
        totals = Totals()  # counted once the step is: a step interrupted before is done again after --resume
        loss = forward_losses(self.head, batch, self.frozen, self.params, noise, totals)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gradients = [parameter.grad for parameter in self.head.parameters() if parameter.grad is not None]
        # an infinite gradient is clipped below, as it always was; a NaN one would pass into every weight
        not_a_number = bool(torch.stack([grad.isnan().any() for grad in gradients]).any()) if gradients else False  # one sync
        if not math.isfinite(float(loss.detach())) or not_a_number:
            # before the step: the head and its checkpoint keep the last finite weights, and no damaged head is written
            raise TrainingDiverged(
                f"training diverged at step {self.step + 1}: its loss or gradients are not numbers (NaN or infinite); the checkpoint "
                f"keeps the head of step {self.step}. Train again with a lower --learning-rate (this run's: "
                f"{self.params.learning_rate:g}) with another --out and --work, or after deleting {self.folder / CHECKPOINT}"
            )
        torch.nn.utils.clip_grad_value_(self.head.parameters(), self.params.grad_clip)
        with deferred_interrupts():  # the step applied whole, with its count, or not at all: a Ctrl+C inside the
            self.optimizer.step()  # optimizer's per-parameter loop saved a half-applied step, which --resume applied again
            self.step += 1
            self.train_totals.merge(totals)
        self.last_loss = float(loss.detach())

    def _epoch_unevaluated(self) -> bool:
        return not self.history or self.history[-1]["step"] != self.step

    def _end_epoch(self, epoch: int, progress: bool = False) -> None:
        record = {"epoch": epoch + 1, "step": self.step, "train": self.train_totals.summary()}
        record["eval"] = evaluate(self.head, self.eval_shards, self.eval_frozen, self.params, progress,
                                  f"epoch {epoch + 1} held-out")  # while the training bar stands at the epoch's end
        self.history.append(record)
        self.train_totals = Totals()

    def final_eval(self) -> dict:
        """The held-out metrics of the head as it is now (the last epoch's when finished)."""
        if self.history and self.history[-1]["step"] == self.step:
            return self.history[-1]["eval"]
        return evaluate(self.head, self.eval_shards, self.eval_frozen, self.params)

    def _save(self, started: float) -> None:
        self.seconds += time.time() - started
        state = {
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "seconds": self.seconds,
            "history": self.history,
            "train_totals": asdict(self.train_totals),
            "params": asdict(self.params),
            "steps_per_epoch": self.steps_per_epoch,
            "data": self.data,
        }
        partial = self.folder / (CHECKPOINT + ".partial")
        try:
            torch.save(state, partial)
        except (OSError, RuntimeError) as error:  # torch's own for a full disk names no file, nor the disk
            partial.unlink(missing_ok=True)
            reason = getattr(error, "strerror", None) or str(error).splitlines()[0]
            if isinstance(error, RuntimeError):  # "basic_ios::clear: iostream error", "unexpected pos ..."
                reason = f"{reason}; {shutil.disk_usage(self.folder).free / 1e6:,.0f} MB free on its disk"
            raise OSError(f"{partial}: cannot be written ({reason})") from error
        partial.replace(self.folder / CHECKPOINT)  # over the last checkpoint (rename refuses that on Windows)

    def _load(self) -> None:
        try:
            state = torch.load(self.folder / CHECKPOINT, map_location="cpu", weights_only=False)
        except (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError) as error:  # cut short or emptied (a power cut)
            raise ValueError(
                f"{self.folder / CHECKPOINT}: cannot be read ({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                "delete it to train from scratch (the answers and features are kept)"
            ) from error
        now = asdict(self.params)
        changed = [f"{OPTIONS.get(name, name)} {_shown(name, state['params'].get(name))}, this run {_shown(name, now[name])}"
                   for name in now if state["params"].get(name) != now[name]]  # fmt: skip
        # features extracted again from other answers (a prompt removed) can plan as many steps: their
        # fingerprint tells (a checkpoint of an earlier version records none)
        data = state.get("data")
        if state["steps_per_epoch"] != self.steps_per_epoch or (data is not None and self.data is not None and data != self.data):
            changed.append("the training data")
        if changed:
            raise ValueError(
                f"{self.folder / CHECKPOINT}: the checkpoint was made with other settings ({'; '.join(changed)}); "
                "resume with the earlier ones, or delete it to train from scratch"
            )
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.seconds, self.history = state["step"], state["seconds"], state["history"]
        self.train_totals = Totals(**state["train_totals"])

    def summary(self) -> dict:
        return {
            "steps": self.step,
            "total_steps": self.total_steps,
            "warmup_steps": warmup_steps(self.total_steps, self.params),
            "steps_per_epoch": self.steps_per_epoch,
            "seconds": round(self.seconds, 1),
            "history": self.history,
            "params": asdict(self.params),
        }


def save_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
