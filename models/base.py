"""Base models: from a Hugging Face repo id, a local folder or a GGUF file,
optionally quantized: to 8 or 4 bits with bitsandbytes (the GPU path), or on
CPUs to int4 or int8 with torch's kernels (models/int4.py, models/int8.py),
which `auto` picks on CPUs: int4 for a Q4_1 GGUF (its own format), else int8
where it is measured faster. On GPUs `auto` picks bitsandbytes' 4bit where
the weights, counted from their files' headers before loading, would take
too much of the GPU's memory."""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import math
import pickle
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from models.errors import (
    CacheWriteError,
    CorruptedFileError,
    KestrelError,
    MissingWeightsError,
    ModelLoadError,
    ModelNotFoundError,
    NetworkError,
    OutOfMemoryError,
    QuantizationUnavailableError,
    UnsupportedArchitectureError,
    json_kind,
)
from models.paths import user_path
from models.repo import parse_repo

QUANTIZATIONS = ("auto", "none", "int4", "int8", "8bit", "4bit")
DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")

log = logging.getLogger("kestrel")

# auto keeps a model's weights unquantized on a GPU where they take at most this share of its memory:
# the rest holds the KV cache, the draft head, the output head's logits over the vocabulary for every tree
# node, and the activations of tree passes. Its whole memory, not what is free as the load starts: the
# Models tab loads a model beside the one it replaces, and the same model would then load otherwise
GPU_WEIGHTS_SHARE = 0.8
SAFETENSORS_HEADER_LIMIT = 100_000_000  # bytes: the longest header the safetensors library reads


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM, in eval mode
    tokenizer: object  # its tokenizer, with a chat template where the model has one
    name: str  # what the user asked for (repo id with its @revision, if any, folder or file)
    quantization: str  # one of QUANTIZATIONS other than auto: what was applied

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype activations are computed in (the embedding's)."""
        return self.model.get_input_embeddings().weight.dtype


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from error
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA GPU is available to torch; use --device cpu")
    if chosen.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use auto, cpu, cuda or cuda:N")
    if chosen.type == "cuda" and chosen.index is not None and chosen.index >= (count := torch.cuda.device_count()):
        gpus = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ValueError(f"device {device!r} asked for, but this computer has {count} CUDA GPU{'s' if count != 1 else ''} ({gpus})")
    return chosen


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 (or fp16 without bf16 support) on GPUs; on CPUs bf16 where the
    CPU computes it natively (AVX512-BF16/AMX: a 16-node tree pass then costs
    little more than a one-token pass, see README), else float32."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cuda":
        with torch.cuda.device(device):
            native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native_bf16 else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # private, so probed defensively
    return bool(probe and probe())


def load_base(
    source: str | None = None,
    quantization: str = "none",
    dtype: str = "auto",
    device: str = "auto",
) -> LoadedModel:
    """Load a base model; `source` None means the bundled default."""
    from models import bundled

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    gguf = None  # where the GGUF file is, for auto to ask whether it is 4-bit
    revision = None  # of a repo id pinned with @REV
    if source is None or source == bundled.DEFAULT_NAME:
        location, gguf_file, name, gguf = str(bundled.converted_folder()), None, bundled.DEFAULT_NAME, bundled.gguf_path
    else:
        path = user_path(source)
        location, gguf_file, name = source, None, source
        if path.is_file():
            if path.suffix.lower() != ".gguf":  # Model.GGUF too
                raise ModelNotFoundError(f"{source}: a model file must be a .gguf file; otherwise give its folder")
            location, gguf_file, gguf = str(path.parent), path.name, lambda: path
        elif path.is_dir():
            check_folder(path)
            location = str(path)
        else:
            location, revision = pinned_repo(source)
    q4_1 = quantization == "auto" and gguf is not None and _q4_1(gguf)
    # bitsandbytes quantizes a Hugging Face folder or repo, not a GGUF file
    weighed = quantization == "auto" and torch_device.type == "cuda" and gguf_file is None
    room = gpu_room(torch_device, location, revision) if weighed else None
    chosen = resolve_quantization(quantization, torch_device, torch_dtype, q4_1, room)
    if torch_device.type == "cpu" and torch_dtype == torch.float16:  # only asked for by name: auto never picks it on CPUs
        log.warning("float16 on a CPU runs the base model without Kestrel's int4 and int8 kernels (and uncompiled, unless "
                    "--compile on), several times slower than bfloat16 or float32 here (--dtype auto picks the faster of those); "
                    "measuring the step costs for planned trees takes minutes")  # fmt: skip
    if gguf_file is not None and chosen in ("4bit", "8bit"):  # transformers refuses the two together
        raise ValueError(
            f"{source}: bitsandbytes' {chosen} quantizes a model given as a Hugging Face folder or repo id, not a GGUF file; "
            "for a GGUF choose quantization auto, int4, int8 or none"
        )
    try:
        return _load(location, gguf_file, name, chosen, torch_dtype, torch_device, quantization == "auto", revision=revision)
    except (CorruptedFileError, MissingWeightsError, ModelLoadError) as error:
        if name != bundled.DEFAULT_NAME or gguf_file is not None:
            raise
        # Kestrel's own converted copy (a power cut after the conversion, a disk error; or files that parse
        # but that the libraries installed since refuse): made again from the GGUF
        why = "cannot be read" if not isinstance(error, ModelLoadError) else "did not load"
        log.warning(f"The converted copy of the bundled model in {location} {why} ({error}); converting it again")
        shutil.rmtree(location, ignore_errors=True)
        return _load(str(bundled.converted_folder()), None, name, chosen, torch_dtype, torch_device, quantization == "auto")


def pinned_repo(source: str) -> tuple[str, str | None]:
    """(repo id, revision) of a base model given as owner/name or owner/name@REV
    that is no local file or folder."""
    repo = parse_repo(source)
    if repo is None:
        raise ModelNotFoundError(f"{source}: no such file or folder, and not a Hugging Face repo id (owner/name, or owner/name@REV)")
    if repo.revision is not None and Path(repo.id).is_dir():  # transformers reads a folder of that name before asking the hub
        raise ModelNotFoundError(
            f"{source}: {Path(repo.id).absolute()} is a folder, which would load in place of the repo's revision "
            f"{repo.revision}; give that folder itself, or run Kestrel from another folder"
        )
    return repo.id, repo.revision


def _q4_1(locate) -> bool:
    """Whether the GGUF file that locate() finds holds Q4_1 weights; False when it cannot be found or read."""
    from models import int4

    try:
        return int4.gguf_is_q4_1(locate())
    except Exception:  # e.g. the bundled package is gone but its converted folder is cached
        return False


@dataclass(frozen=True)
class GpuRoom:
    """What auto weighs before a Hugging Face folder or repo loads on a GPU."""

    parameters: int | None  # the base model's, counted from its weights files' headers; None where they cannot be read
    memory: int  # the GPU's bytes in all


def resolve_quantization(
    quantization: str, device: torch.device, dtype: torch.dtype, q4_1_source: bool = False, room: GpuRoom | None = None
) -> str:
    """auto on CPUs computing in float32 or bf16: int4 for a Q4_1 GGUF where
    Kestrel's int4 kernel is built (it reads the GGUF's blocks exactly: the
    fastest kernel here), else int8 where the int8 kernel beats products in
    `dtype` (a probe of a few milliseconds), else none. auto on GPUs: 4bit
    where `room` says the weights in `dtype` would take more than
    GPU_WEIGHTS_SHARE of its memory and bitsandbytes imports, else none
    (and none without `room`: a GGUF file). torch's
    own int4 kernel (where Kestrel's cannot be built) is only asked for by
    name: it holds each group's scale and minimum in bf16, which moves the
    weights further from the GGUF's than bf16 rounding does (about 0.5% per
    weight), enough to change a greedy reply. int4 and int8 are refused where
    they cannot run."""
    from models import int4, int8

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantization == "auto":
        if device.type == "cuda":
            return gpu_choice(dtype, room)
        if dtype not in (torch.float32, torch.bfloat16):
            return "none"
        if q4_1_source and device.type == "cpu" and int4.own_kernel():
            return "int4"
        return "int8" if int8.kernel_available(device) and int8.pays(dtype) else "none"
    if quantization in ("int4", "int8"):
        available = (int4 if quantization == "int4" else int8).kernel_available(device)
        if not available:
            raise QuantizationUnavailableError(
                f"{quantization} runs on CPUs with torch's {quantization} kernel, not on {device.type}; "
                "on GPUs use 8bit or 4bit (bitsandbytes)"
            )
        if dtype not in (torch.float32, torch.bfloat16):
            raise QuantizationUnavailableError(
                f"{quantization} computes in float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
            )
    return quantization


def gpu_choice(dtype: torch.dtype, room: GpuRoom | None) -> str:
    """auto's choice on a GPU, said on one line."""
    if room is None:
        return "none"
    choice, why = gpu_fit(dtype, room)
    log.info(f"auto: {choice}{' (bitsandbytes)' if choice == '4bit' else ''}: {why}")
    return choice


def gpu_fit(dtype: torch.dtype, room: GpuRoom) -> tuple[str, str]:
    """(none or 4bit, why) for weights of room.parameters in `dtype` on a GPU of room.memory bytes."""
    if room.parameters is None:
        return "none", "the weights' size could not be read from their files before loading, so they load as they are"
    size = room.parameters * dtype.itemsize
    weights = f"the {8 * dtype.itemsize}-bit weights, {size / 1e9:.1f} GB,"
    if size <= GPU_WEIGHTS_SHARE * room.memory:
        return "none", f"{weights} fit the GPU's {room.memory / 1e9:.1f} GB with room to spare"
    too_big = f"{weights} leave too little of the GPU's {room.memory / 1e9:.1f} GB"
    if dtype == torch.float64:
        return "none", f"{too_big}, and bitsandbytes' 4bit cannot compute in float64; loading may run out of memory"
    if not bitsandbytes_importable():
        return "none", f"{too_big}, and bitsandbytes, which would load them in 4 bits, does not import; loading may run out of memory"
    return "4bit", too_big


def bitsandbytes_importable() -> bool:
    import importlib

    quiet_libraries()  # before the import, which logs one of them
    try:
        importlib.import_module("bitsandbytes")
    except ImportError:
        return False
    return True


def gpu_room(device: torch.device, location: str, revision: str | None) -> GpuRoom:
    """The base model's parameters (a local folder's, or a repo id's, from the
    HF cache or the hub's headers) and the memory of `device`."""
    folder = Path(location)
    parameters = folder_parameters(folder) if folder.is_dir() else hub_parameters(location, revision)
    _, memory = torch.cuda.mem_get_info(device)
    return GpuRoom(parameters, memory)


def safetensors_parameters(file: Path) -> int:
    """The elements of every tensor in a safetensors file, from its header
    alone: 8 bytes (little-endian) giving the header's length, then a JSON
    object of name -> {dtype, shape, data_offsets}, and __metadata__."""
    with open(file, "rb") as stream:
        start = stream.read(8)
        length = int.from_bytes(start, "little")
        if len(start) < 8 or not 0 < length <= SAFETENSORS_HEADER_LIMIT:
            raise ValueError(f"{file}: not a safetensors header")
        header = json.loads(stream.read(length))
    return sum(math.prod(tensor["shape"]) for name, tensor in header.items() if name != "__metadata__")


def folder_parameters(folder: Path) -> int | None:
    """A model folder's parameters, from the weights transformers would load:
    model.safetensors, else the shards model.safetensors.index.json names
    (their headers only), else pytorch_model*.bin, whose sizes over the bytes
    per element config.json's torch_dtype gives count them approximately (a
    pickle's framing, and a tensor saved in another dtype, are not told apart);
    None where there are none or they cannot be read."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    try:
        if single.is_file():
            return safetensors_parameters(single)
        if index.is_file():
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            return sum(safetensors_parameters(folder / shard) for shard in shards)
        sizes = [file.stat().st_size for file in folder.glob("pytorch_model*.bin")]
        return bin_parameters(sizes, folder / "config.json") if sizes else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a file cut short or not in its format: the load says which
        return None


def bin_parameters(sizes: list[int], config: Path) -> int:
    """About how many parameters pytorch_model*.bin files of `sizes` bytes hold,
    at the bytes per element of the torch_dtype `config` names (2 where it names none)."""
    settings = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    saved = (settings.get("torch_dtype") or settings.get("dtype")) if isinstance(settings, dict) else None
    element = DTYPES[saved].itemsize if saved in DTYPES else 2
    return sum(sizes) // element


def hub_parameters(repo: str, revision: str | None) -> int | None:
    """A repo's parameters: counted in the HF cache where its files are there,
    else asked of the hub; None without a network, or where the hub does not
    say (the load's own requests then say why)."""
    import httpx2
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import SafetensorsParsingError

    from models import hub

    try:
        cached = try_to_load_from_cache(repo, "config.json", revision=revision)
        counted = folder_parameters(Path(cached).parent) if isinstance(cached, str) else None
        if counted is not None or not hub.reachable():
            return counted
        hub.bound_requests()
        return published_parameters(repo, revision)
    except (OSError, ValueError, httpx2.HTTPError, SafetensorsParsingError):
        return None


def published_parameters(repo: str, revision: str | None) -> int | None:
    """A hub repo's parameters, from its safetensors headers (kilobytes, not
    the weights), else from its pytorch_model*.bin sizes; None where it has neither."""
    from huggingface_hub import get_safetensors_metadata, hf_hub_download, model_info
    from huggingface_hub.errors import NotASafetensorsRepoError

    try:
        return sum(get_safetensors_metadata(repo, revision=revision).parameter_count.values())
    except NotASafetensorsRepoError:
        pass
    files = model_info(repo, revision=revision, files_metadata=True).siblings or []
    sizes = [file.size for file in files if fnmatch.fnmatch(file.rfilename, "pytorch_model*.bin") and file.size]
    return bin_parameters(sizes, Path(hf_hub_download(repo, "config.json", revision=revision))) if sizes else None


def check_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        ggufs = sorted(file for file in path.iterdir() if file.suffix.lower() == ".gguf")
        if ggufs:
            raise MissingWeightsError(f"{path}: no config.json in this folder; for a GGUF give the file itself, e.g. {ggufs[0]}")
        raise MissingWeightsError(f"{path}: no config.json in this folder; is it a Hugging Face model folder?")
    settings = parsed_json(path / "config.json")
    if not isinstance(settings, dict):
        raise CorruptedFileError(f"{path / 'config.json'}: must be a JSON object of settings, got {json_kind(settings)}")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise MissingWeightsError(f"{path}: no weights (*.safetensors or *.bin) in this folder")
    from models.head import holds_a_head

    if holds_a_head(path):  # its config.json can read as a whole model's (published EAGLE heads name LlamaForCausalLM)
        raise ModelNotFoundError(
            f"{path}: is an EAGLE draft head, not a base model; give it as the draft head, and the model it was made for as the base model"
        )


def parsed_json(file: Path):
    """A JSON file's value; CorruptedFileError naming the file where it is not JSON (cut short, say)."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptedFileError(f"{file}: not valid JSON ({error}); copy or download it again") from error


# the JSON files transformers reads from a model folder besides config.json (a generation_config.json
# it cannot read is passed over with a warning, and the model loads)
JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")


def check_readable(folder: Path) -> None:
    """Read a model folder's JSON files and its safetensors weights' headers
    once transformers failed to load it, whose errors about one cut short (a
    download or a copy stopped) do not say which file it is."""
    from safetensors import SafetensorError, safe_open

    for name in JSON_FILES:
        if (folder / name).is_file():
            parsed_json(folder / name)
    weights = [folder / "model.safetensors"]  # transformers' choice: the single file, else the shards an index names
    index = folder / "model.safetensors.index.json"
    if not weights[0].is_file() and index.is_file():
        settings = parsed_json(index)
        weight_map = settings.get("weight_map") if isinstance(settings, dict) else None
        shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        weights = [folder / str(shard) for shard in shards]
        for shard in weights:
            if not shard.is_file():
                raise MissingWeightsError(
                    f"{index}: names the shard {shard.relative_to(folder)}, which is not in {folder}; the download may be incomplete"
                )
    for file in weights:
        if file.is_file():
            try:
                with safe_open(str(file), framework="pt"):  # the header alone, which says where each tensor ends
                    pass
            except (SafetensorError, OSError) as error:
                raise CorruptedFileError(f"{file}: cannot read the weights ({type(error).__name__}: {error}); copy or download it again") from error


# Libraries' log lines that say nothing a user can act on: bitsandbytes' 8-bit product's cast,
# on every product of every step (thousands of lines around one reply on a CPU), and a hub
# kernel package that is not installed (Kestrel runs offline; bitsandbytes falls back by itself)
LOG_NOISE = {  # logger -> the texts that together mark the line
    "bitsandbytes.autograd._functions": ("MatMul8bitLt: inputs will be cast",),
    "bitsandbytes.backends.cpu.ops": ("from kernels-community", "No module named 'kernels'"),
}


class _Dropped(logging.Filter):
    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(text in message for text in self.texts)


def quiet_libraries() -> None:
    for name, texts in LOG_NOISE.items():
        logger = logging.getLogger(name)  # a filter acts on the logger that makes the record
        if not any(isinstance(kept, _Dropped) for kept in logger.filters):
            logger.addFilter(_Dropped(texts))


def quantization_config(quantization: str, dtype: torch.dtype):
    """transformers' bitsandbytes config for 8bit/4bit; None otherwise."""
    if quantization in ("none", "int4", "int8"):
        return None
    quiet_libraries()  # before the import, which logs one of them
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as error:
        raise QuantizationUnavailableError(
            f"{quantization} needs bitsandbytes, which failed to import ({error}); "
            "reinstall it or choose quantization none"
        ) from error
    if dtype == torch.float64:
        raise QuantizationUnavailableError(f"{quantization} cannot compute in float64; use float32 or bfloat16")
    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )


def _load(location, gguf_file, name, quantization, dtype, device, automatic: bool = False, revision: str | None = None) -> LoadedModel:
    """automatic: the quantization was chosen by auto, so int4 may fall back
    to int8 (or none) for a model whose layer sizes the int4 kernel cannot take,
    and a checkpoint saved quantized with bitsandbytes keeps its own.
    revision: the branch, tag or commit of the repo `location` that every file
    (config, tokenizer, weights, generation config) is read from; None = its default branch."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from models.hub import bound_requests, reachable

    # sdpa honours the boolean 4D tree masks of speculative decoding; a repo's own
    # Python code is never run (transformers would otherwise ask on the terminal)
    options = {"dtype": dtype, "attn_implementation": "sdpa", "trust_remote_code": False}
    gguf = {"gguf_file": gguf_file} if gguf_file else {}
    options.update(gguf)
    pinned = {"revision": revision} if revision is not None else {}  # transformers passes it on to the generation config
    options.update(pinned)
    bound_requests()  # a hub that stops answering mid-load: an error in time, not a wait for good
    # a repo id without a network: the cache at once, not after the hub's retries
    cache_only = not Path(location).is_dir() and not reachable()
    options["local_files_only"] = cache_only
    try:
        config = AutoConfig.from_pretrained(location, local_files_only=cache_only, trust_remote_code=False, **gguf, **pinned)
        check_generates(config, name)
        quantization, saved = saved_quantization(config, name, quantization, automatic)
        quantize = quantization_config(quantization, dtype)  # bitsandbytes' import and dtype checks for a saved one too
        if quantize is not None:
            if not saved:  # a saved checkpoint's own settings come with it
                options["quantization_config"] = quantize
            options["device_map"] = {"": device}
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=cache_only, trust_remote_code=False, **gguf, **pinned)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(location, output_loading_info=True, **options)
        except ValueError as error:
            if "scaled_dot_product_attention" not in str(error):
                raise
            # an architecture transformers runs with its eager attention only (Gemma 2, Bloom, GPT-J): the
            # model's own replies (vanilla), while tree passes, which need sdpa's masks, are not offered
            log.info(f"{name}: transformers runs this architecture with eager attention only; vanilla decoding")
            options["attn_implementation"] = "eager"
            model, info = AutoModelForCausalLM.from_pretrained(location, output_loading_info=True, **options)
    except KestrelError:  # the checks above, already specific
        raise
    except Exception as error:  # translated into one specific, readable error
        if gguf_file is None and Path(location).is_dir():
            check_readable(Path(location))  # a file cut short named, where transformers' error names none
        elif not cache_only and "Should have a `model_type` key" in str(error):  # transformers' word for no config.json
            check_not_gguf_only(location, revision, name)
        raise _explain(error, name, quantization) from error
    check_complete(info, name)
    from core.prompt import chat_template, template_syntax_error

    broken = template_syntax_error(tokenizer)
    if broken is not None:  # as a missing template: said once, here, and chats written as a plain transcript
        source = Path(location) / "chat_template.jinja"
        source = (f"the GGUF file ({gguf_file}) holds it" if gguf_file is not None else
                  f"it is {source}" if source.is_file() else "it is in chat_template.jinja or tokenizer_config.json")  # fmt: skip
        log.warning(f"{name}: its chat template does not read ({broken.rstrip('.')}; {source}), so chats are written "
                    "without it, which the model may answer poorly")  # fmt: skip
        tokenizer.chat_template = None
    elif chat_template(tokenizer) is None:  # a base model: said once, here, rather than guessed at from its replies
        log.warning(f"{name}: its tokenizer has no chat template, so chats are written as a plain 'User: ... Assistant:' "
                    "transcript, which a base model may continue past its answer (writing the user's next turn too)")  # fmt: skip
    if quantize is None:
        try:
            model.to(device)
        except Exception as error:
            raise _explain(error, name, quantization) from error
    model.eval()
    model.requires_grad_(False)
    if quantization in ("int4", "int8"):
        from models import int4, int8

        if int8.decoder_layers(model) is None and not automatic:
            raise QuantizationUnavailableError(
                f"{name}: {quantization} replaces the linears of decoder layers kept as model.layers, and "
                f"{type(model).__name__} keeps its layers otherwise; use none"
            )
        if quantization == "int4" and not int4.fits(model):
            if not automatic:
                raise QuantizationUnavailableError(
                    f"{name}: int4 needs layer input sizes that are multiples of {int4.GROUP} and output sizes "
                    "that are multiples of 16; use int8 or none"
                )
            quantization = resolve_quantization("auto", device, dtype)  # int8 where it pays, else none
        if quantization == "int8" and not int8.fits(model):
            if not automatic:
                raise QuantizationUnavailableError(
                    f"{name}: int8 needs layer input sizes that are multiples of {int8.STEP}; use none"
                )
            quantization = "none"
        if quantization != "none":
            (int4 if quantization == "int4" else int8).quantize_decoder(model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, quantization=quantization)


def check_not_gguf_only(repo: str, revision: str | None, name: str) -> None:
    """Refuse a hub repo that holds GGUF files without a config.json (which
    transformers reads as a config that names no model type), naming its GGUF
    files: a GGUF loads as a file, one of the several sizes such a repo holds."""
    import httpx2
    from huggingface_hub import HfApi

    try:
        files = HfApi().list_repo_files(repo, revision=revision)  # one request, bounded as all are (models/hub.py)
    except (OSError, httpx2.HTTPError):  # the load's own error is said instead
        return
    ggufs = sorted(file for file in files if file.lower().endswith(".gguf"))
    if "config.json" in files or not ggufs:
        return
    shown = ", ".join(ggufs[:4]) + (f" and {len(ggufs) - 4} more" if len(ggufs) > 4 else "")
    raise MissingWeightsError(
        f"{name}: the repo holds GGUF files only ({shown}), no config.json; download the .gguf file you want "
        f"(hf download {repo} {ggufs[0]} --local-dir FOLDER) and give its path (--model path/to/file.gguf)"
    )


# methods whose saved weights need kernels (and packages) Kestrel does not install
KERNEL_QUANTIZATIONS = ("gptq", "awq", "aqlm", "exl2", "eetq", "hqq", "quanto", "compressed-tensors", "vptq", "higgs", "spqr", "bitnet")


def saved_quantization(config, name: str, quantization: str, automatic: bool) -> tuple[str, bool]:
    """(the quantization to load with, whether the checkpoint was saved with
    it) for a checkpoint whose config.json names how its weights were saved
    quantized. Quantizing bitsandbytes' saved layers again would read their
    stored codes as weights and write noise, so a bitsandbytes checkpoint
    loads as it was saved (auto) or is refused naming the choice that fits;
    methods that need kernels Kestrel does not install are refused. Others
    (fp8) load as transformers reads them, also where auto picked 4bit for a GPU."""
    saved = getattr(config, "quantization_config", None)
    if saved is None:
        return quantization, False
    settings = saved if isinstance(saved, dict) else saved.to_dict()
    method = str(settings.get("quant_method", "")).lower()
    if method == "bitsandbytes":
        bits = "4bit" if settings.get("load_in_4bit") else "8bit"
        if automatic or quantization == bits:
            return bits, True
        raise QuantizationUnavailableError(
            f"{name}: its weights are saved quantized with bitsandbytes' {bits}, which cannot be quantized again or undone; "
            f"load it with quantization {bits} or auto"
        )
    if method in KERNEL_QUANTIZATIONS:
        raise QuantizationUnavailableError(
            f"{name}: its weights are saved quantized with {method}, whose kernels Kestrel does not run; choose the "
            "model's unquantized repo (Kestrel quantizes it itself: auto, int4, int8, 4bit or 8bit)"
        )
    if automatic and quantization == "4bit":  # auto's pick for a GPU: such weights load as saved instead
        return "none", False
    return quantization, False  # others transformers reads into the model's dtype (fp8 on CPUs)


# model types AutoModelForCausalLM also maps to an encoder's language-model head (BertLMHeadModel): loaded
# without is_decoder, transformers only logs a warning, and the model attends both ways and writes noise
ENCODERS = (
    "bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie", "data2vec-text",
    "rembert", "roc_bert", "megatron-bert", "xmod", "big_bird", "roformer", "bert-generation",
)  # fmt: skip


def check_generates(config, name: str) -> None:
    """Refuse models that read text rather than write it, before their weights load."""
    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"{name}: {model_type} is an encoder-decoder model; Kestrel runs decoder-only chat models (Llama, Qwen, Mistral, ...)"
        )
    if model_type in ENCODERS and not getattr(config, "is_decoder", False):
        raise UnsupportedArchitectureError(
            f"{name}: {model_type} is an encoder, a model that reads text rather than writes it; "
            "choose a decoder-only chat model (Llama, Qwen, Mistral, ...)"
        )


def check_complete(info: dict, name: str) -> None:
    """Refuse a checkpoint that lacks some of the model's weights: transformers
    fills them with random values, and the model would load and write noise.
    (Tied output embeddings are not reported missing.)"""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise MissingWeightsError(
            f"{name}: the checkpoint lacks {len(missing)} of the model's weights ({shown}); "
            "the download may be incomplete or the files belong to another model"
        )


MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory", "paging file is too small")
WINDOWS_MEMORY_ERRORS = (8, 1455)  # ERROR_NOT_ENOUGH_MEMORY, ERROR_COMMITMENT_LIMIT ("the paging file is too small")


def memory_error(name: str, quantization: str, doing: str) -> OutOfMemoryError:
    """Kestrel's error for memory that ran out while `doing` something with the model `name`, saying what to try."""
    smaller = " or 4-bit weights" if quantization not in ("4bit", "int4") else ""
    return OutOfMemoryError(f"{name}: not enough memory to {doing}; free some (close other programs) or choose a smaller model{smaller}")


def out_of_memory(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from, says memory ran out, in any
    of the ways torch, numpy and the OS say it (MemoryError, torch's
    OutOfMemoryError, ENOMEM, Windows' errors 8 and 1455), rather than that the
    files are damaged."""
    from models.hub import error_chain

    for link in error_chain(error):
        if isinstance(link, (MemoryError, torch.OutOfMemoryError)):
            return True
        if isinstance(link, OSError) and (link.errno == errno.ENOMEM or getattr(link, "winerror", None) in WINDOWS_MEMORY_ERRORS):
            return True
        text = str(link).lower()
        if any(words in text for words in MEMORY_WORDS):
            return True
    return False


def _explain(error: Exception, name: str, quantization: str) -> Exception:
    """Map the many ways loading fails onto Kestrel's errors."""
    from huggingface_hub import errors as hub

    from models.hub import (
        answered_message,
        disk_full_message,
        error_chain,
        gated_message,
        missing_message,
        network_cause,
        no_folder,
        unreachable_message,
    )

    text = str(error)
    if out_of_memory(error):
        return memory_error(name, quantization, "load the model")
    full = disk_full_message(name, error)  # a download into the cache cut short: not files to read again
    if full is not None:
        return CacheWriteError(full)
    chain = error_chain(error)  # transformers wraps the hub's errors in an OSError of its own
    if any(isinstance(link, hub.GatedRepoError) for link in chain):
        return NetworkError(gated_message(name))
    if any(isinstance(link, hub.RepositoryNotFoundError) for link in chain):
        return ModelNotFoundError(missing_message(name))
    if any(isinstance(link, hub.RevisionNotFoundError) for link in chain):  # the hub's 404 for a pinned @REV
        return ModelNotFoundError(f"{name}: the repo on the Hugging Face hub has no such revision (branch, tag or commit hash)")
    answered = answered_message(name, error)  # a login refused (a revoked token), the hub's own error
    if answered is not None:
        return NetworkError(answered)
    cause = network_cause(error)
    if cause is not None:
        return NetworkError(unreachable_message(name, cause))
    if isinstance(error, (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled)) or "connect" in text.lower():
        return NetworkError(f"{name}: not in the local cache and the Hugging Face hub cannot be reached{no_folder(name)}")
    gguf = str(name).lower().endswith(".gguf")
    if gguf and "general.architecture" in text:  # every sound GGUF names its architecture there
        return CorruptedFileError(f"{name}: the GGUF file is incomplete or damaged (its metadata names no architecture); download it again")
    if "ignore_mismatched_sizes" in text:  # transformers' load report, printed above, lists the weights
        return CorruptedFileError(
            f"{name}: the weights do not have the shapes config.json gives them (files of another model, or an edited "
            "config.json); the terminal lists them"
        )
    if "trust_remote_code" in text:  # a model_type transformers does not know, whose repo brings its own code
        return UnsupportedArchitectureError(
            f"{name}: this model needs Python code from its own repo (trust_remote_code), which Kestrel does not run; "
            "choose a model whose architecture transformers supports itself"
        )
    if "Unrecognized configuration class" in text:  # transformers knows it, but not as a text generator (T5, vision models)
        return UnsupportedArchitectureError(f"{name}: transformers does not run this architecture as a text generator ({text.splitlines()[0]})")
    if isinstance(error, (ValueError, KeyError)) and ("model type" in text or "architecture" in text.lower()):
        return UnsupportedArchitectureError(f"{name}: architecture not supported by transformers ({text.splitlines()[0]})")
    if "bitsandbytes" in text or "bnb" in text:
        return QuantizationUnavailableError(f"{name}: {quantization} quantization failed ({text.splitlines()[0]})")
    if isinstance(error, OSError) and "does not appear to have a file named" in text:
        return MissingWeightsError(f"{name}: {text.splitlines()[0]}")
    if "instantiate the backend tokenizer" in text:  # a folder without tokenizer.json / tokenizer.model
        return MissingWeightsError(f"{name}: no tokenizer files (tokenizer.json, or tokenizer.model with tokenizer_config.json)")
    said = f"{type(error).__name__}: {text.splitlines()[0] if text else type(error).__name__}"
    if gguf and (unreadable(error) or isinstance(error, GGUF_READ_ERRORS)):
        return CorruptedFileError(f"{name}: cannot read the GGUF file, which may be incomplete or damaged ({said})")
    if unreadable(error):
        return CorruptedFileError(f"{name}: cannot read the model files ({said})")
    # not the files' fault (a GPU's error, a library's): named as it is, and the bundled model's copy is not made again
    return ModelLoadError(f"{name}: the model failed to load ({said})")


# what numpy and the gguf reader raise on a GGUF file cut short or damaged (an array that cannot take its shape)
GGUF_READ_ERRORS = (ValueError, IndexError, KeyError, struct.error)


def unreadable(error: BaseException) -> bool:
    """Whether `error` says that a file could not be read or parsed (cut short,
    damaged, not in its format): safetensors', json's, pickle's and torch's
    readers' errors, anywhere in its chain, or an OSError of its own."""
    from safetensors import SafetensorError

    from models.hub import error_chain

    parsing = (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile)
    for link in error_chain(error):
        if isinstance(link, parsing) or "PytorchStreamReader" in str(link):  # torch.load's for a zip cut short
            return True
    return isinstance(error, OSError)
