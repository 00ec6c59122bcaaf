"""The EAGLE-1/EAGLE-2 draft head and its checkpoint format.

input at position t: [embed(token_{t+1}), feature_t]  (2H, embedding first)
  -> fc (2H -> H) -> one Llama decoder layer without input layernorm
  -> predicted feature_{t+1}; the base model's lm_head turns it into logits
     for token_{t+2}.
Module names mirror the checkpoint keys, so loading is a one-to-one copy."""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.errors import CacheWriteError, HeadFormatError, HeadMismatchError, KestrelError, ModelNotFoundError, NetworkError, json_kind
from models.paths import user_path
from models.repo import Repo, parse_repo

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX = "model.safetensors.index.json"  # a large head's, naming its shards


COUNTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
          "max_position_embeddings", "draft_vocab_size", "head_dim")  # fmt: skip
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")


def _check_field(name: str, value) -> None:
    """ValueError naming a config field whose value cannot be what it sizes."""
    if name in COUNTS and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"field {name} must be a whole number of at least 1, got {value!r}")
    if name in POSITIVE_NUMBERS and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"field {name} must be a number above 0, got {value!r}")
    if name in ("bias", "qkv_bias") and not isinstance(value, bool):
        raise ValueError(f"field {name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # H: the base model's hidden size
    intermediate_size: int  # MLP width of the decoder layer
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # must equal the base model's vocabulary
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama-style, e.g. Llama-3.1's {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048  # informative only: rotary positions are not limited by it
    bias: bool = True  # fc has a bias
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2-style heads)
    hidden_act: str = "silu"
    draft_vocab_size: int | None = None  # drafting over this many target tokens (d2t maps them), None = all
    head_dim: int | None = None  # per attention head; None = hidden_size // num_attention_heads
    extra: dict = field(default_factory=dict)  # other config.json fields, kept on save

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, settings: dict) -> HeadConfig:
        known = {name for name in cls.__dataclass_fields__ if name != "extra"}
        required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [name for name in required if name not in settings]
        if missing:
            raise KeyError(", ".join(missing))
        values = {name: settings[name] for name in known if name in settings and settings[name] is not None}
        values.setdefault("num_key_value_heads", settings["num_attention_heads"])
        rope = settings.get("rope_parameters")
        if isinstance(rope, dict):  # the transformers 5 spelling of rope_theta + rope_scaling
            values.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                values.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        written = ("architectures", "model_type")  # to_dict writes these itself
        extra = {key: value for key, value in settings.items() if key not in known and key not in written}
        for name, value in values.items():
            _check_field(name, value)
        if values["num_attention_heads"] % values["num_key_value_heads"]:
            raise ValueError(
                f"num_key_value_heads {values['num_key_value_heads']} does not divide num_attention_heads "
                f"{values['num_attention_heads']}"
            )
        per_head = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
        if "head_dim" not in values and values["hidden_size"] % values["num_attention_heads"]:
            raise ValueError(
                f"num_attention_heads {values['num_attention_heads']} does not divide hidden_size {values['hidden_size']} "
                "(and no head_dim is given)"
            )
        if per_head % 2:  # rotary embeddings turn pairs of dimensions
            raise ValueError(f"each attention head is {per_head} wide (head_dim, or hidden_size / num_attention_heads): rotary embeddings need an even width")
        return cls(**values, extra=extra)

    def to_dict(self) -> dict:
        settings = asdict(self)
        extra = settings.pop("extra")
        settings["architectures"] = ["LlamaForCausalLM"]
        settings["model_type"] = "llama"
        if settings["head_dim"] is None:  # hidden_size // num_attention_heads; a null would confuse other engines
            del settings["head_dim"]
        return {**extra, **settings}

    def rotary_config(self):
        from transformers import LlamaConfig

        rope_scaling = dict(self.rope_scaling) if self.rope_scaling else None
        if rope_scaling and "rope_type" not in rope_scaling and "type" in rope_scaling:
            rope_scaling["rope_type"] = rope_scaling.pop("type")
        return LlamaConfig(
            # the rotary embedding reads head_dim alone: heads x head_dim as the width keeps transformers'
            # check (width a multiple of the heads) from refusing heads whose head_dim is explicit
            hidden_size=self.num_attention_heads * self.dim_per_head,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.dim_per_head,
            rope_theta=self.rope_theta,
            rope_scaling=rope_scaling,
            # published heads say 2048, which is no real limit of theirs; but
            # dynamic and yarn scaling read this value, so keep it for those
            max_position_embeddings=self.max_position_embeddings
            if (rope_scaling or {}).get("rope_type") in ("dynamic", "yarn")
            else max(self.max_position_embeddings, 1 << 17),
        )


FOLDED_ROWS = 16  # query rows up to which HeadCache.attend folds grouped heads into rows


class HeadCache:
    """Keys and values of the head's single layer: committed positions first,
    then (during drafting) drafted ones, which `crop` discards."""

    def __init__(self):
        self.keys: torch.Tensor | None = None  # (1, kv_heads, L, head_dim)
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            keys = torch.cat([self.keys, keys], dim=2)
            values = torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Append this call's keys and values (B, kv_heads, T, D), then attend:
        query (B, heads, T, D) -> (B, heads, T, D). mask (B or 1, 1, T, L) bool,
        shared by the heads; None: plain causal attention over an empty cache
        (a prefill)."""
        keys, values = self.append(keys, values)
        batch, heads, rows, size = query.shape
        group = heads // keys.shape[1]
        if mask is None or rows > FOLDED_ROWS:
            return F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=group > 1
            )
        # drafting's few rows: the query heads that share a key head as rows of one query, the
        # same attention, on CPUs several times faster than sdpa's grouped path for one row (over
        # 300 keys in bf16: 41 against 135 us; 3 rows 55 against 65, 6 rows 75 against 75)
        folded = query.reshape(batch, heads // group, group * rows, size)
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask.repeat(1, 1, group, 1))  # sdpa broadcasts its batch
        return out.reshape(batch, heads, rows, size)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Attention(nn.Module):
    """qk_norms: an RMSNorm over each head's query and key before the rotary embedding (a Qwen3 layer's)."""

    def __init__(self, config: HeadConfig, input_size: int | None = None, qk_norms: bool = False):
        super().__init__()
        hd, width = config.dim_per_head, input_size or config.hidden_size
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(width, self.heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(width, self.kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(width, self.kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.heads * hd, config.hidden_size, bias=False)
        if qk_norms:
            self.q_norm, self.k_norm = RMSNorm(hd, config.rms_norm_eps), RMSNorm(hd, config.rms_norm_eps)

    def forward(self, x, rotary, mask, cache: HeadCache) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rotary)
        out = cache.attend(q, k, v, mask)  # (B, nh, T, hd), this call's keys and values appended first
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer whose input layernorm is absent (EAGLE's layer 0)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rotary, mask, cache: HeadCache) -> torch.Tensor:
        x = x + self.self_attn(x, rotary, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftHead(nn.Module):
    layer_ids = None  # EAGLE-1/2 heads take the base model's final features, from no captured layers

    def __init__(self, config: HeadConfig, own_embedding: bool = False):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        # None: the base model's (frozen) embedding is passed in by the caller
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if own_embedding else None
        self.rotary = LlamaRotaryEmbedding(config.rotary_config())
        if config.draft_vocab_size:
            # EAGLE-3's mapping: target id = draft id + d2t[draft id]
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def place(self, device=None, dtype=None) -> DraftHead:
        """Move the weights; rotary frequencies stay float32 (in bf16 they would
        be off by tenths of a radian at positions in the hundreds)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.to(device=device, dtype=dtype)
        self.rotary = LlamaRotaryEmbedding(self.config.rotary_config()).to(self.device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's activations: its norm's (its linears may hold int8 for drafting)."""
        return self.layers[0].post_attention_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].post_attention_layernorm.weight.device

    @property
    def feature_size(self) -> int:
        """Width of the base-model features the head takes: the final hidden state."""
        return self.config.hidden_size

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """The target ids the head drafts from, or None for the whole vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def forward(
        self,
        embeddings: torch.Tensor,  # (B, T, H): embed(token_{t+1})
        features: torch.Tensor,  # (B, T, H): feature_t
        positions: torch.Tensor,  # (B, T) int64: t
        mask: torch.Tensor | None,  # (B, 1, T, past + T) bool, True = may attend; None = causal, empty cache
        cache: HeadCache,
    ) -> torch.Tensor:
        """-> (B, T, H) predicted features_{t+1}; appends T entries to `cache`."""
        x = self.fc(torch.cat([embeddings, features], dim=-1).to(self.dtype))
        rotary = self.rotary(x, positions)
        return self.layers[0](x, rotary, mask, cache)


def expected_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every key of an official EAGLE-1/2 checkpoint and its shape."""
    h, i, hd = config.hidden_size, config.intermediate_size, config.dim_per_head
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
        "layers.0.post_attention_layernorm.weight": (h,),
    }
    if config.bias:
        shapes["fc.bias"] = (h,)
    if config.draft_vocab_size:
        shapes["d2t"] = (config.draft_vocab_size,)
    if config.qkv_bias:
        shapes.update({f"layers.0.self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
    return shapes


def check_state(state: dict[str, torch.Tensor], config: HeadConfig, file: Path) -> None:
    """Strict: every expected key of an EAGLE-1/2 head with its shape, nothing unexpected."""
    query = state.get("layers.0.self_attn.q_proj.weight")
    if query is not None and query.dim() == 2 and query.shape[1] == 2 * config.hidden_size:
        raise HeadFormatError(
            f"{file}: an EAGLE-3 head's layer (its attention reads 2 x {config.hidden_size}) named layers.0.*, "
            "without layers.0.hidden_norm.weight, the norm of its hidden input that EAGLE-3 heads have"
        )
    check_keys(state, expected_shapes(config), config, file, "; not an EAGLE-1/2 head?")
    if "d2t" in state:
        check_d2t(state, config, file)


def check_d2t(state: dict[str, torch.Tensor], config: HeadConfig, file: Path) -> None:
    """Every draft id maps into the base model's vocabulary (target id = draft id + d2t[draft id])."""
    target_ids = torch.arange(len(state["d2t"])) + state["d2t"].long()
    if len(target_ids) and (int(target_ids.min()) < 0 or int(target_ids.max()) >= config.vocab_size):
        raise HeadFormatError(f"{file}: d2t maps draft ids outside the vocabulary of {config.vocab_size} tokens")


def check_keys(state: dict[str, torch.Tensor], shapes: dict, config: HeadConfig, file: Path, unexpected: str) -> None:
    """Every key of `shapes` present with its shape, nothing else but an own
    embedding; errors name the key, both shapes and the file. `unexpected`
    ends the message about a key that does not belong."""
    optional = {"embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for key, shape in shapes.items():
        if key not in state:
            raise HeadFormatError(f"{file}: missing key {key} (expected shape {list(shape)})")
    for key, tensor in state.items():
        shape = shapes.get(key, optional.get(key))
        if shape is None:
            raise HeadFormatError(f"{file}: unexpected key {key} (shape {list(tensor.shape)}){unexpected}")
        if tuple(tensor.shape) != shape:
            raise HeadFormatError(
                f"{file}: key {key} has shape {list(tensor.shape)}, expected {list(shape)} from {CONFIG_FILE}"
            )


def save_head(head: nn.Module, folder: str | Path, extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors, the format other EAGLE tools
    read; extra_config overrides or adds config fields."""
    from models.paths import save_tensors, write_whole

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {key: tensor.detach().contiguous().cpu() for key, tensor in head.state_dict().items()}
    # each file whole or not at all, through a .partial one: a full disk leaves an earlier head's as it was
    partial = folder / "model.safetensors.partial"
    try:
        save_tensors(state, partial, metadata={"format": "pt"})  # an OSError naming the file
        partial.chmod(0o644)  # safetensors writes it readable by its owner alone
        partial.replace(folder / "model.safetensors")
    finally:
        partial.unlink(missing_ok=True)
    settings = {**head.config.to_dict(), **(extra_config or {})}
    write_whole(folder / CONFIG_FILE, json.dumps(settings, indent=2) + "\n")
    return folder


def read_checkpoint(folder: Path) -> tuple[HeadConfig, dict[str, torch.Tensor], Path]:
    """A head folder's config, weights (an EAGLE-3 head's under the published
    format's names, whatever layout they were saved in) and weights file."""
    from models import eagle3

    config, file = head_files(folder)
    state = eagle3.published_names(_read_weights(file))
    for key, tensor in state.items():  # a head with such weights would load and never draft
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise HeadFormatError(f"{file}: {key} holds NaN or infinite values; the head is damaged (or its training diverged)")
    return config, state, file


def head_files(folder: Path) -> tuple[HeadConfig, Path]:
    """A head folder's config and weights file, checked without reading the
    weights (a whole model's keys are told from the file's header)."""
    from models import eagle3

    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise HeadFormatError(f"{folder}: no {CONFIG_FILE}; not a draft-head folder")
    try:
        settings = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(settings, dict):
            raise HeadFormatError(f"{config_file}: must be a JSON object of settings, got {json_kind(settings)}")
        config = HeadConfig.from_dict(eagle3.from_speculators(settings, config_file))
    except json.JSONDecodeError as error:
        raise HeadFormatError(f"{config_file}: not valid JSON ({error})") from error
    except KeyError as error:
        raise HeadFormatError(f"{config_file}: missing field {error.args[0]}") from error
    except (ValueError, TypeError) as error:  # a field of the wrong kind
        raise HeadFormatError(f"{config_file}: {error}") from error
    try:
        eagle3.configured_layer_ids(config)  # now, not after the base model has loaded
        eagle3.target_hidden_size(config)
        eagle3.norm_before_residual(config)
    except HeadFormatError as error:
        raise HeadFormatError(f"{config_file}: {error}") from error
    if config.hidden_act != "silu":  # now, not after the base model has loaded
        raise HeadFormatError(f"{config_file}: hidden_act {config.hidden_act!r} is not supported (only silu)")
    try:
        config.rotary_config()  # transformers' checks of rope_scaling now, not after the base model has loaded
    except Exception as error:  # KeyError, ValueError and transformers' own validation errors
        raise HeadFormatError(f"{config_file}: rope_scaling {config.rope_scaling!r} is not one transformers reads ({error})") from error
    for name in WEIGHT_FILES:
        file = folder / name
        if file.is_file():
            if _full_model_keys(file):
                raise HeadFormatError(
                    f"{file}: a whole model's weights (keys model.layers.*), not a draft head; "
                    "give this folder as the base model and a head made for it as the draft head"
                )
            return config, file
    for index in [*folder.glob("*.safetensors.index.json"), *folder.glob("*.bin.index.json")]:
        if any(key.startswith("model.layers.") for key in _sharded_keys(index)):
            raise HeadFormatError(
                f"{folder}: a whole model's sharded weights, not a draft head; "
                "give this folder as the base model and a head made for it as the draft head"
            )
        return config, index  # a draft head in shards (a large one): _read_weights reads them all
    raise HeadFormatError(f"{folder}: no weights ({' or '.join(WEIGHT_FILES)})")


def _full_model_keys(file: Path) -> bool:
    """Whether a weights file holds a whole decoder's layers (model.layers.*):
    a base model given as the head."""
    keys = _weight_keys(file)
    return keys is not None and any(key.startswith("model.layers.") for key in keys)


def holds_a_head(folder: Path) -> bool:
    """Whether `folder` holds a draft head's weights (EAGLE-1/2's fc.weight and
    layers.0.*, EAGLE-3's midlayer.*, without a decoder's model.layers.*): a
    head given as the base model."""
    file = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    keys = _weight_keys(file) if file is not None else None
    if keys is None:
        return False
    layered = any(key.startswith("model.layers.") for key in keys)
    return not layered and ("fc.weight" in keys or any(key.startswith("midlayer.") for key in keys))


def check_fits_sizes(folder: Path, hidden_size: int | None, vocab_size: int | None, base_layers: int | None = None) -> None:
    """What load_head checks of a head against its base model's sizes (hidden
    size, vocabulary, decoder layers), from the head's config and keys alone:
    said before a large base model loads, not after. A size not known (None)
    is not checked."""
    from models import eagle3

    config, file = head_files(folder)
    # a weights file cut short (a download stopped) is said now, as loading would say it
    check_base_sizes(config, eagle3.published_keys(_readable_keys(file)), file, hidden_size, vocab_size, base_layers)


def check_base_sizes(config: HeadConfig, keys, file: Path, hidden_size: int | None, vocab_size: int | None,
                     base_layers: int | None) -> None:  # fmt: skip
    """HeadMismatchError where a head (its config and weight names `keys`)
    does not fit its base model's hidden size, vocabulary or layers; a size
    not known (None) is not checked."""
    from models import eagle3

    if eagle3.is_eagle3(keys):  # it may be narrower than its base
        eagle3.check_fits(config, keys, file, hidden_size, base_layers)
    elif hidden_size is not None and config.hidden_size != hidden_size:
        raise HeadMismatchError(f"{file}: head hidden_size {config.hidden_size} != base model hidden size {hidden_size}")
    if vocab_size is not None and config.vocab_size != vocab_size:
        raise HeadMismatchError(f"{file}: head vocab_size {config.vocab_size} != base model vocabulary {vocab_size}")


def head_keys(folder: Path) -> list[str] | None:
    """A head folder's weight keys, read without its tensors; None where it holds no readable head."""
    from models import eagle3

    try:
        _, file = head_files(folder)
        keys = list(_sharded_keys(file)) if file.name.endswith(".index.json") else _weight_keys(file)
    except (OSError, KestrelError):
        return None
    return None if keys is None else eagle3.published_keys(keys)


def _weight_keys(file: Path) -> list[str] | None:
    """A weights file's keys, read without its tensors (a safetensors header;
    a PyTorch file mapped, not read); None where it cannot be read that way
    (loading it names what is wrong)."""
    try:
        if file.suffix == ".safetensors":
            return _safetensors_keys(file)
        return list(torch.load(file, map_location="meta", weights_only=True, mmap=True).keys())
    except Exception:
        return None


def _readable_keys(file: Path) -> list[str]:
    """A head's weight keys, read without its tensors, for the checks made
    before a base model loads. A file that loading would refuse as cut short
    raises HeadFormatError now: a safetensors header that cannot be read, a
    PyTorch zip whose directory (at its end) is missing, a shard that an index
    names and its folder lacks. A legacy PyTorch file, which cannot be read
    without its tensors, gives []."""
    import zipfile

    if file.name.endswith(".index.json"):
        weight_map = _sharded_keys(file)
        for shard in _shard_files(file, weight_map):
            _readable_keys(shard)
        return list(weight_map)
    if file.suffix == ".safetensors":
        return _safetensors_keys(file)
    try:
        with open(file, "rb") as handle:
            start = handle.read(2)
    except OSError as error:
        raise HeadFormatError(f"{file}: cannot read the weights ({error.strerror or error})") from error
    # torch.save writes a zip (its directory at the end), or in its legacy format a pickle (protocol 2 and up)
    if (start == b"PK" and not zipfile.is_zipfile(file)) or (start != b"PK" and not start.startswith(b"\x80")):
        raise HeadFormatError(f"{file}: not a readable PyTorch checkpoint (damaged, cut short, or not a weights file)")
    return _weight_keys(file) or []


def _safetensors_keys(file: Path) -> list[str]:
    """A safetensors file's keys, from its header; HeadFormatError where that cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as weights:
            return list(weights.keys())
    except Exception as error:
        raise HeadFormatError(f"{file}: cannot read the weights ({type(error).__name__}: {error})") from error


def _sharded_keys(index: Path) -> dict[str, str]:
    """key -> shard file name, from a sharded checkpoint's index."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise TypeError("weight_map is not a map of keys to file names")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise HeadFormatError(f"{index}: not a readable index of shards ({type(error).__name__}: {error})") from error
    return weight_map


def _shard_files(index: Path, weight_map: dict[str, str]) -> list[Path]:
    """The shard files that a sharded checkpoint's index (`weight_map`, read
    from `index`) names, each one in the index's folder."""
    files = []
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if not shard.is_file() or shard.parent != index.parent:
            raise HeadFormatError(f"{index}: names the shard {name}, which is not in {index.parent}")
        files.append(shard)
    return files


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    if file.name.endswith(".index.json"):
        state = {}
        for shard in _shard_files(file, _sharded_keys(file)):
            state.update(_read_weights(shard))
        return state
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file))
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # torch's message suggests weights_only=False, which would run the file's code
        raise HeadFormatError(f"{file}: not a readable PyTorch checkpoint (damaged, cut short, or not a weights file)") from error
    except Exception as error:
        raise HeadFormatError(f"{file}: cannot read the weights ({type(error).__name__}: {error})") from error
    if not isinstance(state, dict):
        raise HeadFormatError(f"{file}: holds {type(state).__name__}, not a map of weight names to tensors")
    for key, value in state.items():  # a training checkpoint ({"state_dict": {...}, "epoch": 3}) is not a head's weights
        if not isinstance(value, torch.Tensor):
            raise HeadFormatError(
                f"{file}: {key!r} holds {type(value).__name__}, not a tensor; a head's weights file maps each weight's "
                "name to its tensor (a training checkpoint keeps them one level down: save that map alone)"
            )
    return state


def local_head_folder(source: str) -> Path | None:
    """The folder `source` names; None where it can only be a Hugging Face repo id (owner/name,
    or owner/name@REV). A path that is not a folder, or a repo id written wrong, is an error at
    once, before any download or model load."""
    path = user_path(source)
    if path.is_dir():
        return path
    if path.is_file():
        folder = f" ({path.parent})" if (path.parent / "config.json").is_file() else ""
        raise ModelNotFoundError(f"{source}: is a file; a draft head is the folder holding config.json and its weights{folder}")
    if path.exists() or parse_repo(source) is None:
        raise ModelNotFoundError(f"{source}: no such draft-head folder, and not a Hugging Face repo id")
    return None


def resolve_head_folder(source: str) -> Path:
    """A local folder as is; otherwise a Hugging Face repo id (at its @revision, if one is
    given), downloaded to the HF cache."""
    path = local_head_folder(source)
    if path is not None:
        return path
    repo = parse_repo(source)  # local_head_folder refused any source that names no repo
    from huggingface_hub import hf_hub_download
    from huggingface_hub import errors as hub

    from models.hub import bound_requests, no_folder, reachable

    bound_requests()  # a hub that stops answering mid-download: an error in time, not a wait for good
    cache_only = not reachable()  # without a network: the cache at once, not after the hub's retries
    try:
        try:
            hf_hub_download(repo.id, CONFIG_FILE, revision=repo.revision, local_files_only=cache_only)
        except hub.RemoteEntryNotFoundError as error:
            raise HeadFormatError(f"{source}: the repo has no {CONFIG_FILE}; not a draft head") from error
        published = None if cache_only else published_safetensors(repo)
        if published is not None:
            if any(key.startswith("model.layers.") for key in published.weight_map):  # judged before gigabytes download
                raise HeadFormatError(
                    f"{source}: a whole model's weights (keys model.layers.*), not a draft head; "
                    "give it as the base model and a head made for it as the draft head"
                )
            if published.sharded:  # a large head in shards: all of them, with their index
                from huggingface_hub import snapshot_download

                patterns = [CONFIG_FILE, "*.safetensors", "*.safetensors.index.json"]
                return Path(snapshot_download(repo.id, revision=repo.revision, allow_patterns=patterns))
        missing = hub.LocalEntryNotFoundError if cache_only else hub.RemoteEntryNotFoundError
        # offline, the cache may hold the other weights file, or a sharded head's index with its shards beside it
        for name in (*WEIGHT_FILES, SHARD_INDEX) if cache_only else WEIGHT_FILES:
            try:
                return Path(hf_hub_download(repo.id, name, revision=repo.revision, local_files_only=cache_only)).parent
            except missing:
                continue
        if cache_only:
            raise NetworkError(f"{source}: its weights are not in the local cache and the Hugging Face hub cannot be reached{no_folder(source)}")
    except KestrelError:  # said above already (a repo without config.json is no head)
        raise
    except Exception as error:
        said = _download_error(source, repo, error)
        if said is None:
            raise
        raise said from error
    raise HeadFormatError(f"{source}: the repo has no {' or '.join(WEIGHT_FILES)}")


def _download_error(source: str, repo: Repo, error: Exception) -> KestrelError | None:
    """Kestrel's error for a head's failed download: what the hub answered, what
    kept the files out of the cache, or the network that failed; None where it
    is none of those."""
    from huggingface_hub import errors as hub

    from models.hub import (
        answered_message,
        cache_write_message,
        gated_message,
        missing_message,
        network_cause,
        no_folder,
        unreachable_message,
    )

    if isinstance(error, hub.GatedRepoError):
        return NetworkError(gated_message(source))
    if isinstance(error, hub.RepositoryNotFoundError):
        return ModelNotFoundError(missing_message(source))
    if isinstance(error, hub.RevisionNotFoundError):  # the hub's 404 for a pinned @REV
        return ModelNotFoundError(f"{source}: the repo {repo.id} has no revision {repo.revision!r} on the Hugging Face hub "
                                  "(no such branch, tag or commit hash)")  # fmt: skip
    if isinstance(error, hub.HfHubHTTPError):  # an answer, not a network to check: a login refused, the hub's own error
        return NetworkError(answered_message(source, error) or str(error))
    stored = cache_write_message(source, error)  # a full disk, a cache folder not the user's
    if stored is not None:
        return CacheWriteError(stored)
    cause = network_cause(error)  # a proxy's refusal, a TLS failure, a timeout: the HTTP client's own error
    if cause is not None:
        return NetworkError(unreachable_message(source, cause))
    if isinstance(error, OSError):  # LocalEntryNotFoundError among them
        return NetworkError(f"{source}: not in the local cache and the Hugging Face hub cannot be reached{no_folder(source)}")
    return None


def published_safetensors(repo: Repo):
    """The names of a hub repo's safetensors weights (at its revision) and whether
    they are in shards, read from the files' headers (kilobytes, not the weights);
    None where the repo has none (a head in pytorch_model.bin) or they cannot be parsed."""
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError, SafetensorsParsingError

    try:
        return get_safetensors_metadata(repo.id, revision=repo.revision)
    except (NotASafetensorsRepoError, SafetensorsParsingError):  # the downloads below say what the repo holds
        return None


def load_head(
    source: str | Path, hidden_size: int, vocab_size: int, device=None, dtype=None, base_layers: int | None = None
):
    """Load an EAGLE-1/2 or EAGLE-3 head (told apart by its keys) strictly and
    check it against the base model's sizes; base_layers (the base model's
    decoder layers) places an EAGLE-3 head's default feature layers."""
    folder = resolve_head_folder(str(source))
    config, state, file = read_checkpoint(folder)  # its hidden_act checked (head_files)
    from models import eagle3

    third = eagle3.is_eagle3(state)
    if third:  # the features it reads are the base's (target_hidden_size); its own layer may be narrower
        config, state = eagle3.completed(config, state, file)
    check_base_sizes(config, state, file, hidden_size, vocab_size, base_layers)
    if third:
        eagle3.check_state(state, config, file)
        if base_layers is None:
            raise ValueError("loading an EAGLE-3 head needs the base model's number of layers")
        head = eagle3.build(config, state, file, base_layers)
        head.requires_grad_(False)
        return head.place(device, dtype).eval()
    check_state(state, config, file)
    head = DraftHead(config, own_embedding="embed_tokens.weight" in state)
    head.load_state_dict(state, strict=True)
    head.requires_grad_(False)
    return head.place(device, dtype).eval()


def with_draft_vocabulary(head: DraftHead, token_ids: torch.Tensor) -> DraftHead:
    """A copy of `head` that drafts only among `token_ids` (e.g. the most
    frequent answer tokens): the draft lm_head shrinks to those rows."""
    weight = head.fc.weight
    token_ids = torch.sort(torch.as_tensor(token_ids, dtype=torch.long, device=weight.device)).values
    config = replace(head.config, draft_vocab_size=len(token_ids))
    reduced = DraftHead(config, own_embedding=head.embed_tokens is not None).place(weight.device, weight.dtype)
    state = {key: value for key, value in head.state_dict().items() if key != "d2t"}
    state["d2t"] = token_ids - torch.arange(len(token_ids), device=weight.device)
    reduced.load_state_dict(state, strict=True)
    return reduced.eval().requires_grad_(False)
