"""`--backend vllm-server`: a real vLLM OpenAI server (dev mode + our extension), attached
over HTTP, driven through the orchestrator; generation is paused while weights change."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from engines.torch_engine import greedy, load_model
from examples.tiny import perturbed
from messages.buckets import digest, iter_buckets
from messages.schema import Probe
from tests.vllm.conftest import server_cluster, vllm_server

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _post(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    log = Path(tmp_path_factory.mktemp("vllm-server")) / "server.log"
    with vllm_server(tiny_model_dir, log) as url:
        yield url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir, server):
    with server_cluster(Path(tmp_path_factory.mktemp("server-cluster")), tiny_model_dir, server) as c:
        yield c


def hf(model_dir, weights, prompts, n=6):
    m = load_model(model_dir)
    m.load_state_dict(weights)
    return [greedy(m, p, n) for p in prompts]


def test_server_is_paused_while_loading_and_serves_new_weights_at_ready(
    cluster, server, tiny_model_dir, tiny_state
):
    with cluster.client(timeout=120.0) as client:
        before = client.status()  # the module's tests share one server, in any order
        v0, count0 = before["last_ready_version"] or 0, before["engines"][0]["finalize_count"]
        for v in (v0 + 1, v0 + 2):
            weights = dict(perturbed(tiny_state, v))
            buckets = list(iter_buckets(weights.items(), 256 * 1024))
            expected = hf(tiny_model_dir, weights, PROMPTS)
            sid = client.begin(v, probes=[Probe(p, 6, e) for p, e in zip(PROMPTS, expected)]).sync_id
            client.send_bucket(sid, buckets[0])
            assert _get(server + "/is_paused")["is_paused"] is True
            for b in buckets[1:]:
                client.send_bucket(sid, b)
            body = client.finish(sid, len(buckets), digest=digest(weights.items()))
            assert body.status == "READY" and len(buckets) >= 4
            assert _get(server + "/is_paused")["is_paused"] is False
            # the server labels what it generates with the committed version
            assert _get(server + "/weight_info")["weight_version"] == str(v)
            assert client.status()["engines"][0]["label"] == str(v)
            served = _get(server + "/v1/models")["data"][0]["id"]
            for p, e in zip(PROMPTS, expected):
                r = _post(
                    server + "/v1/completions",
                    {
                        "model": served,
                        "prompt": list(p),
                        "max_tokens": 6,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                )
                assert tuple(r["choices"][0]["token_ids"]) == e
        st = client.status()
    (e,) = st["engines"]
    assert (e["backend"], e["finalize_count"], e["version"]) == ("vllm-server", count0 + 2, v0 + 2)


def test_collective_sync_goes_through_vllms_own_weight_transfer_routes(
    cluster, server, tiny_model_dir, tiny_state
):
    """A server started with --weight-transfer-config backend=weightsync: the engine drives
    /start_weight_update, /update_weights (each worker receives the bucket by broadcast)
    and /finish_weight_update; the FSM still finalizes once and checks the digest."""
    with cluster.client(timeout=120.0) as client:
        before = client.status()
        count0 = before["engines"][0]["finalize_count"]
        v = (before["last_ready_version"] or 0) + 1
        weights = dict(perturbed(tiny_state, v))
        expected = hf(tiny_model_dir, weights, PROMPTS)
        r = client.push(
            weights.items(),
            v,
            bucket_bytes=256 * 1024,
            transport="collective",
            probes=[Probe(p, 6, e) for p, e in zip(PROMPTS, expected)],
        )
        assert r.detail["transport"] == "collective" and r.state == "READY"
        assert {e["digest"] for e in r.engines} == {digest(weights.items())}
        st = client.status()
    native = _post(server + "/collective_rpc", {"method": "ws_native_info", "args": ["{}"]})["results"]
    assert [(n["native"], n["finalize_count"], n["digest"]) for n in native] == [
        (True, 1, digest(weights.items()))
    ]
    assert st["engines"][0]["finalize_count"] == count0 + 1
    assert st["daemon"]["bytes_received"] == before["daemon"]["bytes_received"]
