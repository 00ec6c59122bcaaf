"""Streaming text from token ids without splitting multi-byte characters."""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence

BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_BYTE_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_ids(tokenizer) -> frozenset[int]:
    """The ids of SentencePiece's byte-fallback pieces ("<0xE4>", in Llama-2's
    and Mistral's vocabularies). Their decoder turns a run of them into text
    only as a whole: a run ending in an incomplete character decodes to U+FFFD
    for every byte, the complete characters before it included, so the text of
    a run can change until a token of another kind ends it."""
    try:
        found = _BYTE_IDS.get(tokenizer)
    except TypeError:  # not weakly referable: looked up each time
        found = None
    if found is None:
        vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        found = frozenset(index for piece, index in vocabulary.items() if len(piece) == 6 and BYTE_PIECE.fullmatch(piece))
        try:
            _BYTE_IDS[tokenizer] = found
        except TypeError:
            pass
    return found


class Detokenizer:
    """Decodes the growing list of generated ids and hands out only new text.
    A trailing U+FFFD means an incomplete UTF-8 sequence: hold it back until the
    next token completes it; so is a trailing run of byte-fallback pieces (see
    `byte_ids`), until a token of another kind ends it. So the text handed out
    after each token is a function of the tokens so far, whatever their number
    per push: one token a step and several give the same text.

    `context`: ids the reply continues (a completion's prompt). Decoders that
    drop the first token's leading space (SentencePiece's) would drop the
    space between the prompt's last word and the reply's first; the reply's
    text is then what the context's last tokens and the reply decode to,
    after the text of those tokens alone. A chat reply begins a new message
    and takes none.

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

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.bytes = byte_ids(tokenizer)
        self.context = self._context(list(context))
        self.context_text = self.tokenizer.decode(self.context, skip_special_tokens=True) if self.context else ""
        self.ids: list[int] = []
        self.emitted = ""
        self.anchor = 0  # ids[: anchor] decode to `settled`; no run of byte pieces goes on across it
        self.settled = ""
        self.next_settle = 2 * self.SETTLE  # the length at which the anchor next moves
        self.next_check = 2 * self.SETTLE  # ... and the windowed text is next checked against the whole decode
        self.windowed = True  # False once they differed: the whole reply is decoded from then on

    def _context(self, ids: list[int]) -> list[int]:
        """The last WINDOW ids, none where they end in a byte piece (the
        reply could complete its character, changing the context's text)."""
        if not ids or ids[-1] in self.bytes:
            return []
        return ids[-self.WINDOW :]

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        end = self._settled_end()
        text = self._text(end)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        if self.windowed and end >= self.next_settle:
            self._settle(text, end)
        return delta

    def held(self) -> str:
        """The text a trailing run of byte pieces would add now, not handed out
        (push holds it until a token of another kind ends the run); "" where
        none is held or it ends in an incomplete character."""
        if self._settled_end() == len(self.ids):
            return ""
        text = self._text(len(self.ids))
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        return text[len(self.emitted) :]

    def flush(self) -> str:
        """What was held back at the end of generation (an incomplete character)."""
        text = self._text(len(self.ids))
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    def _settled_end(self) -> int:
        """The ids before a trailing run of byte pieces (all where none ends them)."""
        end = len(self.ids)
        while end > self.anchor and self.ids[end - 1] in self.bytes:
            end -= 1
        return end

    def _inside_run(self, position: int) -> bool:
        """Whether ids[position] continues a run of byte pieces begun before it
        (a run decodes differently in part than whole; a run of one, as
        Llama-2's newline <0x0A> between words, is whole on either side)."""
        return 0 < position < len(self.ids) and self.ids[position - 1] in self.bytes and self.ids[position] in self.bytes

    def _decode(self, start: int, end: int) -> str:
        if start == 0 and self.context:
            text = self.tokenizer.decode(self.context + self.ids[:end], skip_special_tokens=True)
            if text.startswith(self.context_text):
                return text[len(self.context_text) :]
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

    def _settle(self, text: str, length: int) -> None:
        """Every SETTLE tokens: move the anchor to SETTLE tokens before the
        end of `text` (the text of ids[:length]), where the text before it is
        what was handed out and ends on a whole character, and neither the
        anchor nor the window's start splits a run of byte pieces (a run
        decodes differently in part than whole); else it waits SETTLE tokens
        more. At lengths doubling, the windowed `text` is first checked against the whole
        decode, and windowing stops for good where they differ. So a reply's
        decoding grows with its length, not with its length squared."""
        self.next_settle = length + self.SETTLE
        if length >= self.next_check:
            self.next_check = 2 * length
            if text != self._decode(0, length):
                self.windowed = False
                return
        anchor = length - self.SETTLE
        if self._inside_run(anchor) or self._inside_run(anchor - self.WINDOW):
            return
        settled = self._text(anchor)
        if settled.endswith("\ufffd") or not self.emitted.startswith(settled):
            return
        self.anchor, self.settled = anchor, settled
