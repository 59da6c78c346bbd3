"""Shared fixtures.

The tiny-model fixtures load the default model shipped inside the package (`llmrl/models/shipped/`).
"""

from __future__ import annotations

import os
from pathlib import Path

# Tests never reach a model hub; without this a hub lookup waits for network timeouts. Set before
# any test imports transformers / huggingface_hub, which read it once at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Folder of `tiny://arithmetic`; tests that train load their own copy from it."""
    from llmrl.models import tiny_model_path

    return tiny_model_path("arithmetic")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    """(model, tokenizer) of `tiny://arithmetic`, shared by the whole session: never train it in place."""
    from llmrl.models import load_model

    return load_model("tiny://arithmetic")


@pytest.fixture(autouse=True)
def libraries_left_as_they_are(monkeypatch):
    """`llmrl.cli.main` quiets the libraries for the rest of its process: tests that call it in pytest's
    process leave the session's libraries as they are (tests/unit/test_quiet.py runs it in its own)."""
    monkeypatch.setattr("llmrl.cli.quiet_libraries", lambda: None)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module of tests (restored after it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip, saying so, where torch sees no GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
