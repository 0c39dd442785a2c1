"""Delta sync into a real vLLM engine (in-process, `--delta-base`): patches rebuilt on the
engine's base copy in the engine process, dense tensors into vLLM's loader, the digest
and the canary of the full result before READY."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.canary import make_probes
from messages.errors import ErrorCode, WeightSyncError
from tests.integration.helpers import finalized_syncs, push_lying_delta, small_step
from tests.vllm.conftest import vllm_fleet

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]


def probes_for(model_dir, weights, n=6):
    m = load_model(model_dir)
    m.load_state_dict(weights)
    return make_probes(m, PROMPTS, n)


@pytest.fixture(scope="module")
def vllm_delta(tmp_path_factory, tiny_model_dir):
    workdir = Path(tmp_path_factory.mktemp("vllm-delta"))
    with vllm_fleet(
        workdir,
        tiny_model_dir,
        {"vllm-0": ["--no-vllm-mp"]},
        daemon_args=["--spool", str(workdir / "spool")],
        engine_args=["--delta-base"],
    ) as cluster:
        yield cluster


@pytest.mark.parametrize("transport", ["inline", "auto"])
def test_a_delta_push_into_vllm_serves_the_digest_and_generation_of_the_same_weights(
    vllm_delta, tiny_model_dir, tiny_state, transport
):
    with vllm_delta.client(timeout=120.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        w = dict(perturbed(tiny_state, v))
        client.push(list(w.items()), v, delta=True, transport=transport)
        w2 = small_step(w, v, by=0.05)
        probes = probes_for(tiny_model_dir, w2)
        r = client.push(list(w2.items()), v + 1, delta=True, transport=transport, probes=probes)
        d = r.detail["delta"]
        assert r.state == "READY" and d["base"] == v and d["tensors"]["sparse"] == 3
        assert r.bytes < d["dense_bytes"] / 50
        [e] = r.engines
        assert e["digest"] == digest(w2.items())  # vLLM's workers digest the rebuilt tensors
        assert [tuple(p) for p in e["probes"]] == [p.expected for p in probes]
        assert client.status()["engines"][0]["label"] == str(v + 1)


def test_a_corrupted_patch_never_reaches_vllm(vllm_delta, tiny_state):
    with vllm_delta.client(timeout=120.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        w = dict(perturbed(tiny_state, v))
        client.push(list(w.items()), v, delta=True)
        before = client.status()["engines"][0]
        err = push_lying_delta(client, w, v, seed=5, at=3, by=-1.0)
        assert err.code is ErrorCode.CHECKSUM_MISMATCH
        st = client.wait_ready(v, timeout=120)
        after = client.status()["engines"][0]
        assert st == {"vllm-0": v} and (after["version"], after["digest"]) == (v, before["digest"])
        # vLLM's post-load step never ran for the lying sync (a rollback's may have)
        [proc] = [p for p in vllm_delta.procs if p.name == "vllm-0"]
        assert err.sync_id and err.sync_id not in finalized_syncs(proc) and finalized_syncs(proc)


def test_a_collective_sync_leaves_no_base_and_the_next_delta_goes_dense_at_begin(vllm_delta, tiny_state):
    """vLLM's workers receive a collective sync themselves, so the engine process keeps no
    base of it: its `finalized` says so, and the next delta is refused at begin
    (STALE_BASE, naming the engine) before any engine loads a byte; push(delta=True)
    then goes dense, and the dense push gives the engine its base back."""
    with vllm_delta.client(timeout=120.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        w = dict(perturbed(tiny_state, v))
        r = client.push(list(w.items()), v, transport="collective")
        assert r.detail["transport"] == "collective"
        assert client.status()["engines"][0]["delta"] is False
        with pytest.raises(WeightSyncError) as ei:
            client.begin(v + 1, base=v)
        assert ei.value.code is ErrorCode.STALE_BASE and "vllm-0 keeps no base copy" in ei.value.message
        w2 = small_step(w, v, by=0.05)
        r = client.push(list(w2.items()), v + 1, delta=True, transport="inline")
        assert r.state == "READY" and r.detail["delta"]["base"] is None  # refused, then dense
        assert client.status()["engines"][0]["delta"] is True
        r = client.push(list(small_step(w2, v + 1, by=0.05).items()), v + 2, delta=True, transport="inline")
        assert r.detail["delta"]["base"] == v + 1
