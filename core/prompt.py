"""Chat messages -> prompt token ids, the tokens that end a reply, and prompt
files (JSONL) as `bench` and the Compare tab read them. Nothing here imports
torch or transformers, so a bad prompt file is refused before the engine loads."""

from __future__ import annotations

import copy
import json
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from models.errors import ChatTemplateError

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "</s>")


def encode_chat(tokenizer, messages: list[dict], options: dict | None = None) -> list[int]:
    """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...];
    options: variables for the chat template (Qwen3's enable_thinking).
    Control-token text inside a message (a user pasting "<|im_end|>") stays
    text: only the template's own control tokens are tokens. A reply cut
    inside its reasoning goes back without it (without_unfinished_thinking)."""
    messages = _templated(tokenizer, messages, options)
    text = render_chat(tokenizer, messages, options)
    controls = control_texts(tokenizer)
    if any(control in message["content"] for message in messages for control in controls):
        ids = _encode_contents_literally(tokenizer, messages, text, options)
        if ids is not None:
            return ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _templated(tokenizer, messages: list[dict], options: dict | None) -> list[dict]:
    """`messages` as the chat template is given them: without unfinished reasoning, without the UNFINISHED mark."""
    kept = without_unfinished_thinking(tokenizer, messages, options)
    return [{key: value for key, value in message.items() if key != UNFINISHED} for message in kept]


THINK_START, THINK_END = "<think>", "</think>"  # around a reasoning model's thinking (Qwen3, DeepSeek-R1)
# a reply's key (the page's own replies): it ended before its end (Stop, the token limit), so one
# without </think> under a template that opens the reasoning itself is all unfinished reasoning
UNFINISHED = "unfinished"


def thinks(tokenizer) -> bool:
    """Whether the tokenizer has <think> and </think> as tokens of their own:
    a reasoning model's (Qwen3's, DeepSeek-R1-Distill's)."""
    added = getattr(tokenizer, "added_tokens_encoder", None) or {}
    return THINK_START in added and THINK_END in added


def without_unfinished_thinking(tokenizer, messages: list[dict], options: dict | None = None) -> list[dict]:
    """For a reasoning model (thinks), the messages with each earlier reply cut
    (by Stop or the token limit) inside its reasoning left without that
    unfinished reasoning. Their templates drop a finished reasoning from
    earlier turns (they cut at </think>) but keep an unfinished one whole, as
    if it were the answer: hundreds of tokens of it in every later prompt.
    Where the template opens the reasoning itself (DeepSeek-R1's generation
    prompt ends in <think>), a reply marked UNFINISHED without </think> is
    all unfinished reasoning; one not marked is left as it is (a client that
    sends earlier answers without their reasoning, as DeepSeek advises)."""
    if not thinks(tokenizer):
        return messages
    cut = [index for index, message in enumerate(messages) if message["role"] == "assistant" and THINK_END not in message["content"]]
    if not cut:
        return messages
    opened = None
    kept = list(messages)
    for index in cut:
        content = messages[index]["content"]
        start = content.find(THINK_START)
        if start < 0:
            if not messages[index].get(UNFINISHED):
                continue
            opened = _opens_thinking(tokenizer, options) if opened is None else opened
            if not opened:
                continue
        kept[index] = {**messages[index], "content": content[: max(start, 0)].rstrip()}
    return kept


def _opens_thinking(tokenizer, options: dict | None) -> bool:
    """Whether the template's generation prompt ends inside an opened <think>."""
    try:
        return bool(_thinking_opener(render_chat(tokenizer, [{"role": "user", "content": "x"}], options)))
    except Exception:  # a template that refuses a lone user message: none opened that could be seen
        return False


def opened_thinking(tokenizer, messages: list[dict], options: dict | None = None) -> str:
    """The <think> the prompt of `messages` ends with, as the template wrote
    it (DeepSeek-R1's "<think>\\n"), where the template opens the reasoning
    itself: the reply begins inside it and writes only </think>. "" for a
    model that does not reason (thinks) and where the prompt ends otherwise
    (Qwen3's replies write <think> themselves; chat_template_kwargs may turn
    the reasoning off). The prompt is rendered as encode_chat renders it."""
    if not thinks(tokenizer):
        return ""
    return _thinking_opener(render_chat(tokenizer, _templated(tokenizer, messages, options), options))


def _thinking_opener(text: str) -> str:
    """The <think> that `text` ends with and the whitespace after it; "" where it ends otherwise."""
    kept = text.rstrip()
    return text[len(kept) - len(THINK_START) :] if kept.endswith(THINK_START) else ""


# Vicuna v1.1-v1.5's conversation format (FastChat's "vicuna_v1.1"), which its repos, made before chat
# templates existed, do not carry, and which the published EAGLE heads for Vicuna were trained on:
# "SYSTEM USER: question ASSISTANT: answer</s>USER: next question ASSISTANT:"
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
VICUNA_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system, turns = messages[0]['content'], messages[1:] -%}"
    "{%- else -%}{%- set system, turns = '" + VICUNA_SYSTEM.replace("'", "\\'") + "', messages -%}{%- endif -%}"
    "{{- (bos_token or '') + system -}}"
    "{%- for message in turns -%}"
    "{%- if message['role'] == 'assistant' -%}{{- ' ASSISTANT: ' + message['content'] + (eos_token or '') -}}"
    "{%- else -%}{{- ('' if loop.previtem is defined and loop.previtem['role'] == 'assistant' else ' ') + 'USER: ' + message['content'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ' ASSISTANT:' -}}{%- endif -%}"
)


def chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template, or for a Vicuna without one (the last
    part of its repo id or folder names it) Vicuna's; None: a plain transcript (render_chat)."""
    own = getattr(tokenizer, "chat_template", None)
    if own:
        return own
    name = str(getattr(tokenizer, "name_or_path", "")).replace("\\", "/").rstrip("/").rpartition("/")[2]
    return VICUNA_TEMPLATE if "vicuna" in name.lower() else None


def template_syntax_error(tokenizer) -> str | None:
    """What jinja says is wrong with the chat template's text (one cut short:
    "unexpected end of template"), which no conversation would render; None
    where it reads (a template refusing a lone user message reads), or there is none."""
    from jinja2 import TemplateSyntaxError

    try:
        render_chat(tokenizer, [{"role": "user", "content": "x"}])
    except ChatTemplateError as error:
        if isinstance(error.__cause__, TemplateSyntaxError):
            return str(error.__cause__)
    except Exception:  # noqa: BLE001 (what else a template makes of a lone user message is for a chat to say)
        pass
    return None


def render_chat(tokenizer, messages: list[dict], options: dict | None = None) -> str:
    """The chat template's text of `messages`, ending with the assistant's
    header; options: variables for the template (chat_template_kwargs)."""
    template = chat_template(tokenizer)
    if template:
        from jinja2 import TemplateError, TemplateSyntaxError

        # the tokenizer's own, as transformers picks it (a dict of named templates: the default one)
        given = {} if getattr(tokenizer, "chat_template", None) else {"chat_template": template}
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **given, **(options or {}))
        except TemplateSyntaxError as error:  # a template cut short or mistyped: no conversation is at fault
            raise ChatTemplateError(f"the model's chat template is broken: {error}") from error
        except TemplateError as error:  # the template's raise_exception: what it refuses, in its words
            raise ChatTemplateError(f"the model's chat template refuses this conversation: {error}") from error
    # base models without a template: a plain transcript
    lines = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
    return (tokenizer.bos_token or "") + "\n".join(lines) + "\nAssistant:"


def control_texts(tokenizer) -> set[str]:
    """The texts the tokenizer reads as special (control) tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    controls = {token.content for token in decoder.values() if token.special}
    controls.update(getattr(tokenizer, "all_special_tokens", ()))
    return {control for control in controls if control}


def _encode_contents_literally(tokenizer, messages: list[dict], text: str, options: dict | None = None) -> list[int] | None:
    """The template rendered around markers, each content tokenized with its
    control-token text split into ordinary tokens. Where the template changes
    replies (reasoning models' cut theirs at </think>), the replies stay as
    they are and only the other messages are marked. None where the template
    changes contents in a way the markers cannot place (the caller then
    tokenizes the whole text as usual)."""
    for marked in (lambda message: True, lambda message: message["role"] != "assistant"):
        markers = [{**message, "content": f"\x00{index}\x00"} if marked(message) else message for index, message in enumerate(messages)]
        pieces = re.split("\x00([0-9]+)\x00", render_chat(tokenizer, markers, options))
        # pieces: template text, content index, template text, ..., template text
        for shape in (lambda content: content, str.strip):  # some templates trim contents
            contents = [shape(message["content"]) for message in messages]
            spans = [contents[int(piece)] if odd else piece for odd, piece in _alternating(pieces)]
            if "".join(spans) == text:
                literal = _literal_tokenizer(tokenizer)
                ids = []
                for odd, span in _alternating(spans):
                    if span:
                        ids += _encode_piece(literal if odd else tokenizer, span, odd, first=not ids)
                return ids
    return None


def _encode_piece(tokenizer, text: str, split: bool, first: bool) -> list[int]:
    """`text`'s tokens as they would be inside a longer text. A piece after the
    first is encoded behind a newline whose tokens are then dropped: SentencePiece-
    style tokenizers put a word boundary (▁) at the start of every encode call,
    which mid-text would be a space that is not there. Where the newline merges
    with the piece, the piece is encoded alone."""
    def encode(piece: str) -> list[int]:
        return tokenizer(piece, add_special_tokens=False, split_special_tokens=split)["input_ids"]

    if first:
        return encode(text)
    lead, ids = encode("\n"), encode("\n" + text)
    return ids[len(lead) :] if ids[: len(lead)] == lead else encode(text)


_literal_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_copying = threading.Lock()


def _literal_tokenizer(tokenizer):
    """A copy of `tokenizer` used only with split_special_tokens: the flag is
    state of the backend tokenizer, and setting it on the shared one would race
    with encodes on other threads (API requests, the page)."""
    with _copying:
        if tokenizer not in _literal_copies:
            _literal_copies[tokenizer] = copy.deepcopy(tokenizer)
        return _literal_copies[tokenizer]


def _alternating(pieces: list[str]):
    return ((index % 2 == 1, piece) for index, piece in enumerate(pieces))


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


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    text: str  # the first user turn
    source: str  # e.g. fastchat/vicuna_bench; the summary splits tau by it
    follow_ups: tuple[str, ...] = ()  # the later user turns (bench --turns)


class PromptFileError(ValueError):
    """A prompt file that cannot be used, naming the file and line."""


def unpaired_surrogate(text: str) -> str | None:
    """Where `text` holds a lone UTF-16 surrogate, which valid JSON can spell
    (a "\\ud800" escape without its pair) and no tokenizer or file can take; None otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"a lone surrogate \\u{ord(text[error.start]):04x} at character {error.start + 1}; escapes of U+D800-U+DFFF come in pairs"
    return None


def prompt_rows(path: Path):
    """(line index from 0, the row) of every prompt line in a JSONL file, each
    checked: a JSON object whose 'turns' list starts with the prompt as text.
    Raises PromptFileError naming the file and line; also for an 'id' that an
    earlier line has (answers and results are kept by id)."""
    if not path.is_file():
        if path.is_dir():
            raise PromptFileError(f"{path}: is a folder, not a prompt file")
        if path.exists():  # a pipe (a shell's <(...)) or a device, which a run may need to read more than once
            raise PromptFileError(f"{path}: not a regular file (a pipe or a device); save the prompts to a file and give its path")
        raise PromptFileError(f"{path}: no such prompt file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM, as Windows editors write, is not part of the first line
    except UnicodeDecodeError as error:
        raise PromptFileError(f"{path}: not UTF-8 text (byte {error.start})") from error
    lines = {}  # the line of each id
    for index, line in enumerate(text.split("\n")):  # not splitlines: JSON text may hold U+2028 and the like
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptFileError(f"{path}:{index + 1}: not valid JSON ({error.msg})") from error
        except RecursionError as error:
            raise PromptFileError(f"{path}:{index + 1}: not valid JSON (nested too deeply)") from error
        except ValueError as error:  # a number past Python's limit on the digits of an integer
            raise PromptFileError(f"{path}:{index + 1}: not valid JSON (a number of too many digits)") from error
        turns = row.get("turns") if isinstance(row, dict) else None
        if not turns or not isinstance(turns, list) or not isinstance(turns[0], str):
            raise PromptFileError(f"{path}:{index + 1}: needs a 'turns' list whose first item is the prompt")
        if not turns[0].strip():
            raise PromptFileError(f"{path}:{index + 1}: the prompt is empty")
        for name, value in (("id", row.get("id")), ("source", row.get("source")), *((f"turn {n + 1}", turn) for n, turn in enumerate(turns))):
            if isinstance(value, str) and (problem := unpaired_surrogate(value)):
                raise PromptFileError(f"{path}:{index + 1}: its {name} is not UTF-8 text ({problem})")
        if "id" in row:
            if isinstance(row["id"], bool) or not isinstance(row["id"], str | int | float):  # str() would make "None" of null
                raise PromptFileError(f"{path}:{index + 1}: its id {json.dumps(row['id'])[:40]} is not text or a number; "
                                      "give one, or leave 'id' out")  # fmt: skip
            if str(row["id"]) in lines:
                raise PromptFileError(f"{path}:{index + 1}: id {str(row['id'])!r} is already the id of line {lines[str(row['id'])]}")
            lines[str(row["id"])] = index + 1
        yield index, row


def load_prompts(path: str | Path, limit: int | None = None, per_source: int | None = None) -> list[BenchPrompt]:
    """JSONL lines with a `turns` list (the first turn is the prompt) and optional `id`, `source`.
    per_source keeps the first N prompts of every source (e.g. chat and code halves)."""
    path = Path(path)
    prompts, seen, lines = [], {}, {}  # lines: the line of each id
    for index, row in prompt_rows(path):
        turns = row["turns"]
        source = str(row.get("source", "prompts"))
        seen[source] = seen.get(source, 0) + 1
        if per_source is not None and seen[source] > per_source:
            continue
        prompt_id = str(row.get("id", f"line-{index + 1}"))
        if prompt_id in lines:
            raise PromptFileError(f"{path}:{index + 1}: id {prompt_id!r} is already the id of line {lines[prompt_id]}")
        lines[prompt_id] = index + 1
        for number, turn in enumerate(turns[1:], 2):  # skipped, a bad turn would move the later ones into its place
            if not (isinstance(turn, str) and turn.strip()):
                raise PromptFileError(f"{path}:{index + 1}: turn {number} is {'empty' if isinstance(turn, str) else 'not text'}")
        follow_ups = tuple(turns[1:])
        prompts.append(BenchPrompt(prompt_id, turns[0], source, follow_ups))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts[:limit] if limit else prompts
