"""push_module: a live module streams into buckets (HF names, tied weights once, dtype cast,
FSDP2 gathered per tensor, a filter), each push ending READY with the engine's digest equal
to the trainer's and the engine's greedy output equal to the trainer model's."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch

from engines.torch_engine import load_model
from examples.tiny import build_tiny_llama
from messages.buckets import Digester
from messages.canary import make_probes
from orchestrator.trainer import module_tensors

from .helpers import running_daemon

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]


def step(model: torch.nn.Module, seed: int) -> None:
    """What a training step does to the weights (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.dtype))


def digest_of(pairs) -> str:
    d = Digester()
    for name, t in pairs:
        d.update(name, t)
    return d.hexdigest()


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tied"), tie=True, seed=3)


def test_tied_embeddings_are_sent_once_and_generation_matches(tmp_path, tied_dir):
    model = load_model(tied_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    names = [n for n, _ in module_tensors(model)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    with running_daemon(tmp_path, tied_dir, engines=1) as c, c.client(timeout=30.0) as client:
        for v in (1, 2):
            step(model, v)
            r = client.push_module(model, v, bucket_bytes=64 * 1024, probes=make_probes(model, PROMPTS, 6))
            assert r.state == "READY"
            assert {e["digest"] for e in r.engines} == {digest_of(module_tensors(model))}
        assert client.wait_ready(2) == {"engine-0": 2} == client.served_versions()
        from messages.errors import ErrorCode, WeightSyncError

        with pytest.raises(WeightSyncError) as ei:
            client.wait_ready(3, timeout=0.5)
        assert ei.value.code is ErrorCode.TIMEOUT and ei.value.details["behind"] == ["engine-0"]


def test_fp32_master_is_cast_to_the_engines_bf16_on_the_fly(tmp_path):
    bf16_dir = build_tiny_llama(tmp_path / "bf16", dtype=torch.bfloat16, seed=4)
    master = load_model(bf16_dir, dtype=torch.float32)  # the trainer's fp32 master copy
    with running_daemon(tmp_path / "run", bf16_dir, engines=1) as c, c.client(timeout=30.0) as client:
        step(master, 11)
        served = load_model(bf16_dir, dtype=torch.bfloat16)
        served.load_state_dict({n: t.to(torch.bfloat16) for n, t in master.state_dict().items()})
        r = client.push_module(
            master, 1, dtype=torch.bfloat16, bucket_bytes=64 * 1024, probes=make_probes(served, PROMPTS, 6)
        )
        assert r.state == "READY"
        assert {e["digest"] for e in r.engines} == {digest_of(module_tensors(master, dtype=torch.bfloat16))}
        assert all(t.dtype == torch.float32 for t in master.parameters())  # the master is untouched


def test_filtered_push_updates_only_what_the_filter_picks(tmp_path, tiny_model_dir):
    model = load_model(tiny_model_dir)
    with running_daemon(tmp_path, tiny_model_dir, engines=1) as c, c.client(timeout=30.0) as client:
        step(model, 21)
        client.push_module(model, 1, bucket_bytes=64 * 1024)
        before = {n: t.clone() for n, t in module_tensors(model)}
        step(model, 22)
        picked = lambda name, t: ".layers.1." in name  # noqa: E731
        expected = {n: (t.clone() if picked(n, t) else before[n]) for n, t in module_tensors(model)}
        served = load_model(tiny_model_dir)
        served.load_state_dict(expected)  # what the engine must now hold: old layers, new layer 1
        r = client.push_module(
            model,
            2,
            filter=picked,
            partial=True,
            bucket_bytes=64 * 1024,
            probes=make_probes(served, PROMPTS, 6),
        )
        assert r.state == "READY"
        assert {e["digest"] for e in r.engines} == {digest_of(expected.items())}
        assert r.bytes == sum(t.numel() * t.element_size() for n, t in expected.items() if picked(n, t))


FSDP_RANK = r"""
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from engines.torch_engine import load_model
from messages.canary import make_probes
from orchestrator.trainer import TrainerClient, push_module, module_tensors
model_dir, addr = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = load_model(model_dir)
g = torch.Generator().manual_seed(31)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.02 * torch.randn(p.shape, generator=g))
probes = make_probes(model, [(1, 17, 42, 99, 7), (1, 250, 3, 64)], 6) if rank == 0 else ()
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
assert type(next(iter(model.parameters()))).__name__ == "DTensor"
if rank == 0:
    with TrainerClient(addr, timeout=60) as client:
        r = push_module(client, model, 1, bucket_bytes=64 * 1024, probes=probes)
    print("RESULT " + json.dumps({"state": r.state, "digest": r.digest,
                                  "engines": [e["digest"] for e in r.engines]}), flush=True)
else:
    push_module(None, model, 1)
dist.barrier()  # no rank tears gloo down while its peer is still working
dist.destroy_process_group()
# Every check is done and printed. Leave without running C++ static destructors: at
# interpreter exit torch's gloo teardown has aborted a rank ("terminate called without an
# active exception", SIGABRT) after a clean destroy_process_group: once in CI, once in a
# fresh-clone run of each test file alone.
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def test_fsdp2_sharded_model_is_gathered_per_tensor_on_two_gloo_ranks(tmp_path, tiny_model_dir, tiny_state):
    from orchestrator.daemon.config import child_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with running_daemon(tmp_path, tiny_model_dir, engines=1) as c:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", FSDP_RANK, str(tiny_model_dir), c.addr],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=child_env(
                    {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "2"}
                ),
            )
            for r in (0, 1)
        ]
        outs = [p.communicate(timeout=240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    (res,) = [json.loads(ln[7:]) for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")]
    model = load_model(tiny_model_dir)
    step_like = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=step_like))
    want = digest_of(module_tensors(model))
    assert res["state"] == "READY" and res["digest"] == want and res["engines"] == [want]
