"""A model with a frozen part, synced the way TRL syncs it (`WeightSyncTransfer(model=)`:
the frozen tensors with the first sync, partial pushes after), into a real vLLM engine:
every sync's canary (the trainer's greedy answers) is reproduced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.torch_engine import load_model
from examples.tiny import perturbed
from orchestrator.trainer.trl import WeightSyncTransfer, canary
from tests.vllm.conftest import vllm_fleet

FROZEN = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def vllm_one(tmp_path_factory, tiny_model_dir):
    with vllm_fleet(
        Path(tmp_path_factory.mktemp("vllm-frozen")), tiny_model_dir, {"vllm-0": ["--no-vllm-mp"]}
    ) as cluster:
        yield cluster


def test_a_frozen_embedding_survives_partial_syncs_into_vllm(vllm_one, tiny_model_dir, tiny_state):
    model = load_model(tiny_model_dir)
    model.get_parameter(FROZEN).requires_grad_(False)
    wt = WeightSyncTransfer(
        vllm_one.addr, model=model, probes=canary(model, [[1, 17, 42, 99], [1, 250, 3]], 6)
    )
    wt.init_weight_transfer()
    try:
        for k in range(1, 5):
            trained = dict(perturbed(tiny_state, k))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        p.copy_(trained[n])
            wt.send_weights((n, p.detach()) for n, p in model.named_parameters() if p.requires_grad)
            assert wt.last is not None and wt.last.state == "READY", k
        assert wt.unchanged == {FROZEN}
    finally:
        wt.destroy()
