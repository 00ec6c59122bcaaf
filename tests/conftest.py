import contextlib
import os
import warnings

import pytest
import torch

from tests.factory import save_tiny_model

# Two cores on CI machines: one torch pool of an explicit size, never oversubscribed.
torch.set_num_threads(int(os.environ.get("KESTREL_TEST_THREADS", "2")))


@contextlib.contextmanager
def environment(name: str, value: str):
    """`name` set to `value` for the session, then as it was."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@pytest.fixture(autouse=True, scope="session")
def costs_dir(tmp_path_factory):
    """Step costs measured by tests go to a temporary folder, not the user's cache."""
    folder = tmp_path_factory.mktemp("costs")
    with environment("KESTREL_COSTS_DIR", str(folder)):
        yield folder


@pytest.fixture(autouse=True, scope="session")
def upload_dir(tmp_path_factory):
    """Gradio's upload folder is the tests' temporary folder: the page's
    handlers read only uploaded files, and the tests hand them files written there."""
    folder = tmp_path_factory.getbasetemp()
    with environment("GRADIO_TEMP_DIR", str(folder)):
        yield folder


warnings.filterwarnings("ignore", message="MatMul8bitLt")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_base(tiny_dir):
    from models.base import load_base

    return load_base(str(tiny_dir), dtype="float64")


@pytest.fixture(scope="session")
def default_base():
    """The bundled SmolLM2-135M-Instruct (converted once into the user cache)."""
    from models.base import load_base

    return load_base(None, dtype="float32")
