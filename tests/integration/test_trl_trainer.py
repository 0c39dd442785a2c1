"""TRL's own AsyncGRPOTrainer (trl 1.16), its weight syncs through `WeightSyncTransfer`,
against a real daemon and a torch engine: `tests/integration/trl_run.py` runs the trainer
in its own process (TRL's trainer, loss, optimizer and `_sync_weight` unchanged; rollouts
from an in-process worker instead of a vLLM server)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from examples.tiny import build_tiny_llama
from orchestrator.daemon.config import child_env

from .helpers import running_daemon

pytest.importorskip("trl", reason="the .[trl] extra (make test installs it)")
pytestmark = pytest.mark.slow

STEPS = 3
FROZEN = "model.embed_tokens.weight"


def _train(addr: str, model, out, *args: str) -> dict:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integration.trl_run",
            addr,
            str(model),
            str(out),
            "--steps",
            str(STEPS),
            *args,
        ],
        capture_output=True,
        text=True,
        env=child_env({"TRL_EXPERIMENTAL_SILENCE": "1"}),
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    return json.loads(out.read_text())


def test_a_trl_run_with_a_frozen_parameter_syncs_it_once_and_trains_the_rest(tmp_path):
    """TRL leaves `requires_grad=False` parameters out of every send_weights: the first
    sync sends them (a full push, digest over everything), the later ones declare them
    unchanged; every step commits (the engine answering the trainer's canary each time),
    some step had a gradient and moved the weights, and the engine ends holding exactly
    the trainer's weights, frozen part included."""
    model = build_tiny_llama(tmp_path / "model", size="tiny", seed=0)
    with running_daemon(tmp_path, model, engines=1) as c:
        out = _train(c.addr, model, tmp_path / "result.json", "--freeze", FROZEN, "--canary")
        st = c.status()
    syncs = out["syncs"]
    assert out["global_step"] == STEPS and len(syncs) == STEPS + 1  # the cold sync, then one per step
    assert [s["state"] for s in syncs] == ["READY"] * (STEPS + 1)
    assert out["unchanged"] == [FROZEN]
    # something trained: a step had a gradient and the trainable weights moved; the frozen did not
    assert any(g > 0 for g in out["grad_norms"]), out["grad_norms"]
    assert out["after"]["trainable"] != out["before"]["trainable"]
    assert out["after"]["frozen"] == out["before"]["frozen"]
    # the frozen tensor (512 x 128 float32) travels once, at the first sync
    frozen_bytes = 512 * 128 * 4
    assert all(s["bytes"] == syncs[1]["bytes"] for s in syncs[1:])
    assert syncs[0]["bytes"] == syncs[1]["bytes"] + frozen_bytes
    # the engine serves the last version and holds all of the trainer's weights
    (engine,) = st["engines"]
    assert (st["state"], engine["version"]) == ("READY", syncs[-1]["version"])
    assert engine["digest"] == out["after"]["all"]


def test_a_trl_lora_run_sends_the_merged_base_weights_under_their_checkpoint_names(tmp_path):
    """trl 1.16 with `peft_config` and a weight transfer set takes its merged path (never
    its adapter-only one, which needs no transfer): at each sync it merges the adapter,
    sends every base weight under its checkpoint name through `send_weights`, and unmerges.
    Those are full pushes the engine accepts as they are, and it ends holding the merged
    weights."""
    pytest.importorskip("peft", reason="the .[trl] extra (make test installs it)")
    model = build_tiny_llama(tmp_path / "model", size="tiny", seed=0)
    with running_daemon(tmp_path, model, engines=1) as c:
        out = _train(c.addr, model, tmp_path / "result.json", "--lora")
        st = c.status()
    syncs = out["syncs"]
    assert out["global_step"] == STEPS and [s["state"] for s in syncs] == ["READY"] * (STEPS + 1)
    assert out["unchanged"] == []  # every base weight travels: nothing declared unchanged
    assert any(g > 0 for g in out["grad_norms"]), out["grad_norms"]
    assert out["after"]["trainable"] != out["before"]["trainable"]  # the adapter trained
    assert out["after"]["merged"] != out["after"]["all"]  # and moves the merged weights
    (engine,) = st["engines"]
    assert engine["version"] == syncs[-1]["version"]
    assert engine["digest"] == syncs[-1]["sent_digest"] == out["after"]["merged"]
