"""Chat messages -> prompt token ids, and the tokens that end a reply."""

from __future__ import annotations

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "</s>")


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...]."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:  # base models without a template: a plain transcript
        lines = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
        text = "\n".join(lines) + "\nAssistant:"
        if tokenizer.bos_token:
            text = tokenizer.bos_token + text
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids of the generation config and tokenizer, plus known end-of-turn tokens."""
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
    return frozenset(ids)
