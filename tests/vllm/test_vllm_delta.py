"""Delta sync into a real vLLM engine (in-process, `--delta-base`): patches rebuilt on the
engine's base copy in the engine process, dense tensors into vLLM's loader, the digest
and the canary of the full result before READY."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.torch_engine import load_model
from examples.launch import Cluster
from examples.tiny import perturbed
from messages import delta
from messages.buckets import Patched, digest, iter_buckets
from messages.canary import make_probes
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import Patch

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]


def probes_for(model_dir, weights, n=6):
    m = load_model(model_dir)
    m.load_state_dict(weights)
    return make_probes(m, PROMPTS, n)


def step(weights, seed, tensors=3, elements=50):
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in weights.items()}
    for n in [n for n in sorted(out) if out[n].numel() > 1000][:tensors]:
        flat = out[n].view(-1)
        flat[torch.randint(0, flat.numel(), (elements,), generator=g)] += 0.05
    return out


@pytest.fixture(scope="module")
def vllm_delta(tmp_path_factory, tiny_model_dir):
    workdir = Path(tmp_path_factory.mktemp("vllm-delta"))
    cluster = Cluster(
        workdir,
        tiny_model_dir,
        engines=0,
        min_engines=1,
        backend="vllm",
        daemon_args=["--engine-timeout", "30", "--spool", str(workdir / "spool")],
        engine_args=["--delta-base"],
    )
    try:
        cluster.start_daemon()
        cluster.start_engine("vllm-0", ["--no-vllm-mp"])
        cluster.wait_engines(1, timeout=300)
        yield cluster
    except BaseException:
        for p in cluster.procs:
            print(f"----- {p.name} -----\n{p.log_tail(80)}")
        raise
    finally:
        cluster.stop()


@pytest.mark.parametrize("transport", ["inline", "auto"])
def test_a_delta_push_into_vllm_serves_the_digest_and_generation_of_the_same_weights(
    vllm_delta, tiny_model_dir, tiny_state, transport
):
    with vllm_delta.client(timeout=120.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        w = dict(perturbed(tiny_state, v))
        client.push(list(w.items()), v, delta=True, transport=transport)
        w2 = step(w, v)
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
        name = sorted(n for n in w if w[n].numel() > 1000)[0]
        good = step(w, 5)[name]
        wrong = good.clone()
        wrong.view(-1)[3] -= 1.0
        enc, _ = delta.encode(name, wrong, w[name], lambda: delta.part(name, w[name]))
        lie = Patch("sparse", enc.patch.base, delta.part(name, good), enc.patch.count)
        items = [(n, Patched(lie, enc.data, t.dtype, t.shape) if n == name else t) for n, t in w.items()]
        sid = client.begin(v + 1, base=v)["sync_id"]
        with pytest.raises(WeightSyncError) as ei:
            for b in iter_buckets(items, 1 << 20):
                client.send_bucket(sid, b)
            client.finish(sid, 1)
        assert ei.value.code is ErrorCode.CHECKSUM_MISMATCH
        st = client.wait_ready(v, timeout=120)
        after = client.status()["engines"][0]
        assert st == {"vllm-0": v} and (after["version"], after["digest"]) == (v, before["digest"])
