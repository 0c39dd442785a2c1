"""LoRA adapter sync into torch engines with LoRA slots: the adapter alone is pushed (a
partial push), merged once at finalize over an untouched base, and a failed adapter push
rolls back to the previous adapter from the spool."""

from __future__ import annotations

import time

import torch

from engines.torch_engine import load_model
from examples.launch import Cluster
from examples.tiny import perturbed
from messages.buckets import iter_buckets
from messages.canary import make_probes
from orchestrator.trainer.lora import lora_tensors, push_adapter

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]
TARGETS = ("q_proj", "v_proj")
RANK, ALPHA, ENGINE_RANK = 2, 8.0, 4


def make_adapter(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in TARGETS:
            out[f"{name}.lora_A.weight"] = 0.2 * torch.randn((RANK, m.in_features), generator=g)
            out[f"{name}.lora_B.weight"] = 0.2 * torch.randn((m.out_features, RANK), generator=g)
    return out


def merged(model_dir, adapter, base_state=None) -> torch.nn.Module:
    """The trainer's view of base + adapter (what the engines must serve); `base_state`:
    another base than the checkpoint's."""
    m = load_model(model_dir)
    if base_state is not None:
        m.load_state_dict(base_state)
    mods = dict(m.named_modules())
    with torch.no_grad():
        for name, t in adapter.items():
            if ".lora_A." in name:
                mod = name.removesuffix(".lora_A.weight")
                b = adapter[f"{mod}.lora_B.weight"]
                mods[mod].weight += (ALPHA / RANK) * b @ t
    return m


def test_lora_adapter_push_then_failed_push_rolls_back_to_the_previous_adapter(tmp_path, tiny_model_dir):
    args = ["--engine-timeout", "3", "--spool", str(tmp_path / "spool")]
    lora = ["--lora-rank", str(ENGINE_RANK), "--lora-targets", ",".join(TARGETS)]
    base = load_model(tiny_model_dir)
    cluster = Cluster(
        tmp_path,
        tiny_model_dir,
        engines=2,
        daemon_args=args,
        engine_args=["--threads", "1", "--heartbeat-interval", "0.5", *lora],
    )
    with cluster as c:
        with c.client(timeout=30.0) as client:
            a1 = make_adapter(base, 1)
            p1 = make_probes(merged(tiny_model_dir, a1), PROMPTS, 6)
            assert p1 != make_probes(base, PROMPTS, 6)  # the probes tell adapter 1 from none
            r1 = push_adapter(client, a1, 1, alpha=ALPHA, engine_rank=ENGINE_RANK, probes=p1)
            assert r1.state == "READY" and len({e["digest"] for e in r1.engines}) == 1
            # the adapter alone travelled: A/B of 4 modules x 2 layers, not the model
            assert r1.bytes == sum(
                t.numel() * 4 for _, t in lora_tensors(a1, alpha=ALPHA, engine_rank=ENGINE_RANK)
            )
            assert r1.bytes < sum(t.numel() * 4 for t in base.state_dict().values()) / 5
            # a second adapter push dies half-way: rolled back to adapter 1 from the spool
            a2 = make_adapter(base, 2)
            sid = client.begin(2).sync_id
            b0 = next(iter(iter_buckets(lora_tensors(a2, alpha=ALPHA, engine_rank=ENGINE_RANK), 16 * 1024)))
            client.send_bucket(sid, b0)
            client.abort(sid, reason="trainer step failed")
            deadline = time.monotonic() + 30
            while True:
                st = client.status()
                if st["state"] == "READY" and not st["dirty"]:
                    break
                assert time.monotonic() < deadline, st
                time.sleep(0.1)
            assert st["version"] == 1
            assert {e["digest"] for e in st["engines"]} == {r1.engines[0]["digest"]}
            # the rollback re-ran adapter 1's canaries on every engine: what they serve is
            # the trainer's merged model again, not only the bytes they hold
            last = st["last_sync"]
            assert last["status"] == "ROLLED_BACK" and len(last["engines"]) == 2, last
            assert all(e["probes"] == [list(p.expected) for p in p1] for e in last["engines"]), last
            # the next adapter reaches READY with exact generation over the same base
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
            # merged-weight sync stays available: the base changes, the adapter stays applied
            # (generation equals new base + adapter 3, which the probes tell from the base alone)
            w = dict(perturbed(dict(base.state_dict()), 4))
            new_base = load_model(tiny_model_dir)
            new_base.load_state_dict(w)
            p4 = make_probes(merged(tiny_model_dir, a3, w), PROMPTS, 6)
            assert p4 != make_probes(new_base, PROMPTS, 6)
            r4 = client.push(w.items(), 4, partial=True, probes=p4)
            assert r4.state == "READY" and r4.engines[0]["digest"] != r3.engines[0]["digest"]
            assert all(e["probes"] == [list(p.expected) for p in p4] for e in r4.engines)
