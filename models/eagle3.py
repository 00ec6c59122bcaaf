"""The EAGLE-3 draft head (Li et al. 2025) and its published checkpoint format.

features: three hidden states of the base model, at the inputs of decoder
layers low, mid and high (default 2, L//2, L-3), concatenated (T, 3H)
  g = fc(cat(low, mid, high))                      (only for the base model's features)
  x = cat(input_layernorm(embed(token_{t+1})), hidden_norm(g))       (2H)
  h = g + attention(x);  h = h + mlp(post_attention_layernorm(h))
      (hidden_norm(g) + attention(x) where the config sets norm_before_residual)
  logits over the draft vocabulary = lm_head(norm(h)); target id = draft id + d2t[draft id]
At later draft steps the head's own pre-norm output h is fed back as g, so fc
is skipped. Module names mirror the checkpoint keys (fc, midlayer.*, norm,
lm_head, d2t, t2d), so loading is a one-to-one copy, and heads saved here load
in vLLM, SGLang and llama.cpp. Heads saved by the speculators library (their
layer named layers.0.*, its settings nested in transformer_layer_config) are
read under these names; a Qwen3 layer adds q_norm and k_norm to the attention."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from models.errors import HeadFormatError, HeadMismatchError
from models.head import CONFIG_FILE, MLP, Attention, HeadCache, HeadConfig, RMSNorm, check_d2t, check_keys, save_head

log = logging.getLogger("kestrel")

ARCHITECTURE = "LlamaForCausalLMEagle3"
MARKER = "midlayer.self_attn.q_proj.weight"  # a key only EAGLE-3 checkpoints have
QK_NORM = "midlayer.self_attn.q_norm.weight"  # a Qwen3 layer's: its attention norms each head's queries and keys
QK_NORMS = "qk_norms"  # config field: whether the layer has them (a speculators config says by its layer's kind)
LAYER_TYPES = ("llama", "qwen3")  # the decoder layers an EAGLE-3 head may have
LAYER, SPECULATORS_LAYER = "midlayer.", "layers.0."
# the speculators library's config wraps the decoder layer's settings; these keys are the wrapping's own
SPECULATORS_WRAPPING = ("speculators_model_type", "transformer_layer_config", "speculators_config", "speculators_version", "architectures")


def is_eagle3(keys) -> bool:
    """Whether a head's weights (or their names) are an EAGLE-3 head's."""
    return MARKER in keys


def speculators_layout(keys) -> bool:
    """Whether weight names are the speculators library's EAGLE-3 layout: the
    layer named layers.0.*, as EAGLE-1/2 heads name theirs, told from those by
    the norm of its hidden input (EAGLE-1/2 layers have none)."""
    return SPECULATORS_LAYER + "hidden_norm.weight" in keys


def published_names(state: dict) -> dict:
    """A head's weights under the published format's names (midlayer.*): a
    speculators-layout head's layer renamed, any other head as it is."""
    if not speculators_layout(state):
        return state
    return {LAYER + key.removeprefix(SPECULATORS_LAYER) if key.startswith(SPECULATORS_LAYER) else key: value
            for key, value in state.items()}  # fmt: skip


def published_keys(keys: list[str]) -> list[str]:
    return list(published_names(dict.fromkeys(keys)))


def from_speculators(settings: dict, config_file: Path) -> dict:
    """A config.json written by the speculators library (speculators_model_type)
    as the published format's flat settings: its decoder layer's settings
    (transformer_layer_config) with the EAGLE-3 fields beside them
    (draft_vocab_size, target_hidden_size, norm_before_residual,
    eagle_aux_hidden_state_layer_ids, ...) laid over them. Any other config is
    returned as it is."""
    kind = settings.get("speculators_model_type")
    if kind is None:
        return settings
    if kind != "eagle3":
        raise HeadFormatError(
            f"{config_file}: a speculators {kind!r} head; Kestrel reads the speculators library's EAGLE-3 heads "
            "(speculators_model_type eagle3), and EAGLE-1/2 and EAGLE-3 heads in the published format"
        )
    layer = settings.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise HeadFormatError(f"{config_file}: a speculators EAGLE-3 config needs transformer_layer_config, "
                              "the settings of the head's decoder layer")  # fmt: skip
    layer_type = layer.get("model_type", "llama")
    if layer_type not in LAYER_TYPES:
        raise HeadFormatError(
            f"{config_file}: the head's decoder layer is a {layer_type!r} layer (transformer_layer_config.model_type); "
            "Kestrel reads EAGLE-3 heads whose layer is a Llama or a Qwen3 layer"
        )
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        raise HeadFormatError(f"{config_file}: the head has {layers!r} decoder layers (transformer_layer_config.num_hidden_layers); "
                              "an EAGLE-3 head has one")  # fmt: skip
    for name, what in (("attention_bias", "its attention projections"), ("mlp_bias", "its MLP")):
        if layer.get(name):
            raise HeadFormatError(f"{config_file}: the head's layer has biases on {what} "
                                  f"(transformer_layer_config.{name}), which Kestrel's EAGLE-3 heads do not read")  # fmt: skip
    own = {key: value for key, value in settings.items() if key not in SPECULATORS_WRAPPING}
    layer = {key: value for key, value in layer.items() if key not in ("architectures", "model_type")}
    return {**layer, **own, QK_NORMS: layer_type == "qwen3"}  # the weights are checked against it (check_state)


def verifier_of(settings: dict) -> str | None:
    """The base model a speculators-library config names its head's
    (speculators_config.verifier.name_or_path); None where it names none."""
    wrapping = settings.get("speculators_config") if isinstance(settings, dict) else None
    verifier = wrapping.get("verifier") if isinstance(wrapping, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return name if isinstance(name, str) and name else None


def qk_norms(config: HeadConfig, state) -> bool:
    """Whether the layer norms each head's queries and keys (a Qwen3 layer):
    as the config says where it does (a speculators config, by its layer's
    kind), so that weights saying otherwise are refused by name; else as the
    weights have them."""
    said = config.extra.get(QK_NORMS)
    if said is None:
        return QK_NORM in state
    if not isinstance(said, bool):
        raise HeadFormatError(f"{QK_NORMS} must be true or false, got {said!r}")
    return said


def norm_before_residual(config: HeadConfig) -> bool:
    """Whether the layer's residual is its hidden input after hidden_norm
    (true) or before it (false, the EAGLE-3 reference's; also when the config
    does not say, as the speculators library reads it)."""
    value = config.extra.get("norm_before_residual", False)
    if not isinstance(value, bool):
        raise HeadFormatError(f"norm_before_residual must be true or false, got {value!r}")
    return value


def default_layer_ids(layers: int) -> tuple[int, ...]:
    """The reference choice: low, middle and high layers (2, L//2, L-3) of an
    L-layer base, kept inside very shallow models (L = 2: 0, 1, 2)."""
    return tuple(sorted((min(2, layers), layers // 2, max(layers - 3, 0))))


def training_layer_ids(layers: int) -> tuple[int, ...]:
    """The layers a new head fuses: the reference choice where its three are
    different layers (L >= 7, and L = 2 or 3); on a 4- to 6-layer base, where
    it names a layer twice (which config.json may not), the second layer, the
    middle one and the last one's input instead. A 1-layer base has only two
    points to read (ids 0 and 1): no EAGLE-3 head."""
    reference = default_layer_ids(layers)
    if len(set(reference)) == 3:
        return reference
    if layers < 2:
        raise ValueError(f"an EAGLE-3 head fuses three layers of its base model; this one has {layers} decoder layer")
    return (1, layers // 2, layers - 1)


def configured_layer_ids(config: HeadConfig) -> tuple[int, ...] | None:
    """`eagle_aux_hidden_state_layer_ids` from config.json, at top level or in
    `eagle_config`. Read as vLLM does: id i is the input of decoder layer i,
    which for i < L is transformers' `output_hidden_states[i]`; id L is the
    final norm's input (transformers' `output_hidden_states[L]` comes after
    that norm)."""
    extra = config.extra
    ids = extra.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(extra.get("eagle_config"), dict):
        ids = extra["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or len(ids) != 3 or not all(type(i) is int and i >= 0 for i in ids):  # no booleans
        raise HeadFormatError(f"eagle_aux_hidden_state_layer_ids must be three layer numbers, got {ids!r}")
    if len(set(ids)) < 3:
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        raise HeadFormatError(
            f"eagle_aux_hidden_state_layer_ids names layer {repeated[0]} more than once ({ids!r}): "
            "an EAGLE-3 head fuses three different layers"
        )
    return tuple(ids)


class MidLayer(nn.Module):
    """EAGLE-3's decoder layer: attention over [normed embedding, normed hidden]
    (2H wide); qk_norms: a Qwen3 layer, which norms each head's queries and keys."""

    def __init__(self, config: HeadConfig, qk_norms: bool = False):
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, input_size=2 * config.hidden_size, qk_norms=qk_norms)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norm_before_residual = norm_before_residual(config)

    def forward(self, embeddings, hidden, rotary, mask, cache: HeadCache) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeddings), normed], dim=-1)
        h = (normed if self.norm_before_residual else hidden) + self.self_attn(x, rotary, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    def __init__(
        self, config: HeadConfig, layer_ids: tuple[int, ...], own_embedding: bool = False, fc_norms: bool = False,
        qk_norms: bool = False,
    ):  # fmt: skip
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        self.layer_ids = tuple(layer_ids)  # base decoder layers whose inputs are the features, low to high
        target = self.target_hidden_size
        # EAGLE-3.1: one RMSNorm per captured feature before fc
        self.fc_norm = nn.ModuleList([RMSNorm(target, config.rms_norm_eps) for _ in range(3)]) if fc_norms else None
        self.fc = nn.Linear(3 * target, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config, qk_norms)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config.rotary_config())

    @property
    def target_hidden_size(self) -> int:
        return int(self.config.extra.get("target_hidden_size") or self.config.hidden_size)

    @property
    def feature_size(self) -> int:
        """Width of the base-model features the head takes: three captured layers."""
        return 3 * self.target_hidden_size

    def place(self, device=None, dtype=None) -> Eagle3Head:
        """Move the weights (d2t and t2d keep their dtypes: `to` casts floating
        tensors only); rotary frequencies stay float32."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.to(device=device, dtype=dtype)
        self.rotary = LlamaRotaryEmbedding(self.config.rotary_config()).to(self.device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """The target id of each draft-vocabulary entry (d2t is an offset)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def forward(
        self,
        embeddings: torch.Tensor,  # (B, T, H): embed(token_{t+1})
        features: torch.Tensor,  # (B, T, 3H) captured base-model states, or (B, T, H) the head's own output h
        positions: torch.Tensor,  # (B, T) int64
        mask: torch.Tensor | None,  # (B, 1, T, past + T) bool, True = may attend; None = causal, empty cache
        cache: HeadCache,
    ) -> torch.Tensor:
        """-> (B, T, H) pre-norm outputs h (fed back at the next draft step); appends T entries to `cache`."""
        features = features.to(self.dtype)
        if features.shape[-1] == self.feature_size:
            if self.fc_norm is not None:
                chunks = features.chunk(3, dim=-1)
                features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
            features = self.fc(features)
        rotary = self.rotary(features, positions)
        return self.midlayer(embeddings.to(self.dtype), features, rotary, mask, cache)


def expected_shapes(config: HeadConfig, target_hidden_size: int, fc_norms: bool, qk_norms: bool = False) -> dict[str, tuple[int, ...]]:
    """Every key of a published EAGLE-3 checkpoint and its shape."""
    h, i, hd = config.hidden_size, config.intermediate_size, config.dim_per_head
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {
        "fc.weight": (h, 3 * target_hidden_size),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
    }
    if config.qkv_bias:
        shapes.update({f"midlayer.self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
    if fc_norms:
        shapes.update({f"fc_norm.{k}.weight": (target_hidden_size,) for k in range(3)})
    if qk_norms:
        shapes.update({f"midlayer.self_attn.{p}_norm.weight": (hd,) for p in ("q", "k")})
    return shapes


def target_hidden_size(config: HeadConfig) -> int:
    """The width of each base-model feature the head reads (its hidden size unless the config says otherwise)."""
    value = config.extra.get("target_hidden_size") or config.hidden_size
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value) or value < 1:
        raise HeadFormatError(f"target_hidden_size must be a positive whole number, got {value!r}")
    return int(value)


def completed(config: HeadConfig, state: dict[str, torch.Tensor], file: Path) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """What published heads leave out and Kestrel can tell: draft_vocab_size
    (absent or null in some configs) from lm_head's rows; d2t where the draft
    vocabulary is the whole vocabulary (every offset 0); t2d, which drafting
    never reads, from d2t. The rest is checked strictly by `check_state`."""
    state = dict(state)
    if not config.draft_vocab_size and "lm_head.weight" in state:
        config = replace(config, draft_vocab_size=int(state["lm_head.weight"].shape[0]))
    if not config.draft_vocab_size:
        raise HeadFormatError(f"{file.parent / CONFIG_FILE}: an EAGLE-3 head needs draft_vocab_size (or an lm_head.weight to tell it)")
    if "d2t" not in state and config.draft_vocab_size == config.vocab_size:
        state["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
    if "t2d" not in state and "d2t" in state and state["d2t"].shape == (config.draft_vocab_size,):
        target_ids = torch.arange(config.draft_vocab_size) + state["d2t"].long()
        if 0 <= int(target_ids.min()) and int(target_ids.max()) < config.vocab_size:
            state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, target_ids, True)
    return config, state


def check_state(state: dict[str, torch.Tensor], config: HeadConfig, file: Path) -> None:
    """Strict: every expected key with its shape, nothing unexpected."""
    if not config.draft_vocab_size:
        raise HeadFormatError(f"{file.parent / CONFIG_FILE}: an EAGLE-3 head needs draft_vocab_size")
    target = target_hidden_size(config)
    shapes = expected_shapes(config, target, fc_norms="fc_norm.0.weight" in state, qk_norms=qk_norms(config, state))
    check_keys(state, shapes, config, file, " in an EAGLE-3 head")
    check_d2t(state, config, file)


def check_fits(config: HeadConfig, keys, file: Path, hidden_size: int | None, base_layers: int | None) -> None:
    """What an EAGLE-3 head needs of its base model, from the head's config and
    weight names (`keys`) alone, so that it is said before a large base model
    loads as well as after: features as wide as the base's hidden states, an
    embedding of its own where its layer is narrower, aux layers the base has.
    A size not known (None) is not checked; norm_output heads are refused."""
    nested = config.extra.get("eagle_config") if isinstance(config.extra.get("eagle_config"), dict) else {}
    if config.extra.get("norm_output") or nested.get("norm_output"):
        raise HeadFormatError(f"{file.parent / CONFIG_FILE}: norm_output heads (an EAGLE-3.1 variant) are not supported")
    if config.extra.get("norm_before_fc") or nested.get("norm_before_fc"):  # vLLM reads it in either place
        raise HeadFormatError(f"{file.parent / CONFIG_FILE}: norm_before_fc heads (a norm over the three features "
                              "before fc) are not supported")  # fmt: skip
    target = target_hidden_size(config)
    if hidden_size is not None and target != hidden_size:
        raise HeadMismatchError(
            f"{file}: the head reads features {target} wide (target_hidden_size; fc.weight takes 3 x {target}), "
            f"and the base model's hidden size is {hidden_size}"
        )
    if hidden_size is not None and config.hidden_size != hidden_size and "embed_tokens.weight" not in keys:
        raise HeadMismatchError(
            f"{file}: head hidden_size {config.hidden_size} != base model hidden size {hidden_size}, and the head "
            "has no embed_tokens of its own to embed tokens at its width"
        )
    configured = configured_layer_ids(config)  # the default layers are always the base's (default_layer_ids)
    if base_layers is not None and configured is not None and max(configured) > base_layers:
        raise HeadMismatchError(
            f"{file.parent / CONFIG_FILE}: aux layers {sorted(configured)} do not exist in a {base_layers}-layer base model"
        )


def build(config: HeadConfig, state: dict[str, torch.Tensor], file: Path, base_layers: int) -> Eagle3Head:
    """An Eagle3Head from a state checked by check_state and check_fits; aux
    layers from the config or the default."""
    default, configured = default_layer_ids(base_layers), configured_layer_ids(config)
    if configured is not None and list(configured) != sorted(configured):
        # the features are fused low, mid, high, as vLLM captures them (in the order the layers run)
        log.info(f"{file.parent / CONFIG_FILE}: aux layers {list(configured)} taken in the order the layers run, "
                 f"{sorted(configured)}")
        configured = tuple(sorted(configured))
    layer_ids = configured or default
    if configured is not None:
        if configured == tuple(layer - 1 for layer in default):
            # the default layers counted by the layer whose output is taken (SGLang's, SpecForge's and
            # ModelOpt's numbering): one less than the input-of-layer numbering read here
            log.info(f"{file.parent / CONFIG_FILE}: aux layers {list(layer_ids)} read as the outputs of those layers, "
                     f"that is the inputs of layers {list(default)}")
            layer_ids = default
        else:
            log.info(f"{file.parent / CONFIG_FILE}: aux layers {list(layer_ids)} read as the inputs of those layers")
    head = Eagle3Head(config, layer_ids, own_embedding="embed_tokens.weight" in state, fc_norms="fc_norm.0.weight" in state,
                      qk_norms=qk_norms(config, state))  # fmt: skip
    state = dict(state, d2t=state["d2t"].long(), t2d=state["t2d"].bool())
    head.load_state_dict(state, strict=True)
    return head


def new_head(config: HeadConfig, layer_ids: tuple[int, ...], draft_ids: torch.Tensor) -> Eagle3Head:
    """A freshly initialised head drafting among `draft_ids` (target ids, any order)."""
    draft_ids = torch.sort(torch.as_tensor(draft_ids, dtype=torch.long)).values
    head = Eagle3Head(config, layer_ids)
    with torch.no_grad():
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    return head


def save(head: Eagle3Head, folder: str | Path, extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors in the published EAGLE-3 format."""
    settings = dict(
        architectures=[ARCHITECTURE], num_hidden_layers=1, tie_word_embeddings=False, bias=False,
        eagle_aux_hidden_state_layer_ids=list(head.layer_ids),
    )  # fmt: skip
    return save_head(head, folder, {**settings, **(extra_config or {})})
