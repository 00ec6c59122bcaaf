import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from models import bundled
from models.base import load_base
from models.errors import (
    CorruptedFileError,
    MissingWeightsError,
    ModelNotFoundError,
    QuantizationUnavailableError,
    UnsupportedArchitectureError,
)


@pytest.mark.parametrize("quantization", ["none", "8bit", "4bit"])
def test_tiny_model_loads_and_runs(tiny_dir, quantization):
    loaded = load_base(str(tiny_dir), quantization=quantization, dtype="float32")
    assert loaded.quantization == quantization
    layer = loaded.model.model.layers[0].mlp.up_proj
    expected = {"none": "Linear", "8bit": "Linear8bitLt", "4bit": "Linear4bit"}[quantization]
    assert type(layer).__name__ == expected
    out = loaded.model(torch.tensor([[1, 9, 10, 11]])).logits
    assert out.shape == (1, 4, loaded.model.config.vocab_size)
    assert torch.isfinite(out).all()


def test_bitsandbytes_on_a_cpu_does_not_log_at_every_product(tiny_dir, caplog):
    """Its 8-bit product logged a cast warning at every call (thousands of lines
    around one reply in a terminal); Kestrel drops that line and no other."""
    import logging

    loaded = load_base(str(tiny_dir), quantization="8bit", dtype="bfloat16")
    with caplog.at_level(logging.WARNING):
        loaded.model(torch.tensor([[1, 9, 10, 11]]))
        logging.getLogger("bitsandbytes.autograd._functions").warning("another warning")
    messages = [record.getMessage() for record in caplog.records]
    assert "another warning" in messages and not any("MatMul8bitLt" in message for message in messages)


def test_bundled_default_loads_and_reuses_its_conversion():
    first = load_base(None)
    folder = bundled.converted_folder()
    assert (folder / "model.safetensors").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime
    started = time.perf_counter()
    second = load_base(None)
    assert time.perf_counter() - started < 15  # the GGUF parse alone takes ~25 s
    assert (folder / "model.safetensors").stat().st_mtime == stamp
    assert second.model.config.hidden_size == first.model.config.hidden_size == 576
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())


def test_unknown_path_is_named(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no_such_model"):
        load_base(str(tmp_path / "no_such_model"))


def test_folder_without_weights(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(MissingWeightsError, match="no weights"):
        load_base(str(tmp_path))


def test_folder_without_tokenizer(tmp_path, tiny_dir):
    import shutil

    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (tiny_dir / name).is_file():
            shutil.copy(tiny_dir / name, tmp_path / name)
    with pytest.raises(MissingWeightsError, match="no tokenizer files"):
        load_base(str(tmp_path))


def test_folder_without_config(tmp_path):
    with pytest.raises(MissingWeightsError, match="config.json"):
        load_base(str(tmp_path))


def test_unsupported_architecture(tmp_path, tiny_dir):
    for file in tiny_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    settings = json.loads((tiny_dir / "config.json").read_text())
    settings["model_type"] = "kestrel-imaginary"
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(UnsupportedArchitectureError, match="kestrel-imaginary"):
        load_base(str(tmp_path))


def test_corrupted_weights(tmp_path, tiny_dir):
    for file in tiny_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CorruptedFileError, match=str(tmp_path)):
        load_base(str(tmp_path))


def test_corrupted_config(tmp_path, tiny_dir):
    for file in tiny_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CorruptedFileError, match="config.json"):
        load_base(str(tmp_path))
    for text, kind in (("[1, 2]", "an array"), ("null", "null")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(CorruptedFileError, match=f"config.json: must be a JSON object of settings, got {kind}"):
            load_base(str(tmp_path))


def test_quantization_in_float64_is_refused(tiny_dir):
    with pytest.raises(QuantizationUnavailableError, match="float64"):
        load_base(str(tiny_dir), quantization="4bit", dtype="float64")


def test_bad_options(tiny_dir):
    with pytest.raises(ValueError, match="quantization"):
        load_base(str(tiny_dir), quantization="3bit")
    with pytest.raises(ValueError, match="dtype"):
        load_base(str(tiny_dir), dtype="float8")


def test_a_gpu_number_past_those_there_are_is_named(monkeypatch):
    """cuda:1 on a one-GPU computer: said before anything loads (CUDA's own error
    escaped as a traceback, or as unreadable model files, whose converted copy was then made again)."""
    from models.base import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"'cuda:1' asked for, but this computer has 1 CUDA GPU \(cuda:0\)"):
        resolve_device("cuda:1")
    assert resolve_device("cuda:0") == torch.device("cuda:0") and resolve_device("cuda") == torch.device("cuda")


def test_non_gguf_file_is_refused(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"0")
    with pytest.raises(ModelNotFoundError, match="gguf"):
        load_base(str(file))


def test_a_gguf_cut_short_is_named_damaged_not_an_unsupported_architecture(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 20)  # a header and no metadata
    with pytest.raises(CorruptedFileError, match="the GGUF file is incomplete or damaged"):
        load_base(str(file), quantization="none", dtype="float32")


def test_a_folder_holding_only_a_gguf_says_to_give_the_file(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(MissingWeightsError, match=f"give the file itself, e.g. {tmp_path / 'm.gguf'}"):
        load_base(str(tmp_path))


def test_weights_of_another_size_than_config_json_are_named(tmp_path):
    from tests.factory import save_tiny_model

    folder = save_tiny_model(tmp_path / "model")
    other = save_tiny_model(tmp_path / "other", hidden_size=96)
    (folder / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(CorruptedFileError, match="the weights do not have the shapes config.json gives them"):
        load_base(str(folder), dtype="float32")


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_bitsandbytes_on_a_gguf_file_is_refused_by_name(tmp_path, quantization):
    file = tmp_path / "model.Q4_1.gguf"
    file.write_bytes(b"0")  # refused before it is read
    with pytest.raises(ValueError, match=f"bitsandbytes' {quantization} .* not a GGUF file; for a GGUF choose quantization auto"):
        load_base(str(file), quantization=quantization, dtype="float32")


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_missing_a_weight_is_refused(tmp_path, tied):
    """transformers fills a missing weight with random values; such a model
    must not load as if it were whole (tied output embeddings are not missing)."""
    from safetensors.torch import load_file, save_file

    from tests.factory import save_tiny_model

    folder = save_tiny_model(tmp_path / "model", tie_word_embeddings=tied)
    assert load_base(str(folder), dtype="float32").model is not None
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError, match=r"lacks 1 of the model's weights \(model\.layers\.1\.mlp\.up_proj\.weight\)"):
        load_base(str(folder), dtype="float32")


def test_two_first_starts_converting_at_once_both_end_with_the_bundled_model(tmp_path, monkeypatch):
    """Each conversion stages in a folder of its own process; one that finds the
    model already converted by another start uses that copy; a staging folder
    left by a killed conversion is removed, and a copy lacking its tokenizer is
    made again rather than used."""
    import os
    import shutil

    import transformers

    class Saved:
        def __init__(self, name):
            self.name = name

        def save_pretrained(self, folder):
            (Path(folder) / self.name).write_text("{}")
            if self.name == "tokenizer.json":  # as transformers saves a tokenizer's chat template
                (Path(folder) / "chat_template.jinja").write_text("{{ messages }}")
            if self.name == "model.safetensors":
                (Path(folder) / "config.json").write_text("{}")
                if finish_first:  # another start renames its copy into place meanwhile
                    other = tmp_path / "models" / "M.partial-1"
                    other.mkdir()
                    for name in bundled.CONVERTED_FILES:
                        (other / name).write_text("other")
                    other.rename(tmp_path / "models" / "M")

    class Loaded:
        config = SimpleNamespace(to_dict=lambda: {"model_type": "llama"})

        def state_dict(self):
            return {}

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Saved("tokenizer.json"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Loaded())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda config: SimpleNamespace(
        load_state_dict=lambda *a, **k: None, save_pretrained=Saved("model.safetensors").save_pretrained))
    monkeypatch.setattr(transformers.AutoConfig, "for_model", lambda **settings: None)
    folder = tmp_path / "models" / "M"
    (tmp_path / "models" / "M.partial").mkdir(parents=True)  # left by a killed conversion
    (folder).mkdir()
    (folder / "model.safetensors").write_text("{}")  # a copy without its tokenizer: not complete
    assert not bundled.complete(folder)
    finish_first = False
    bundled.convert(tmp_path / "x.gguf", folder)
    assert bundled.complete(folder) and (folder / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["M"]

    shutil.rmtree(folder)
    finish_first = True
    bundled.convert(tmp_path / "x.gguf", folder)  # the other start won the race: its copy is used, no error
    assert (folder / "tokenizer.json").read_text() == "other"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["M"]
    assert not (tmp_path / "models" / f"M.partial-{os.getpid()}").exists()


def test_a_stopped_or_failed_conversion_leaves_no_half_copy(tmp_path, monkeypatch):
    """Ctrl+C or a full disk while the bundled model is written removes its
    staging folder (a full disk is one line naming the cache), and a start that
    finds the model converted removes the staging folder of a conversion whose
    process is gone (killed outright)."""
    import subprocess
    import sys

    import transformers

    from models.errors import KestrelError

    def fail_with(error):
        def save_pretrained(folder):
            (Path(folder) / "model.safetensors").write_text("half")
            raise error

        return save_pretrained

    class Loaded:
        config = SimpleNamespace(to_dict=lambda: {"model_type": "llama"})

        def state_dict(self):
            return {}

    saving = {}
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SimpleNamespace(save_pretrained=lambda f: None))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Loaded())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda config: SimpleNamespace(
        load_state_dict=lambda *a, **k: None, save_pretrained=lambda folder: saving["run"](folder)))
    monkeypatch.setattr(transformers.AutoConfig, "for_model", lambda **settings: None)
    folder = tmp_path / "models" / "M"
    saving["run"] = fail_with(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bundled.convert(tmp_path / "x.gguf", folder)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []
    saving["run"] = fail_with(OSError(28, "No space left on device"))
    with pytest.raises(KestrelError, match=f"cannot be written into Kestrel's cache {tmp_path / 'models'} .*No space left.*KESTREL_CACHE_DIR"):
        bundled.convert(tmp_path / "x.gguf", folder)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []
    # a cache without the room, or that cannot be written, is said before the half minute of converting
    read = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: read.append(1))
    monkeypatch.setattr(bundled.shutil, "disk_usage", lambda path: SimpleNamespace(free=100 << 20))
    with pytest.raises(KestrelError, match="cannot be written into Kestrel's cache .*100 MB free.*about 520 MB"):
        bundled.convert(tmp_path / "x.gguf", folder)
    monkeypatch.undo()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: read.append(1))
    monkeypatch.setattr(bundled.os, "access", lambda path, mode: False)  # a read-only cache (root may write anywhere)
    with pytest.raises(KestrelError, match="cannot be written into Kestrel's cache .*it cannot be written"):
        bundled.convert(tmp_path / "x.gguf", folder)
    monkeypatch.undo()
    assert read == []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SimpleNamespace(save_pretrained=lambda f: None))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Loaded())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda config: SimpleNamespace(
        load_state_dict=lambda *a, **k: None, save_pretrained=lambda folder: saving["run"](folder)))
    monkeypatch.setattr(transformers.AutoConfig, "for_model", lambda **settings: None)

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "models" / f"M.partial-{gone}").mkdir()  # a conversion killed outright (kill -9)
    (tmp_path / "models" / f"M.partial-{os.getpid()}").mkdir()  # this process's own: not stale
    folder.mkdir()
    for name in bundled.CONVERTED_FILES:
        (folder / name).write_text("{}")
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bundled, "DEFAULT_NAME", "M")
    assert bundled.converted_folder() == folder
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["M", f"M.partial-{os.getpid()}"]


def test_an_unwritable_cache_folder_leaves_torch_s_compile_cache_where_it_is(tmp_path, monkeypatch):
    """torch makes its compile cache folder when it is imported: one in a cache
    that cannot be written would stop every start, a model of one's own too."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(blocked / "cache"))
    bundled.use_compile_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))
    bundled.use_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")


def test_a_damaged_converted_bundled_model_is_converted_again(tmp_path, monkeypatch):
    """The bundled model's converted copy is Kestrel's own cache: one that cannot
    be read (cut short by a power cut) is removed and made again from the GGUF,
    once; a user's own folder that cannot be read is an error naming it."""
    import models.base as base_module
    from models.errors import CorruptedFileError

    folder = tmp_path / "models" / bundled.DEFAULT_NAME
    conversions, loads = [], []

    def converted_folder():
        if not folder.exists():
            conversions.append(1)
            folder.mkdir(parents=True)
        return folder

    def load(location, *args, **kwargs):
        loads.append(location)
        if len(loads) == 1:
            raise CorruptedFileError(f"{bundled.DEFAULT_NAME}: cannot read the model files (SafetensorError: incomplete metadata)")
        return "loaded"

    folder.mkdir(parents=True)
    monkeypatch.setattr(bundled, "converted_folder", converted_folder)
    monkeypatch.setattr(base_module, "_load", load)
    assert load_base(None, quantization="none") == "loaded"
    assert conversions == [1] and loads == [str(folder), str(folder)]
    loads.clear()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    (mine / "model.safetensors").write_text("x")
    with pytest.raises(CorruptedFileError):  # not Kestrel's to delete: named, left as it is
        load_base(str(mine), quantization="none")
    assert (mine / "model.safetensors").exists() and loads == [str(mine)]



def test_a_bad_head_is_said_before_the_base_model_loads(tmp_path, monkeypatch, tiny_dir):
    """The page and `chat` name a missing or malformed head at once, not after
    the base model has loaded (minutes for a large one)."""
    from app import session
    from models.errors import HeadFormatError, ModelNotFoundError

    def no_model(*args, **kwargs):
        raise AssertionError("the base model must not load")

    monkeypatch.setattr(session, "load_base", no_model)
    (tmp_path / "nothead").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    cases = [
        (tmp_path / "nothead", HeadFormatError, "no config.json; not a draft-head folder"),
        (tmp_path / "broken", HeadFormatError, "not valid JSON"),
        (tmp_path / "missing", ModelNotFoundError, "no such draft-head folder"),
        (tiny_dir, HeadFormatError, "a whole model's weights"),
    ]
    from models.head import save_head
    from tests.factory import random_head, tiny_config
    from transformers import AutoModelForCausalLM

    for name, changes in (("wide", {"hidden_size": 96}), ("words", {"vocab_size": 80})):  # a head made for another base
        save_head(random_head(AutoModelForCausalLM.from_config(tiny_config(**changes))), tmp_path / name)
    save_head(random_head(AutoModelForCausalLM.from_config(tiny_config())), tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy or download cut short
    cases += [
        (tmp_path / "wide", HeadFormatError, "head hidden_size 96 != base model hidden size 64"),
        (tmp_path / "words", HeadFormatError, "head vocab_size 80 != base model vocabulary 64"),
        (tmp_path / "cut", HeadFormatError, "model.safetensors: cannot read the weights"),
    ]
    for head, error, message in cases:
        with pytest.raises(error, match=message):
            session.load_pair(str(tiny_dir), str(head))


def wrapped_memory_error() -> OSError:
    """A MemoryError inside another library's error, as transformers wraps what loading raises."""
    try:
        try:
            raise MemoryError()
        except MemoryError as error:
            raise OSError("Unable to load weights from the checkpoint file") from error
    except OSError as wrapped:
        return wrapped


def test_running_out_of_memory_is_named_and_the_bundled_copy_kept(tmp_path, monkeypatch, tiny_dir):
    """Memory running out while the weights are read (mmap's ENOMEM, numpy's or
    Python's MemoryError, Windows' wording) is not a damaged file: it is named,
    and the bundled model's converted copy is not deleted to be made again
    (which would take more memory, and leave no model where it fails)."""
    import shutil

    import transformers

    from models.errors import OutOfMemoryError

    folder = tmp_path / "models" / bundled.DEFAULT_NAME
    shutil.copytree(tiny_dir, folder)
    monkeypatch.setattr(bundled, "converted_folder", lambda: folder)
    for error in (
        RuntimeError("unable to mmap 538090408 bytes from file <model.safetensors>: Cannot allocate memory (12)"),
        MemoryError(),
        RuntimeError("[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you tried to allocate 3538944 bytes."),
        OSError(22, "The paging file is too small for this operation to complete"),  # Windows' error 1455
        wrapped_memory_error(),
    ):

        def from_pretrained(*args, **kwargs):
            raise error

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
        with pytest.raises(OutOfMemoryError, match="not enough memory to load the model; free some"):
            load_base(None, quantization="none")
        assert (folder / "model.safetensors").is_file()


def test_a_head_given_as_the_base_model_is_named_so(tmp_path):
    """Published heads hold a config.json that reads as a whole model's; their
    keys tell: said as a head, not as a model without tokenizer files."""
    from transformers import AutoModelForCausalLM

    from models import eagle3
    from models.head import save_head
    from tests.factory import random_eagle3_head, random_head, tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config())
    for folder in (save_head(random_head(model), tmp_path / "eagle"), eagle3.save(random_eagle3_head(model), tmp_path / "eagle3")):
        with pytest.raises(ModelNotFoundError, match="is an EAGLE draft head, not a base model; give it as the draft head"):
            load_base(str(folder))
    bin_head = tmp_path / "bin"
    bin_head.mkdir()
    (bin_head / "config.json").write_text((tmp_path / "eagle" / "config.json").read_text())
    torch.save({"fc.weight": torch.zeros(2, 4), "layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, bin_head / "pytorch_model.bin")
    with pytest.raises(ModelNotFoundError, match="is an EAGLE draft head"):
        load_base(str(bin_head))


def test_bad_head_files_and_paths_are_named(tmp_path, monkeypatch, tiny_dir):
    """A training checkpoint given as a head's weights, a non-numeric EAGLE-3
    target_hidden_size, a ~user who is no user here, and a proxy that refuses
    the hub: each a specific error naming it, not a Python traceback."""
    import huggingface_hub
    from transformers import AutoModelForCausalLM

    from models import eagle3, hub
    from models.errors import HeadFormatError, NetworkError
    from models.head import head_files, read_checkpoint, resolve_head_folder, save_head
    from tests.factory import random_eagle3_head, random_head, tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config())
    folder = save_head(random_head(model), tmp_path / "checkpoint")
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save({"state_dict": state, "epoch": 3}, folder / "pytorch_model.bin")
    with pytest.raises(HeadFormatError, match=r"'state_dict' holds dict, not a tensor; a head's weights file maps"):
        read_checkpoint(folder)
    third = eagle3.save(random_eagle3_head(model), tmp_path / "eagle3")
    config = json.loads((third / "config.json").read_text())
    (third / "config.json").write_text(json.dumps({**config, "target_hidden_size": "abc"}))
    with pytest.raises(HeadFormatError, match=r"config.json: target_hidden_size must be a positive whole number, got 'abc'"):
        head_files(third)
    for source in ("~no-such-user-here/model", "~no-such-user-here/head"):
        with pytest.raises(ModelNotFoundError, match="no user 'no-such-user-here' on this computer"):
            load_base(source) if source.endswith("model") else resolve_head_folder(source)

    class ProxyError(Exception):  # as the HTTP client's own error reaches Kestrel through huggingface_hub
        __module__ = "httpx2"

    def refused(*args, **kwargs):
        raise ProxyError("404 Not Found")

    monkeypatch.setattr(hub, "reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused)
    with pytest.raises(NetworkError, match=r"owner/head: the Hugging Face hub cannot be reached \(ProxyError: 404 Not Found\); check the network"):
        resolve_head_folder("owner/head")
    wrapped = OSError("Can't load the configuration of 'owner/model'. make sure you don't have a local directory with the same name")
    wrapped.__cause__ = ProxyError("404 Not Found")
    from models.base import _explain

    assert isinstance(_explain(wrapped, "owner/model", "none"), NetworkError)


def test_what_the_hub_answers_is_not_said_as_a_network_failure(monkeypatch):
    """A repo the hub does not have, a gated one, a repo without a head's
    config.json: the hub answered (its own errors, raised from the HTTP
    client's status error), so each is named as such, not as a network to check."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.utils import hf_raise_for_status

    from models import hub
    from models.base import _explain
    from models.errors import HeadFormatError, NetworkError
    from models.head import resolve_head_folder

    def answered(status: int, code: str, message: str = "x") -> Exception:
        request = httpx2.Request("GET", "https://huggingface.co/api/models/owner/name")
        try:
            hf_raise_for_status(httpx2.Response(status, headers={"X-Error-Code": code, "X-Error-Message": message}, request=request))
        except Exception as error:  # as transformers wraps it
            try:
                raise OSError("owner/name is not a local folder and is not a valid model identifier") from error
            except OSError as wrapped:
                return wrapped
        raise AssertionError("no error raised")

    missing = _explain(answered(404, "RepoNotFound"), "owner/name", "none")
    assert isinstance(missing, ModelNotFoundError) and "no such repo on the Hugging Face hub" in str(missing)
    assert f"nor a folder {Path('owner/name').absolute()} here" in str(missing)  # a mistyped relative path, likelier
    gated = _explain(answered(401, "GatedRepo"), "owner/name", "none")
    assert isinstance(gated, NetworkError) and "this repo is gated" in str(gated)
    for status in (401, 403):  # a revoked or expired token: said as the login it is, not as a network to check
        revoked = _explain(answered(status, "", "Invalid credentials in Authorization header"), "owner/name", "none")
        assert isinstance(revoked, NetworkError) and f"refused the saved login (HTTP {status}); log in again" in str(revoked)
    assert "the Hugging Face hub answered HTTP 500" in str(_explain(answered(500, ""), "owner/name", "none"))

    def refused_login(*args, **kwargs):
        raise answered(401, "", "Invalid credentials in Authorization header").__cause__

    monkeypatch.setattr(hub, "reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused_login)
    with pytest.raises(NetworkError, match=r"owner/name: the Hugging Face hub refused the saved login \(HTTP 401\)"):
        resolve_head_folder("owner/name")

    def no_config(*args, **kwargs):
        raise answered(404, "EntryNotFound").__cause__

    monkeypatch.setattr(hub, "reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_config)
    with pytest.raises(HeadFormatError, match="owner/name: the repo has no config.json; not a draft head"):
        resolve_head_folder("owner/name")


def save_other_model(folder: Path, config) -> Path:
    """A tiny model of an architecture outside the tested four, with the tests' tokenizer."""
    from transformers import AutoModelForCausalLM

    from tests.factory import tiny_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_a_model_without_llama_like_layers_runs_unquantized_and_refuses_what_needs_them(tmp_path):
    """GPT-2 keeps its layers as `transformer.h`: int8/int4 asked for are refused
    by name, auto keeps the weights as they are, and an EAGLE-3 head (whose
    features are captured at model.layers) is refused; each had raised an
    AttributeError traceback."""
    from transformers import GPT2Config

    from core.config import SamplingParams
    from core.engine import Engine
    from tests.factory import random_eagle3_head

    folder = save_other_model(tmp_path / "gpt2", GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=4))
    for quantization in ("int8", "int4"):
        with pytest.raises(QuantizationUnavailableError, match=f"{quantization} replaces the linears of decoder layers kept as model.layers"):
            load_base(str(folder), quantization=quantization, dtype="float32")
    from models import int4, int8

    base = load_base(str(folder), quantization="auto", dtype="float32")
    assert base.quantization == "none" and not int8.fits(base.model) and not int4.fits(base.model)
    steps = list(Engine(base).stream([5, 9, 10], "vanilla", SamplingParams(max_new_tokens=4)))
    assert steps[-1].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="where an EAGLE-3 head's features are captured; use an EAGLE-1/2 head"):
        Engine(base, random_eagle3_head(base.model, layer_ids=(0, 1, 2)))


def test_a_model_whose_forward_takes_no_tree_mask_runs_vanilla_without_a_head(tmp_path):
    """Falcon with ALiBi fails a tree pass with an error of its own; the check of
    exact rows had let it through only as NotImplementedError, so the model
    loaded with a head (vanilla only) but not without one."""
    from transformers import FalconConfig

    from core.config import SamplingParams
    from core.engine import Engine

    config = FalconConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                          new_decoder_architecture=False, multi_query=True, bos_token_id=1, eos_token_id=4)  # fmt: skip
    base = load_base(str(save_other_model(tmp_path / "falcon", config)), quantization="none", dtype="float32")
    engine = Engine(base)
    assert engine.modes == ("vanilla",) and not engine.exact
    steps = list(engine.stream([5, 9, 10], "vanilla", SamplingParams(max_new_tokens=4)))
    assert steps[-1].finish_reason in ("stop", "length")


def test_an_architecture_transformers_runs_with_eager_attention_only_decodes_vanilla(tmp_path):
    """Gemma 2 has no sdpa attention in transformers: it was refused as "not
    supported by transformers". It loads with eager attention and decodes its
    own replies (vanilla), as transformers' generate does; tree passes are not offered."""
    from transformers import Gemma2Config

    from core.config import SamplingParams
    from core.engine import Engine
    from tests.factory import random_head

    config = Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=4, pad_token_id=2)  # fmt: skip
    base = load_base(str(save_other_model(tmp_path / "gemma2", config)), quantization="none", dtype="float32")
    assert base.model.config._attn_implementation == "eager"
    engine = Engine(base, random_head(base.model))
    assert engine.modes == ("vanilla",) and engine.speculation_problem()
    prompt = [5, 9, 10, 11, 20, 30]
    ours = [token for step in engine.stream(prompt, "vanilla", SamplingParams(max_new_tokens=10)) for token in step.token_ids]
    expected = base.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :].tolist()
    assert ours == expected[: len(ours)] and len(ours) >= 1


@pytest.mark.parametrize("bits", [8, 4])
def test_a_checkpoint_saved_quantized_with_bitsandbytes_loads_as_saved_or_is_refused_by_name(tmp_path, tiny_dir, bits):
    """int8 (or auto, where the int8 probe wins on a CPU) read bitsandbytes'
    saved 8-bit codes as weights, 127 times too large, and the model wrote
    noise without an error; int4 on a 4-bit one failed with a traceback."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.factory import tiny_tokenizer

    settings = BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    saved = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=settings, device_map={"": "cpu"}, dtype=torch.float32)
    saved.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    prompt = torch.tensor([[1, 9, 10, 11, 12, 13]])
    # in inference mode, as Kestrel runs models: there bitsandbytes packs 4-bit weights for its CPU kernel where the
    # CPU has AVX512-BF16 (scales in bf16), which computes otherwise than its plain path (0.05 apart in these logits)
    with torch.inference_mode():
        expected = saved(prompt).logits
    loaded = load_base(str(tmp_path), quantization="auto", dtype="float32")
    assert loaded.quantization == f"{bits}bit"
    assert type(loaded.model.model.layers[0].mlp.up_proj).__name__ == ("Linear8bitLt" if bits == 8 else "Linear4bit")
    with torch.inference_mode():
        assert torch.equal(loaded.model(prompt).logits, expected)
    for other in ("none", "int8", "int4", "8bit" if bits == 4 else "4bit"):
        with pytest.raises(QuantizationUnavailableError, match=f"saved quantized with bitsandbytes' {bits}bit.*quantization {bits}bit or auto"):
            load_base(str(tmp_path), quantization=other, dtype="float32")


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_a_checkpoint_saved_for_kernels_kestrel_does_not_run_is_refused_by_name(tmp_path, tiny_dir, method):
    """They were said as damaged files, some with a hint to pip install optimum."""
    for file in tiny_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    settings = json.loads((tiny_dir / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(QuantizationUnavailableError, match=f"saved quantized with {method}, whose kernels Kestrel does not run; choose the model's unquantized repo"):
        load_base(str(tmp_path))


def test_a_model_that_needs_its_repo_s_own_code_is_refused_without_running_it(tmp_path, tiny_dir):
    """transformers asked on the terminal whether to run the folder's Python
    code (and ran it on "y"), and elsewhere it was said as damaged files."""
    for file in tiny_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    settings = json.loads((tiny_dir / "config.json").read_text())
    settings.update(model_type="kestrel_custom_lm", architectures=["CustomForCausalLM"])
    settings["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(settings))
    ran = tmp_path / "ran.txt"
    code = f"open({str(ran)!r}, 'w').close()\nfrom transformers import LlamaConfig\nclass CustomConfig(LlamaConfig):\n    model_type = 'kestrel_custom_lm'\n"
    (tmp_path / "configuration_custom.py").write_text(code)
    (tmp_path / "modeling_custom.py").write_text(code.replace("Config", "ForCausalLM").replace("model_type", "base_model_prefix"))
    with pytest.raises(UnsupportedArchitectureError, match=r"needs Python code from its own repo \(trust_remote_code\), which Kestrel does not run"):
        load_base(str(tmp_path))
    assert not ran.exists()


def test_encoders_are_refused_before_their_weights_load(tmp_path):
    """A BERT loaded as BertLMHeadModel (transformers only logs that it wants
    is_decoder) and wrote noise; an encoder-decoder was said as damaged files."""
    import transformers

    common = dict(vocab_size=64, bos_token_id=1, eos_token_id=4, pad_token_id=2)
    bert = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **common)
    save_other_model(tmp_path / "bert", bert)
    with pytest.raises(UnsupportedArchitectureError, match="bert is an encoder, a model that reads text rather than writes it"):
        load_base(str(tmp_path / "bert"))
    t5 = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0, **common)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(t5).save_pretrained(tmp_path / "t5")
    with pytest.raises(UnsupportedArchitectureError, match="t5 is an encoder-decoder model"):
        load_base(str(tmp_path / "t5"))


def test_a_vision_language_model_takes_a_head_by_its_text_model_s_sizes(tmp_path):
    """Gemma 3's config keeps its text model's sizes in text_config: loading a
    head for it failed with an AttributeError after the whole model had loaded."""
    import transformers

    from app.session import load_draft_head
    from models.errors import HeadFormatError
    from models.head import DraftHead, HeadConfig, save_head

    text = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=5, eoi_token_index=6, image_token_index=7)
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path / "base")
    from tests.factory import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "base")
    base = load_base(str(tmp_path / "base"), dtype="float32")
    for width in (64, 48):
        head = DraftHead(HeadConfig(hidden_size=width, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
        save_head(head, tmp_path / f"head{width}")
    assert load_draft_head(base, str(tmp_path / "head64")).config.hidden_size == 64
    from core.engine import Engine

    assert Engine(base).context_limit == config.text_config.max_position_embeddings  # prompts past it are refused
    with pytest.raises(HeadFormatError, match="48"):  # sized from the text model: refused by its width, not an AttributeError
        load_draft_head(base, str(tmp_path / "head48"))


def test_a_hub_head_is_judged_by_its_weights_headers_before_they_download(tmp_path, monkeypatch, tiny_dir):
    """A whole model given as the head by repo id downloaded all its weights
    (gigabytes) before it was refused; a head in shards was refused as a repo
    with no model.safetensors. The safetensors headers (kilobytes) tell both."""
    import huggingface_hub
    from safetensors.torch import load_file, save_file

    from models import hub
    from models.errors import HeadFormatError
    from models.head import resolve_head_folder, save_head
    from tests.factory import random_head

    base = load_base(str(tiny_dir))
    head = save_head(random_head(base.model), tmp_path / "head")
    downloads = []

    def download(repo, name, **options):
        downloads.append(name)
        return str(head / name)

    def headers(repo, **options):
        if repo == "owner/model":
            return SimpleNamespace(weight_map={"model.layers.0.mlp.up_proj.weight": "model.safetensors"}, sharded=False)
        return SimpleNamespace(weight_map={key: "model-00001-of-00002.safetensors" for key in state}, sharded=repo == "owner/sharded")

    state = load_file(str(head / "model.safetensors"))
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "config.json").write_text((head / "config.json").read_text())
    keys = sorted(state)
    parts = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2], "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    for name, part in parts.items():
        save_file({key: state[key] for key in part}, str(shards / name))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {key: name for name, part in parts.items() for key in part}}))
    monkeypatch.setattr(hub, "reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", headers)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **options: str(shards))
    with pytest.raises(HeadFormatError, match=r"owner/model: a whole model's weights \(keys model.layers.\*\), not a draft head"):
        resolve_head_folder("owner/model")
    assert downloads == ["config.json"]  # the weights were never asked for
    assert resolve_head_folder("owner/sharded") == shards
    assert resolve_head_folder("owner/head") == head and downloads[-1] == "model.safetensors"
    config = base.model.config
    from models.head import load_head

    assert load_head(shards, config.hidden_size, config.vocab_size).config.hidden_size == config.hidden_size


def fake_conversion(monkeypatch) -> None:
    """transformers' GGUF parse and save, faked: a conversion writes the converted files at once."""
    import transformers

    class Saved:
        def __init__(self, *names):
            self.names = names

        def save_pretrained(self, folder):
            for name in self.names:
                (Path(folder) / name).write_text("{}")

    class Loaded:
        config = SimpleNamespace(to_dict=lambda: {"model_type": "llama"})

        def state_dict(self):
            return {}

    tokenizer = Saved("tokenizer.json", "chat_template.jinja")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Loaded())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda config: SimpleNamespace(
        load_state_dict=lambda *a, **k: None, save_pretrained=Saved("config.json", "model.safetensors").save_pretrained))  # fmt: skip
    monkeypatch.setattr(transformers.AutoConfig, "for_model", lambda **settings: None)


def test_a_converted_copy_whose_chat_template_was_lost_is_made_again(tmp_path):
    """A power cut soon after the first conversion can leave chat_template.jinja
    empty or missing: the model still loads, and the instruct model would get a
    plain transcript at every start. Such a copy is not complete."""
    folder = tmp_path / "M"
    folder.mkdir()
    for name in bundled.CONVERTED_FILES:
        (folder / name).write_text("{}")
    assert bundled.complete(folder)
    (folder / "chat_template.jinja").write_text("")
    assert not bundled.complete(folder)
    (folder / "chat_template.jinja").unlink()
    assert not bundled.complete(folder)


def test_the_room_for_the_conversion_counts_what_kestrel_s_own_leftovers_free(tmp_path, monkeypatch):
    """A conversion killed mid-save leaves a staging folder (about 0.5 GB) and a
    stopped one a copy that is not complete: removed before free space is
    measured, a nearly full disk has the room. A running conversion's is kept."""
    import subprocess
    import sys

    fake_conversion(monkeypatch)
    models = tmp_path / "models"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (models / f"M.partial-{gone}").mkdir(parents=True)  # a conversion killed outright
    (models / f"M.partial-{gone}" / "model.safetensors").write_text("half")
    (models / f"M.partial-{os.getppid()}").mkdir()  # a running one's
    (models / "M").mkdir()
    (models / "M" / "model.safetensors").write_text("{}")  # a copy without its tokenizer

    def disk_usage(path):  # the disk has the room once the leftovers are gone
        leftovers = (models / f"M.partial-{gone}").exists() or (models / "M").exists()
        return SimpleNamespace(free=(100 if leftovers else 600) << 20)

    monkeypatch.setattr(bundled.shutil, "disk_usage", disk_usage)
    bundled.convert(tmp_path / "x.gguf", models / "M")
    assert bundled.complete(models / "M")
    assert sorted(p.name for p in models.iterdir()) == ["M", f"M.partial-{os.getppid()}"]


def test_the_converted_model_is_renamed_into_place_once_a_virus_scanner_lets_go_of_it(tmp_path, monkeypatch):
    """On Windows, Defender or the search indexer reading the model just written
    holds its staging folder for a moment: the rename into place is tried again
    (as a chat's file is saved, app/store.py) instead of losing the conversion."""
    fake_conversion(monkeypatch)
    real, refusals = Path.rename, []

    def held(source, target):
        if len(refusals) < 2:
            refusals.append(target)
            raise PermissionError(13, "Access is denied")
        return real(source, target)

    monkeypatch.setattr(bundled, "RENAME_TRIES", 6)
    monkeypatch.setattr(Path, "rename", held)
    folder = tmp_path / "models" / "M"
    bundled.convert(tmp_path / "x.gguf", folder)
    assert len(refusals) == 2 and bundled.complete(folder)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["M"]
    refusals.clear()
    monkeypatch.setattr(bundled, "RENAME_TRIES", 2)
    (tmp_path / "models" / "M" / "tokenizer.json").unlink()
    with pytest.raises(PermissionError):  # held for longer: the error, and no staging folder left
        bundled.convert(tmp_path / "x.gguf", folder)
    assert list(folder.parent.iterdir()) == []


def test_a_repo_id_may_pin_a_revision_and_a_bad_one_is_named(tmp_path, monkeypatch, tiny_dir):
    """owner/name@REV (a branch, tag, commit hash or a pull request's ref), as vLLM
    and other tools take it. A bad form is refused naming what is wrong, for a base
    model and a head alike, before the hub is asked; a local folder that exists
    loads as that folder, an '@' in its path or not."""
    import re
    import shutil

    from models import hub
    from models.head import resolve_head_folder, save_head
    from models.repo import Repo, parse_repo
    from tests.factory import random_head

    assert parse_repo("owner/name") == Repo("owner/name", None)
    assert parse_repo("owner/name@v1.0") == Repo("owner/name", "v1.0")
    assert parse_repo("owner/name@refs/pr/3") == Repo("owner/name", "refs/pr/3")
    assert parse_repo("./folder") is None and parse_repo("name") is None
    monkeypatch.setattr(hub, "reachable", lambda: pytest.fail("the hub was asked"))
    for source, wrong in (
        ("owner/name@", "the revision after '@' is empty; write owner/name@REV (REV a branch, tag or commit hash), or owner/name for"),
        ("owner/name@v1@v2", "not a Hugging Face repo id: it has two '@'"),
        ("@v1", "'' before '@' is not a Hugging Face repo id"),
        ("./models/name@v1", "'./models/name' before '@' is not a Hugging Face repo id"),
    ):  # fmt: skip
        for load in (load_base, resolve_head_folder):
            with pytest.raises(ModelNotFoundError, match=re.escape(f"{source}: no such file or folder, and {wrong}")):
                load(source)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dir, tmp_path / "owner" / "tiny@v1")
    assert load_base("owner/tiny@v1").name == "owner/tiny@v1"
    head = save_head(random_head(load_base(str(tiny_dir)).model), tmp_path / "owner" / "head@v1")
    assert resolve_head_folder("owner/head@v1") == Path("owner/head@v1")
    assert resolve_head_folder(str(head)) == head
    shutil.copytree(tiny_dir, tmp_path / "owner" / "tiny")  # transformers would read this folder, not the hub's v2
    with pytest.raises(ModelNotFoundError, match=r"owner/tiny@v2: .*owner/tiny is a folder, which would load in place of the repo's revision v2"):
        load_base("owner/tiny@v2")


def test_a_pinned_base_model_passes_its_revision_to_every_load(monkeypatch, tiny_dir):
    """Its config, tokenizer and model (whose weights and generation config
    transformers reads at the revision given it) are each asked for at REV;
    without an '@', at the default branch as before. The hub's repo is the
    tiny folder here."""
    import transformers

    from models import hub

    asked = []

    def spying(kind):
        original = kind.from_pretrained

        def from_pretrained(location, **options):
            if location != "owner/tiny":  # transformers' own calls, made with the folder below
                return original(location, **options)
            asked.append((kind.__name__, location, options.get("revision")))
            return original(str(tiny_dir), **options)

        return from_pretrained

    monkeypatch.setattr(hub, "reachable", lambda: True)
    for kind in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(kind, "from_pretrained", spying(kind))
    kinds = ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM")
    assert load_base("owner/tiny@v1", dtype="float32").name == "owner/tiny@v1"
    assert asked == [(kind, "owner/tiny", "v1") for kind in kinds]
    asked.clear()
    assert load_base("owner/tiny", dtype="float32").name == "owner/tiny"
    assert asked == [(kind, "owner/tiny", None) for kind in kinds]


def test_a_pinned_head_passes_its_revision_to_every_hub_call(tmp_path, monkeypatch, tiny_dir):
    """config.json, the safetensors headers, the weights, and a sharded head's
    snapshot are each asked for at REV; without an '@', at the default branch
    (no revision) as before."""
    import huggingface_hub

    from models import hub
    from models.head import resolve_head_folder, save_head
    from tests.factory import random_head

    head = save_head(random_head(load_base(str(tiny_dir)).model), tmp_path / "head")
    asked = []

    def download(repo, name, revision=None, **options):
        asked.append(("hf_hub_download", repo, name, revision))
        return str(head / name)

    def headers(repo, revision=None, **options):
        asked.append(("get_safetensors_metadata", repo, revision))
        return SimpleNamespace(weight_map={"fc.weight": "model.safetensors"}, sharded=repo == "owner/sharded")

    def snapshot(repo, revision=None, **options):
        asked.append(("snapshot_download", repo, revision))
        return str(head)

    monkeypatch.setattr(hub, "reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", headers)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    for source, repo, revision in (("owner/head@v1", "owner/head", "v1"), ("owner/head", "owner/head", None)):
        asked.clear()
        assert resolve_head_folder(source) == head
        assert asked == [("hf_hub_download", repo, "config.json", revision), ("get_safetensors_metadata", repo, revision),
                         ("hf_hub_download", repo, "model.safetensors", revision)]  # fmt: skip
    asked.clear()
    assert resolve_head_folder("owner/sharded@refs/pr/3") == head
    assert asked == [("hf_hub_download", "owner/sharded", "config.json", "refs/pr/3"),
                     ("get_safetensors_metadata", "owner/sharded", "refs/pr/3"), ("snapshot_download", "owner/sharded", "refs/pr/3")]  # fmt: skip


def test_a_revision_the_hub_lacks_is_named_as_such(monkeypatch):
    """The hub's 404 for a revision it does not have, for a head and (wrapped by
    transformers) for a base model: named as a missing revision, not as an answer
    to try again later."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.utils import hf_raise_for_status

    from models import hub
    from models.base import _explain
    from models.head import resolve_head_folder

    def no_revision(*args, **kwargs):
        request = httpx2.Request("GET", "https://huggingface.co/owner/name/resolve/v9/config.json")
        hf_raise_for_status(httpx2.Response(404, headers={"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id: v9"}, request=request))

    monkeypatch.setattr(hub, "reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_revision)
    with pytest.raises(ModelNotFoundError, match=r"owner/name@v9: the repo owner/name has no revision 'v9' on the Hugging Face hub"):
        resolve_head_folder("owner/name@v9")
    try:
        try:
            no_revision()
        except Exception as error:  # as transformers wraps it
            raise OSError("v9 is not a valid git identifier (branch name, tag name or commit id)") from error
    except OSError as wrapped:
        explained = _explain(wrapped, "owner/name@v9", "none")
    assert isinstance(explained, ModelNotFoundError) and "owner/name@v9: the repo on the Hugging Face hub has no such revision" in str(explained)


def copied(tiny_dir: Path, folder: Path) -> Path:
    import shutil

    return Path(shutil.copytree(tiny_dir, folder))


def test_a_chat_template_cut_short_is_said_at_load_and_chats_fall_back_to_a_transcript(tmp_path, tiny_dir, caplog):
    """As for a model without a template: a warning at load naming the file,
    and chats written as a plain transcript (every message failed with the
    template's syntax error, said as a conversation the template refuses)."""
    import logging

    from core.prompt import encode_chat, render_chat
    from models.errors import ChatTemplateError

    folder = copied(tiny_dir, tmp_path / "model")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        loaded = load_base(str(folder), dtype="float32")
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "its chat template does not read (unexpected end of template" in warned
    assert "chats are written without it" in warned and f"it is {folder / 'chat_template.jinja'}" in warned
    assert render_chat(loaded.tokenizer, [{"role": "user", "content": "w1 w2"}]).endswith("User: w1 w2\nAssistant:")
    assert encode_chat(loaded.tokenizer, [{"role": "user", "content": "w1 w2"}])
    loaded.tokenizer.chat_template = "{% for m in messages %}{{ m.content "  # broken after load: said as broken
    with pytest.raises(ChatTemplateError, match="the model's chat template is broken: unexpected end of template"):
        render_chat(loaded.tokenizer, [{"role": "user", "content": "hi"}])
    loaded.tokenizer.chat_template = "{{ raise_exception('System role not supported') }}"  # its own refusal, in its words
    with pytest.raises(ChatTemplateError, match="the model's chat template refuses this conversation: System role not supported"):
        render_chat(loaded.tokenizer, [{"role": "user", "content": "hi"}])


def test_a_failure_not_about_the_files_keeps_its_kind_and_the_bundled_copy(tmp_path, monkeypatch, tiny_dir):
    """A GPU's error while the bundled model loads is not a damaged file: named
    as it is, not as "cannot read the model files". The bundled copy is still
    converted again once, in case it is at fault (files that parse but that
    libraries installed since refuse), and the error stands where it was not."""
    import transformers

    from models.errors import ModelLoadError

    folder, conversions = tmp_path / "models" / bundled.DEFAULT_NAME, []

    def converted_folder():  # the conversion, as a copy of the tiny model
        if not folder.exists():
            conversions.append(copied(tiny_dir, folder))
        return folder

    monkeypatch.setattr(bundled, "converted_folder", converted_folder)

    def from_pretrained(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nCUDA kernel errors might be reported later")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    message = f"{bundled.DEFAULT_NAME}: the model failed to load \\(RuntimeError: CUDA error: no kernel image is available for execution on the device\\)$"
    with pytest.raises(ModelLoadError, match=message):
        load_base(None, quantization="none", dtype="float32")
    assert len(conversions) == 2 and (folder / "model.safetensors").is_file()  # the first, then once again


def test_json_files_and_shards_cut_short_are_named(tmp_path, tiny_dir):
    """transformers' own errors name no file (JSONDecodeError: Expecting ','
    delimiter: line 71 column 25): the file cut short is named, and so is a shard."""
    from transformers import AutoModelForCausalLM

    for name in ("tokenizer.json", "tokenizer_config.json"):
        folder = copied(tiny_dir, tmp_path / name)
        (folder / name).write_text((tiny_dir / name).read_text()[:60])
        with pytest.raises(CorruptedFileError, match=f"{folder / name}: not valid JSON"):
            load_base(str(folder), dtype="float32")
    sharded = copied(tiny_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(sharded, max_shard_size="100KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    assert load_base(str(sharded), dtype="float32").model is not None
    weights = shard.read_bytes()
    shard.write_bytes(weights[: len(weights) // 2])
    with pytest.raises(CorruptedFileError, match=f"{shard}: cannot read the weights \\(SafetensorError"):
        load_base(str(sharded), dtype="float32")
    shard.unlink()
    with pytest.raises(MissingWeightsError, match=f"model.safetensors.index.json: names the shard {shard.name}, which is not in"):
        load_base(str(sharded), dtype="float32")
    index = sharded / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    with pytest.raises(CorruptedFileError, match=f"{index}: not valid JSON"):
        load_base(str(sharded), dtype="float32")


def test_a_gguf_file_s_suffix_may_be_in_capitals(tmp_path):
    file = tmp_path / "Model.GGUF"
    file.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 20)  # read as a GGUF: its metadata is found missing
    with pytest.raises(CorruptedFileError, match="the GGUF file is incomplete or damaged"):
        load_base(str(file), quantization="none", dtype="float32")
    file.rename(tmp_path / "M.Gguf")
    with pytest.raises(MissingWeightsError, match=f"give the file itself, e.g. {tmp_path / 'M.Gguf'}"):
        load_base(str(tmp_path))


def test_a_head_that_cannot_run_on_the_base_is_said_before_the_base_loads(tmp_path, monkeypatch, tiny_dir):
    """What load_head checks against the base (an EAGLE-3 head's width and aux
    layers, norm_output, hidden_act) is said before a local base folder loads,
    and before a repo id's whose config.json is in the Hugging Face cache."""
    import huggingface_hub
    from transformers import AutoModelForCausalLM

    from app import session
    from models import eagle3
    from models.errors import HeadFormatError
    from models.head import save_head
    from tests.factory import random_eagle3_head, random_head, tiny_config

    def no_model(*args, **kwargs):
        raise AssertionError("the base model must not load")

    monkeypatch.setattr(session, "load_base", no_model)
    model = AutoModelForCausalLM.from_config(tiny_config())  # the sizes of tiny_dir's: 64 wide, 2 layers
    wide = eagle3.save(random_eagle3_head(AutoModelForCausalLM.from_config(tiny_config(hidden_size=96))), tmp_path / "wide")
    cases = [(wide, r"the head reads features 96 wide \(target_hidden_size; fc.weight takes 3 x 96\), and the base model's hidden size is 64")]
    for name, change, message in (
        ("gelu", {"hidden_act": "gelu"}, "config.json: hidden_act 'gelu' is not supported"),
        ("aux", {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}, r"config.json: aux layers \[0, 1, 9\] do not exist in a 2-layer base model"),
        ("norm", {"norm_output": True}, "config.json: norm_output heads .* are not supported"),
    ):
        folder = (save_head(random_head(model), tmp_path / name) if name == "gelu" else eagle3.save(random_eagle3_head(model), tmp_path / name))
        settings = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**settings, **change}))
        cases.append((folder, message))
    snapshot = tmp_path / "hub" / "models--owner--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "hub" / "models--owner--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--owner--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for base in (str(tiny_dir), "owner/tiny"):
        for head, message in cases:
            with pytest.raises(HeadFormatError, match=message):
                session.load_pair(base, str(head))


def test_a_trained_head_loads_only_onto_the_base_its_report_names(tmp_path, monkeypatch, tiny_base):
    """The Models tab's list of trained heads may be older than the loaded base
    (another tab loaded one since): a head whose training report names another
    base is refused by name, whatever is loaded."""
    import app.library
    from app.library import LibraryHandlers
    from app.runtime import Runtime
    from core.engine import Engine
    from core.training.report import REPORT_FILE

    head = tmp_path / "heads" / "mine"
    head.mkdir(parents=True)
    trained_for = tmp_path / "tiny"
    (head / REPORT_FILE).write_text(json.dumps({"base_model": str(trained_for)}))
    library = LibraryHandlers(Runtime(Engine(tiny_base)), tmp_path / "heads", "cpu", "off")
    loads = []
    monkeypatch.setattr(app.library, "load_pair", lambda *args: loads.append(args[:2]) or Engine(tiny_base))
    monkeypatch.setattr(app.library, "prepared", lambda engine: engine)
    for box in ("", tiny_base.name):  # the box empty: the loaded base, which the head was not trained for
        _, notice, _ = library.load(box, "", str(head), "none", "float32")
        assert f"was made for {trained_for}, not for {tiny_base.name}; put {trained_for} in the base model box" in notice
    assert loads == []
    library.load(str(trained_for), "", str(head), "none", "float32")
    assert loads == [(str(trained_for), str(head))]


def test_the_status_says_a_model_is_loading_while_it_loads(tiny_base):
    """Other tabs' status said the previous model while a load ran, which serves nothing meanwhile."""
    from app.runtime import Runtime
    from core.engine import Engine

    runtime = Runtime(Engine(tiny_base))
    engine = Engine(tiny_base)
    said = []
    runtime.replace(lambda: said.append(runtime.describe()) or engine, "owner/big")
    assert said == ["Loading owner/big..."]
    assert runtime.describe().startswith(f"{tiny_base.name} (cpu, float64)")



def test_a_model_replaced_in_the_models_tab_is_freed_by_the_replace_itself(tiny_dir, tmp_path):
    """The Models tab's Load held the loaded engine in a local while replacing
    it: the collection that replace runs found it still referenced, and a
    compiled model (a reference cycle: model._kestrel_compiled <-> its
    Compiled) stayed in memory, beside the new one, until some later one."""
    import gc
    import weakref

    from app.library import LibraryHandlers
    from app.runtime import Runtime

    runtime = Runtime(None)
    library = LibraryHandlers(runtime, tmp_path / "heads", "cpu", "off")
    assert library.load(str(tiny_dir), "", None, "none", "float32")[1] == "Loaded."
    first = weakref.ref(runtime.engine.model)
    runtime.engine.model.held_by = [runtime.engine.model]  # a cycle, as compiling makes one
    gc.disable()  # only the collection replace runs itself
    try:
        assert library.load(str(tiny_dir), "", None, "none", "float32")[1] == "Loaded."
        assert first() is None
    finally:
        gc.enable()


def test_auto_on_a_gpu_loads_4bit_where_the_16_bit_weights_leave_too_little_of_its_memory(monkeypatch, caplog):
    """auto kept 16-bit weights on every GPU: Llama-3.1-8B (16 GB in bf16) on a
    12 GB card ran out of memory after its download."""
    import logging

    from models import base
    from models.base import GpuRoom, resolve_quantization

    cuda, llama = torch.device("cuda"), 8_030_000_000
    monkeypatch.setattr(base, "bitsandbytes_importable", lambda: True)
    with caplog.at_level(logging.INFO, logger="kestrel"):
        assert resolve_quantization("auto", cuda, torch.bfloat16, room=GpuRoom(llama, 11_800_000_000)) == "4bit"
    assert caplog.messages[-1] == "auto: 4bit (bitsandbytes): the 16-bit weights, 16.1 GB, leave too little of the GPU's 11.8 GB"
    assert resolve_quantization("auto", cuda, torch.bfloat16, room=GpuRoom(llama, 24_000_000_000)) == "none"  # 16.1 of 24: fits
    assert resolve_quantization("auto", cuda, torch.bfloat16, room=GpuRoom(llama, 20_000_000_000)) == "4bit"  # 16.1 > 80% of 20
    assert resolve_quantization("auto", cuda, torch.float32, room=GpuRoom(llama // 2, 20_000_000_000)) == "4bit"  # 4 bytes each
    assert resolve_quantization("auto", cuda, torch.bfloat16, room=None) == "none"  # a GGUF file: bitsandbytes does not take one
    assert resolve_quantization("auto", cuda, torch.bfloat16, room=GpuRoom(None, 11_800_000_000)) == "none"  # size unknown
    assert resolve_quantization("4bit", cuda, torch.bfloat16, room=GpuRoom(llama, 24_000_000_000)) == "4bit"  # asked for by name
    fp8 = SimpleNamespace(quantization_config={"quant_method": "fp8"})  # saved quantized otherwise: loaded as saved
    assert base.saved_quantization(fp8, "owner/fp8", "4bit", automatic=True) == ("none", False)
    monkeypatch.setattr(base, "bitsandbytes_importable", lambda: False)
    with caplog.at_level(logging.INFO, logger="kestrel"):
        assert resolve_quantization("auto", cuda, torch.bfloat16, room=GpuRoom(llama, 11_800_000_000)) == "none"
    assert "bitsandbytes, which would load them in 4 bits, does not import; loading may run out of memory" in caplog.messages[-1]


def test_load_base_weighs_a_folder_s_weights_against_the_gpu_s_memory_and_a_gguf_s_not(tmp_path, monkeypatch, tiny_dir):
    """What load_base hands auto on a GPU: the folder's parameters and the
    memory of that device, before anything loads; nothing for a GGUF file."""
    from models import base
    from models.base import folder_parameters

    asked, chosen = [], []

    def mem_get_info(device):  # what is free now does not count: a model the Models tab replaces is still there
        asked.append(device)
        return 1, memory

    def load(location, gguf_file, name, quantization, *rest, **options):
        chosen.append(quantization)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(base, "bitsandbytes_importable", lambda: True)
    monkeypatch.setattr(base, "_load", load)
    weights = folder_parameters(tiny_dir) * 2
    for memory, expected in ((weights, "4bit"), (2 * weights, "none")):
        base.load_base(str(tiny_dir), "auto", "bfloat16", "cuda:1")
        assert chosen[-1] == expected and asked[-1] == torch.device("cuda:1")
    file = tmp_path / "model.gguf"
    file.write_bytes(b"0")
    memory = 0
    base.load_base(str(file), "auto", "bfloat16", "cuda")
    assert chosen[-1] == "none" and len(asked) == 2  # not weighed


def test_a_checkpoint_s_parameters_are_counted_from_its_safetensors_headers(tmp_path, tiny_dir):
    """auto weighs the weights before they load: from the safetensors headers
    alone (a single file or an index's shards), or pytorch_model*.bin sizes."""
    from transformers import AutoModelForCausalLM

    from models.base import folder_parameters, safetensors_parameters

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    expected = sum(parameter.numel() for parameter in model.parameters())
    assert folder_parameters(tiny_dir) == expected
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    assert folder_parameters(sharded) == expected
    whole = (tiny_dir / "model.safetensors").read_bytes()
    header_only = tmp_path / "cut.safetensors"  # the weights themselves are never read
    header_only.write_bytes(whole[: 8 + int.from_bytes(whole[:8], "little")])
    assert safetensors_parameters(header_only) == expected
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tiny_dir / "config.json").read_text())
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    assert expected <= folder_parameters(pickled) < 1.05 * expected  # float32 (config.json's torch_dtype), and the zip's framing
    (sharded / "model-00002-of-00004.safetensors").write_bytes(b"\x00" * 4)  # a shard cut short: unknown
    assert folder_parameters(sharded) is None and folder_parameters(tmp_path) is None


def test_a_hub_repo_s_parameters_come_from_the_cache_else_the_hub_s_headers(monkeypatch, tiny_dir):
    import huggingface_hub
    from huggingface_hub.errors import NotASafetensorsRepoError

    from models import hub
    from models.base import folder_parameters, hub_parameters

    cached = {"owner/cached": str(tiny_dir / "config.json")}
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name, revision=None: cached.get(repo))
    monkeypatch.setattr(hub, "reachable", lambda: False)
    assert hub_parameters("owner/cached", None) == folder_parameters(tiny_dir)
    assert hub_parameters("owner/other", None) is None  # no network: the load says so

    def headers(repo, revision=None):
        if repo == "owner/bin":
            raise NotASafetensorsRepoError("no safetensors")
        return SimpleNamespace(parameter_count={"BF16": 7_000, "F32": 30})

    files = [SimpleNamespace(rfilename=f"pytorch_model-0000{i}-of-00002.bin", size=2_000) for i in (1, 2)]
    monkeypatch.setattr(hub, "reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", headers)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo, revision=None, files_metadata=False: SimpleNamespace(siblings=files))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, revision=None: str(tiny_dir / "config.json"))
    assert hub_parameters("owner/other", None) == 7_030
    assert hub_parameters("owner/bin", None) == 4_000 // 4  # the tiny model's config.json: float32
