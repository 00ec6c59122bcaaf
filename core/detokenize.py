"""Streaming text from token ids without splitting multi-byte characters."""

from __future__ import annotations


class Detokenizer:
    """Decodes the growing list of generated ids and hands out only new text.
    A trailing U+FFFD means an incomplete UTF-8 sequence: hold it back until the
    next token completes it.

    Decoding every id again at each token costs a long reply's length per token
    (7.7 s over 8,000 tokens, on the thread that serves the page and the API).
    So the text is decoded from an anchor: the ids before it decode to
    `settled`, and the text after it is what decoding from WINDOW tokens before
    the anchor adds to decoding those tokens alone (the window gives the
    tokenizer the context its rules at the start of a text need, such as
    SentencePiece dropping a first token's leading space). Where that does not
    hold (the window's own text changes once later tokens follow it, as a
    tokenizer's clean-up of spaces before punctuation can make it), the whole
    reply is decoded, as before (see `_settle`)."""

    WINDOW = 6
    SETTLE = 64

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""
        self.anchor = 0  # ids[: anchor] decode to `settled`
        self.settled = ""
        self.next_settle = 2 * self.SETTLE  # the length at which the anchor next moves
        self.next_check = 2 * self.SETTLE  # ... and the windowed text is next checked against the whole decode
        self.windowed = True  # False once they differed: the whole reply is decoded from then on

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self._text(len(self.ids))
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        if self.windowed and len(self.ids) >= self.next_settle:
            self._settle(text)
        return delta

    def flush(self) -> str:
        """What was held back at the end of generation (an incomplete character)."""
        text = self._text(len(self.ids))
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True)

    def _text(self, end: int) -> str:
        """The text of ids[:end] (end >= anchor): tokenizer.decode's, through the anchor."""
        if not self.anchor or not self.windowed:
            return self._decode(0, end)
        start = self.anchor - min(self.WINDOW, self.anchor)
        window, tail = self._decode(start, self.anchor), self._decode(start, end)
        if not tail.startswith(window):
            return self._decode(0, end)
        return self.settled + tail[len(window) :]

    def _settle(self, text: str) -> None:
        """Every SETTLE tokens: move the anchor to SETTLE tokens before the end,
        where the text before it is what was handed out and ends on a whole
        character (else it waits SETTLE tokens more). At lengths doubling, the
        windowed `text` is first checked against the whole decode, and windowing
        stops for good where they differ. So a reply's decoding grows with its
        length, not with its length squared."""
        length = len(self.ids)
        self.next_settle = length + self.SETTLE
        if length >= self.next_check:
            self.next_check = 2 * length
            if text != self._decode(0, length):
                self.windowed = False
                return
        anchor = length - self.SETTLE
        settled = self._text(anchor)
        if settled.endswith("\ufffd") or not self.emitted.startswith(settled):
            return
        self.anchor, self.settled = anchor, settled
