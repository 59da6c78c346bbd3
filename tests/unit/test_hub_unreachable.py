"""A hub id whose hub cannot be reached fails at once with a clear error (llmrl/models/loading.py)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from llmrl.errors import ModelSpecError
from llmrl.models import loading


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The hub online as for a user, at an address where nothing listens (refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    loading._unreachable_hub.cache_clear()
    yield f"http://127.0.0.1:{port}"
    loading._unreachable_hub.cache_clear()


def test_a_hub_model_that_cannot_be_reached_fails_at_once_naming_the_hub(unreachable_hub):
    started = time.monotonic()
    with pytest.raises(ModelSpecError) as info:
        loading.load_model("someone/not-cached-model")
    # huggingface_hub alone retries each file it looks for with waits of 1, 2, 4, 8 and 8 s
    assert time.monotonic() - started < 10
    assert str(info.value).startswith(
        "model spec 'someone/not-cached-model': no folder someone/not-cached-model (looked in the working "
        f"folder: {Path.cwd()}/someone/not-cached-model); its tokenizer is not in the local cache, "
        f"and {unreachable_hub} cannot be reached: "
    )


def test_local_folders_and_tiny_models_load_without_asking_the_hub(unreachable_hub, tiny_model_path):
    for spec in ("tiny://arithmetic", str(tiny_model_path)):
        model, tokenizer = loading.load_model(spec)
        assert tokenizer.pad_token is not None and model.config.vocab_size > 0
    assert loading._unreachable_hub.cache_info().misses == 0
