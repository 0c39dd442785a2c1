"""LoRA adapter sync into a real vLLM engine (vLLM's own LoRA, CPU punica kernels): the
adapter alone is pushed, vLLM serves it under a new adapter id, a failed adapter push is
rolled back to the previous adapter, and generation equals the trainer's merged model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engines.torch_engine import load_model
from examples.launch import Cluster
from messages.canary import make_probes
from messages.errors import ErrorCode, WeightSyncError
from orchestrator.trainer.lora import push_adapter
from tests.integration.test_lora import ALPHA, PROMPTS, TARGETS, make_adapter, merged

ENGINE_RANK = 8


def test_vllm_serves_pushed_adapters_and_rolls_back_to_the_previous_one(tmp_path_factory, tiny_model_dir):
    work = Path(tmp_path_factory.mktemp("vllm-lora"))
    c = Cluster(
        work,
        tiny_model_dir,
        engines=1,
        backend="vllm",
        daemon_args=["--engine-timeout", "30", "--spool", str(work / "spool")],
        engine_args=["--lora-rank", str(ENGINE_RANK), "--lora-targets", ",".join(TARGETS)],
    )
    base = load_model(tiny_model_dir)
    try:
        with c, c.client(timeout=120.0) as client:
            a1 = make_adapter(base, 1)
            m1 = merged(tiny_model_dir, a1)
            p1 = make_probes(m1, PROMPTS, 6)
            assert p1 != make_probes(base, PROMPTS, 6)  # the probes tell adapter 1 from none
            r1 = push_adapter(client, a1, 1, alpha=ALPHA, engine_rank=ENGINE_RANK, probes=p1)
            assert r1.state == "READY"
            # Adapter 2 loads and finalizes (vLLM serves it), then the commit fails: its
            # canaries are adapter 1's. The rollback must load adapter 1 again: were it to
            # replay nothing, the engine would still serve adapter 2 and adapter 1's
            # canaries, re-run by the rollback, would fail it.
            a2 = make_adapter(base, 2)
            assert make_probes(merged(tiny_model_dir, a2), PROMPTS, 6) != p1
            with pytest.raises(WeightSyncError) as ei:
                push_adapter(client, a2, 2, alpha=ALPHA, engine_rank=ENGINE_RANK, probes=p1)
            assert ei.value.code is ErrorCode.CANARY_MISMATCH, ei.value
            deadline = time.monotonic() + 60
            while not ((st := client.status())["state"] == "READY" and not st["dirty"]):
                assert time.monotonic() < deadline, st
                time.sleep(0.2)
            assert st["version"] == 1 and st["engines"][0]["digest"] == r1.engines[0]["digest"]
            # vLLM's digest is over the tensors as received; what it serves after the
            # rollback is checked by adapter 1's canaries, re-run by the rollback
            last = st["last_sync"]
            assert last["status"] == "ROLLED_BACK", last
            assert [e["probes"] for e in last["engines"]] == [[list(p.expected) for p in p1]], last
            a3 = make_adapter(base, 3)
            r3 = push_adapter(
                client,
                a3,
                3,
                alpha=ALPHA,
                engine_rank=ENGINE_RANK,
                probes=make_probes(merged(tiny_model_dir, a3), PROMPTS, 6),
            )
            assert r3.state == "READY"
            assert make_probes(m1, PROMPTS, 6) != make_probes(merged(tiny_model_dir, a3), PROMPTS, 6)
    except BaseException:
        for p in c.procs:
            print(f"----- {p.name} -----\n{p.log_tail(60)}")
        raise
