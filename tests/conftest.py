"""Shared fixtures: tiny random models saved locally (no hub), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from examples.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_state(tiny_model_dir):
    """The checkpoint tensors of the tiny model, as a trainer would hold them."""
    from engines.torch_engine import load_model

    return {k: v.detach().clone() for k, v in load_model(tiny_model_dir).state_dict().items()}


# -- the fault matrix: tests/faults record one row per scenario; `--matrix-out` saves them
MATRIX_ROWS: list[dict] = []


def pytest_addoption(parser):
    parser.addoption(
        "--matrix-out",
        default=None,
        help="write the fault-matrix rows measured by tests/faults to this JSON file",
    )
    parser.addoption(
        "--fuzz-cases", type=int, default=300, help="hypothesis cases per fuzzed socket (slow mode: 10000)"
    )


@pytest.fixture
def matrix_row():
    """Call with the scenario's measured outcome; saved when --matrix-out is given."""
    return MATRIX_ROWS.append


def pytest_sessionfinish(session, exitstatus):
    out = session.config.getoption("--matrix-out")
    if out and MATRIX_ROWS:
        import json

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(MATRIX_ROWS, indent=2))
