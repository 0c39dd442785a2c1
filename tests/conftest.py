"""Shared fixtures: tiny random models saved locally (no hub), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from engines.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_state(tiny_model_dir):
    """The checkpoint tensors of the tiny model, as a trainer would hold them."""
    from engines.torch_engine import load_model

    return {k: v.detach().clone() for k, v in load_model(tiny_model_dir).state_dict().items()}
