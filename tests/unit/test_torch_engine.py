"""The embedded torch engine: in-place validated loads and a non-idempotent post-load step."""

from __future__ import annotations

import pytest
import torch

from engines.base import Engine
from engines.torch_engine import TorchEngine, greedy, load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import DataError, ErrorCode, WeightSyncError
from messages.schema import Probe

PROBE = Probe((1, 9, 33, 71), 8)


@pytest.fixture()
def engine(tiny_model_dir):
    e = TorchEngine(tiny_model_dir, threads=1)
    yield e
    e.close()


def reference(tiny_model_dir, weights):
    m = load_model(tiny_model_dir)
    m.load_state_dict(weights)
    return greedy(m, PROBE.prompt, PROBE.max_tokens)


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, Engine)
    info = engine.describe()
    assert info.backend == "torch" and len(info.spec) == len(engine.params)


def test_sync_loads_in_place_and_matches_trainer(engine, tiny_model_dir, tiny_state):
    ptrs = engine.weight_ptrs()
    new = dict(perturbed(tiny_state, 1))
    engine.begin("s1", 1)
    engine.load(list(new.items()))
    got = engine.finalize()
    assert got == digest(new.items()) == engine.digest()
    assert engine.weight_ptrs() == ptrs  # parameter storage never replaced
    assert engine.probe([PROBE]) == (reference(tiny_model_dir, new),)
    assert engine.finalize_count == 1


def test_unknown_tensor_fails_before_any_parameter_changes(engine, tiny_state):
    engine.begin("s1", 1)
    before = {k: v.detach().clone() for k, v in engine.params.items()}
    name = "model.layers.0.mlp.up_proj.weight"
    bucket = [(name, tiny_state[name] + 1), ("model.not_a_layer.weight", torch.zeros(3))]
    with pytest.raises(DataError) as ei:
        engine.load(bucket)
    assert ei.value.code is ErrorCode.UNKNOWN_TENSOR
    assert all(torch.equal(before[k], v) for k, v in engine.params.items())


@pytest.mark.parametrize("bad", [torch.zeros(3, 3), torch.zeros(512, 128, dtype=torch.bfloat16)])
def test_wrong_shape_or_dtype_fails_before_any_parameter_changes(engine, tiny_state, bad):
    engine.begin("s1", 1)
    before = {k: v.detach().clone() for k, v in engine.params.items()}
    name = "model.norm.weight"
    with pytest.raises(DataError) as ei:
        engine.load([(name, tiny_state[name] * 2), ("model.embed_tokens.weight", bad)])
    assert ei.value.code is ErrorCode.SHAPE_MISMATCH
    assert all(torch.equal(before[k], v) for k, v in engine.params.items())


def test_second_finalize_corrupts_outputs(engine, tiny_model_dir, tiny_state):
    """The post-load step is not idempotent (why the guards exist): run twice, outputs change."""
    new = dict(perturbed(tiny_state, 2))
    engine.begin("s2", 2)
    engine.load(list(new.items()))
    engine.finalize()
    good = engine.probe([PROBE])
    engine.finalize()
    assert engine.probe([PROBE]) != good
    assert good == (reference(tiny_model_dir, new),)


def test_begin_restores_checkpoint_layout(engine, tiny_state):
    engine.begin("s1", 1)
    for name, t in engine.params.items():
        assert torch.equal(t.detach(), tiny_state[name]), name


def test_load_while_packed_is_refused(engine, tiny_state):
    with pytest.raises(WeightSyncError) as ei:
        engine.load([("model.norm.weight", tiny_state["model.norm.weight"])])
    assert ei.value.code is ErrorCode.INVALID_STATE


def test_a_fresh_digest_reads_the_served_weights_back_and_sees_them_change(engine, tiny_state):
    """`fresh_digest` reads the packed kernels back in checkpoint layout (equal to the
    digest finalize reported) and is computed again each time: one element changed in a
    served kernel changes it while the recorded digest stays."""
    new = dict(perturbed(tiny_state, 3))
    engine.begin("s3", 3)
    engine.load(list(new.items()))
    reported = engine.finalize()
    assert engine.packed and engine.fresh_digest() == reported == digest(new.items())
    with torch.no_grad():
        engine.linears[0].weight.data.view(-1)[5] += 1.0  # the served kernel, not its record
    assert engine.digest() == reported != engine.fresh_digest()
