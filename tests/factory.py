"""Tiny random-weight models, tokenizers and draft heads for tests."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"] + [
    f"w{i}" for i in range(56)
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>", pad_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# Architectures whose transformers implementation is tested here to honour tree
# masks and position ids (tree logits equal sequential ones; float64 identity).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(architecture: str = "llama", vocab_size: int = len(WORDS), **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    settings = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=4, pad_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    if architecture in ("mistral", "qwen3"):
        settings["sliding_window"] = None
    settings.update(overrides)
    if architecture == "qwen3":
        settings["head_dim"] = settings["hidden_size"] // settings["num_attention_heads"]
    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config}
    return configs[architecture](**settings)


def save_tiny_model(
    folder: Path, architecture: str = "llama", seed: int = 0, sharpness: float = 20.0, **overrides
) -> Path:
    """A random tiny causal LM with its tokenizer, saved as a Hugging Face folder.
    `sharpness` scales the output layer: large values keep greedy choices away
    from near-ties, small ones give spread-out sampling distributions."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture, **overrides))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpness)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def random_head(model, seed: int = 0, qkv_bias: bool = False):
    """A random draft head sized for `model`, in its dtype."""
    from models.head import DraftHead, HeadConfig

    config = model.config
    torch.manual_seed(seed)
    head_config = HeadConfig(
        hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=config.vocab_size, qkv_bias=qkv_bias,
    )  # fmt: skip
    head = DraftHead(head_config)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.2)
    dtype = model.get_input_embeddings().weight.dtype
    return head.place(dtype=dtype).eval().requires_grad_(False)


def random_eagle3_head(model, seed: int = 0, draft_ids=None, qkv_bias: bool = False, layer_ids=None):
    """A random EAGLE-3 head sized for `model`, in its dtype, drafting among
    `draft_ids` (default: every other token); features from `layer_ids`
    (default: the first layer, the middle one and the final norm)."""
    from models.eagle3 import new_head
    from models.head import HeadConfig

    config = model.config
    torch.manual_seed(seed)
    head_config = HeadConfig(
        hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=config.vocab_size, qkv_bias=qkv_bias, bias=False,
        draft_vocab_size=len(draft_ids) if draft_ids is not None else (config.vocab_size + 1) // 2,
    )  # fmt: skip
    layers = config.num_hidden_layers
    layer_ids = layer_ids or (0, layers // 2, layers)  # the last: the input of the final norm
    draft_ids = torch.arange(0, config.vocab_size, 2) if draft_ids is None else draft_ids
    head = new_head(head_config, layer_ids, draft_ids)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            parameter.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    dtype = model.get_input_embeddings().weight.dtype
    return head.place(dtype=dtype).eval().requires_grad_(False)


def tokens_of(steps) -> list[int]:
    """The token ids of a decoding's steps, in order."""
    return [token for step in steps for token in step.token_ids]


def decodes_as(engine, reference, vocab_size: int = 48) -> int:
    """Assert that `engine` decodes as `reference` does in vanilla, and that
    its speculative modes (EAGLE-1's tree, two EAGLE-2 trees) equal its
    vanilla, greedy and sampled, over three random prompts. -> drafted tokens accepted."""
    import torch

    from core.config import SamplingParams, TreeParams

    accepted = 0
    for seed in range(3):
        prompt = torch.randint(8, vocab_size, (5 + 4 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        for sampling in (SamplingParams(max_new_tokens=24), SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed)):
            expected = tokens_of(reference.stream(prompt, "vanilla", sampling))
            assert tokens_of(engine.stream(prompt, "vanilla", sampling)) == expected
            for mode, tree in (("eagle", TreeParams()), ("eagle2", TreeParams(12, 4, 3)), ("eagle2", TreeParams(30, 6, 5))):
                steps = list(engine.stream(prompt, mode, sampling, tree))
                assert tokens_of(steps) == expected, (mode, tree, seed, sampling)
                accepted += sum(step.accepted for step in steps)
    return accepted
