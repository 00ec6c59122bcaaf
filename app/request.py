"""OpenAI-style request bodies -> Kestrel's settings, with errors that name the
parameter at fault and its allowed range (the API answers them with 400)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from core.config import MODES, SEEDS, TOP_K_LIMIT, TREE_LIMITS, SamplingParams, TreeParams
from models.errors import json_kind

MAX_MESSAGES = 1024  # messages in one chat request
MAX_STOPS = 32  # stop strings: OpenAI allows 4, but front-ends made for local servers send more (an instruct template's and the user's own)
MAX_STOP_CHARS = 256  # characters in one stop string
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields that would change the output and that Kestrel cannot honour: refused
# by name rather than dropped. Each maps to the value that is harmless. OpenAI's
# own first, then the extensions that other local servers (vLLM, llama.cpp,
# text-generation-webui, koboldcpp) take and that their front-ends send.
REFUSED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "audio": (None,),
    "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "suffix": (None, ""), "echo": (None, False), "best_of": (None, 1, 1.0),
    "min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "repeat_penalty": (None, 1, 1.0),
    "typical_p": (None, 1, 1.0), "top_a": (None, 0, 0.0), "tfs_z": (None, 1, 1.0), "mirostat": (None, 0),
    "mirostat_mode": (None, 0), "dry_multiplier": (None, 0, 0.0), "xtc_probability": (None, 0, 0.0),
    "length_penalty": (None, 1, 1.0), "use_beam_search": (None, False), "ignore_eos": (None, False),
    "min_tokens": (None, 0), "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "max_new_tokens": (None,), "n_predict": (None,), "truncate": (None,),
    "grammar": (None, ""), "json_schema": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "logits_processors": (None,), "structured_outputs": (None,),
    "ban_eos_token": (None, False), "do_sample": (None, True), "num_beams": (None, 1), "no_repeat_ngram_size": (None, 0),
    "bad_words": (None, []), "allowed_token_ids": (None,), "continue_final_message": (None, False),
    "add_generation_prompt": (None, True), "n_probs": (None, 0),
    "dynatemp_range": (None, 0, 0.0), "tfs": (None, 1, 1.0), "typical": (None, 1, 1.0),
    "epsilon_cutoff": (None, 0, 0.0), "eta_cutoff": (None, 0, 0.0), "grammar_string": (None, ""),
    "rep_pen": (None, 1, 1.0), "smoothing_factor": (None, 0, 0.0), "smoothing_curve": (None, 1, 1.0),
    "dynamic_temperature": (None, False), "top_n_sigma": (None, -1, -1.0, 0, 0.0), "penalty_alpha": (None, 0, 0.0),
    "guidance_scale": (None, 1, 1.0), "max_length": (None,), "num_predict": (None,), "max_output_tokens": (None,),
}  # fmt: skip (fields that act only with one of these, as mirostat_tau or negative_prompt do, are ignored with it off)
LENGTH_NAMES = ("max_new_tokens", "n_predict", "max_length", "num_predict", "max_output_tokens")  # other servers' max_tokens
TREE_RANGES = {  # kestrel.<name>: (TreeParams field, lowest, highest); total_tokens 0 = sized by the planner (1 is refused by name below)
    ("tree_top_k" if field == "top_k" else field): (field, *limits) for field, limits in TREE_LIMITS.items()
}
KESTREL_FIELDS = {"mode", "top_k", "min_path_prob", *TREE_RANGES}


class RequestError(ValueError):
    """A bad request body; `param` names the field (dotted path) at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


# the sampling settings a request may send, with the ranges it may send them in (top_k also -1, for off),
# and that a model's generation_config.json may recommend for the requests that leave them out
SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, TOP_K_LIMIT)}
SAMPLING_FIELDS = tuple(SAMPLING_RANGES)


@dataclass(frozen=True)
class Generation:
    """What one request asks the engine for, before its prompt is tokenized."""

    model: str  # the model id the client named
    messages: list[dict] | None  # chat: [{"role", "content": str}]
    prompt: str | list[int] | None  # completions: raw text or token ids
    sampling: SamplingParams  # max_new_tokens is set once the prompt's length is known
    max_tokens: int | None  # requested limit; None = up to the context window
    tree: TreeParams
    mode: str | None  # None = the best mode the model offers
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    max_tokens_sent: bool = True  # False where max_tokens is the endpoint's default (completions' 16), not the client's
    sampling_sent: frozenset[str] = frozenset(SAMPLING_FIELDS)  # of SAMPLING_FIELDS, those the client sent (model_defaults)
    tree_sent: frozenset[str] = frozenset()  # the kestrel.<name> tree settings the client sent
    template_options: dict | None = None  # chat_template_kwargs: variables for the model's chat template


def parse_chat(body: dict) -> Generation:
    messages = _messages(body.get("messages"))
    return replace(_generation(body, messages=messages, prompt=None), template_options=_template_options(body.get("chat_template_kwargs")))


# what the chat template is given by Kestrel itself: not a request's to set through chat_template_kwargs
TEMPLATE_OWN = (
    "messages", "conversation", "add_generation_prompt", "tools", "documents", "chat_template", "tokenize", "continue_final_message",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
)  # fmt: skip (apply_chat_template's own arguments too)


def _template_options(value) -> dict | None:
    """chat_template_kwargs (vLLM's and SGLang's name): variables for the
    model's chat template, as Qwen3's {"enable_thinking": false}. A template
    reads only those it knows; Kestrel's own variables are refused by name."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"chat_template_kwargs must be an object of the chat template's variables, got {json_kind(value)}", "chat_template_kwargs")
    for name in value:
        if name in TEMPLATE_OWN or not name.isidentifier():
            why = "is set by Kestrel" if name in TEMPLATE_OWN else "is not a template variable's name"
            raise RequestError(f"chat_template_kwargs.{name} {why}", f"chat_template_kwargs.{name}")
    return value or None


COMPLETION_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


def parse_completion(body: dict) -> Generation:
    return _generation(body, messages=None, prompt=_prompt(body.get("prompt")), default_max_tokens=COMPLETION_MAX_TOKENS)


def _generation(body: dict, messages, prompt, default_max_tokens: int | None = None) -> Generation:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required: the id of the loaded model (see GET /v1/models)", "model")
    _refuse_unsupported(body)
    n = _integer(body, "n", 1, 1, 1_000_000)
    if n != 1:
        raise RequestError(f"n must be 1: Kestrel writes one choice per request, got {n}", "n")
    kestrel = {} if body.get("kestrel") is None else body["kestrel"]
    if not isinstance(kestrel, dict):
        raise RequestError("kestrel must be an object of Kestrel's own settings", "kestrel")
    unknown = sorted(set(kestrel) - KESTREL_FIELDS)
    if unknown:
        raise RequestError(
            f"kestrel.{unknown[0]} is not a Kestrel setting; known: {', '.join(sorted(KESTREL_FIELDS))}", f"kestrel.{unknown[0]}"
        )
    max_tokens = _max_tokens(body, default_max_tokens)
    in_kestrel = kestrel.get("top_k") is not None  # null is left out, as for every kestrel setting: the top level's then holds
    top_k_source = kestrel if in_kestrel else body
    top_k_name = "kestrel.top_k" if in_kestrel else "top_k"
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, *SAMPLING_RANGES["temperature"]),
        top_p=_number(body, "top_p", 1.0, *SAMPLING_RANGES["top_p"]),  # as OpenAI's: 0 keeps the most likely token alone
        top_k=max(0, _integer(top_k_source, "top_k", 0, -1, SAMPLING_RANGES["top_k"][1], top_k_name)),  # -1: off, as vLLM takes it
        max_new_tokens=max_tokens or 1,
        seed=_seed(body),
    )
    mode = kestrel.get("mode")
    if mode is not None and mode not in MODES:
        raise RequestError(f"kestrel.mode must be one of {', '.join(MODES)}, got {mode!r}", "kestrel.mode")
    return Generation(
        model=model, messages=messages, prompt=prompt, sampling=sampling, max_tokens=max_tokens,
        tree=_tree(kestrel), mode=mode, stop=_stops(body.get("stop")), stream=_boolean(body, "stream", False),
        include_usage=_include_usage(body),
        max_tokens_sent=default_max_tokens is None or any(body.get(name) is not None for name in ("max_tokens", "max_completion_tokens")),
        sampling_sent=frozenset(name for name in SAMPLING_FIELDS if body.get(name) is not None or (name == "top_k" and kestrel.get(name) is not None)),
        tree_sent=frozenset(name for name in (*TREE_RANGES, "min_path_prob") if kestrel.get(name) is not None),
    )  # fmt: skip


def _refuse_unsupported(body: dict) -> None:
    asked = tuple(body[name] for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None)
    for name, harmless in REFUSED.items():
        if name in LENGTH_NAMES:  # the same length sent again under another server's name is harmless
            harmless = (*harmless, *asked)
        if name in body and not any(_same(body[name], value) for value in harmless):
            hint = " (max_tokens sets the reply's length)" if name in LENGTH_NAMES else ""
            raise RequestError(f"{name} is not supported by Kestrel; leave it out{hint}", name, "unsupported_parameter")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError("response_format is not supported by Kestrel (only {\"type\": \"text\"})", "response_format", "unsupported_parameter")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise RequestError("modalities: Kestrel writes text only", "modalities", "unsupported_parameter")


def _same(value, harmless) -> bool:
    return type(value) is type(harmless) and value == harmless  # False is not 0 here


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    if len(value) > MAX_MESSAGES:
        raise RequestError(f"messages: at most {MAX_MESSAGES} messages, got {len(value)}", "messages")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise RequestError(f"{where}.role must be one of system, developer, user, assistant; got {role!r}", f"{where}.role")
        if message.get("tool_calls") or message.get("function_call"):
            raise RequestError(f"{where}: tool calls are not supported by Kestrel", f"{where}.tool_calls")
        messages.append({"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content")})
    return messages


def _content(value, where: str) -> str:
    """A string, or the list-of-parts form with text parts only."""
    if isinstance(value, str):
        return _unicode(value, where)
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a string or a list of text parts", where)
    texts = []
    for index, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}[{index}]: only text parts are supported, got {kind!r}", f"{where}[{index}]")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{index}].text must be a string", f"{where}[{index}].text")
        texts.append(_unicode(part["text"], f"{where}[{index}].text"))
    return "\n".join(texts)


def _unicode(text: str, where: str) -> str:
    """`text`, if it is valid Unicode: JSON's \\u escapes can carry half of a
    surrogate pair (a character cut in two), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"{where} is not valid Unicode: a lone surrogate {text[error.start]!r} at character {error.start}"
            " (half of a character that was cut in two)", where,
        ) from error  # fmt: skip
    return text


def _prompt(value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # one prompt in a list, as text or token ids
    if isinstance(value, str):
        if not value:
            raise RequestError("prompt is empty", "prompt")
        return _unicode(value, "prompt")
    if isinstance(value, list) and value and all(type(token) is int and token >= 0 for token in value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(one, str | list) for one in value):
        raise RequestError(
            f"prompt: Kestrel writes one completion per request; send each of these {len(value)} prompts in a request of its own",
            "prompt",
        )
    raise RequestError("prompt must be a non-empty string or list of token ids, or a list of one of these", "prompt")


def _seed(body: dict) -> int | None:
    """OpenAI's seed is any 64-bit integer; -1, which SillyTavern and text-generation-webui
    send by default, means a fresh seed as no seed does."""
    seed = _integer(body, "seed", None, *SEEDS)
    return None if seed == -1 else seed


MOST_TOKENS = (1 << 63) - 1  # any count a client may mean as "no limit" (2^31 - 1 is common); cut to the room left


def _max_tokens(body: dict, default: int | None) -> int | None:
    """The reply's limit, `default` when none is sent; -1, which some front-ends
    send for "no limit", is none (up to the context window)."""
    new, old = (_integer(body, name, None, -1, MOST_TOKENS) for name in ("max_completion_tokens", "max_tokens"))
    for name, value in (("max_completion_tokens", new), ("max_tokens", old)):
        if value == 0:
            raise RequestError(f"{name} must be -1 (no limit) or an integer from 1 to {MOST_TOKENS}, got 0", name)
    if new is not None and old is not None and new != old:
        raise RequestError(
            f"max_tokens ({old}) and max_completion_tokens ({new}) disagree; send one of them", "max_completion_tokens"
        )
    limit = new if new is not None else old
    return default if limit is None else None if limit == -1 else limit


def _tree(kestrel: dict) -> TreeParams:
    defaults = TreeParams()
    values = {}
    for name, (field, low, high) in TREE_RANGES.items():
        values[field] = _integer(kestrel, name, getattr(defaults, field), low, high, f"kestrel.{name}")
    values["min_path_prob"] = _number(kestrel, "min_path_prob", defaults.min_path_prob, 0.0, 0.999, param="kestrel.min_path_prob")
    if values["total_tokens"] == 1:
        raise RequestError(f"kestrel.total_tokens must be 0 (sized by the planner) or between 2 and {TREE_LIMITS['total_tokens'][1]}", "kestrel.total_tokens")
    return TreeParams(**values)


def _stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) and stop for stop in stops):
        raise RequestError("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise RequestError(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(_unicode(stop, "stop") for stop in stops)


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object such as {\"include_usage\": true}", "stream_options")
    return _boolean(options, "include_usage", False, "stream_options.include_usage")


def _boolean(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{param or name} must be true or false, got {value!r}", param or name)
    return value


def _number(body: dict, name: str, default, low: float, high: float, param: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    param = param or name
    interval = f"from {low:g} to {high:g}"
    if isinstance(value, bool) or not isinstance(value, int | float) or (isinstance(value, float) and not math.isfinite(value)):
        raise RequestError(f"{param} must be a number {interval}, got {value!r}", param)
    if not low <= value <= high:  # compared exactly: an integer past float's range has no float to convert to
        # as sent: a float's repr keeps the digits that set it apart from the bound (2.0000001, which :g showed as 2)
        shown = repr(value) if isinstance(value, float) or abs(value) < 10**16 else f"an integer of {len(str(abs(value)))} digits"
        raise RequestError(f"{param} must be a number {interval}, got {shown}", param)
    return float(value)


def _integer(body: dict, name: str, default, low: int, high: int, param: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    param = param or name
    sent = value  # named as sent: 1e30 converted is 1000000000000000019884624838656, which no client wrote
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not low <= value <= high:
        raise RequestError(f"{param} must be an integer from {low} to {high}, got {sent!r}", param)
    return value


def model_defaults(model) -> dict:
    """The temperature, top_p and top_k that the model's generation_config.json
    recommends for sampling (do_sample true: Qwen3's 0.6, 0.95 and 20), for
    the requests that leave them out, as vLLM and Ollama take a model's own
    defaults; {} where it recommends none (OpenAI's defaults then hold).
    Values outside what a request may send are left out."""
    config = getattr(model, "generation_config", None)
    try:
        written = config.to_diff_dict() if config is not None else {}  # what the file sets, not the class's defaults
    except Exception:  # a generation config transformers cannot compare: none recommended
        return {}
    if written.get("do_sample") is not True:
        return {}
    # a temperature not written is transformers' default, 1 (Gemma 3 recommends top_k 64 and top_p 0.95 alone):
    # named, so that what the page and chat say to set samples, where their own default, 0, is greedy
    found = {} if "temperature" in written else {"temperature": 1.0}
    for name, (low, high) in SAMPLING_RANGES.items():
        value = written.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and low <= value <= high:
            found[name] = int(value) if name == "top_k" else float(value)
    return found
