"""Orchestrator + two real vLLM engine processes (multiprocessing on for one, off for the
other) + TrainerClient: fan-out, READY with equal digests, canary gate."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.canary import make_probes
from messages.errors import EngineError, ErrorCode
from tests.vllm.conftest import vllm_fleet

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]


def probes_for(model_dir, weights, n=6):
    m = load_model(model_dir)
    m.load_state_dict(weights)
    return make_probes(m, PROMPTS, n)


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory, tiny_model_dir):
    with vllm_fleet(
        Path(tmp_path_factory.mktemp("vllm-cluster")),
        tiny_model_dir,
        {"vllm-mp": ["--vllm-mp"], "vllm-inproc": ["--no-vllm-mp"]},
    ) as cluster:
        yield cluster


def test_two_vllm_engines_three_versions_finalized_once_each(vllm_cluster, tiny_model_dir, tiny_state):
    with vllm_cluster.client(timeout=120.0) as client:
        before = client.status()  # the module's tests share the engines, in any order
        base = before["last_ready_version"] or 0
        counts = {e["engine_id"]: e["finalize_count"] for e in before["engines"]}
        for v in (base + 1, base + 2, base + 3):
            weights = dict(perturbed(tiny_state, v))
            r = client.push(
                weights.items(), v, bucket_bytes=256 * 1024, probes=probes_for(tiny_model_dir, weights)
            )
            assert r.state == "READY" and r.buckets >= 4
            assert {e["digest"] for e in r.engines} == {digest(weights.items())}
            assert sorted(e["engine_id"] for e in r.engines) == ["vllm-inproc", "vllm-mp"]
        st = client.status()
    assert [(e["engine_id"], e["backend"], e["finalize_count"], e["version"]) for e in st["engines"]] == [
        ("vllm-inproc", "vllm", counts["vllm-inproc"] + 3, base + 3),
        ("vllm-mp", "vllm", counts["vllm-mp"] + 3, base + 3),
    ]
    # each engine declared what its one rank loads (recorded from vLLM's loaders at
    # register): the whole model, one layout for both, whatever runs its workers
    whole = sum(t.numel() * t.element_size() for t in tiny_state.values())
    assert [e["slices"]["rank_bytes"] for e in st["engines"]] == [[whole], [whole]], st["engines"]
    assert st["engines"][0]["slices"]["key"] == st["engines"][1]["slices"]["key"]


def test_collective_push_reaches_vllm_workers_by_broadcast_with_exact_outputs(
    vllm_cluster, tiny_model_dir, tiny_state
):
    """Each vLLM worker (in the engine process, or in vLLM's own worker process) joins the
    group and receives every bucket itself; no tensor crosses collective_rpc."""
    with vllm_cluster.client(timeout=120.0) as client:
        before = client.status()
        base = before["last_ready_version"] or 0
        for v in (base + 1, base + 2, base + 3):
            weights = dict(perturbed(tiny_state, v))
            r = client.push(
                weights.items(),
                v,
                bucket_bytes=256 * 1024,
                transport="collective",
                probes=probes_for(tiny_model_dir, weights),
            )
            assert r.state == "READY" and r.detail["transport"] == "collective"
            assert {e["digest"] for e in r.engines} == {digest(weights.items())}
        st = client.status()
    assert st["collective"]["world_size"] == 3
    assert st["daemon"]["bytes_received"] == before["daemon"]["bytes_received"]


def test_wrong_canary_expectation_fails_with_canary_mismatch(vllm_cluster, tiny_model_dir, tiny_state):
    with vllm_cluster.client(timeout=120.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        weights = dict(perturbed(tiny_state, v))
        good = probes_for(tiny_model_dir, weights)
        wrong = list(good[0].expected)
        wrong[2] = (wrong[2] + 1) % 512
        probes = [good[0].__class__(good[0].prompt, good[0].max_tokens, tuple(wrong)), good[1]]
        with pytest.raises(EngineError) as ei:
            client.push(weights.items(), v, bucket_bytes=256 * 1024, probes=probes)
        err = ei.value
        assert err.code is ErrorCode.CANARY_MISMATCH
        assert err.details["position"] == 2 and err.details["engine_id"] in ("vllm-mp", "vllm-inproc")
        st = client.status()
        assert st["state"] == "IDLE" and st["dirty"] is True  # never READY on a wrong canary
        # the right expectation on the next version goes through
        w2 = dict(perturbed(tiny_state, v + 1))
        assert client.push(w2.items(), v + 1, probes=probes_for(tiny_model_dir, w2)).state == "READY"


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_a_corrupted_byte_is_caught_by_vllm_engines(vllm_cluster, tiny_state, monkeypatch, transport):
    """A byte flipped after the trainer took the checksum (in its shm slot, or on the
    broadcast) fails the sync with CHECKSUM_MISMATCH on both vLLM engines (in-process and
    multiprocessing workers); nothing is finalized and the next push is READY."""
    from messages.errors import WeightSyncError
    from orchestrator.trainer.group import TrainerGroup
    from orchestrator.trainer.stream import Stream

    if transport == "shm":
        real_msg = Stream.bucket_msg

        def bucket_msg(self, sync_id, b, rid, checksum=None, ref=None):
            if b.seq == 1 and ref is not None:
                b.data[b.nbytes // 2] ^= 0x40  # in the slot, after the checksum was taken
            return real_msg(self, sync_id, b, rid, checksum, ref)

        monkeypatch.setattr(Stream, "bucket_msg", bucket_msg)
    else:
        real_start = TrainerGroup.start

        def start(self, data, seq, give_up=None):
            if seq == 1:
                data = data.clone()
                data[len(data) // 2] ^= 0x40  # in flight, after the checksum was taken
            real_start(self, data, seq, give_up)

        monkeypatch.setattr(TrainerGroup, "start", start)
    with vllm_cluster.client(timeout=60.0) as client:
        st = client.status()
        v = (st["last_ready_version"] or 0) + 1
        counts = {e["engine_id"]: e["finalize_count"] for e in st["engines"]}
        with pytest.raises(WeightSyncError) as ei:
            client.push(
                dict(perturbed(tiny_state, v)).items(), v, bucket_bytes=256 * 1024, transport=transport
            )
        assert ei.value.code is ErrorCode.CHECKSUM_MISMATCH, ei.value
        monkeypatch.undo()
        assert {e["engine_id"]: e["finalize_count"] for e in client.status()["engines"]} == counts
        w = dict(perturbed(tiny_state, v + 1))
        r = client.push(w.items(), v + 1, bucket_bytes=256 * 1024, transport=transport)
        assert r.detail["transport"] == transport
        assert {e["digest"] for e in r.engines} == {digest(w.items())}


def test_every_output_is_labelled_with_the_committed_version_and_a_failed_sync_keeps_the_label(
    vllm_cluster, tiny_model_dir, tiny_state
):
    """vLLM's weight version labels each output; each engine sets it at commit (after every
    participant finalized, before READY) and reports the label its engine core now stamps
    on every output (read back from the core, as the server backend reads `/weight_info`).
    An aborted sync leaves the committed label: no output says a version that was not
    committed fleet-wide."""
    from messages.buckets import iter_buckets

    with vllm_cluster.client(timeout=120.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        w = dict(perturbed(tiny_state, v))
        r = client.push(w.items(), v, bucket_bytes=256 * 1024)
        assert r.state == "READY"
        labels = {e["engine_id"]: e["label"] for e in client.status()["engines"]}
        assert labels == {"vllm-inproc": str(v), "vllm-mp": str(v)}
        assert client.wait_ready(v, timeout=10) == {"vllm-inproc": v, "vllm-mp": v}
        sid = client.begin(v + 1).sync_id
        (b0, *_) = list(iter_buckets(dict(perturbed(tiny_state, v + 1)).items(), 256 * 1024))
        client.send_bucket(sid, b0)
        client.abort(sid, "test")
        st = client.status()
        assert {e["engine_id"]: e["label"] for e in st["engines"]} == labels
        w = dict(perturbed(tiny_state, v + 2))
        assert client.push(w.items(), v + 2, bucket_bytes=256 * 1024).state == "READY"
        assert {e["label"] for e in client.status()["engines"]} == {str(v + 2)}
