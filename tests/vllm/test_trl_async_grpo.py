"""TRL's AsyncGRPOTrainer (trl 1.16) trains a tiny Llama for three optimizer steps on CPU,
generating from a real vLLM OpenAI server, with every weight sync going through
weightsync: `weight_transfer=WeightSyncTransfer(addr)`, a daemon, and a
`weightsync engine --backend vllm-server` attached to that server.

The trainer runs as `examples/trl_grpo.py --cpu --freeze model.embed_tokens.weight` in its
own process: TRL's classes unchanged except its two CUDA-only calls (the peak-FLOPs lookup
and the FA3 kernel of its tree attention), which the example replaces on a CPU host. The
embeddings are frozen, so TRL leaves them out of every sync: the first sync sends them,
the later ones declare them unchanged (`tests/vllm/test_vllm_frozen.py` checks a canary
through such syncs into a vLLM engine)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from examples.tiny import build_tiny_llama
from orchestrator.daemon.config import child_env
from tests.vllm.conftest import server_cluster, vllm_server

pytest.importorskip("trl", reason="the .[trl] extra (make test installs it)")

STEPS = 3
FROZEN = "model.embed_tokens.weight"
FROZEN_BYTES = 512 * 128 * 4  # the tiny Llama's embedding table, float32


@pytest.fixture(scope="module")
def grpo_model(tmp_path_factory):
    # no chat template: the example gives the tokenizer one (examples.trl_grpo.chat_tokenizer)
    return build_tiny_llama(tmp_path_factory.mktemp("grpo-llama"), size="tiny", seed=0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, grpo_model):
    work = Path(tmp_path_factory.mktemp("trl-grpo"))
    # --enable-scale-out: the token-in-token-out route, whose outputs carry the weight version
    with vllm_server(grpo_model, work / "server.log", ["--enable-scale-out"]) as url:
        with server_cluster(work / "cluster", grpo_model, url) as c:
            yield c, url, work


def test_async_grpo_trainer_syncs_every_step_through_weightsync(fleet, grpo_model):
    cluster, url, work = fleet
    before = cluster.status()
    served0 = before["last_ready_version"] or 0
    count0 = before["engines"][0]["finalize_count"]
    log = work / "trainer.log"
    result = work / "result.json"
    with open(log, "wb") as fh:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "examples.trl_grpo",
                "--cpu",
                "--freeze",
                FROZEN,
                "--model",
                str(grpo_model),
                "--addr",
                cluster.addr,
                "--server",
                url,
                "--steps",
                str(STEPS),
                "--output-dir",
                str(work / "out"),
                "--result",
                str(result),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=child_env({"TRL_EXPERIMENTAL_SILENCE": "1"}),
            timeout=900,
            check=False,
        )
    text = log.read_text(errors="replace")
    assert r.returncode == 0, text[-6000:]
    out = json.loads(result.read_text())
    for line in text.splitlines():
        if line.startswith("weightsync sync:") or "weightsync sync:" in line:
            print(line[line.index("weightsync sync:") :])
    syncs = out["syncs"]

    # TRL ran its optimizer steps and synced once at train start and once per step
    assert out["global_step"] == STEPS
    assert len(syncs) == STEPS + 1
    # each sync committed the next version on the engine, with the digest the trainer sent
    assert [s["version"] for s in syncs] == list(range(served0 + 1, served0 + STEPS + 2))
    for s in syncs:
        assert s["state"] == "READY" and s["bytes"] > 0
        assert s["engine_digests"] == {"server-0": s["sent_digest"]}, s
        # what the server generates right after the sync carries that version
        assert s["label_after"] == [str(s["version"])], s
    # the frozen embeddings travel once, with the first sync
    assert all(s["bytes"] == syncs[1]["bytes"] for s in syncs[1:])
    assert syncs[0]["bytes"] == syncs[1]["bytes"] + FROZEN_BYTES
    # something trained, and the engine got each step's weights: a step with a gradient
    # changed the digest of what was sent (a step whose groups' rewards all tie has none;
    # Adam's momentum may still move it); sync 0 also carried the embeddings, so step 1's
    # is compared with nothing
    sent = [s["sent_digest"] for s in syncs]
    steps = [h for h in out["log_history"] if "loss" in h]
    assert len(steps) == STEPS
    assert any(h["grad_norm"] > 0 for h in steps), [h["grad_norm"] for h in steps]
    for k, h in enumerate(steps, start=1):
        if k >= 2 and h["grad_norm"] > 0:
            assert sent[k] != sent[k - 1], (k, h["grad_norm"], sent)
    # TRL's own version counter moved once per sync, after it returned
    assert [s["trl_version_before"] for s in syncs] == list(range(STEPS + 1))
    assert out["trl_model_version"] == STEPS + 1

    st = cluster.status()
    (engine,) = st["engines"]
    assert engine["finalize_count"] == count0 + STEPS + 1  # finalized once per version
    assert (engine["state"], engine["version"], engine["label"]) == (
        "READY",
        syncs[-1]["version"],
        str(syncs[-1]["version"]),
    )
    assert engine["digest"] == syncs[-1]["sent_digest"]

    # TRL's metrics keep their meaning: its transfer phase covers weightsync's send, the
    # loss is finite, staleness is counted against its own version counter
    for h in steps:
        assert math.isfinite(h["loss"]) and h["sample/staleness_max"] >= 0
    # steps 2.. log exactly one sync each (step 1 also averages in the cold one)
    for h, s in zip(steps[1:], syncs[2:]):
        assert h["perf/weight_sync_transfer_s"] >= s["seconds"], (h, s)
