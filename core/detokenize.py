"""Streaming text from token ids without splitting multi-byte characters."""

from __future__ import annotations


class Detokenizer:
    """Decodes the growing list of generated ids and hands out only new text.
    A trailing U+FFFD means an incomplete UTF-8 sequence: hold it back until the
    next token completes it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    def flush(self) -> str:
        """What was held back at the end of generation (an incomplete character)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
