"""`orchestrator.trainer.trl.WeightSyncTransfer`, driven the way TRL's AsyncGRPO trainer
drives its weight transfer (init once; per sync pause, send_weights(iterator), resume;
destroy), against a real daemon and torch engines. These calls are the protocol's; TRL's
own trainer drives it in `tests/integration/test_trl_trainer.py` (docs/INTEGRATIONS.md)."""

from __future__ import annotations

import signal
import time

import pytest

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError
from orchestrator.trainer.trl import WeightSyncTransfer, canary

from .helpers import running_daemon

pytestmark = pytest.mark.slow


def _sync(wt: WeightSyncTransfer, items) -> None:
    """TRL's _sync_weight on the main process: pause, send the iterator, resume."""
    wt.pause()
    wt.send_weights(iter(items))
    wt.resume()


def test_each_send_weights_commits_the_next_version_on_every_engine(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path, tiny_model_dir, engines=2) as c:
        wt = WeightSyncTransfer(c.addr, timeout=30.0)
        wt.init_weight_transfer()
        assert wt.version is None  # a fresh fleet serves nothing
        try:
            for v in (1, 2, 3):
                w = list(perturbed(tiny_state, v))
                _sync(wt, w)
                assert wt.version == v and wt.last is not None and wt.last.state == "READY"
                st = c.status()
                assert st["state"] == "READY" and st["version"] == v
                assert {e["digest"] for e in st["engines"]} == {digest(w)}
                assert all(e["version"] == v for e in st["engines"])
        finally:
            wt.destroy()
        # a trainer restarted against the running fleet continues after what it serves
        again = WeightSyncTransfer(c.addr, timeout=30.0)
        again.init_weight_transfer()
        try:
            assert again.version == 3
            _sync(again, list(perturbed(tiny_state, 4)))
            assert again.version == 4 and c.status()["version"] == 4
        finally:
            again.destroy()


def test_an_engine_killed_mid_send_raises_in_time_and_the_next_send_commits_on_the_survivor(
    tmp_path, tiny_model_dir, tiny_state
):
    """SIGKILL one of two engines while send_weights streams: it raises (never returns as
    if the version were served) within the engine deadline plus 10 s, and the next
    send_weights commits on the survivor."""
    args = ["--engine-timeout", "5", "--log-level", "info"]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, min_engines=1, daemon_args=args) as c:
        wt = WeightSyncTransfer(c.addr, timeout=30.0, bucket_bytes=64 * 1024, window=1)
        wt.init_weight_transfer()
        try:
            _sync(wt, list(perturbed(tiny_state, 1)))
            victim = next(p for p in c.procs if p.name == "engine-1")

            def killing():
                for i, item in enumerate(perturbed(tiny_state, 2)):
                    if i == 4:
                        victim.popen.send_signal(signal.SIGKILL)
                        victim.popen.wait(30)
                    yield item

            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as ei:
                _sync(wt, killing())
            assert time.monotonic() - t0 < 5 + 10
            assert ei.value.code is ErrorCode.ENGINE_FAILED and "engine-1" in ei.value.message
            assert wt.version == 1  # nothing new committed
            w = list(perturbed(tiny_state, 3))
            _sync(wt, w)
            st = c.status()
            assert wt.version == st["version"] and st["state"] == "READY"
            engines = {e["engine_id"]: e for e in st["engines"]}
            assert engines["engine-0"]["digest"] == digest(w) and engines["engine-1"]["state"] == "LOST"
        finally:
            wt.destroy()


FROZEN = "model.embed_tokens.weight"


def _frozen_model(model_dir):
    """The trainer's model with its embeddings frozen, and TRL's iterator over it (a
    non-PEFT model: the parameters with requires_grad, as `_iter_vllm_named_params` walks)."""
    model = load_model(model_dir)
    model.get_parameter(FROZEN).requires_grad_(False)

    def trl_iterator():
        return ((n, p.detach()) for n, p in model.named_parameters() if p.requires_grad)

    return model, trl_iterator


def test_a_later_send_that_leaves_out_a_trained_tensor_is_refused_and_nothing_commits(
    tmp_path, tiny_model_dir
):
    """Only the tensors frozen at the first sync are declared unchanged: a later iterator
    that also leaves out a trained one raises INCOMPLETE_SYNC and commits nothing."""
    model, trl_iterator = _frozen_model(tiny_model_dir)
    with running_daemon(tmp_path, tiny_model_dir, engines=1) as c:
        wt = WeightSyncTransfer(c.addr, model=model, timeout=30.0)
        wt.init_weight_transfer()
        try:
            _sync(wt, trl_iterator())
            assert wt.unchanged == {FROZEN}
            with pytest.raises(WeightSyncError) as ei:
                _sync(wt, (item for item in trl_iterator() if item[0] != "lm_head.weight"))
            assert ei.value.code is ErrorCode.INCOMPLETE_SYNC and "lm_head.weight" in ei.value.message
            assert wt.version == 1 and c.status()["last_ready_version"] == 1
            _sync(wt, trl_iterator())  # the next complete one commits
            st = c.status()
            assert st["state"] == "READY" and st["version"] == wt.version == 2
            assert st["engines"][0]["digest"] == digest((n, p.detach()) for n, p in model.named_parameters())
        finally:
            wt.destroy()


def test_a_canary_probe_catches_an_engine_that_lost_its_weights_after_a_sync(tmp_path, tiny_model_dir):
    """trl#5312: a server that slept and woke without its weights still reports the
    digest it had. The engine zeroes its weights once it finalized version 2
    (`--failpoint drop_weights_after=2`); the next send_weights reloads only what TRL
    sends, so the frozen embeddings stay lost: the canary (the trainer's own greedy
    answer, computed at each send) raises CANARY_MISMATCH and version 3 is not committed."""
    model, trl_iterator = _frozen_model(tiny_model_dir)
    args = ["--failpoint", "drop_weights_after=2"]
    with running_daemon(tmp_path, tiny_model_dir, engines=1, engine_args=args) as c:
        probes = canary(model, [[5, 9, 17], [40, 41]], 4)
        wt = WeightSyncTransfer(c.addr, model=model, probes=probes, timeout=30.0)
        wt.init_weight_transfer()
        try:
            for _ in range(2):
                _sync(wt, trl_iterator())
            assert wt.version == 2 and c.status()["state"] == "READY"
            with pytest.raises(WeightSyncError) as ei:
                _sync(wt, trl_iterator())
            assert ei.value.code is ErrorCode.CANARY_MISMATCH and "engine-0" in ei.value.message
            assert wt.version == 2 and c.status()["last_ready_version"] == 2
        finally:
            wt.destroy()
