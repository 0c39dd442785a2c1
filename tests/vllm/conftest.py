"""Real vLLM fixtures (CPU). Every test in this directory is marked `vllm`."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """One in-process vLLM (V1 multiprocessing off) hosting the tiny Llama."""
    pytest.importorskip("vllm")
    from engines.vllm_engine import VllmEngine

    engine = VllmEngine(tiny_model_dir, multiprocessing=False)
    yield engine
    engine.close()
