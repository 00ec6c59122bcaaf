"""Errors raised while loading models and draft heads.

Each names what is at fault (a path, a repo id, a key) and, where one exists,
the fix. The UI and the CLI show `str(error)` as is.
"""


class KestrelError(Exception):
    """Base of every error Kestrel reports to the user."""


class ModelNotFoundError(KestrelError):
    """A repo id, folder or file that does not exist."""


class MissingWeightsError(KestrelError):
    """A folder that exists but holds no weights."""


class UnsupportedArchitectureError(KestrelError):
    """A model type that transformers or the engine cannot run."""


class CorruptedFileError(KestrelError):
    """A weights or config file that cannot be parsed."""


class ModelLoadError(KestrelError):
    """A model whose files were read but that failed to load otherwise (a GPU's
    error, a library's): a fresh copy of the files would not mend it."""


class QuantizationUnavailableError(KestrelError):
    """bitsandbytes quantization asked for where it cannot run."""


class OutOfMemoryError(KestrelError):
    """Not enough memory to load or run a model."""


class HeadFormatError(KestrelError):
    """A draft-head checkpoint that does not match the expected format."""


class HeadMismatchError(HeadFormatError):
    """A draft head whose sizes do not fit the base model given (its hidden size, vocabulary or layers)."""


class ChatTemplateError(KestrelError):
    """A conversation the model's own chat template refuses (a system message
    where it takes none, roles that do not alternate)."""


class NetworkError(KestrelError):
    """The Hugging Face hub could not be reached or refused access."""


class CacheWriteError(KestrelError):
    """A download the Hugging Face cache could not take: its disk is full, or its folder is not the user's."""


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words (for messages about a file or request body)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)
